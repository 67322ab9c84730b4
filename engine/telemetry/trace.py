"""The engine's side of the request trace: it fills the records (what it saw of its workload,
never its text) and the step shapes.

The records, their hashes and their snapshot rows are the protocol's (kvtop/protocol/trace.py:
`kvctl bench` reads and writes traces without the engine). `TraceRecorder` keeps both in bounded
rings, like the flight recorder's frames; the engine feeds it, snapshots store it (`requests`,
`steps` tables), `kvtop.protocol.trace_file` writes it as JSONL, and `engine.whatif` replays it
through the real scheduler.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from engine.sequence import Sequence
from kvtop.protocol.trace import RequestRecord, StepRecord, packed_hash_chain

MAX_REQUESTS = 20_000  # finished requests kept (minutes of a busy server; ~0.3 KB + 8 B a block each)
MAX_STEPS = 20_000  # steps kept (10 minutes of 30 ms steps, the flight recorder's default history)


@dataclass
class StepShape:
    prefill_tokens: int
    decode_seqs: int
    context_tokens: int


def step_shape(seqs: list[Sequence], num_new_tokens: list[int]) -> StepShape:
    """A scheduled batch's shape, taken before its tokens are computed (the engine's and the
    simulator's one definition): one-token rows are decodes, as the runner packs them."""
    prefill = decodes = context = 0
    for seq, n in zip(seqs, num_new_tokens, strict=True):
        if n == 1:
            decodes += 1
        else:
            prefill += n
        context += seq.num_computed_tokens + n
    return StepShape(prefill, decodes, context)


class TraceRecorder:
    """The engine's request and step rings."""

    def __init__(self, block_size: int, max_requests: int = MAX_REQUESTS, max_steps: int = MAX_STEPS) -> None:
        self.block_size = block_size
        self.salt = random.getrandbits(63)
        self.requests: deque[RequestRecord] = deque(maxlen=max_requests)
        self.steps: deque[StepRecord] = deque(maxlen=max_steps)

    def record(self, seq: Sequence) -> RequestRecord:
        """A request's record as it stands (finished or still in flight); its hashes packed, 8
        bytes a block, as the ring keeps them (`tables` writes them out in hex)."""
        p, m = seq.params, seq.metrics
        return RequestRecord(
            id=seq.seq_id,
            arrival_time=seq.arrival_time,
            prompt_len=seq.num_prompt_tokens,
            block_hashes=packed_hash_chain(seq.token_ids, self.block_size, self.salt),
            max_tokens=p.max_tokens,
            ignore_eos=p.ignore_eos,
            min_tokens=p.min_tokens,
            has_stop=bool(p.stop or p.stop_token_ids),
            output_len=seq.num_output_tokens,
            finish_reason=seq.finish_reason,
            first_scheduled_time=m.first_scheduled_time,
            first_token_time=m.first_token_time,
            finished_time=m.finished_time,
            preemptions=seq.num_preemptions,
            cached_tokens=seq.num_cached_tokens,
        )

    def finished(self, seq: Sequence) -> None:
        self.requests.append(self.record(seq))

    def step(self, step: int, start: float, end: float, batch, shape: StepShape, held: int, hits: list[int]) -> None:
        """One step that ran; `hits`: each admitted sequence's prefix-hit tokens at admission."""
        self.steps.append(
            StepRecord(
                step=step,
                start=start,
                end=end,
                num_seqs=len(batch.seqs),
                prefill_tokens=shape.prefill_tokens,
                decode_seqs=shape.decode_seqs,
                context_tokens=shape.context_tokens,
                held_blocks=held,
                admitted=[[s.seq_id, h] for s, h in zip(batch.admitted, hits, strict=True)],
                preempted=[s.seq_id for s in batch.preempted],
            )
        )

    def capture(self, in_flight: Iterable[Sequence]) -> tuple[list[RequestRecord], list[StepRecord]]:
        """The rings as they stand plus the requests in flight (by arrival): quick, under the
        engine's lock; `rows` turns them into table rows after it."""
        live = sorted((self.record(s) for s in in_flight), key=lambda r: r.arrival_time)
        return [*self.requests, *live], list(self.steps)


def trace_header(engine) -> dict:
    """What a replay needs to know of the engine that ran the trace: its scheduling knobs, its
    KV cache, and the model's shape (to size another KV budget or dtype in blocks)."""
    c, kv, spec, bm = engine.config, engine.kv, engine.spec, engine.block_manager
    return {
        "model": c.served_model_name or c.model,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "device": engine.device,
        "num_layers": spec.num_layers,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "block_size": kv.block_size,
        "num_blocks": kv.num_blocks,
        "kv_cache_dtype": kv.kv_cache_dtype,
        "bytes_per_token": kv.bytes_per_token,
        "kv_cache_memory": kv.total_bytes,
        "max_num_seqs": engine.scheduler.max_num_seqs,
        "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens,
        "max_model_len": engine.max_model_len,
        "enable_prefix_caching": bm.enable_prefix_caching,
        "schedule_policy": engine.scheduler.policy,
        "preemption_mode": engine.scheduler.preemption_mode,
        "cpu_blocks": bm.cpu.num_blocks if bm.cpu is not None else 0,
    }
