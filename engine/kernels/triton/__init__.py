"""Triton paged attention: `store_kv`, `paged_decode_attention`, `paged_prefill_attention`; and
the decoder layer's element-wise ops, one kernel each (`elementwise.py`).

Same signatures, layouts and quantization conventions as `engine.kernels.reference` (the oracle);
see its docstring and DESIGN §2–§3. Cache per layer `[num_blocks, block_size, kv_heads, head_dim]`.

- `store_kv`: one program per token writes all its KV heads; int8 gets one symmetric scale per
  (token, KV head), fp8_e4m3 divides by the per-tensor scale. Rounding is round-half-even and the
  divisions are IEEE (`div_rn`), so the cache bytes equal the reference's bit for bit.
- Decode: one program per (sequence, KV head, split) runs every query head of the GQA group as
  the rows of one tile, so each K/V tile is loaded once per group; a sequence's context is cut into
  `num_splits` chunks (flash-decoding) whose partial results a second kernel merges by
  log-sum-exp. `decode_num_splits` picks the split count.
- Prefill: one program per (tile of new tokens × GQA group, KV head); causal over the whole context
  in the cache, fully visible key tiles without masks, the diagonal ones masked. Programs find
  their sequence by a binary search over `cu_seqlens_q`, so the launch needs no host sync.

Dequantization happens in the tiles: int8 K scales multiply the scores column-wise, int8 V scales
the probabilities; fp8 per-tensor scales fold into the softmax scale and the output.

Only positions below a sequence's length are read, from the cache and from its block table, so
stale blocks and unwritten slots never reach the result. Under `TRITON_INTERPRET=1` (tests on the
CPU) all arithmetic runs in fp32, since the interpreter has no bf16 arithmetic.

Element-wise ops (`elementwise.py`): `rms_norm`, `fused_add_rms_norm` (the residual add and the
norm in one kernel), `rotary_embedding` (q and k in place, one launch) and `silu_and_mul`, with the
reference's signatures and rounding. `engine.kernels.get_backend` serves the reference's torch ops
in their place when `KVTOP_TRITON_ELEMENTWISE=0`, to compare.

Files: `common.py` (quantization modes; the cache as the kernels take it, `KVPages` and
`KVStrides`; `_attend`, the online softmax both attention kernels run; host checks), `store.py`,
`decode.py`, `prefill.py`, `elementwise.py`.
"""

from engine.kernels.triton.common import _INTERPRETER_SMS, Quant, _num_sms
from engine.kernels.triton.decode import MAX_SPLITS, MIN_TOKENS_PER_SPLIT, decode_num_splits, paged_decode_attention
from engine.kernels.triton.elementwise import fused_add_rms_norm, rms_norm, rotary_embedding, silu_and_mul
from engine.kernels.triton.prefill import paged_prefill_attention
from engine.kernels.triton.store import store_kv

__all__ = [
    "MAX_SPLITS",
    "MIN_TOKENS_PER_SPLIT",
    "_INTERPRETER_SMS",
    "Quant",
    "_num_sms",
    "decode_num_splits",
    "fused_add_rms_norm",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "store_kv",
]
