"""A random-weight GGUF file of a llama shape, its tensors in Q4_K_M's (or Q5_K_M's) mix of formats (issue #41).

    .venv/bin/python benchmarks/random_gguf.py --shape llama3-8b --out /tmp/llama3-8b-q4_k_m.gguf
    .venv/bin/python benchmarks/random_gguf.py --shape tiny --out /tmp/tiny-q4_k_m.gguf
    .venv/bin/python benchmarks/random_gguf.py --shape llama3-1b --mix Q5_K_M --out /tmp/llama3-1b-q5_k_m.gguf

No model hub is reachable here, and the `gguf` package cannot quantize to the K formats, so the blocks
are random bytes with their super-scales set to small positive numbers: the file has a real model's
tensor names, shapes, formats and bytes, which is what memory and speed depend on, and garbage for
text. The tokenizer (and so the vocabulary, 49,152 tokens against Llama 3's 128,256) is SmolLM2's,
copied from the default model's file. Formats as llama.cpp's Q4_K_M picks them: Q4_K everywhere but
the logits head (Q6_K) and attn_v and ffn_down in the layers llama.cpp gives more bits (the first and
last eighth, and every third between), Q6_K; the norms F32. `--mix Q5_K_M`: the same with Q5_K for
Q4_K, as llama.cpp's Q5_K_M picks them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# hidden, intermediate, layers, heads, kv heads
SHAPES = {
    "llama3-8b": (4096, 14336, 32, 32, 8),
    "llama3-1b": (2048, 8192, 16, 32, 8),
    "tiny": (256, 512, 2, 4, 2),
}


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def random_blocks(fmt, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, row bytes] uint8 of random Q4_K, Q5_K or Q6_K blocks whose weights are about ±0.03."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    per_block, block_bytes = GGML_QUANT_SIZES[fmt]
    blocks = rng.integers(0, 256, size=(rows * k // per_block, block_bytes), dtype=np.uint8)
    if fmt in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K):  # w = d sc q - dmin min: sc, min < 64
        top = 15 if fmt == GGMLQuantizationType.Q4_K else 31  # q's largest
        d = (rng.uniform(1e-4, 2e-4, blocks.shape[0]) * 15 / top).astype(np.float16)
        blocks[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
        blocks[:, 2:4] = (d * np.float16(top / 2)).view(np.uint8).reshape(-1, 2)
    else:  # Q6_K: w = d scale (q - 32): |scale| < 128, |q - 32| <= 32
        d = rng.uniform(1e-5, 3e-5, blocks.shape[0]).astype(np.float16)
        blocks[:, 208:210] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def add_metadata(writer, shape: str, mix: str, source) -> int:
    """The shape's hyperparameters and `source`'s tokenizer; returns the vocabulary's size."""
    hidden, inter, layers, heads, kv_heads = SHAPES[shape]
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    writer.add_name(f"random {shape} {mix} (kvtop benchmarks/random_gguf.py)")
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    for field in source.fields.values():
        if field.name.startswith("tokenizer."):
            sub_type = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type)
    return vocab


MIXES = ("Q4_K_M", "Q5_K_M")  # llama.cpp's names: Q4_K or Q5_K, and Q6_K where it gives more bits


def write(out: Path, shape: str, seed: int = 0, mix: str = "Q4_K_M") -> int:
    """Write the file; returns its tensors' bytes."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

    from engine.model.default import KNOWN_MODELS, fetch_gguf

    hidden, inter, layers, heads, kv_heads = SHAPES[shape]
    head_dim = hidden // heads
    writer = GGUFWriter(out, arch="llama")
    vocab = add_metadata(writer, shape, mix, GGUFReader(fetch_gguf(*KNOWN_MODELS["smollm2-135m"])))
    rng = np.random.default_rng(seed)
    base = GGMLQuantizationType.Q5_K if mix == "Q5_K_M" else GGMLQuantizationType.Q4_K  # the mix's base format
    q6k = GGMLQuantizationType.Q6_K
    total = 0

    def tensor(name: str, fmt, rows: int, k: int) -> None:
        nonlocal total
        data = random_blocks(fmt, rows, k, rng)
        writer.add_tensor(name, data, raw_dtype=fmt)
        total += data.nbytes

    def norm(name: str) -> None:
        nonlocal total
        writer.add_tensor(name, np.ones(hidden, dtype=np.float32))
        total += hidden * 4

    tensor("token_embd.weight", base, vocab, hidden)
    for i in range(layers):
        b, wide = f"blk.{i}.", more_bits(i, layers)
        norm(b + "attn_norm.weight")
        tensor(b + "attn_q.weight", base, hidden, hidden)
        tensor(b + "attn_k.weight", base, kv_heads * head_dim, hidden)
        tensor(b + "attn_v.weight", q6k if wide else base, kv_heads * head_dim, hidden)
        tensor(b + "attn_output.weight", base, hidden, hidden)
        norm(b + "ffn_norm.weight")
        tensor(b + "ffn_gate.weight", base, inter, hidden)
        tensor(b + "ffn_up.weight", base, inter, hidden)
        tensor(b + "ffn_down.weight", q6k if wide else base, hidden, inter)
    norm("output_norm.weight")
    tensor("output.weight", q6k, vocab, hidden)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--out", type=Path, required=True, help="the .gguf file to write")
    ap.add_argument("--mix", choices=MIXES, default="Q4_K_M", help="the formats, as llama.cpp's file types pick them")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.out.suffix != ".gguf":
        sys.exit(f"random_gguf: {args.out}: the file's name must end in .gguf")
    t0 = time.perf_counter()
    total = write(args.out, args.shape, args.seed, args.mix)
    print(f"{args.out}: {args.shape} {args.mix}, {total / 2**30:.2f} GiB of tensors, {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
