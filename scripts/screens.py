"""Draw kvtop's screens of a recording as SVG files for the docs: the dashboard replaying a .kvsnap,
paused at a moment, in a terminal of the sizes given (headless, through Textual's Pilot).

    .venv/bin/python scripts/screens.py snapshots/engines/vllm-under-pressure.kvsnap --at 29 \\
        --size 160x48 --size 80x24 --size 80x24:2 --out docs/img/vllm-under-pressure

writes `docs/img/vllm-under-pressure-160x48.svg`, `…-80x24.svg` and `…-80x24-tab2.svg` (`:2` presses
`2` first: the sequences tab of the 80×24 layout). `--at` is seconds into the recording.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvtop.dashboard.app import KvtopApp  # noqa: E402
from kvtop.sources import ReplaySource  # noqa: E402


def parse_size(text: str) -> tuple[int, int, str | None]:
    """ "160x48" or "80x24:2" (a key pressed before the screen is taken)."""
    size, _, key = text.partition(":")
    width, _, height = size.partition("x")
    return int(width), int(height), key or None


async def screen(path: Path, at: float, width: int, height: int, key: str | None, out: Path) -> None:
    source = ReplaySource.open(path)
    app = KvtopApp(source)
    async with app.run_test(size=(width, height)) as pilot:
        await pilot.pause()
        if source.playing:
            await pilot.press("space")
        source.seek(at)
        if key:
            await pilot.press(key)
        for _ in range(2):  # a redraw, then one after the layout settled (the panels' sizes follow their text)
            app.redraw()
            await pilot.pause(0.3)
        out.write_text(app.export_screenshot(title=f"kvtop {width}×{height}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshot", type=Path)
    parser.add_argument("--at", type=float, default=0.0, help="seconds into the recording")
    parser.add_argument("--size", action="append", default=[], help="WxH or WxH:KEY, repeatable")
    parser.add_argument("--out", type=Path, required=True, help="path prefix of the SVG files")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for spec in args.size or ["160x48"]:
        width, height, key = parse_size(spec)
        out = args.out.with_name(f"{args.out.name}-{width}x{height}" + (f"-tab{key}" if key else "") + ".svg")
        asyncio.run(screen(args.snapshot, args.at, width, height, key, out))
        print(f"{out}: {out.stat().st_size / 1024:.0f} KiB", file=sys.stderr)


if __name__ == "__main__":
    main()
