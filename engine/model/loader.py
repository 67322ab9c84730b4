"""Find a model (name, HF directory, GGUF file or hub id), read its config, load its weights.

GGUF files are converted once into an HF directory under the cache (`engine.model.gguf`); the
shape of a model is `engine.model.spec`. With `quantization="auto"` (the default) a GGUF file's
weights load from the file in their block formats (`engine.model.gguf_quant`); `"none"` (or a device
without the quantized kernels) de-quantizes them from the file a tensor at a time (a known model's,
or another architecture's, loads the converted directory's); `"int8"` makes any checkpoint's projections and head Q8_0 blocks at load
(`engine.model.int8_weights`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from gguf.quants import quant_shape_from_byte_shape

from engine.errors import ModelLoadError
from engine.model import default
from engine.model.gguf import convert_gguf, describe_gguf
from engine.model.gguf_quant import ARCHITECTURES, load_quantized, quantized_load_refusal, read_index
from engine.model.int8_weights import int8_refusal, quantize_int8
from engine.model.llama import CausalLM
from engine.model.packed_linear import pack_model, second_copy_bytes
from engine.model.quant_linear import pack_for_decode
from engine.model.spec import ModelSpec, config_fields, read_spec
from engine.runtime import devices
from engine.runtime.log import log
from kvtop.protocol.config import format_bytes


@dataclass
class LoadedModel:
    model: CausalLM
    spec: ModelSpec
    tokenizer: object
    path: Path
    eos_token_ids: set[int]
    weights_bytes: int  # the model's resident weights (blocks, parameters), what `kvctl plan` counts
    # held besides: oneDNN's copy of the AMX or bf16-panel projections for long prefill steps
    prefill_copy_bytes: int = 0
    weights_format: str = ""  # "float32"; a quantized GGUF's formats by bytes, e.g. "Q4_1, Q8_0, float32"
    # what the weights would take de-quantized to the model's dtype: blocks save the difference, which
    # the KV cache's `auto` size on the CPU gets (engine/runtime/devices.py); 0: held as loaded
    dequantized_bytes: int = 0

    @property
    def bytes_saved(self) -> int:
        """What the weights' blocks save against the same weights de-quantized (0 when held as loaded)."""
        return max(0, self.dequantized_bytes - self.weights_bytes)


def read_config_fields(model: str) -> dict:
    """The HF config fields of a .gguf file, an HF directory or a name this engine fetches, without
    loading weights (`kvctl plan` reads a shape from them; kvtop.protocol.sizing)."""
    from transformers import AutoConfig

    path = Path(model).expanduser()
    try:
        if path.suffix == ".gguf" and path.is_file():
            config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        else:
            config = AutoConfig.from_pretrained(str(resolve_model_dir(model)))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read a model config from {model}: {exc}") from None
    return config_fields(config)


def resolve_model_dir(model: str) -> Path:
    """Turn what the user typed into an HF directory on disk, fetching or converting if needed."""
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
    known = ", ".join(default.KNOWN_MODELS)
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


def _read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no .safetensors weights in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def gguf_file(model: str) -> Path | None:
    """The GGUF file a model name or path stands for (a known model's, fetched if missing), else None."""
    if model in default.KNOWN_MODELS:
        return default.fetch_gguf(*default.KNOWN_MODELS[model])
    path = Path(model).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def per_tensor_gguf(model: str) -> Path | None:
    """A GGUF file (not a known model's, whose conversion is shared) that loads de-quantized tensor by
    tensor (engine.model.gguf_quant) rather than through transformers' conversion: one of the
    architectures whose tensors map onto our decoder."""
    path = Path(model).expanduser()
    if model in default.KNOWN_MODELS or path.suffix != ".gguf" or not path.is_file():
        return None
    return path if read_index(path).architecture in ARCHITECTURES else None


def check_dequantized_fits(path: Path, dtype: torch.dtype) -> None:
    """ModelLoadError, before any work, where the file's tensors de-quantized to `dtype` would not fit
    in the host's available memory (they are built there, for a GPU too): one line, with what to change,
    instead of the kernel's OOM kill halfway through."""
    tensors = read_index(path).tensors.values()
    need = sum(math.prod(t.shape) for t in tensors) * torch.empty((), dtype=dtype).element_size()
    available = devices.host_memory_available()
    if need > available:
        name = str(dtype).removeprefix("torch.")
        raise ModelLoadError(
            f"{path.name} de-quantized to {name} takes {format_bytes(need)}, more than the "
            f"{format_bytes(available)} of memory available: --quantization auto keeps its "
            f"{format_bytes(sum(t.n_bytes for t in tensors))} of blocks"
            + ("" if dtype == torch.bfloat16 else ", --dtype bfloat16 halves it")
        )


def held_tensors(net: torch.nn.Module) -> Iterator[tuple[torch.Tensor, GGMLQuantizationType | None]]:
    """Every parameter and buffer with its block format: a quantized layer's uint8 blocks give their
    GGUF type, anything else None (a tensor held in two places comes once per holder)."""
    for module in net.modules():
        fmt = getattr(module, "fmt", None)
        for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            yield tensor, fmt if tensor.dtype == torch.uint8 else None


def weights_format(net: torch.nn.Module) -> str:
    """The formats the weights are held in, most bytes first: "Q4_1, Q8_0, float32"."""
    by_format: dict[str, int] = {}
    for tensor, fmt in held_tensors(net):
        key = fmt.name if fmt is not None else str(tensor.dtype).removeprefix("torch.")
        by_format[key] = by_format.get(key, 0) + tensor.numel() * tensor.element_size()
    return ", ".join(sorted(by_format, key=by_format.__getitem__, reverse=True))


def dequantized_bytes(net: torch.nn.Module, dtype: torch.dtype) -> int:
    """What the weights would take with every block de-quantized to `dtype` (a tensor held in two
    places, as a tied embedding's blocks, counted once; the other tensors as they are held)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes: dict[int, int] = {}
    for tensor, fmt in held_tensors(net):
        if fmt is not None:  # [N, row bytes] blocks: N × K values
            sizes[id(tensor)] = math.prod(quant_shape_from_byte_shape(tuple(tensor.shape), fmt)) * itemsize
        else:
            sizes[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(sizes.values())


def resident_bytes(net: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer (a tensor held in two places counted once)."""
    return sum(t.numel() * t.element_size() for t in (*net.parameters(), *net.buffers()))


def load_model(model: str, dtype: torch.dtype, device: str, quantization: str = "none") -> LoadedModel:
    from transformers import AutoTokenizer

    source = gguf_file(model) if quantization == "auto" else None
    if source is not None and (refusal := quantized_load_refusal(source, device)):
        log(refusal)
        source = None
    dense_file = None if source is not None else per_tensor_gguf(model)
    # a GGUF file read here needs only its config and tokenizer beside it, never transformers'
    # de-quantized copy (a known model's conversion exists already: every path shares it)
    own_file = (source is not None and model not in default.KNOWN_MODELS) or dense_file is not None
    model_dir = describe_gguf(source or dense_file) if own_file else resolve_model_dir(model)
    spec, config = read_spec(model_dir)
    if source is not None:
        net = load_quantized(source, spec, dtype)
        pack_for_decode(net)  # the decode kernel's tiles (csrc/quant_packed.cpp): the same bytes
    elif dense_file is not None:  # de-quantized a projection at a time, not all of it in float32 at once
        check_dequantized_fits(dense_file, dtype)
        log(f"de-quantizing {dense_file.name} to {str(dtype).removeprefix('torch.')}, a tensor at a time…")
        started = time.monotonic()
        net = load_quantized(dense_file, spec, dtype, dequantize_all=True).to(device)
        log(f"de-quantized in {time.monotonic() - started:.1f} s")
    else:
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
    weights_bytes, fmt = resident_bytes(net), weights_format(net)
    if source is not None:  # the quantized layers are what runs: nothing to pack
        dequantized = dequantized_bytes(net, dtype)
        return LoadedModel(net, spec, tokenizer, model_dir, eos_ids, weights_bytes, 0, fmt, dequantized)
    if quantization == "int8" and (refusal := int8_refusal(device)) is not None:
        log(refusal)
    elif quantization == "int8":
        if kept := quantize_int8(net, dtype):
            log(
                f"int8 weights: {', '.join(kept[:4])}{' …' if len(kept) > 4 else ''} kept as loaded (K not a multiple of 32)"
            )
        pack_for_decode(net)  # its Q8_0 blocks in the decode kernel's tiles, as a GGUF's
        return LoadedModel(
            net, spec, tokenizer, model_dir, eos_ids, resident_bytes(net), 0, weights_format(net), weights_bytes
        )
    pack_model(net)  # CPU bf16/fp32 only; KVTOP_PACKED_LINEAR=0 keeps nn.Linear
    copy = second_copy_bytes(net)
    return LoadedModel(net, spec, tokenizer, model_dir, eos_ids, weights_bytes, copy, fmt)
