"""Find a model (name, HF directory, GGUF file or hub id), read its config, load its weights.

GGUF files are converted once into an HF directory under the cache (transformers dequantizes
them; we drop `quantization_config` and write safetensors) so later loads take seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import ModelLoadError, UnsupportedArchitectureError
from engine.model.llama import CausalLM, ModelSpec

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def cache_dir() -> Path:
    return Path(os.environ.get("KVTOP_CACHE") or Path.home() / ".cache" / "kvtop")


def log(msg: str) -> None:
    print(f"[kvtop] {msg}", file=sys.stderr, flush=True)


@dataclass
class LoadedModel:
    model: CausalLM
    spec: ModelSpec
    tokenizer: object
    path: Path
    eos_token_ids: set[int]
    weights_bytes: int


def resolve_model_dir(model: str) -> Path:
    """Turn what the user typed into an HF directory on disk, fetching or converting if needed."""
    from engine.model import default

    if model in default.KNOWN_MODELS:
        return default.ensure_known_model(model)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} is a directory without config.json: point --model at an HF model directory")
        return path
    if path.suffix == ".gguf":
        if not path.exists():
            raise ModelLoadError(f"GGUF file {path} does not exist")
        return convert_gguf(path)
    if path.exists():
        raise ModelLoadError(f"{path} is neither an HF model directory nor a .gguf file")
    return _from_hub(model)


def _from_hub(model_id: str) -> Path:
    known = ", ".join(__import__("engine.model.default", fromlist=["KNOWN_MODELS"]).KNOWN_MODELS)
    if model_id.count("/") != 1:
        raise ModelLoadError(
            f"unknown model {model_id!r}: use a known name ({known}), an HF directory, a .gguf file or an HF hub id"
        )
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as exc:  # no network, no such repo, gated…
        raise ModelLoadError(
            f"could not fetch {model_id!r} from the Hugging Face hub ({type(exc).__name__}); "
            f"use a known name ({known}), an HF directory or a .gguf file"
        ) from None


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


def read_spec(model_dir: Path) -> tuple[ModelSpec, object]:
    """The ModelSpec of an HF directory, or a clear error naming an unsupported architecture."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(model_dir))
    except (ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"cannot read the model config in {model_dir}: {exc}") from None
    return spec_from_config(config), config


def spec_from_config(config) -> ModelSpec:
    model_type = getattr(config, "model_type", "?")
    if model_type not in SUPPORTED_MODEL_TYPES:
        arch = ", ".join(getattr(config, "architectures", None) or [model_type])
        raise UnsupportedArchitectureError(
            f"unsupported architecture {arch} (model_type {model_type!r}): kvtop runs Llama-family decoders "
            f"({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq, scaling = _rope(config)
    return ModelSpec(
        model_type=model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
        qk_norm=model_type == "qwen3",
        inv_freq=inv_freq,
        rope_scaling=scaling,
    )


def _rope(config) -> tuple[torch.Tensor, float]:
    """inv_freq through transformers' own RoPE initialisers (default, llama3, linear, yarn…)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise UnsupportedArchitectureError(f"unsupported RoPE type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq, float(scaling)


def _read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no .safetensors weights in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def load_model(model: str, dtype: torch.dtype, device: str) -> LoadedModel:
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(model)
    spec, config = read_spec(model_dir)
    with torch.device("meta"):
        net = CausalLM(spec)
    net = net.to_empty(device=device).to(dtype)
    net.load_hf_state_dict(_read_weights(model_dir))
    net.eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer in {model_dir}: {exc}") from None
    eos = config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    weights_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    return LoadedModel(net, spec, tokenizer, model_dir, eos_ids, weights_bytes)
