"""Scheduler: continuous batching under a sequence cap and a token budget.

Each step: running sequences first (decode: one token; a prompt still prefilling: its next chunk),
then swapped-out ones come back, then waiting ones join while the budget, `max_num_seqs` and free
blocks allow. When blocks run out the newest running sequence is preempted: swapped to the CPU
tier (preemption_mode=swap, when it has room) or freed and recomputed later from its tokens.
Waiting order is arrival (fcfs) or longest cached prefix first (lpm), where a request passed over
`lpm_max_skips` times goes first so nothing starves.

After the step the scheduler finishes what it scheduled (`postprocess`, as nano-vllm's): the KV
each sequence wrote is committed (full blocks into the prefix cache), each sampled sequence gets
its new token, its stop conditions are checked (engine/stopping.py), and one that stopped is
ended and its blocks freed. What the engine measures of it (metrics, trace) stays the engine's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv.block_manager import BlockManager
from engine.sequence import Sequence, SequenceState
from kvtop.protocol.config import EngineConfig
from kvtop.protocol.frame import SchedulerInfo

StopCheck = Callable[[Sequence, int], "tuple[str, str] | None"]  # (finish_reason, detail) when the token ends it


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    swapped_in: list[Sequence] = field(default_factory=list)
    peak_held_blocks: int = 0  # the most device blocks held during this schedule (just before a preemption)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


def active_tokens(running, block_size: int) -> int:
    """Tokens the running sequences hold KV slots for. A prompt in prefill counts from the step
    that schedules it (its blocks are taken then), not only once its KV is written."""
    return sum(max(s.num_computed_tokens, min(s.num_tokens, len(s.block_table) * block_size)) for s in running)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
        preemption_mode: str = "recompute",
        lpm_max_skips: int = 16,
    ) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.preemption_mode = preemption_mode
        self.lpm_max_skips = lpm_max_skips
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.preemptions_total = 0

    def stats(self, queued_elsewhere: int = 0) -> SchedulerInfo:
        """The scheduler's part of the stats frame; `queued_elsewhere`: requests added but not yet
        handed to it (the engine's inbox), counted as waiting."""
        return {
            "running": len(self.running),
            "waiting": len(self.waiting) + queued_elsewhere,
            "swapped": len(self.swapped),
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "active_tokens": active_tokens(self.running, self.bm.block_size),
            "preemptions_total": self.preemptions_total,
        }

    @classmethod
    def from_config(cls, block_manager: BlockManager, config: EngineConfig) -> Scheduler:
        return cls(
            block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            policy=config.schedule_policy,
            preemption_mode=config.preemption_mode,
        )

    def add(self, seq: Sequence) -> None:
        seq.state = SequenceState.WAITING
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        bm, free_blocks = self.bm, self.bm.free_queue  # the hot loop: one pass per running sequence
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            needed = bm.blocks_needed(seq, n)  # preempting others frees blocks, never changes this
            while needed > len(free_blocks):
                batch.peak_held_blocks = max(batch.peak_held_blocks, bm.num_blocks - len(free_blocks))
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                bm.take_blocks(seq, needed)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
                i += 1
        if batch.preempted:
            return batch  # the cache is full: nobody comes back or joins this step
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.bm.can_swap_in(seq, n):
                break
            self.swapped.popleft()
            self.bm.swap_in(seq)
            self._start(seq, n, batch, batch.swapped_in)
            budget -= n
        if self.swapped:
            return batch  # swapped sequences come back before new ones start
        if self.policy == "lpm" and len(self.waiting) > 1:
            self._order_longest_prefix_first()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self.bm.lookup_prefix(seq)
            computed = len(hits) * self.bm.block_size
            n = min(seq.num_tokens - computed, budget)
            if self.bm.blocks_to_admit(hits, computed + n) > self.bm.num_free:
                break
            self.waiting.popleft()
            self.bm.allocate_prefix(seq, hits)
            self._start(seq, n, batch, batch.admitted)
            budget -= n
        if self.policy == "lpm":
            for seq in self.waiting:
                seq.lpm_skips += 1
        return batch

    def _start(self, seq: Sequence, n: int, batch: ScheduledBatch, why: list[Sequence]) -> None:
        """A swapped-in or newly admitted sequence joins the running set and this step's batch."""
        self.bm.append_slots(seq, n)
        seq.state = SequenceState.RUNNING
        self.running.append(seq)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
        why.append(seq)

    def _order_longest_prefix_first(self) -> None:
        """lpm: sequences already started (preempted) and starving ones first, then by cached prefix."""
        window = list(self.waiting)[:256]
        rest = list(self.waiting)[256:]

        def key(seq: Sequence) -> tuple[int, int]:
            if seq.num_preemptions or seq.lpm_skips >= self.lpm_max_skips:
                return (0, -seq.lpm_skips)
            return (1, -len(self.bm.lookup_prefix(seq)))

        window.sort(key=key)  # stable: equal prefixes stay in arrival order
        self.waiting = deque(window + rest)

    def requeue(self, seq: Sequence) -> None:
        """Operator eviction with requeue: free the blocks, recompute the sequence later."""
        self.running.remove(seq)
        self._preempt(seq, allow_swap=False)
        self.preemptions_total -= 1  # not a preemption the scheduler chose
        seq.num_preemptions -= 1

    def _preempt(self, seq: Sequence, allow_swap: bool = True) -> None:
        seq.num_preemptions += 1
        self.preemptions_total += 1
        if allow_swap and self.preemption_mode == "swap" and self.bm.swap_out(seq):
            seq.state = SequenceState.SWAPPED
            self.swapped.appendleft(seq)
            return
        self.bm.free(seq)
        seq.state = SequenceState.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
        self.bm.free(seq)

    def end(self, seq: Sequence, reason: str, detail: str) -> None:
        """A sequence is done (stopped, aborted, failed): out of the queues, its blocks freed,
        FINISHED with its reason."""
        self.finish(seq)
        seq.state = SequenceState.FINISHED
        seq.finish_reason, seq.finish_detail = reason, detail

    def postprocess(
        self, batch: ScheduledBatch, seqs: list[Sequence], tokens: list[int], logprobs, stop: StopCheck
    ) -> list[Sequence]:
        """After the model ran `batch`: its KV committed, then each of `seqs` (the sampled ones)
        given its token (and log-prob), checked by `stop` and ended when it stopped. A sequence
        aborted while the model ran is skipped. Returns those that got a token, in order."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
            self.bm.commit_full_blocks(seq)
        appended = []
        for j, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            if seq.is_finished:
                continue
            seq.token_ids.append(token)
            if logprobs is not None:
                seq.output_logprobs.append(logprobs[j])
            reason = stop(seq, token)
            if reason is not None:
                self.end(seq, *reason)
            appended.append(seq)
        return appended
