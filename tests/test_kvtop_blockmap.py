"""The block map when the cache has more blocks than the panel has cells: ranges summarised by
dominant state and density, zoom in and out, the selected sequence's blocks highlighted."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from kvtop.dashboard.app import KvtopApp
from kvtop.dashboard.widgets.block_map import BlockMap, render_cells, summarise
from kvtop.protocol.snapshot import read_snapshot
from kvtop.sources import LiveSource
from tests.test_kvtop_live import until

STORM = Path(__file__).resolve().parent.parent / "snapshots" / "preemption-storm.kvsnap"
BLOCKS = 6000


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize(
    ("chars", "state", "glyph"),
    [
        ("....", ".", "."),
        ("uuuu", "u", "█"),
        ("uu..", "u", "▒"),  # a tie goes to the busier state
        ("u...", ".", "░"),
        ("ccuuu.", "u", "▓"),
        ("ssuucc", "s", "█"),
        ("oo.", "o", "▒"),
    ],
)
def test_summarise(chars: str, state: str, glyph: str):
    assert summarise(chars) == (state, glyph)


def test_render_cells_rows_and_highlight():
    rows = render_cells("uuuu....cccc", 2, 3, highlight={2})
    assert [r.plain for r in rows] == ["██.", ".██"]
    assert any("reverse" in str(span.style) for span in rows[0].spans)  # block 2 is in cell 1
    assert [r.plain for r in render_cells("uc.s", 1, 10, set())] == ["uc.s"]


def big_frame() -> dict:
    frame = copy.deepcopy(read_snapshot(STORM).frames[60])
    pattern = "uuuuuuuuuuuuuuuuccccssss........"
    frame["kv"]["blocks"] = (pattern * (BLOCKS // len(pattern) + 1))[:BLOCKS]
    frame["kv"]["num_blocks"] = BLOCKS
    frame["sequences"][0]["block_ids"] = list(range(4000, 4100))
    return frame


class BigClient:
    def __init__(self, path, timeout) -> None:
        self.frame = big_frame()

    def stats(self) -> dict:
        return self.frame

    def history(self, since=None) -> dict:
        return {"frames": [], "events": []}

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


@pytest.mark.anyio
async def test_zoom_in_and_out_of_a_big_cache():
    app = KvtopApp(LiveSource("/tmp/kvtop-test.sock", interval=3600, client_factory=BigClient))
    async with app.run_test(size=(160, 48)) as pilot:
        bm = app.query_one(BlockMap)
        await until(pilot, lambda: bm.view is not None and bm.per_cell > 1, "the first frame drawn")
        fit = bm.per_cell
        assert fit > 1
        assert f"Block map · {BLOCKS} blocks · 1 cell = {fit} blocks (fit)" == str(bm.border_title)
        grid = bm.query_one("#block-grid")
        cells = "".join(grid.content.plain.splitlines()[1:])  # under the legend line
        assert set(cells) <= set(".░▒▓█") and "▒" in cells  # ranges, by density
        await pilot.press("z")
        assert bm.per_cell == fit // 2 and "(fit)" not in str(bm.border_title)
        for _ in range(12):
            await pilot.press("z")
        assert bm.per_cell == 1
        assert "1 block per cell" in str(bm.border_title)
        assert bm.max_scroll_y > 0  # one block per cell does not fit: the map scrolls
        assert "uuuuuuuuuuuuuuuuccccssss" in grid.content.plain
        selected = app.dashboard.state.selected_seq
        assert f"{selected}: 100 blocks" in str(bm.border_subtitle)
        while "(fit)" not in str(bm.border_title):
            await pilot.press("Z")
        assert bm.per_cell == fit
