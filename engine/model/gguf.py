"""GGUF files into HF directories: transformers dequantizes them, we drop `quantization_config`
and write safetensors under the cache, once, so later loads take seconds.

The directory is a plain transformers checkpoint that any loader (transformers, vLLM) takes: tied
embeddings are stored once, as `model.embed_tokens.weight`, the name transformers writes. Format 1
directories (before this) stored them only as `lm_head.weight`; `ready()` renames the tensor in
place the first time it meets one, so an old cache needs no new conversion.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch

from engine.errors import ModelLoadError
from engine.runtime.log import log
from kvtop.protocol.paths import cache_dir

FORMAT = 2  # 2: tied embeddings under transformers' name, model.embed_tokens.weight
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _cache_key(gguf: Path) -> str:
    """The file's path, size and modification time: a changed file is converted again."""
    return hashlib.sha256(f"{gguf}:{gguf.stat().st_size}:{gguf.stat().st_mtime_ns}".encode()).hexdigest()[:16]


def describe_gguf(gguf: Path) -> Path:
    """An HF directory holding only a GGUF file's config and tokenizer, no weights: what a quantized
    load needs beside the file (engine.model.gguf_quant reads the weights from the file itself).
    Written once under the cache in seconds, where a full conversion de-quantizes every tensor in
    memory (an 8B model's 32 GB of float32 would not fit). A full conversion's directory serves if
    there is one."""
    gguf = gguf.resolve()
    key = _cache_key(gguf)
    if ready(full := cache_dir() / "models" / f"{gguf.stem}-{key}"):
        return full
    out_dir = cache_dir() / "models" / f"{gguf.stem}-{key}-config"
    if ready(out_dir):
        return out_dir
    from transformers import AutoConfig, AutoTokenizer

    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as exc:
        raise ModelLoadError(f"transformers could not read {gguf}: {exc}") from None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    _mark(tmp, {"source": str(gguf), "converted": time.time(), "weights": "none: read from the file"})
    _publish(tmp, out_dir)
    return out_dir


def convert_gguf(gguf: Path, out_dir: Path | None = None) -> Path:
    """Dequantize a GGUF file into an HF directory (once; cached by the file's path and size)."""
    gguf = gguf.resolve()
    if out_dir is None:
        out_dir = cache_dir() / "models" / f"{gguf.stem}-{_cache_key(gguf)}"
    if ready(out_dir):
        return out_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"converting {gguf.name} to an HF directory in {out_dir} (once; takes ~30 s)…")
    t0 = time.time()
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as exc:
        raise ModelLoadError(f"transformers could not read {gguf}: {exc}") from None
    cfg = hf.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tensors = {name: t.contiguous() for name, t in hf.state_dict().items()}
    if getattr(cfg, "tie_word_embeddings", False):
        tensors.pop(LM_HEAD, None)  # one tensor, under the name every loader reads
    _save(tensors, tmp / "model.safetensors")
    _mark(tmp, {"source": str(gguf), "converted": time.time()})
    _publish(tmp, out_dir)
    log(f"converted in {time.time() - t0:.1f} s")
    return out_dir


def ready(out_dir: Path) -> bool:
    """A finished conversion in the current format (an older one is brought up to date first)."""
    marker = out_dir / ".complete"
    if not marker.exists():
        return False
    try:
        info = json.loads(marker.read_text() or "{}")
    except json.JSONDecodeError:
        info = {}
    if info.get("format", 1) < FORMAT:
        _name_tied_embeddings(out_dir)
        _mark(out_dir, info)
    return True


def _name_tied_embeddings(out_dir: Path) -> None:
    """Format 1 → 2: a tied embedding stored only as `lm_head.weight` is renamed `model.embed_tokens.weight`."""
    from safetensors.torch import load_file

    config = json.loads((out_dir / "config.json").read_text())
    path = out_dir / "model.safetensors"
    if not config.get("tie_word_embeddings") or not path.exists():
        return
    tensors = load_file(str(path))
    if EMBED in tensors or LM_HEAD not in tensors:
        return
    log(f"renaming the tied embedding in {out_dir} to {EMBED} (once)…")
    tensors[EMBED] = tensors.pop(LM_HEAD)
    _save(tensors, path)


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Written beside and renamed into place: a reader never sees half a file."""
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)


def _publish(tmp: Path, out_dir: Path) -> None:
    """A finished directory written beside `out_dir` takes its place (a reader never sees half of one)."""
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    tmp.rename(out_dir)


def _mark(out_dir: Path, info: dict) -> None:
    tmp = out_dir / f".complete.tmp{os.getpid()}"
    tmp.write_text(json.dumps({**info, "format": FORMAT}))
    os.replace(tmp, out_dir / ".complete")
