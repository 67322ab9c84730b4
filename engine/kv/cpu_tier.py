"""CpuTier: host-memory KV blocks behind the device pool — a trade of capacity for latency.

Two uses: a preempted sequence's blocks are swapped out here and back (preemption_mode=swap), and
free prefix blocks evicted from the device spill here, to be restored on a later hit instead of
recomputed. Host blocks are free, spilled prefixes (reusable, evicted LRU like the device's), or
held by a swapped sequence. Every copy is timed and counted: the trade must show in the stats.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from kvtop.protocol.frame import CpuTier as CpuTierInfo


class BlockCopier(Protocol):
    def copy_to_host(self, device_ids: list[int], host_ids: list[int]) -> None: ...
    def copy_to_device(self, host_ids: list[int], device_ids: list[int]) -> None: ...


@dataclass
class TransferStats:
    swap_outs: int = 0  # sequences swapped out
    swap_ins: int = 0
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    spills: int = 0  # prefix blocks moved to the host instead of dropped
    restores: int = 0  # prefix blocks brought back on a hit
    dropped: int = 0  # spilled prefixes lost when the host tier filled up
    to_host_s: float = 0.0
    to_device_s: float = 0.0


@dataclass
class CpuTier:
    num_blocks: int
    block_bytes: int
    copier: BlockCopier
    free_queue: OrderedDict[int, None] = field(init=False)
    prefix_of: dict[int, tuple[int, tuple[int, ...]]] = field(init=False)  # host id -> (hash, tokens)
    hash_to_block: dict[int, int] = field(init=False)
    stats: TransferStats = field(init=False)

    def __post_init__(self) -> None:
        self.free_queue = OrderedDict((i, None) for i in range(self.num_blocks))
        self.prefix_of = {}
        self.hash_to_block = {}
        self.stats = TransferStats()

    @property
    def num_free(self) -> int:
        """Blocks available for new data (spilled prefixes count: they can be dropped)."""
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        """Blocks holding data: swapped sequences' and spilled prefixes."""
        return self.num_blocks - len(self.free_queue) + len(self.prefix_of)

    def report(self, swapped_seqs: int) -> CpuTierInfo:
        """The CPU tier's part of the stats frame: its occupancy and what its transfers cost."""
        t = self.stats
        return {
            "enabled": True,
            "num_blocks": self.num_blocks,
            "used": self.num_used,
            "prefix_blocks": len(self.prefix_of),
            "swapped_sequences": swapped_seqs,
            "bytes": self.num_blocks * self.block_bytes,
            "swap_outs": t.swap_outs,
            "swap_ins": t.swap_ins,
            "swap_out_bytes": t.swap_out_blocks * self.block_bytes,
            "swap_in_bytes": t.swap_in_blocks * self.block_bytes,
            "spilled_blocks": t.spills,
            "restored_blocks": t.restores,
            "dropped_blocks": t.dropped,
            "to_host_s": t.to_host_s,
            "to_device_s": t.to_device_s,
        }

    def states(self) -> str:
        """One char per host block: `o` holds KV (swapped or spilled), `.` free."""
        return "".join(
            "." if (i in self.free_queue and i not in self.prefix_of) else "o" for i in range(self.num_blocks)
        )

    def _take(self) -> int:
        host_id, _ = self.free_queue.popitem(last=False)
        prefix = self.prefix_of.pop(host_id, None)
        if prefix is not None:
            del self.hash_to_block[prefix[0]]
            self.stats.dropped += 1
        return host_id

    def _release(self, host_id: int) -> None:
        self.free_queue[host_id] = None
        self.free_queue.move_to_end(host_id, last=False)

    # ---- swapping whole sequences ----------------------------------------------------------
    def swap_out(self, device_ids: list[int]) -> list[int] | None:
        if len(device_ids) > self.num_free:
            return None
        host_ids = [self._take() for _ in device_ids]
        t0 = time.perf_counter()
        self.copier.copy_to_host(device_ids, host_ids)
        self.stats.to_host_s += time.perf_counter() - t0
        self.stats.swap_outs += 1
        self.stats.swap_out_blocks += len(device_ids)
        return host_ids

    def swap_in(self, host_ids: list[int], device_ids: list[int]) -> None:
        t0 = time.perf_counter()
        self.copier.copy_to_device(host_ids, device_ids)
        self.stats.to_device_s += time.perf_counter() - t0
        self.stats.swap_ins += 1
        self.stats.swap_in_blocks += len(host_ids)
        for h in host_ids:
            self._release(h)

    def release(self, host_ids: list[int]) -> None:
        """A swapped sequence ended (aborted) before coming back."""
        for h in host_ids:
            self._release(h)

    # ---- spilled prefixes ------------------------------------------------------------------
    def spill(self, device_id: int, block_hash: int, tokens: tuple[int, ...]) -> None:
        if self.num_blocks == 0 or block_hash in self.hash_to_block:
            return
        host_id = self._take()
        t0 = time.perf_counter()
        self.copier.copy_to_host([device_id], [host_id])
        self.stats.to_host_s += time.perf_counter() - t0
        self.prefix_of[host_id] = (block_hash, tokens)
        self.hash_to_block[block_hash] = host_id
        self.free_queue[host_id] = None  # reusable, most recently used end
        self.stats.spills += 1

    def lookup(self, block_hash: int, tokens: tuple[int, ...]) -> int | None:
        host_id = self.hash_to_block.get(block_hash)
        if host_id is None or self.prefix_of[host_id][1] != tokens:
            return None
        return host_id

    def claim(self, host_id: int) -> tuple[int, tuple[int, ...]]:
        """Take a spilled prefix block out of circulation before restoring it."""
        del self.free_queue[host_id]
        block_hash, tokens = self.prefix_of.pop(host_id)
        del self.hash_to_block[block_hash]
        return block_hash, tokens

    def restore(self, host_id: int, device_id: int) -> None:
        t0 = time.perf_counter()
        self.copier.copy_to_device([host_id], [device_id])
        self.stats.to_device_s += time.perf_counter() - t0
        self.stats.restores += 1
        self._release(host_id)
