"""GGUF files into HF directories: transformers dequantizes them, we drop `quantization_config`
and write safetensors under the cache, once, so later loads take seconds."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch

from engine.errors import ModelLoadError
from engine.log import log
from engine.paths import cache_dir


def convert_gguf(gguf: Path, out_dir: Path | None = None) -> Path:
    """Dequantize a GGUF file into an HF directory (once; cached by the file's path and size)."""
    gguf = gguf.resolve()
    if out_dir is None:
        key = hashlib.sha256(f"{gguf}:{gguf.stat().st_size}:{gguf.stat().st_mtime_ns}".encode()).hexdigest()[:16]
        out_dir = cache_dir() / "models" / f"{gguf.stem}-{key}"
    if (out_dir / ".complete").exists():
        return out_dir
    from safetensors.torch import save_model
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
    save_model(hf, str(tmp / "model.safetensors"))
    (tmp / ".complete").write_text(json.dumps({"source": str(gguf), "converted": time.time()}))
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    log(f"converted in {time.time() - t0:.1f} s")
    return out_dir
