"""Formatting, one home for the panels, kvctl's tables and the fleet: sizes, durations, times,
counts, rates, sparklines and gauges as plain text.

Everything here returns strings or rich Text so that a panel reads the same in 16 colours and
under NO_COLOR: colour only ever repeats what the characters already say. A figure that is not a
usable number (None, NaN, ±Inf, 1e308, a huge integer from a crafted file) is `–`, never a crash:
frames come from other engines and from files (`number`, as `kvtop.sources.prometheus` reads a page).
"""

from __future__ import annotations

import time

from rich.text import Span, Text

# block map: DESIGN §6 characters and the style each is drawn in, one home for both maps
from kvtop.blocks import NAMES as BLOCK_NAMES  # noqa: F401
from kvtop.blocks import STYLES as BLOCK_STYLES  # noqa: F401
from kvtop.sources.prometheus import number

SPARK = "▁▂▃▄▅▆▇█"
NONE = "–"  # no data yet (never 0: a zero is a measurement)


def count(v: object) -> str:
    """A count as the engine said it: 12; NONE where it is not a usable number."""
    return NONE if number(v) is None else str(v)


def mib(n: float | None) -> str:
    n = number(n)
    return NONE if n is None else f"{n / 1024**2:.1f}"


def size(n: float | None) -> str:
    """Binary size, short: 512 B, 1.5 KiB, 23.4 MiB, 2.00 GiB."""
    n = number(n)
    if n is None:
        return NONE
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def secs(v: float | None) -> str:
    """A latency: 850µs, 42ms, 1.25s, 3m05s."""
    v = number(v)
    if v is None:
        return NONE
    if v < 1e-3:
        return f"{v * 1e6:.0f}µs"
    if v < 1:
        return f"{v * 1e3:.0f}ms" if v >= 0.1 else f"{v * 1e3:.1f}ms"
    if v < 60:
        return f"{v:.2f}s"
    return duration(v)


def ms(v: float | None, digits: int = 0) -> str:
    """Seconds as a number of milliseconds, for a column headed "ms": 42, 1250.5."""
    v = number(v)
    return NONE if v is None else f"{v * 1000:.{digits}f}"


def duration(v: float | None) -> str:
    """An age or uptime: 12s, 3m05s, 2h04m, 3d02h."""
    v = number(v)
    if v is None:
        return NONE
    v = max(0, int(v))
    if v < 60:
        return f"{v}s"
    if v < 3600:
        return f"{v // 60}m{v % 60:02d}s"
    if v < 86400:
        return f"{v // 3600}h{v % 3600 // 60:02d}m"
    return f"{v // 86400}d{v % 86400 // 3600:02d}h"


def age(v: float | None) -> str:
    """An age in at most three characters, for narrow columns: 45s, 12m, 3h, 2d."""
    v = number(v)
    if v is None:
        return NONE
    v = max(0, int(v))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if v >= size:
            return f"{v // size}{unit}"
    return f"{v}s"


def clock(ts: float | None, millis: bool = False) -> str:
    ts = number(ts)
    if ts is None:
        return NONE
    try:
        s = time.strftime("%H:%M:%S", time.localtime(ts))
    except (OverflowError, OSError, ValueError):  # a time the platform cannot hold (year 300,000,000)
        return NONE
    return f"{s}.{int(ts % 1 * 1000):03d}" if millis else s


def pct(v: float | None) -> str:
    v = number(v)
    return NONE if v is None else f"{v * 100:.1f}%"


def ratio(num: object, den: object) -> float | None:
    """`num / den` where both are usable numbers and `den` is above 0 (a share, a per-unit figure)."""
    n, d = number(num), number(den)
    return None if n is None or d is None or d <= 0 else n / d


def rate(v: float | None) -> str:
    v = number(v)
    if v is None:
        return NONE
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 1 else f"{v:.2f}"


def sparkline(values: list[float], width: int) -> str:
    """The last `width` values as block characters, scaled to their maximum (0 stays lowest; a
    value that is not a usable number, or below 0, is drawn as 0)."""
    values = [max(0.0, number(v) or 0.0) for v in values[-width:]] if width > 0 else []
    if not values:
        return ""
    top = max(values)
    if top <= 0:
        return SPARK[0] * len(values)
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))] for v in values)


def gauge(fraction: float, width: int, style: str = "green") -> Text:
    """A bar: filled share in `style`, the rest dotted, so it reads without colour."""
    fraction = min(max(number(fraction) or 0.0, 0.0), 1.0)
    filled = round(fraction * width)
    if fraction >= 0.9:
        style = "red"
    elif fraction >= 0.75:
        style = "yellow"
    return Text.assemble(("█" * filled, style), ("·" * (width - filled), "bright_black"))


def label_value(label: str, value: str, width: int = 12) -> Text:
    return Text.assemble((f"{label:<{width}}", "bold"), value)


def lines(rows: list[Text | str], height: int | None = None) -> Text:
    """Rows joined into one Text that crops (never wraps) at the panel's edge."""
    rows = rows if height is None else rows[: max(0, height)]
    out = Text("\n").join(Text(r) if isinstance(r, str) else r for r in rows)
    out.no_wrap = True
    out.overflow = "ellipsis"
    return merge_spans(out)


def merge_spans(text: Text) -> Text:
    """`text` with touching spans of the same style made one: a bar drawn a cell at a time is one
    span, not forty (Textual's cost of drawing a panel grows with its spans)."""
    merged: list[Span] = []
    for span in text.spans:
        last = merged[-1] if merged else None
        if last is not None and last.style == span.style and last.end == span.start:
            merged[-1] = Span(last.start, span.end, last.style)
        else:
            merged.append(span)
    text.spans = merged
    return text
