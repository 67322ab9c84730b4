"""`kvctl plan`: the KV capacity calculator, as a table or JSON (kvtop/planning.py: the engine's own
sizing rule, torch-free; a .gguf file's shape is read through the engine)."""

import dataclasses
import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvtop.ctl.options import JsonFlag
from kvtop.planning import PLAN_DEVICES, Plan, plan
from kvtop.protocol.config import (
    CPU_DEFAULT_KV_MEMORY,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    EngineConfig,
    format_bytes,
    parse_size,
)

QuantizationOption = Annotated[
    str,
    typer.Option(
        help=f"{' | '.join(QUANTIZATIONS)}: a GGUF's weights counted in their Q4/Q8 blocks as the engine "
        "holds them on the CPU (auto), de-quantized to --dtype (none), or any model's made Q8_0 at load (int8). "
        "On --device cuda the weights are always counted in --dtype: the engine de-quantizes there."
    ),
]
DeviceOption = Annotated[
    str,
    typer.Option(
        help=f"{' | '.join(PLAN_DEVICES)}: where the engine runs, which decides how a GGUF's weights are held "
        "(blocks on the CPU, de-quantized on a GPU)."
    ),
]


def plan_command(
    model: Annotated[
        str,
        typer.Argument(
            help="smollm2-135m, llama3-8b, llama3-70b, mistral-7b, qwen2.5-7b, an HF directory, "
            "a config.json or a .gguf file."
        ),
    ] = "smollm2-135m",
    dtype: Annotated[str, typer.Option(help="Weights / 16-bit KV dtype: bfloat16 | float16 | float32.")] = "bfloat16",
    kv_cache_memory: Annotated[
        str | None, typer.Option(help="KV budget, e.g. 8GiB (what the engine's --kv-cache-memory takes).")
    ] = None,
    memory: Annotated[
        str | None, typer.Option(help="Device memory, e.g. 80GiB: the KV gets what the weights leave.")
    ] = None,
    gpu_memory_utilization: Annotated[
        float, typer.Option(help="With --memory: the share the engine may use; the rest is headroom (vLLM's).")
    ] = EngineConfig.gpu_memory_utilization,
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    quantization: QuantizationOption = EngineConfig.quantization,
    device: DeviceOption = "cpu",
    context: Annotated[
        str | None, typer.Option(help="Context lengths for max concurrent sequences, e.g. 2048,8192,32768.")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """How much KV a model needs per token, how many tokens and sequences a memory budget holds."""
    if dtype not in ("bfloat16", "float16", "float32"):
        raise typer.BadParameter("use bfloat16, float16 or float32", param_hint="--dtype")
    if kv_cache_memory is None and memory is None:
        memory = "80GiB"
    try:
        contexts = [int(c) for c in context.split(",")] if context else None
    except ValueError:
        raise typer.BadParameter(
            "a comma-separated list of token counts, e.g. 2048,8192", param_hint="--context"
        ) from None
    if contexts and any(c <= 0 for c in contexts):
        raise typer.BadParameter("context lengths must be positive", param_hint="--context")
    p = plan(
        model,
        dtype=dtype,
        kv_cache_memory=parse_size(kv_cache_memory),
        memory=parse_size(memory),
        block_size=block_size,
        contexts=contexts,
        kv_dtypes=KV_CACHE_DTYPES,
        gpu_memory_utilization=gpu_memory_utilization,
        quantization=quantization,
        device=device,
    )  # PlanError (weights or budget do not fit): one line and exit 1, from kvctl's main
    if as_json:
        body = dataclasses.asdict(p)
        body["gqa_saving"] = p.gqa_saving
        body["cpu_auto_kv_bytes"] = p.cpu_auto_kv_bytes if p.device == "cpu" else None
        print(json.dumps(body, indent=2))
    else:
        print_plan(p)


def print_plan(p: Plan) -> None:
    """The plan as a terminal reads it: the model, the budget, one row per KV dtype, the warnings."""
    out = Console()
    budget = f"{format_bytes(p.kv_memory_bytes)} for KV"
    if p.memory_bytes is not None:
        left = p.usable_bytes - p.weights_bytes
        budget += (
            f" (of {format_bytes(left)} left: {format_bytes(p.memory_bytes)} × {p.gpu_memory_utilization:g} − "
            f"{format_bytes(p.weights_bytes)} weights)"
        )
    out.print(
        f"[bold]{p.model}[/bold] ({p.model_type}): {p.layers} layers, {p.heads} query heads, "
        f"{p.kv_heads} KV heads × {p.head_dim}, {p.parameters / 1e6:.1f} M parameters, "
        f"{format_bytes(p.weights_bytes)} of {p.weights_format or p.dtype} weights; {budget}, blocks of {p.block_size}",
        highlight=False,
    )
    table = Table(title="KV bytes = layers × 2 × kv_heads × head_dim × tokens × bytes/element")
    table.add_column("KV dtype", no_wrap=True)
    table.add_column("B/token", justify="right")
    table.add_column("MHA B/tok", justify="right")
    table.add_column("blocks", justify="right", no_wrap=True)
    table.add_column("tokens", justify="right", no_wrap=True)
    for c in p.contexts:
        table.add_column(f"seqs@{c}", justify="right", no_wrap=True)
    for o in p.options:
        name = (
            {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[p.dtype]
            if o.kv_cache_dtype == "auto"
            else o.kv_cache_dtype
        )
        table.add_row(
            name,
            f"{o.bytes_per_token:,}",
            f"{o.mha_bytes_per_token:,}",
            f"{o.num_blocks:,}",
            f"{o.capacity_tokens:,}",
            *(f"{o.max_seqs[c]:,}" for c in p.contexts),
        )
    out.print(table)
    for w in p.warnings:
        out.print(f"[yellow]warning:[/yellow] {w}", highlight=False)
    if note := weights_note(p):
        out.print(note, highlight=False)
    out.print(
        f"GQA: {p.heads} query heads share {p.kv_heads} KV heads, so the KV is {p.gqa_saving:.1f}× smaller "
        f"than the same model with full multi-head KV.",
        highlight=False,
    )


def weights_note(p: Plan) -> str | None:
    """What the plan says of how the weights are held where that depends on the device, or None."""
    if p.weights_format != p.dtype:  # blocks (a GGUF's, or int8's): held so on the CPU only
        return (
            f"Weights counted as the CPU holds them ({p.weights_format}); on a GPU the engine de-quantizes "
            f"them to {p.dtype}: plan that with --device cuda. On the CPU, with no --kv-cache-memory, "
            f"the engine's KV gets {format_bytes(CPU_DEFAULT_KV_MEMORY)} + the {format_bytes(p.bytes_saved)} "
            f"they save = {format_bytes(p.cpu_auto_kv_bytes)} (at most half the memory free at its start)."
        )
    if p.dequantized_on_device:
        return (
            f"Weights counted in {p.dtype}, as the engine holds them on {p.device}: it runs no quantized kernel "
            "there, so a GGUF's blocks are de-quantized and --quantization int8 keeps the weights as loaded "
            "(plan the CPU's blocks with --device cpu)."
        )
    return None
