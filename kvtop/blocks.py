"""Block-map characters (DESIGN §6) and the one way a range of blocks is folded into one cell.

Both block maps — the dashboard's panel and `kvctl status` — draw from here, so a range reads
the same on both: the same dominant state (ties go to the busier state, `PRIORITY`), the same
colour. A frame's `kv.blocks` holds one character per block: `.` free, `c` cached (free, holds a
reusable prefix), `u` used by one sequence, `s` shared, `o` offloaded to the CPU tier.
"""

from __future__ import annotations

from collections import Counter

NAMES = {".": "free", "c": "cached", "u": "used", "s": "shared", "o": "offloaded"}
STYLES = {".": "bright_black", "c": "cyan", "u": "green", "s": "magenta", "o": "yellow"}
PRIORITY = "suoc."  # tie-break for the dominant state: the busier state wins
DENSITY = ((0.0, "."), (1 / 3, "░"), (2 / 3, "▒"), (0.999, "▓"), (1.0, "█"))


def summarise(chars: str) -> tuple[str, str]:
    """(dominant state, density glyph) of a range of block characters. The glyph is the share of
    the range that is not free: `.` none, `░` ≤⅓, `▒` ≤⅔, `▓` most, `█` all."""
    counts = Counter(chars)
    top = max(counts.values())
    dominant = next((c for c in PRIORITY if counts.get(c) == top), None)
    if dominant is None:  # a character outside DESIGN §6: still a deterministic answer
        dominant = min(c for c, n in counts.items() if n == top)
    busy = 1 - counts.get(".", 0) / len(chars)
    glyph = next(g for limit, g in DENSITY if busy <= limit + 1e-9)
    return dominant, glyph


def blocks_per_cell(num_blocks: int, cells: int) -> int:
    """The fewest blocks per cell that fit `num_blocks` into `cells` cells (at least 1)."""
    return max(1, -(-num_blocks // max(1, cells)))


def fold(chars: str, per_cell: int) -> list[tuple[str, str]]:
    """`chars` cut into ranges of `per_cell` blocks from the left, each range `summarise`d."""
    return [summarise(chars[lo : lo + per_cell]) for lo in range(0, len(chars), max(1, per_cell))]
