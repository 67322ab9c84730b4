"""KV cache: usage gauge, block counts by state, bytes, active tokens, bytes per token, CPU tier."""

from __future__ import annotations

from rich.text import Text

from kvtop.widgets import fmt
from kvtop.widgets.view import Panel, View


def _pair(a: str, av: object, b: str, bv: object) -> Text:
    return Text.assemble((f"{a:<10}", "bold"), f"{av!s:>6}   ", (f"{b:<8}", "bold"), f"{bv!s:>6}")


class KVPanel(Panel):
    TITLE = "KV cache"

    def draw(self, view: View, width: int, height: int) -> Text:
        f = view.frame
        kv = f.get("kv", {})
        sched = f.get("scheduler", {})
        usage = kv.get("usage", 0.0)
        cpu = kv.get("cpu") or {}
        offloaded = kv.get("offloaded", cpu.get("used", 0))
        lines = [
            Text.assemble(("usage ", "bold"), fmt.gauge(usage, max(4, width - 14)), f" {fmt.pct(usage):>6}"),
            _pair("used", kv.get("used", 0), "shared", kv.get("shared", 0)),
            _pair("cached", kv.get("cached", 0), "free", kv.get("free", 0)),
            _pair("offloaded", offloaded, "total", kv.get("num_blocks", 0)),
            fmt.label_value("bytes", f"{fmt.size(kv.get('used_bytes'))} / {fmt.size(kv.get('total_bytes'))}", 10),
            fmt.label_value("active", f"{sched.get('active_tokens', 0)} tokens", 10),
            fmt.label_value("per token", f"{fmt.size(kv.get('bytes_per_token'))} · {kv.get('dtype', '?')}", 10),
            fmt.label_value(
                "CPU tier",
                f"{offloaded}/{cpu.get('num_blocks', 0)} blocks" if cpu.get("num_blocks") else "off",
                10,
            ),
            fmt.label_value("peak", f"{fmt.pct(kv.get('peak_usage'))} · {kv.get('block_size', '?')} tok/block", 10),
        ]
        return fmt.lines(lines, height)
