"""kvtop in real and small terminals: a pseudo-terminal at 80×24 in 16 colours and under
NO_COLOR, keys only (no mouse), a clean exit when the terminal goes away; and the layouts a
resize switches between, down to the "too small" message."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import sys
import termios
import time
from pathlib import Path

import pytest

from kvtop.dashboard.app import KvtopApp
from kvtop.dashboard.messages import SequenceSelected
from kvtop.dashboard.widgets.block_map import BlockMap
from kvtop.dashboard.widgets.dashboard import Dashboard
from kvtop.dashboard.widgets.kv_panel import KVPanel
from kvtop.protocol.snapshot import read_snapshot
from kvtop.sources import ReplaySource
from tests.helpers import widget_text as text

pytestmark = pytest.mark.integration  # a real terminal (a pty) for kvtop: not the fast lane's
ROOT = Path(__file__).resolve().parent.parent
STORM = ROOT / "snapshots" / "preemption-storm.kvsnap"
SGR = re.compile(r"\x1b\[([0-9;]*)m")


class Terminal:
    """kvtop on a pseudo-terminal of a given size; `screen` is everything it wrote. `program`: what
    runs (default: this checkout's kvtop), `args` after it."""

    def __init__(self, args: list[str], env: dict[str, str], size: tuple[int, int] = (80, 24),
                 program: list[str] | None = None) -> None:  # fmt: skip
        self.output = b""
        argv = [*(program or [sys.executable, "-c", "from kvtop.dashboard.cli import main; main()"]), *args]
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the terminal's size, then kvtop
            cols, rows = size
            fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
            os.execve(argv[0], argv, env)

    def read_until(self, needle: str, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while needle.encode() not in self.output:
            if time.monotonic() > deadline:
                raise AssertionError(f"{needle!r} never appeared; last output: {self.output[-800:]!r}")
            ready, _, _ = select.select([self.fd], [], [], 0.2)
            if ready:
                try:
                    self.output += os.read(self.fd, 65536)
                except OSError:
                    break

    def press(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def hang_up(self, timeout: float = 20.0) -> int:
        """Close the terminal (as a dropped SSH session does); the exit status of kvtop."""
        os.close(self.fd)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return status
            time.sleep(0.1)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        raise AssertionError("kvtop did not exit after its terminal went away")

    @property
    def colours(self) -> list[str]:
        return [p for m in SGR.finditer(self.output.decode(errors="replace")) for p in [m.group(1)] if p]


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLORTERM", "NO_COLOR", "TERM", "TEXTUAL")}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def test_16_colour_terminal_keys_only_and_hang_up():
    term = Terminal(["--replay", str(STORM)], base_env(TERM="xterm"))
    term.read_until("Block map")
    term.press("G")  # the end of the recording, by keyboard alone
    term.read_until(f"frame {len(read_snapshot(STORM).frames)}/")
    term.press("2")
    term.read_until("Sequences (")
    term.press("?")
    term.read_until("kvtop keys")
    codes = " ".join(term.colours)
    assert "38;2;" not in codes and "48;2;" not in codes, "truecolor escape sent to a 16-colour terminal"
    assert "38;5;" not in codes and "48;5;" not in codes, "256-colour escape sent to a 16-colour terminal"
    status = term.hang_up()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"exit status {status}"


def test_no_color_terminal_draws_in_greys_and_q_quits():
    term = Terminal(["--replay", str(STORM)], base_env(TERM="xterm-256color", COLORTERM="truecolor", NO_COLOR="1"))
    term.read_until("Block map")
    term.press("q")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        pid, status = os.waitpid(term.pid, os.WNOHANG)
        if pid:
            break
        try:
            term.read_until("\x00", timeout=0.3)
        except AssertionError:
            pass
    else:
        raise AssertionError("q did not quit")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    for params in term.colours:
        parts = params.split(";")
        for i, p in enumerate(parts):
            if p in ("38", "48") and parts[i + 1 : i + 2] == ["2"]:
                r, g, b = parts[i + 2 : i + 5]
                assert r == g == b, f"a colour under NO_COLOR: {params}"
    os.close(term.fd)


@pytest.mark.anyio
async def test_resizing_switches_layouts_down_to_too_small():
    app = KvtopApp(ReplaySource(read_snapshot(STORM)))
    async with app.run_test(size=(50, 14)) as pilot:
        await pilot.pause()
        message = text(app.query_one("#too-small"))
        assert "Terminal too small: 50×14" in message and "at least 60×18" in message
        assert not app.query(KVPanel)
        await pilot.resize_terminal(80, 24)
        await pilot.pause(0.3)
        assert app.query_one(Dashboard).mode == "tabs"
        assert "usage" in text(app.query_one(KVPanel))  # redrawn into the new panels
        await pilot.press("z")  # state kept by the app survives a rebuild
        zoom = app.dashboard.state.zoom
        await pilot.resize_terminal(160, 48)
        await pilot.pause(0.3)
        assert app.query_one(Dashboard).mode == "wide"
        assert app.dashboard.state.zoom == zoom
        assert app.query_one(BlockMap).per_cell >= 1


@pytest.mark.anyio
async def test_no_color_app(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    app = KvtopApp(ReplaySource(read_snapshot(STORM)))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        await pilot.press("G")
        await pilot.pause()
        assert app.no_color
        grid = text(app.query_one(BlockMap).query_one("#block-grid"))
        assert read_snapshot(STORM).frames[-1]["kv"]["blocks"] in grid.replace("\n", "")  # the letters carry the state


def test_a_real_terminal_is_repainted_where_a_panel_line_wraps():
    """Panels repaint only the lines that changed; where a line is wider than its panel (the block
    map's legend at 120×40) text line y is not screen row y, and repainting by text line left the
    map's rows showing the first frame on a real terminal (a screenshot recomposes, so Pilot saw
    nothing wrong). What a terminal receives after `G` must hold the last frame's block letters."""
    term = Terminal(["--replay", str(STORM)], base_env(TERM="xterm", NO_COLOR="1"), size=(120, 40))
    term.read_until("Block map")
    term.read_until("frame 1/")
    time.sleep(1.0)  # let the first frame's paint finish
    term.read_until("Block map", timeout=0.5)
    start = len(term.output)
    term.press("G")
    last = read_snapshot(STORM).frames[-1]["kv"]["blocks"]
    term.read_until(f"frame {len(read_snapshot(STORM).frames)}/")
    time.sleep(1.0)
    try:
        term.read_until("\x00", timeout=0.5)  # collect what the repaint wrote
    except AssertionError:
        pass
    after = SGR.sub("", term.output[start:].decode(errors="replace"))
    assert last[:10] in after, f"the block map was not repainted with the last frame ({last[:10]!r})"
    term.press("q")
    term.hang_up()


@pytest.mark.anyio
async def test_a_message_that_lands_while_kvtop_quits_is_dropped():
    """A cursor move or a frame posted just before quitting is handled after the screens are gone;
    it must not end kvtop with a traceback (seen once in CI as an IndexError on quit)."""
    app = KvtopApp(ReplaySource(read_snapshot(STORM)))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
    assert not app.screen_stack
    app.dashboard._selected(SequenceSelected("cmpl-gone"))
    app.dashboard.redraw()
    app.dashboard._focus_sequences()
