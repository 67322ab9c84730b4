"""The what-if step loop: a trace's requests through the engine's real `Scheduler` and
`BlockManager`, with no model and a simulated clock.

Each simulated step does what `LLMEngine.step` does, in its order: take the requests that have
arrived by the step's start, apply due aborts, `schedule()`, then — instead of the forward — let
the timing say how long the step took, mark each sequence's new tokens computed and commit its
full blocks, and append a token to every sequence whose chunk reached its end (decodes first, as
the runner packs them), finishing those that reach their recorded output length.

Tokens are synthesized, never read: each distinct prefix-block hash of the trace becomes one
block of a token id of its own, the rest of a request a token id no other request has — so the
prefix cache finds exactly the sharing the recording had (at the recorded block size; a
different `--block-size` keeps it where the blocks still line up).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv.block_manager import BlockManager
from engine.kv.cpu_tier import CpuTier
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceState
from engine.telemetry.trace import step_shape
from engine.whatif.config import SimConfig
from kvtop.protocol.errors import ConfigError
from kvtop.protocol.trace import RequestRecord, StepRecord
from kvtop.protocol.trace_file import Trace

_TAIL = 1 << 40  # token ids of a request's own tokens start here; shared blocks' ids are below
_PARAMS = SamplingParams(max_tokens=1 << 30, ignore_eos=True)


class _NoCopy:
    """The CPU tier's copier: the simulation moves no bytes (the cost of a swap is not modeled)."""

    def copy_to_host(self, device_ids: list[int], host_ids: list[int]) -> None: ...
    def copy_to_device(self, host_ids: list[int], device_ids: list[int]) -> None: ...


@dataclass
class Outcome:
    """One request as simulated (times in the trace's own clock)."""

    id: str
    arrival: float
    prompt_len: int
    output_len: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    finish_reason: str | None = None  # length | abort | rejected; None: the trace ended it in flight
    preemptions: int = 0
    cached_tokens: int = 0
    in_flight: bool = False  # in flight when the trace was taken: its output is a lower bound


@dataclass
class SimResult:
    config: SimConfig
    outcomes: list[Outcome]
    itls: array = field(default_factory=lambda: array("d"))
    steps: list[StepRecord] = field(default_factory=list)  # kept when asked (the exactness check)
    num_steps: int = 0
    seq_steps: int = 0  # sequences summed over steps: concurrency = seq_steps / num_steps
    peak_blocks: int = 0
    preemptions: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    start: float = 0.0
    end: float = 0.0


class _Run:
    """One simulation's state: the real scheduler and block manager, and what they are fed."""

    def __init__(self, trace: Trace, config: SimConfig, timing, load: float, keep_steps: bool) -> None:
        if config.preemption_mode == "swap" and not config.cpu_blocks:
            raise ConfigError("--preemption-mode swap needs a CPU tier: give --cpu-offload-memory (e.g. 1GiB)")
        cpu = (
            CpuTier(config.cpu_blocks, config.block_size * config.bytes_per_token, _NoCopy())
            if config.cpu_blocks
            else None
        )
        self.bm = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching, cpu)
        self.sched = Scheduler(self.bm, config.max_num_seqs, config.max_num_batched_tokens,
                               policy=config.schedule_policy, preemption_mode=config.preemption_mode)  # fmt: skip
        self.config, self.timing, self.keep_steps = config, timing, keep_steps
        self.max_seq_len = config.max_seq_len
        self.block_size = int((trace.config or {}).get("block_size") or config.block_size)
        t0 = trace.start
        self.records = trace.requests
        self.arrivals = [t0 + (r.arrival_time - t0) / load for r in self.records]
        self.aborts = [_abort_after(r) for r in self.records]
        self.res = SimResult(
            config, [Outcome(r.id, a, r.prompt_len) for r, a in zip(self.records, self.arrivals, strict=True)]
        )
        self.hash_ids: dict[str, int] = {}
        self.live: dict[str, tuple[Sequence, list[int], int, int]] = {}  # id -> (seq, tokens, target, index)
        self.abort_due: list[tuple[float, str]] = []

    def tokens(self, rec: RequestRecord, j: int) -> list[int]:
        n = rec.prompt_len + max(rec.output_len, 1)
        out: list[int] = []
        for h in rec.block_hashes:
            out.extend([self.hash_ids.setdefault(h, len(self.hash_ids))] * self.block_size)
        del out[n:]
        out.extend([_TAIL + j] * (n - len(out)))
        return out

    def arrive(self, j: int) -> None:
        rec, o = self.records[j], self.res.outcomes[j]
        if rec.prompt_len >= self.config.max_seq_len:
            o.finish_reason = "rejected"  # the engine refuses it at add_request (engine/validation.py)
            return
        tokens = self.tokens(rec, j)
        seq = Sequence(rec.id, tokens[: rec.prompt_len], _PARAMS, arrival_time=o.arrival)
        self.live[rec.id] = (seq, tokens, max(rec.output_len, 1), j)
        o.in_flight = rec.finish_reason is None
        self.sched.add(seq)
        if self.aborts[j] is not None:
            self.abort_due.append((o.arrival + self.aborts[j], rec.id))

    def apply_aborts(self, now: float) -> None:
        due = [x for x in self.abort_due if x[0] <= now]
        if not due:
            return
        self.abort_due = [x for x in self.abort_due if x[0] > now]
        for _, seq_id in due:
            if seq_id in self.live:
                self.finish(seq_id, now, "abort")

    def finish(self, seq_id: str, now: float, reason: str) -> None:
        seq, _, _, j = self.live.pop(seq_id)
        self.sched.finish(seq)
        seq.state = SequenceState.FINISHED
        o = self.res.outcomes[j]
        o.finished, o.finish_reason = now, reason
        o.output_len, o.preemptions, o.cached_tokens = seq.num_output_tokens, seq.num_preemptions, seq.num_cached_tokens

    def step(self, index: int, now: float) -> float | None:
        """One step at `now`; its end (None when nothing could be scheduled)."""
        sched, bm = self.sched, self.bm
        batch = sched.schedule()
        held = max(batch.peak_held_blocks, bm.num_blocks - bm.num_free)
        self.res.peak_blocks = max(self.res.peak_blocks, held)
        if not batch:
            return None
        for seq in batch.admitted:
            o = self.res.outcomes[self.live[seq.seq_id][3]]
            if o.first_scheduled is None:
                o.first_scheduled = now
        shape = step_shape(batch.seqs, batch.num_new_tokens)
        hits = [s.num_computed_tokens for s in batch.admitted]
        duration, gap = self.timing.step(index, shape)
        end = now + duration
        commit, bs, decodes, chunks = bm.commit_full_blocks, bm.block_size, [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens // bs > seq.num_hashed_blocks:  # else commit_full_blocks does nothing
                commit(seq)
            if seq.num_computed_tokens == len(seq.token_ids):  # its chunk reached the end: it samples
                (decodes if n == 1 else chunks).append(seq)
        for seq in decodes + chunks:  # the runner's order: decodes first
            self.emit(seq, end)
        self.res.num_steps += 1
        self.res.seq_steps += len(batch.seqs)
        if self.keep_steps:
            rec = StepRecord(index, now, end, len(batch.seqs), shape.prefill_tokens, shape.decode_seqs,
                             shape.context_tokens, held, [[s.seq_id, h] for s, h in zip(batch.admitted, hits, strict=True)],
                             [s.seq_id for s in batch.preempted])  # fmt: skip
            self.res.steps.append(rec)
        return end + gap

    def emit(self, seq: Sequence, now: float) -> None:
        """A token for `seq` at `now`: the next planned one; finish it at its recorded length."""
        _, tokens, target, j = self.live[seq.seq_id]
        ids = seq.token_ids
        n = len(ids)
        ids.append(tokens[n] if n < len(tokens) else _TAIL + j)
        o = self.res.outcomes[j]
        if o.last_token is None:
            o.first_token = now
        else:
            self.res.itls.append(now - o.last_token)
        o.last_token = now
        if n + 1 - o.prompt_len >= target or n + 1 >= self.max_seq_len:
            self.finish(seq.seq_id, now, "length")


def _abort_after(rec: RequestRecord) -> float | None:
    """Seconds after arrival at which the recording's client gave up (an aborted request)."""
    if rec.finish_reason in ("abort", "error") and rec.finished_time is not None:
        return max(0.0, rec.finished_time - rec.arrival_time)
    return None


def simulate(
    trace: Trace,
    config: SimConfig,
    timing,
    load: float = 1.0,
    keep_steps: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> SimResult:
    """Run `trace` (arrivals compressed by `load`) under `config`; `timing` times each step
    (timing.StepTimeModel or RecordedTiming). ConfigError when not one request fits."""
    run = _Run(trace, config, timing, load, keep_steps)
    n = len(run.records)
    if all(r.prompt_len >= config.max_seq_len for r in run.records):
        shortest = min(r.prompt_len for r in run.records)
        raise ConfigError(
            f"this configuration cannot hold even one request of the trace: the shortest prompt has "
            f"{shortest} tokens, the configuration fits {config.max_seq_len - 1} ({config.describe()}) — "
            "raise --kv-cache-memory or --max-model-len"
        )
    clock = timing.first_start(run.arrivals[0])
    run.res.start = run.arrivals[0]
    nxt = index = 0
    while nxt < n or run.live:
        while nxt < n and run.arrivals[nxt] <= clock:
            run.arrive(nxt)
            nxt += 1
        run.apply_aborts(clock)
        end = run.step(index, clock)
        if end is None:
            clock = _idle(run, nxt, index, clock)
            continue
        index += 1
        clock = end
        if progress is not None and index % 256 == 0:
            progress(nxt, n)
    run.res.preemptions = run.sched.preemptions_total
    run.res.prefix_query_tokens = run.bm.prefix.query_tokens
    run.res.prefix_hit_tokens = run.bm.prefix.hit_tokens
    run.res.end = max((o.finished for o in run.res.outcomes if o.finished is not None), default=clock)
    return run.res


def _idle(run: _Run, nxt: int, index: int, clock: float) -> float:
    """Nothing could run at `clock`: the time of the next thing that can change that."""
    candidates = []
    if nxt < len(run.arrivals):
        candidates.append(run.timing.idle_until(index, run.arrivals[nxt]))
    candidates += [t for t, _ in run.abort_due]
    if not candidates:
        stuck = ", ".join(list(run.live)[:3])
        raise ConfigError(f"requests {stuck} can never be scheduled under {run.config.describe()}")
    return max(clock, min(candidates))
