"""Options declared once and shared by kvctl's commands: the engine knobs (added to every command
that builds an engine), the control socket, `--json`.

Flags are the EngineConfig field names in kebab case (DESIGN §5): `--kv-cache-memory 128MiB`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from kvtop.protocol.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    PREEMPTION_MODES,
    QUANTIZATIONS,
    SCHEDULE_POLICIES,
    EngineConfig,
)

_P = "Engine"


def _choice(values: tuple[str, ...]) -> str:
    return " | ".join(values)


ENGINE_OPTIONS: dict[str, tuple[object, object]] = {
    "model": (
        str,
        typer.Option(
            "--model",
            "-m",
            help="Known name (smollm2-135m), HF model directory, .gguf file or HF hub id.",
            rich_help_panel=_P,
        ),
    ),
    "dtype": (str, typer.Option(help=f"Model dtype: {_choice(DTYPES)}.", rich_help_panel=_P)),
    "device": (str, typer.Option(help="auto | cpu | cuda | cuda:N.", rich_help_panel=_P)),
    "kv_cache_memory": (
        str | None,
        typer.Option(
            help="KV cache size, e.g. 256MiB, 2GiB (default on CPU: 256MiB plus what quantized weights save).",
            rich_help_panel=_P,
        ),
    ),
    "gpu_memory_utilization": (
        float,
        typer.Option(
            help="GPU: share of device memory for weights + KV when --kv-cache-memory is unset.", rich_help_panel=_P
        ),
    ),
    "block_size": (int, typer.Option(help="Tokens per KV block.", rich_help_panel=_P)),
    "max_num_seqs": (int, typer.Option(help="Most sequences running at once.", rich_help_panel=_P)),
    "max_num_batched_tokens": (
        int,
        typer.Option(
            help="Token budget of one step (prefill chunks + decodes): smaller gives a burst its first tokens "
            "sooner, larger keeps running streams' token gaps short (docs/serving.md).",
            rich_help_panel=_P,
        ),
    ),
    "max_model_len": (
        int | None,
        typer.Option(help="Longest prompt + output (default: the model's).", rich_help_panel=_P),
    ),
    "enable_prefix_caching": (
        bool,
        typer.Option(
            "--enable-prefix-caching/--no-enable-prefix-caching",
            help="Reuse KV of shared prompt prefixes.",
            rich_help_panel=_P,
        ),
    ),
    "kv_cache_dtype": (str, typer.Option(help=f"KV storage: {_choice(KV_CACHE_DTYPES)}.", rich_help_panel=_P)),
    "quantization": (
        str,
        typer.Option(
            help=f"Weights: {_choice(QUANTIZATIONS)} (auto, the default: a GGUF file's stay in its Q4/Q8 "
            "blocks on the CPU, under a fifth of fp32's bytes, an HF checkpoint's load as they are; none: de-quantized "
            "to --dtype; int8: any model's projections and head made Q8_0 blocks at load, on the CPU).",
            rich_help_panel=_P,
        ),
    ),
    "attention_backend": (str, typer.Option(help=f"{_choice(ATTENTION_BACKENDS)}.", rich_help_panel=_P)),
    "schedule_policy": (str, typer.Option(help=f"{_choice(SCHEDULE_POLICIES)}.", rich_help_panel=_P)),
    "preemption_mode": (str, typer.Option(help=f"{_choice(PREEMPTION_MODES)}.", rich_help_panel=_P)),
    "cpu_offload_memory": (
        str | None,
        typer.Option(help="Host-memory KV tier for swapped and spilled blocks, e.g. 1GiB.", rich_help_panel=_P),
    ),
    "seed": (int, typer.Option(help="Seed for requests that bring none.", rich_help_panel=_P)),
    "served_model_name": (
        str | None,
        typer.Option(help="Model id the API reports (default: --model).", rich_help_panel=_P),
    ),
}


SOCKET_HELP = "Control socket (default: $KVTOP_SOCKET, else $XDG_RUNTIME_DIR/kvtop-$UID/engine.sock)."
SocketOption = Annotated[Path | None, typer.Option("--socket", help=SOCKET_HELP)]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]


def with_options(options: dict[str, tuple[object, object]], defaults: dict, build: Callable[..., object], param: str):
    """A decorator adding every flag of `options` (name -> (type, typer.Option)) to a typer command,
    keyword-only after its own; the command receives `param=build(**those values)` instead."""

    def decorate(func):
        sig = inspect.signature(func, eval_str=True)
        params = [p for name, p in sig.parameters.items() if name != param]
        for name, (annotation, option) in options.items():
            params.append(
                inspect.Parameter(
                    name,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=defaults[name],
                    annotation=Annotated[annotation, option],
                )
            )

        @functools.wraps(func)
        def wrapper(**kwargs):
            values = {name: kwargs.pop(name) for name in options}
            return func(**{param: build(**values)}, **kwargs)

        wrapper.__signature__ = sig.replace(parameters=params)
        # typer reads annotations too: give it the real objects, not the wrapped function's
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper

    return decorate


def with_engine_options(func):
    """Add every ENGINE_OPTIONS flag to a typer command; the command receives `config: EngineConfig`."""
    defaults = EngineConfig()
    values = {name: getattr(defaults, name) for name in ENGINE_OPTIONS}
    return with_options(ENGINE_OPTIONS, values, EngineConfig, "config")(func)
