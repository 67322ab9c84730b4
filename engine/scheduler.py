"""Scheduler: continuous batching under a sequence cap and a token budget.

Each step: running sequences first (decode: one token; a prompt still prefilling: its next chunk),
then waiting ones join while the budget, `max_num_seqs` and free blocks allow. When blocks run out
the newest running sequence is preempted (its blocks freed, recomputed later from its tokens).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.kv.block_manager import BlockManager
from engine.sequence import Sequence, SequenceState


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions_total = 0

    def add(self, seq: Sequence) -> None:
        seq.state = SequenceState.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.bm.can_append(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.bm.append_slots(seq, n)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
                i += 1
        # a step that had to preempt admits nobody: the cache is full
        while self.waiting and not batch.preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self.bm.lookup_prefix(seq)
            computed = len(hits) * self.bm.block_size
            n = min(seq.num_tokens - computed, budget)
            reused_free = sum(1 for b in hits if self.bm.blocks[b].ref_count == 0)
            needed = -(-(computed + n) // self.bm.block_size) - len(hits)
            if needed + reused_free > self.bm.num_free:
                break
            self.waiting.popleft()
            self.bm.allocate_prefix(seq, hits)
            self.bm.append_slots(seq, n)
            seq.state = SequenceState.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            batch.admitted.append(seq)
            budget -= n
        return batch

    def requeue(self, seq: Sequence) -> None:
        """Operator eviction with requeue: free the blocks, recompute the sequence later."""
        self.running.remove(seq)
        self._preempt(seq)
        self.preemptions_total -= 1  # not a preemption the scheduler chose
        seq.num_preemptions -= 1

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free(seq)
        seq.state = SequenceState.WAITING
        seq.num_preemptions += 1
        self.preemptions_total += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)
