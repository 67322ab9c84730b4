"""LLMEngine: requests in, tokens out, one `step()` at a time.

Owns the model runner, the block manager, the scheduler and the metrics. Thread-safe in the
ways a server needs: `add_request`/`abort` from any thread land in an inbox the step loop drains;
`stats()` reads under the same lock the step holds while it changes state (not while the model
computes).
"""

from __future__ import annotations

import itertools
import threading
import time
import traceback
from collections import deque

import torch

from engine.calibration import calibrate_fp8
from engine.drain import Drain, EngineState
from engine.errors import EngineDrainingError, InvalidRequestError
from engine.kernels import get_backend, resolve_backend_name
from engine.kv.block_manager import BlockManager
from engine.kv.cache import KVCache
from engine.kv.cpu_tier import CpuTier
from engine.model.loader import load_model
from engine.model.packed_linear import weights_note
from engine.outputs import RequestOutput, request_output
from engine.runner import ModelRunner
from engine.runtime import huge_pages, knobs
from engine.runtime.devices import kv_budget_note, kv_memory_bytes, resolve_device, resolve_dtype
from engine.runtime.faults import FaultInjector
from engine.runtime.host_memory import keep_freed_memory
from engine.runtime.log import log
from engine.sampling import SamplingParams, sample
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceState
from engine.stopping import stop_reason
from engine.telemetry.metrics import Metrics
from engine.telemetry.stats import build_frame, build_gauges, memory_gauges
from engine.telemetry.trace import TraceRecorder, step_shape, trace_header
from engine.validation import PromptLimits
from kvtop.protocol.config import EngineConfig, format_bytes
from kvtop.protocol.errors import ConfigError
from kvtop.protocol.trace import rows


def allocate_kv(
    config: EngineConfig, spec, dtype: torch.dtype, device: str, memory_bytes: int
) -> tuple[KVCache, BlockManager]:
    """The KV cache (its one allocation, of `memory_bytes`: the config's memory rule), the CPU tier
    when `cpu_offload_memory` asks for one, and the block manager over both."""
    kv = KVCache.allocate(
        spec,
        memory_bytes,
        config.block_size,
        config.kv_cache_dtype,
        dtype,
        device,
    )
    cpu = None
    if config.cpu_offload_memory:
        cpu = CpuTier(kv.allocate_host(int(config.cpu_offload_memory)), kv.block_bytes, kv)
    elif config.preemption_mode == "swap":
        raise ConfigError("preemption_mode=swap needs a CPU tier: set cpu_offload_memory (e.g. 1GiB)")
    return kv, BlockManager(kv.num_blocks, config.block_size, config.enable_prefix_caching, cpu)


class LLMEngine:
    # About 250 lines, kept whole: what is left is what only the engine does under its lock (the
    # wiring, the inbox, the step, the operator controls). The post-step work is the scheduler's
    # (postprocess), the drain engine/drain.py's, what is measured engine/telemetry/metrics.py's.
    def __init__(self, config: EngineConfig, quiet: bool = False) -> None:
        self.config = config
        knobs.check()  # a bad KVTOP_* value stops here, not in a step
        self.device = resolve_device(config.device)
        if self.device.startswith("cpu"):
            keep_freed_memory()  # a step's activations are not faulted in again at every step
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.start_time = time.time()
        t0 = time.time()
        loaded = load_model(config.model, self.dtype, self.device, config.quantization)
        if self.device.startswith("cpu"):
            huge_pages.place_weights(loaded.model)  # a decode step streams them: fewer TLB misses
        self.model, self.spec, self.tokenizer = loaded.model, loaded.spec, loaded.tokenizer
        self.model_path, self.eos_token_ids = loaded.path, loaded.eos_token_ids
        self.weights_bytes, self.prefill_copy_bytes = loaded.weights_bytes, loaded.prefill_copy_bytes
        self.weights_format = loaded.weights_format
        self.max_model_len = config.max_model_len or self.spec.max_position_embeddings
        self.model.build_rope_cache(self.max_model_len)
        self.attention_backend = resolve_backend_name(config.attention_backend, self.device)
        kernels = get_backend(config.attention_backend, self.device)
        # on the CPU the `auto` size also gets what the weights' blocks save against the same weights de-quantized
        self.kv_budget = kv_memory_bytes(config, self.device, self.spec.hidden_size, loaded.bytes_saved)
        self.kv, self.block_manager = allocate_kv(config, self.spec, self.dtype, self.device, self.kv_budget)
        self.scheduler = Scheduler.from_config(self.block_manager, config)
        self.runner = ModelRunner(self.model, self.kv, kernels, self.device)
        if config.kv_cache_dtype == "fp8_e4m3":
            calibrate_fp8(self.runner, self.tokenizer)
        self.metrics, self.trace = (
            Metrics(),
            TraceRecorder(config.block_size),
        )  # trace: engine/telemetry/trace.py's rings
        self.generator = torch.Generator().manual_seed(config.seed)
        self.limits = PromptLimits(self.spec.vocab_size, self.max_model_len, self.kv.num_blocks * config.block_size)
        self.max_seq_len = self.limits.max_seq_len
        self.drain_state = Drain(self.metrics.event)  # running → draining → drained (engine/drain.py)
        self.step_count = 0
        self.seqs: dict[str, Sequence] = {}  # every unfinished request
        self._inbox: deque[Sequence] = deque()
        self._aborts: deque[tuple[str, str]] = deque()
        self._requeues: deque[str] = deque()
        self._lock = threading.RLock()
        self._faults = FaultInjector.from_env()
        self._ids = itertools.count()
        self.load_seconds = time.time() - t0
        if not quiet:
            log(self.summary())

    def summary(self) -> str:
        kv = self.kv
        cap = kv.num_blocks * kv.block_size
        at_len = cap // self.max_model_len if self.max_model_len else 0
        return (
            f"model {self.config.model} ({self.spec.model_type}, {self.spec.num_layers} layers, "
            f"{self.spec.num_kv_heads} KV heads × {self.spec.head_dim}) on {self.device}, {str(self.dtype)[6:]}, "
            f"attention {self.attention_backend}; KV {kv.kv_cache_dtype}: {kv.bytes_per_token} B/token, "
            f"{kv.num_blocks} blocks × {kv.block_size} = {cap} tokens in {format_bytes(kv.total_bytes)}"
            f"{kv_budget_note(self.config, self.device, self.kv_budget)}; "
            f"{at_len} concurrent sequences at max_model_len={self.max_model_len}"
            + f"; weights {weights_note(self.weights_format, self.weights_bytes, self.prefill_copy_bytes)}"
        )

    # ---- requests ------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises InvalidRequestError for a request that could
        never run, EngineDrainingError while draining."""
        params = params or SamplingParams()
        if self.state is not EngineState.RUNNING:
            raise EngineDrainingError(f"engine is {self.state}: not admitting new requests (resume to admit)")
        if isinstance(prompt, str) and not prompt:  # before the tokenizer adds a BOS to it
            raise InvalidRequestError("prompt is empty")
        token_ids = self.tokenize(prompt)
        self.limits.check(token_ids)
        request_id = request_id or f"req-{next(self._ids)}"
        seq = Sequence(
            request_id,
            token_ids,
            params,
            arrival_time=arrival_time or time.time(),
            prompt=prompt if isinstance(prompt, str) else None,
        )
        with self._lock:
            if request_id in self.seqs:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            self.seqs[request_id] = seq
            self._inbox.append(seq)
        return request_id

    def abort(self, request_id: str, detail: str = "aborted") -> bool:
        """Abort a request (from any thread); it finishes with reason `abort` at the next step."""
        with self._lock:
            if request_id not in self.seqs:
                return False
            self._aborts.append((request_id, detail))
            return True

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def num_waiting(self) -> int:
        """Requests not yet running: queued in the scheduler or added since the last step."""
        return len(self.scheduler.waiting) + self.num_unscheduled()

    def num_unscheduled(self) -> int:
        """Requests added since the last step, not yet handed to the scheduler."""
        return len(self._inbox)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and return outputs of every request that got a
        token or finished this step."""
        outputs: list[RequestOutput] = []
        with self._lock:
            start = time.time()
            self._take_inbox(outputs)
            evictions_before = self.block_manager.prefix.evictions
            batch = self.scheduler.schedule()
            shape, hits = step_shape(batch.seqs, batch.num_new_tokens), [s.num_computed_tokens for s in batch.admitted]
            held = max(batch.peak_held_blocks, self.kv.num_blocks - self.block_manager.num_free)
            self.metrics.observe_kv_usage(held / self.kv.num_blocks)
            now = time.time()
            where = "spilled to the CPU tier" if self.block_manager.cpu is not None else "dropped"
            self.metrics.prefix_evictions(self.block_manager.prefix.evictions - evictions_before, now, where)
            self.metrics.scheduled(batch, now)
        if not batch:
            return outputs
        t0 = time.perf_counter()
        try:
            self._faults.maybe_fail(self.step_count, batch)
            logits, sample_idx = self.runner.execute(batch)
            seqs = [batch.seqs[i] for i in sample_idx]
            tokens, logprobs = sample(
                logits,
                [s.params for s in seqs],
                [s.generator or self.generator for s in seqs],
                token_ids=[s.token_ids for s in seqs],
                num_outputs=[s.num_output_tokens for s in seqs],
                eos_token_ids=self.eos_token_ids,
            )
        except Exception as exc:  # a failed step fails its requests, not the engine
            return outputs + self._fail_batch(batch, exc)
        elapsed = time.perf_counter() - t0
        with self._lock:
            self.metrics.account_step(batch, elapsed)
            now = time.time()
            for seq in self.scheduler.postprocess(batch, seqs, tokens, logprobs, self._stop_reason):
                self.metrics.token(seq, now)
                if seq.is_finished:
                    self._finished(seq, now)  # at its last token's time, the step's end in the trace
                outputs.append(request_output(seq, [seq.token_ids[-1]], self.decode))
            self.trace.step(self.step_count, start, now, batch, shape, held, hits)
            self.step_count += 1
            self.metrics.record_step(now)
            self.metrics.observe_kv_usage(1.0 - self.block_manager.num_free / self.kv.num_blocks)
            self.drain_state.settle(len(self.seqs))
        return outputs

    def _fail_batch(self, batch, exc: Exception) -> list[RequestOutput]:
        """End every request of a step that raised with reason `error`; the KV they wrote this
        step is unusable, so their blocks go back (and their prefix hashes are not registered)."""
        detail = f"{type(exc).__name__}: {exc}"
        # the traceback goes to the log (the server's stderr): a client is told to look there
        log(f"step {self.step_count} failed; its {len(batch.seqs)} requests end with reason error:\n"
            + "".join(traceback.format_exception(exc)))  # fmt: skip
        outputs = []
        with self._lock:
            self.metrics.event("step_failed", None, f"step {self.step_count}: {detail}; {len(batch.seqs)} requests")
            for seq in batch.seqs:
                if not seq.is_finished:
                    outputs.append(self._finish(seq, "error", detail))
            self.step_count += 1
        return outputs

    def _take_inbox(self, outputs: list[RequestOutput]) -> None:
        while self._inbox:
            seq = self._inbox.popleft()
            self.scheduler.add(seq)
            self.metrics.event("admitted", seq.seq_id, f"{seq.num_prompt_tokens} prompt tokens")
        while self._aborts:
            request_id, detail = self._aborts.popleft()
            seq = self.seqs.get(request_id)
            if seq is not None:
                outputs.append(self._finish(seq, "abort", detail))
        while self._requeues:
            seq = self.seqs.get(self._requeues.popleft())
            if seq is not None and seq.state is SequenceState.RUNNING:
                self.scheduler.requeue(seq)
                self.metrics.event("evicted", seq.seq_id, f"requeued; {seq.num_tokens} tokens to recompute")

    def _stop_reason(self, seq: Sequence, token: int) -> tuple[str, str] | None:
        return stop_reason(seq, token, self.eos_token_ids, self.max_seq_len, self.max_model_len, self.decode)

    def _finish(self, seq: Sequence, reason: str, detail: str) -> RequestOutput:
        """End a request that gets no token (aborted, failed); its output."""
        self.scheduler.end(seq, reason, detail)
        self._finished(seq, time.time())
        return request_output(seq, [], self.decode)

    def _finished(self, seq: Sequence, now: float) -> None:
        """The scheduler has ended `seq` at `now`: out of the engine's requests, into the metrics and the trace."""
        self.metrics.finished(seq, now)
        self.seqs.pop(seq.seq_id, None)
        self.trace.finished(seq)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # ---- operator controls ---------------------------------------------------------------
    @property
    def state(self) -> EngineState:
        return self.drain_state.state

    def drain(self, timeout_s: float | None = None, abort_after: bool = False) -> None:
        """Stop admitting; requests in flight finish, `drained` once none is left. A deadline
        (`timeout_s`, with `abort_after`) is kept in `drain_state.info` for the server to enforce."""
        with self._lock:
            self.drain_state.start(len(self.seqs), timeout_s, abort_after)

    def resume(self) -> None:
        with self._lock:
            self.drain_state.resume()

    def evict_prefix_cache(self, max_blocks: int | None = None) -> int:
        """Drop free cached prefix blocks (all, or the `max_blocks` least recently used)."""
        with self._lock:
            n = self.block_manager.evict_cached(max_blocks)
            self.metrics.event("evicted", None, f"{n} cached prefix blocks")
            return n

    def evict_sequence(self, request_id: str, requeue: bool = False) -> bool:
        """Take a request's KV blocks back. Without `requeue` it ends with reason `abort`; with it,
        it goes back to the front of the queue and is recomputed. Applied at the next step."""
        if not requeue:
            return self.abort(request_id, "evicted by operator")
        with self._lock:
            if request_id not in self.seqs:
                return False
            self._requeues.append(request_id)
            return True

    def eviction_queued(self, request_id: str) -> bool:
        """An abort or requeue of `request_id` still waits for the next step to apply it."""
        with self._lock:
            return request_id in self._requeues or any(queued == request_id for queued, _ in self._aborts)

    def has_pending(self) -> bool:
        """Work for `step()`: requests in flight, or queued aborts and evictions."""
        return bool(self.seqs or self._aborts or self._requeues)

    def stats(self) -> dict:
        with self._lock:
            return build_frame(self)

    def gauges(self) -> dict:
        """The frame's counters and gauges, for a /metrics scrape: cheaper than `stats()` under the lock."""
        with self._lock:
            gauges = build_gauges(self)
        gauges["memory"] = memory_gauges(self)
        return gauges

    def trace_tables(self) -> tuple[dict, list[dict], list[dict]]:
        """The trace's header, its requests (finished, then in flight) and its steps, for a snapshot."""
        with self._lock:  # a copy under the lock; the rows (hex, dicts) after it
            header, (requests, steps) = trace_header(self), self.trace.capture(self.seqs.values())
        return header, *rows(requests, steps)
