"""A GGUF file whose layers' weights are re-quantized to another block format (issue #41).

    .venv/bin/python benchmarks/requantize_gguf.py --type Q5_0 --out /tmp/smollm2-q5_0.gguf
    .venv/bin/python benchmarks/quant.py --model /tmp/smollm2-q5_0.gguf --engines quant-bf16,bf16

No model hub is reachable here, and the default model's file is all Q4_1 and Q8_0; files from other
quantizers hold other formats — llama.cpp's Q4_K_M writes Q5_0 (and Q5_K_M Q5_1) for rows that are
not a multiple of 256, SmolLM2's 576. This copies a file (the default model's, or `--model`) with every
layer's weight matrix de-quantized and quantized again to `--type` by the `gguf` package: a real
model's names, shapes and text in that format. The tests use `rewrite_gguf` for single tensors.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# the formats the `gguf` package quantizes to (not the K formats)
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def rewrite_gguf(source: Path, out: Path, requantize: dict, make_blocks: Callable | None = None) -> None:
    """`source` copied to `out` (its metadata and tensors) with the tensors named in `requantize`
    de-quantized and quantized again to the given GGMLQuantizationType, as a file from another
    quantizer would hold them; `make_blocks(kind, rows, k)` makes the blocks of a format the `gguf`
    package cannot quantize to (the tests: random K-format blocks)."""
    from gguf import GGUFReader, GGUFWriter
    from gguf.quants import dequantize, quantize

    reader = GGUFReader(source)
    writer = GGUFWriter(out, arch="llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub_type = field.types[-1] if len(field.types) > 1 else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type)
    for tensor in reader.tensors:
        data, kind = tensor.data, tensor.tensor_type
        if tensor.name in requantize:
            kind = requantize[tensor.name]
            if kind.name in QUANTIZABLE:
                data = quantize(dequantize(tensor.data, tensor.tensor_type), kind)
            elif make_blocks is not None:
                k, rows = (int(x) for x in tensor.shape)
                data = make_blocks(kind, rows, k)
            else:
                raise SystemExit(
                    f"the gguf package cannot quantize to {kind.name}; pick one of {', '.join(QUANTIZABLE)}"
                )
        writer.add_tensor(tensor.name, np.asarray(data), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def layer_weights(source: Path) -> list[str]:
    """The names of the file's per-layer weight matrices (its projections; not the norms)."""
    from gguf import GGUFReader

    return [t.name for t in GGUFReader(source).tensors if t.name.startswith("blk.") and len(t.shape) == 2]


def checked_paths(model: str, out: Path) -> Path:
    """The source file for `model`, after refusing in one line what would fail or lose a file: no source,
    an output that is the source (writing it would truncate what is being read), no output directory."""
    from engine.model.default import KNOWN_MODELS, fetch_gguf

    source = fetch_gguf(*KNOWN_MODELS[model]) if model in KNOWN_MODELS else Path(model)
    if not source.is_file():
        raise SystemExit(f"no GGUF file at {source}")
    if out.resolve() == source.resolve():
        raise SystemExit(f"--out {out} is the source file: write the copy elsewhere")
    if not out.parent.is_dir():
        raise SystemExit(f"no directory {out.parent} for --out")
    return source


def main() -> None:
    from gguf import GGMLQuantizationType

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--type", required=True, choices=QUANTIZABLE, help="the block format to write the layers in")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--model", default="smollm2-135m", help="a known name or a .gguf file")
    args = ap.parse_args()
    source = checked_paths(args.model, args.out)
    t0 = time.perf_counter()
    partial = args.out.with_name(args.out.name + ".part")  # renamed once whole: a failure leaves no half file
    try:
        names = layer_weights(source)
        rewrite_gguf(source, partial, {name: GGMLQuantizationType[args.type] for name in names})
    except (ValueError, OSError) as exc:  # not a GGUF file, a full disk
        partial.unlink(missing_ok=True)
        raise SystemExit(f"could not rewrite {source}: {exc}") from None
    partial.replace(args.out)
    size = args.out.stat().st_size / 2**20
    print(f"{args.out}: {len(names)} layer weights in {args.type}, {size:.1f} MiB, {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
