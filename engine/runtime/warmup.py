"""Warm-up before serving: the first full-size step after a start costs more than the ones after it.

The first forward at the full token budget is the first time the process allocates activations of
that size: glibc maps each big tensor fresh (page faults on every page) until its dynamic mmap
threshold has grown past them, and the kernels touch their buffers for the first time. On the
2-core CPU machine, the first load of 16 streams of 256-token prompts after a start had a TTFT P50
of 1.98 s without the warm-up and 1.60 s with it (medians over five starts each; benchmarks/HISTORY.md,
"Warm-up before serving"). vLLM pays the same costs in its start-up profile run.

`warm_up` runs one prefill at the engine's token budget and one decode step over the same sequences
through the model runner only: no request, no metrics, no prefix-cache entry and no block taken
from the block manager. It writes K/V into blocks that are free (at start every block is), whose
contents nobody reads before a sequence that owns them writes them: every reader is bounded by its
sequence's length.
"""

from __future__ import annotations

import time

from engine.sampling import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence

PROMPT_TOKENS = 256  # each warm-up sequence's prompt: a typical chat prompt, so attention runs at that size


def warm_up(engine) -> tuple[int, int, float] | None:
    """One full-budget prefill and one decode step on a fresh engine; (prefill tokens, decode rows,
    seconds), or None where the engine already holds sequences or cached blocks (it would write over them)."""
    kv, bm = engine.kv, engine.block_manager
    if engine.seqs or bm.num_free != kv.num_blocks or bm.num_cached:
        return None
    bs, cfg = kv.block_size, engine.config
    cap = min(engine.max_seq_len, kv.num_blocks * bs) - 1  # room for the prompt and the decoded token
    length = max(1, min(PROMPT_TOKENS, cfg.max_num_batched_tokens, cap))
    blocks_each = -(-(length + 1) // bs)
    count = min(cfg.max_num_seqs, max(1, cfg.max_num_batched_tokens // length), kv.num_blocks // blocks_each)
    vocab = engine.spec.vocab_size
    seqs = []
    for i in range(count):
        ids = [(7 + 31 * (i * length + j)) % vocab for j in range(length)]
        seq = Sequence(f"warm-up-{i}", ids, SamplingParams(max_tokens=1))
        seq.block_table = list(range(i * blocks_each, (i + 1) * blocks_each))
        seqs.append(seq)
    t0 = time.perf_counter()
    engine.runner.execute(ScheduledBatch(seqs=seqs, num_new_tokens=[length] * count))
    for seq in seqs:
        seq.num_computed_tokens = length
        seq.token_ids.append(seq.token_ids[-1])
    engine.runner.execute(ScheduledBatch(seqs=seqs, num_new_tokens=[1] * count))
    return length * count, count, time.perf_counter() - t0
