"""ModelRunner: turns a scheduled batch into packed tensors, runs the forward, returns logits.

It owns the model, the KV cache tensors and the kernel backend; it knows nothing of requests
beyond their tokens, positions and block tables.
"""

from __future__ import annotations

import torch

from engine.kernels.attention import AttentionBatch
from engine.kv.cache import KVCache
from engine.model.llama import CausalLM
from engine.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCache, kernels, device: str) -> None:
        self.model = model
        self.kv = kv
        self.kernels = kernels
        self.device = device
        self.block_size = kv.block_size

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Run one step. Returns logits for the sequences that reach their last token this step
        (a prompt chunk mid-prefill produces none) and those sequences' indices in the batch."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        cu = [0]
        sample_rows: list[int] = []
        sample_idx: list[int] = []
        # decodes first: they take the decode kernel, the rest the prefill kernel, in one forward
        # (padding one-token decodes to a prompt chunk's length would waste most of the attention)
        order = [i for i, n in enumerate(batch.num_new_tokens) if n == 1]
        num_decodes = len(order)
        order += [i for i, n in enumerate(batch.num_new_tokens) if n != 1]
        for i in order:
            seq, n = batch.seqs[i], batch.num_new_tokens[i]
            start = seq.num_computed_tokens
            end = start + n
            input_ids.extend(seq.token_ids[start:end])
            table = seq.block_table
            for pos in range(start, end):
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
            seq_lens.append(end)
            cu.append(cu[-1] + n)
            if end == seq.num_tokens:
                sample_rows.append(cu[-1] - 1)
                sample_idx.append(i)
        dev = self.device
        decode_seqs = [batch.seqs[i] for i in order[:num_decodes]]
        prefill_seqs = [batch.seqs[i] for i in order[num_decodes:]]
        attn = AttentionBatch(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decodes=num_decodes,
            decode_tables=_tables(decode_seqs, dev),
            decode_lens=torch.tensor(seq_lens[:num_decodes], dtype=torch.int32, device=dev),
            prefill_tables=_tables(prefill_seqs, dev),
            prefill_lens=torch.tensor(seq_lens[num_decodes:], dtype=torch.int32, device=dev),
            prefill_cu_seqlens_q=torch.tensor(
                [c - num_decodes for c in cu[num_decodes:]], dtype=torch.int32, device=dev
            ),
        )
        # a prompt's rows before its last feed only the KV: the last layer computes the sampling rows
        every_row = len(sample_rows) == len(input_ids)
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            attn,
            self.kv.layers,
            self.kernels,
            None if every_row else torch.tensor(sample_rows, dtype=torch.int64, device=dev),
        )
        if not sample_rows:
            return hidden.new_empty(0, self.model.spec.vocab_size), []
        return self.model.compute_logits(hidden), sample_idx


def _tables(seqs, device) -> torch.Tensor | None:
    """Block tables padded to the longest (padding is never read: lengths bound every read)."""
    if not seqs:
        return None
    width = max(len(s.block_table) for s in seqs)
    return torch.tensor(
        [s.block_table + [0] * (width - len(s.block_table)) for s in seqs], dtype=torch.int32, device=device
    )
