"""BlockManager: the paged KV pool — block tables, ref counts, and the prefix cache.

Every block is in exactly one state: free (in `free_queue`, with or without a reusable prefix
hash — "cached" when with), used by one sequence, or shared (ref count > 1). Full blocks get a
hash chained from their parent's hash and their token ids; a freed block keeps its hash and stays
findable until it is reallocated, least recently used first. `free_queue` is an OrderedDict used
as an O(1) linked list: blocks without a hash sit at the front (reused first), cached ones are
appended at the back as they are freed.

With a CPU tier, a cached block about to be reallocated spills its content to the host first,
and a prefix lookup that misses on the device continues on the host (restored at admission);
preemption can swap a sequence's blocks out and back instead of recomputing them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from engine.kv.cpu_tier import CpuTier
from engine.sequence import Sequence
from kvtop.protocol.frame import PrefixCache
from kvtop.protocol.trace import chain_hash


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


@dataclass
class PrefixStats:
    query_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of those, found in the cache
    queries: int = 0  # requests looked up
    hit_requests: int = 0  # requests with at least one block hit
    evictions: int = 0  # cached blocks reallocated (their prefix lost, or spilled to the host)
    restored_blocks: int = 0  # prefix blocks found on the host tier and brought back

    def report(self, enabled: bool, cached_blocks: int, prefill_s_per_token: float | None) -> PrefixCache:
        """The prefix cache's part of the stats frame; the prefill it saved priced at `prefill_s_per_token`."""
        return {
            "enabled": enabled,
            "query_tokens": self.query_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
            "queries": self.queries,
            "hit_requests": self.hit_requests,
            "request_hit_rate": self.hit_requests / self.queries if self.queries else 0.0,
            "saved_prefill_s": self.hit_tokens * prefill_s_per_token if prefill_s_per_token else 0.0,
            "evictions": self.evictions,
            "restored_blocks": self.restored_blocks,
            "cached_blocks": cached_blocks,
        }


# a prefix hit: (on_host, block id) — device blocks are reused in place, host ones restored
Hit = tuple[bool, int]


@dataclass
class BlockManager:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    cpu: CpuTier | None = None
    blocks: list[Block] = field(init=False)
    free_queue: OrderedDict[int, None] = field(init=False)
    hash_to_block: dict[int, int] = field(init=False)
    prefix: PrefixStats = field(init=False)

    def __post_init__(self) -> None:
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self.free_queue = OrderedDict((i, None) for i in range(self.num_blocks))
        self.hash_to_block = {}
        self.prefix = PrefixStats()

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached(self) -> int:
        return sum(1 for b in self.free_queue if self.blocks[b].hash is not None)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free

    # ---- prefix cache --------------------------------------------------------------------
    chain_hash = staticmethod(chain_hash)  # the protocol's, so that traces hash blocks as the cache does

    def lookup_prefix(self, seq: Sequence) -> list[Hit]:
        """The longest cached prefix of `seq`, block by block, on the device or the host (full
        blocks only, and never the whole sequence: its last token must be computed for logits)."""
        if not self.enable_prefix_caching:
            return []
        hits: list[Hit] = []
        parent = None
        tokens = seq.token_ids
        bs = self.block_size
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = self.chain_hash(parent, chunk)
            block_id = self.hash_to_block.get(h)
            if block_id is not None and self.blocks[block_id].token_ids == chunk:
                hits.append((False, block_id))
            elif self.cpu is not None and (host_id := self.cpu.lookup(h, chunk)) is not None:
                hits.append((True, host_id))
            else:
                break
            parent = h
        return hits

    def blocks_to_admit(self, hits: list[Hit], num_tokens: int) -> int:
        """Free device blocks that admitting with `hits` and `num_tokens` total tokens consumes."""
        reused_free = sum(1 for on_host, b in hits if not on_host and self.blocks[b].ref_count == 0)
        device_hits = sum(1 for on_host, _ in hits if not on_host)
        return -(-num_tokens // self.block_size) - device_hits + reused_free

    def allocate_prefix(self, seq: Sequence, hits: list[Hit]) -> None:
        """Give a newly admitted sequence its cached prefix blocks (restoring host ones) and count
        the lookup. Caller checked blocks_to_admit against num_free."""
        assert not seq.block_table, "sequence already holds blocks"
        table: list[int] = []
        for on_host, block_id in hits:  # claim device hits first so no allocation below takes one
            if not on_host:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.free_queue[block_id]
                block.ref_count += 1
        # take host hits out of circulation before any allocation can spill over them
        claimed = {block_id: self.cpu.claim(block_id) for on_host, block_id in hits if on_host}
        for on_host, block_id in hits:
            if on_host:
                block_hash, tokens = claimed[block_id]
                device_id = self._pop_free()
                self.cpu.restore(block_id, device_id)
                block = self.blocks[device_id]
                block.hash, block.token_ids = block_hash, tokens
                self.hash_to_block[block_hash] = device_id
                self.prefix.restored_blocks += 1
                table.append(device_id)
            else:
                table.append(block_id)
        seq.block_table = table
        seq.num_hashed_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching and not seq.prefix_counted:
            # a request is counted once, on first admission (not again after a preemption)
            seq.prefix_counted = True
            seq.num_cached_tokens = seq.num_computed_tokens
            self.prefix.queries += 1
            self.prefix.query_tokens += seq.num_prompt_tokens
            self.prefix.hit_tokens += seq.num_computed_tokens
            self.prefix.hit_requests += bool(hits)

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of blocks the last step filled, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        tokens = seq.token_ids
        parent = self.blocks[seq.block_table[seq.num_hashed_blocks - 1]].hash if seq.num_hashed_blocks else None
        for i in range(seq.num_hashed_blocks, full):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = self.chain_hash(parent, chunk)
            block = self.blocks[seq.block_table[i]]
            if h not in self.hash_to_block:
                block.hash, block.token_ids = h, chunk
                self.hash_to_block[h] = block.block_id
            elif block.hash is None:
                # the same content is cached in another block: keep the chain going from here
                block.hash, block.token_ids = h, chunk
            parent = h
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    # ---- allocation ----------------------------------------------------------------------
    def _pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
                self.prefix.evictions += 1
                if self.cpu is not None:
                    self.cpu.spill(block_id, block.hash, block.token_ids)
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow `seq`'s table to hold `num_new_tokens` more tokens. Caller checked can_append."""
        self.take_blocks(seq, self.blocks_needed(seq, num_new_tokens))

    def take_blocks(self, seq: Sequence, count: int) -> None:
        """`count` free blocks onto the end of `seq`'s table (blocks_needed said how many)."""
        for _ in range(count):
            seq.block_table.append(self._pop_free())

    def free(self, seq: Sequence) -> None:
        """Return a sequence's blocks. Tail blocks go in first so a prefix outlives its suffix."""
        if seq.host_table:
            self.cpu.release(seq.host_table)
            seq.host_table = []
        self._release_device(seq)
        seq.num_computed_tokens = 0

    def _release_device(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
                    self.free_queue[block_id] = None
                else:
                    block.hash, block.token_ids = None, ()
                    self.free_queue[block_id] = None
                    self.free_queue.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_hashed_blocks = 0

    # ---- swapping (preemption_mode=swap) ------------------------------------------------------
    def swap_out(self, seq: Sequence) -> bool:
        """Move a sequence's KV to the host tier and free its device blocks; False if no room."""
        if self.cpu is None or not seq.block_table:
            return False
        host_ids = self.cpu.swap_out(seq.block_table)
        if host_ids is None:
            return False
        self._release_device(seq)
        seq.host_table = host_ids
        return True

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        total = seq.num_computed_tokens + num_new_tokens
        return -(-total // self.block_size) <= self.num_free

    def swap_in(self, seq: Sequence) -> None:
        device_ids = [self._pop_free() for _ in seq.host_table]
        self.cpu.swap_in(seq.host_table, device_ids)
        seq.host_table = []
        seq.block_table = device_ids
        seq.num_hashed_blocks = 0  # re-registered by the next commit_full_blocks

    def evict_cached(self, max_blocks: int | None = None) -> int:
        """Drop up to `max_blocks` free cached prefixes, least recently used first (to the CPU
        tier when there is one)."""
        dropped = 0
        for block_id in list(self.free_queue):
            if max_blocks is not None and dropped >= max_blocks:
                break
            block = self.blocks[block_id]
            if block.hash is None:
                continue
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
                if self.cpu is not None:
                    self.cpu.spill(block_id, block.hash, block.token_ids)
            block.hash, block.token_ids = None, ()
            self.free_queue.move_to_end(block_id, last=False)
            self.prefix.evictions += 1
            dropped += 1
        return dropped

    # ---- views ---------------------------------------------------------------------------
    def block_states(self) -> str:
        """One char per device block (DESIGN §6): `.` free, `c` cached, `u` used, `s` shared;
        then one per host block: `o` holding offloaded KV, `.` free."""
        chars = []
        for b in self.blocks:
            if b.ref_count > 1:
                chars.append("s")
            elif b.ref_count == 1:
                chars.append("u")
            elif b.hash is not None:
                chars.append("c")
            else:
                chars.append(".")
        return "".join(chars) + (self.cpu.states() if self.cpu is not None else "")
