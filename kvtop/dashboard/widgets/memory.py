"""Memory: the device's total and used memory, what weights and KV take, and NVML's GPU view.

NVML figures come from the frame (`memory.nvml`, filled by the engine through pynvml); where it
is null — no NVIDIA GPU, no driver — the panel says so quietly.
"""

from __future__ import annotations

from rich.text import Text

from kvtop import fmt
from kvtop.dashboard.widgets.view import Panel, View


def weights_text(m: dict) -> str:
    """The weights' bytes, their formats where the engine says them (a GGUF's blocks kept quantized:
    "Q4_1, Q8_0, float32"), and a prefill copy where there is one."""
    text = fmt.size(m.get("weights"))
    if m.get("weights_format"):
        text += f" {m['weights_format']}"
    if m.get("prefill_copy"):
        text += f" + {fmt.size(m['prefill_copy'])} prefill copy"
    return text


class MemoryPanel(Panel):
    TITLE = "Memory"

    def draw(self, view: View, width: int, height: int) -> Text:
        m = view.frame.get("memory") or {}
        device = view.frame.get("engine", {}).get("device", "?")
        total, used = m.get("device_total") or 0, m.get("device_used") or 0
        bar = max(4, width - 24)
        rows = [
            fmt.label_value("device", f"{device} · {fmt.size(total)} total", 10),
            Text.assemble(
                ("used      ", "bold"), fmt.gauge(fmt.ratio(used, total) or 0, bar), f" {fmt.size(used):>10}"
            ),
            fmt.label_value("weights", weights_text(m), 10),
            fmt.label_value(
                "KV",
                f"{fmt.size(m.get('kv'))}"
                + (f" ({fmt.pct(fmt.ratio(m['kv'], total))} of device)" if total and m.get("kv") else ""),
                10,
            ),
        ]
        nvml = m.get("nvml")
        if not nvml:
            rows.append(Text("no NVIDIA GPU (NVML figures absent)", "dim italic"))
        else:
            rows.append(
                Text.assemble(
                    ("GPU util  ", "bold"),
                    fmt.gauge(fmt.ratio(nvml.get("gpu_util"), 100) or 0, bar),
                    f" {nvml.get('gpu_util', 0):>9}%",
                )
            )
            rows.append(
                Text.assemble(
                    ("mem bw    ", "bold"),
                    fmt.gauge(fmt.ratio(nvml.get("mem_bw_util"), 100) or 0, bar),
                    f" {nvml.get('mem_bw_util', 0):>9}%",
                )
            )
            rows.append(
                fmt.label_value("GPU mem", f"{fmt.size(nvml.get('mem_used'))} / {fmt.size(nvml.get('mem_total'))}", 10)
            )
        return fmt.lines(rows, height)
