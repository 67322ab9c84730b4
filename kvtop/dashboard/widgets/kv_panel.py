"""KV cache: usage gauge, block counts by state, bytes, active tokens, bytes per token, CPU tier.

The counts are the frame's, one per block-map character (`free` is `.` only, `used` is `u` only),
so they add up to the total and match `kvctl status` and `/metrics`. A figure the frame does not
carry shows "–", never 0.
"""

from __future__ import annotations

from rich.text import Text

from kvtop import fmt
from kvtop.dashboard.widgets.view import Panel, View


def _n(v: object) -> str:
    return fmt.NONE if v is None else str(v)


def _pair(a: str, av: object, b: str, bv: object) -> Text:
    return Text.assemble((f"{a:<10}", "bold"), f"{_n(av):>6}   ", (f"{b:<8}", "bold"), f"{_n(bv):>6}")


class KVPanel(Panel):
    TITLE = "KV cache"

    def draw(self, view: View, width: int, height: int) -> Text:
        f = view.frame
        kv = f.get("kv") or {}
        sched = f.get("scheduler") or {}
        usage = kv.get("usage")
        # the peak since start can lag the frame it is read with (an old recording): never show it below usage
        peak = None if usage is None else max(usage, kv.get("peak_usage") or 0.0)
        cpu = kv.get("cpu") or {}
        offloaded = kv.get("offloaded", cpu.get("used"))
        active = sched.get("active_tokens")
        gauge = fmt.gauge(usage or 0.0, max(4, width - 14)) if usage is not None else fmt.NONE
        lines = [
            Text.assemble(("usage ", "bold"), gauge, f" {fmt.pct(usage):>6}"),
            _pair("used", kv.get("used"), "shared", kv.get("shared")),
            _pair("cached", kv.get("cached"), "free", kv.get("free")),
            _pair("offloaded", offloaded, "total", kv.get("num_blocks")),
            fmt.label_value("bytes", f"{fmt.size(kv.get('used_bytes'))} / {fmt.size(kv.get('total_bytes'))}", 10),
            fmt.label_value("active", fmt.NONE if active is None else f"{active} tokens", 10),
            fmt.label_value("per token", f"{fmt.size(kv.get('bytes_per_token'))} · {kv.get('dtype', fmt.NONE)}", 10),
            fmt.label_value(
                "CPU tier",
                f"{_n(offloaded)}/{cpu['num_blocks']} blocks" if cpu.get("num_blocks") else "off",
                10,
            ),
            fmt.label_value("peak", f"{fmt.pct(peak)} · {kv.get('block_size', fmt.NONE)} tok/block", 10),
        ]
        return fmt.lines(lines, height)
