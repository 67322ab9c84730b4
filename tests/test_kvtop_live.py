"""kvtop live against a real `kvctl serve` (tiny model) under real load: every panel, every
action behind its confirmation, read-only mode, sorting and filtering, and surviving the engine
restarting. One server for the module; the last test kills and restarts it."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvtop.client import EngineClient
from kvtop.dashboard.app import KvtopApp
from kvtop.dashboard.messages import FrameArrived, SourceLost
from kvtop.dashboard.widgets.block_map import BlockMap
from kvtop.dashboard.widgets.confirm import ConfirmScreen
from kvtop.dashboard.widgets.dashboard import Dashboard
from kvtop.dashboard.widgets.drain_dialog import DrainScreen
from kvtop.dashboard.widgets.events import EventsPanel
from kvtop.dashboard.widgets.header import EngineHeader
from kvtop.dashboard.widgets.help import HelpScreen
from kvtop.dashboard.widgets.kv_panel import KVPanel
from kvtop.dashboard.widgets.latency import LatencyPanel
from kvtop.dashboard.widgets.memory import MemoryPanel
from kvtop.dashboard.widgets.prefix_panel import PrefixPanel
from kvtop.dashboard.widgets.sequences import SequencesPanel, SequencesTable
from kvtop.dashboard.widgets.snapshot_dialog import SnapshotScreen
from kvtop.dashboard.widgets.throughput import ThroughputPanel
from kvtop.protocol.snapshot import read_snapshot
from kvtop.sources import LiveSource
from tests.helpers import widget_text as text
from tests.server_harness import start_server

SIZE = (160, 48)
SHARED_PREFIX = "You are a careful assistant who answers in full sentences. " * 3


SERVE_ARGS = ("--kv-cache-memory", "512KiB", "--max-num-seqs", "8", "--stats-interval", "0.2")


class Load:
    """Keeps `n` long completions in flight (a shared prefix, so the prefix cache has hits)."""

    def __init__(self, server: Engine, model: str, n: int = 6) -> None:
        self.server, self.model = server, model
        self.stop_event = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def start(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def _run(self, i: int) -> None:
        k = 0
        while not self.stop_event.is_set():
            k += 1
            try:
                with self.server.http(timeout=120) as http:
                    http.post(
                        "/v1/completions",
                        json={
                            "model": self.model,
                            "prompt": f"{SHARED_PREFIX} Request {i}.{k}: tell me about the number {i * 100 + k}.",
                            "max_tokens": 300,
                            "ignore_eos": True,
                        },
                    )
            except httpx.HTTPError:
                pass
            time.sleep(0.1)  # draining (503) or restarting: try again shortly

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(10)


class Engine:
    """The module's `kvctl serve` (tests/server_harness.py), which the last test restarts."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.server = start_server(model, *SERVE_ARGS)
        self.socket = self.server.socket

    def kill(self) -> None:
        self.server.stop(signal.SIGKILL)

    def restart(self) -> None:
        self.server = start_server(self.model, *SERVE_ARGS, socket_path=self.socket, tmp=self.server.tmp)

    def client(self) -> EngineClient:
        return self.server.control()

    def http(self, **kw):
        return self.server.http(**kw)


@pytest.fixture(scope="module")
def server(tiny_dir):
    engine = Engine(tiny_dir)
    load = Load(engine, str(tiny_dir)).start()
    yield engine
    load.stop_event.set()
    engine.server.stop(signal.SIGKILL)  # no graceful drain of the test load: nothing to keep
    load.stop()
    engine.server.cleanup()


async def until(pilot, condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        await pilot.pause(0.1)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def live_app(server: Engine, readonly: bool = False) -> KvtopApp:
    return KvtopApp(LiveSource(server.socket, interval=0.2), readonly=readonly)


async def busy(pilot, app: KvtopApp, min_seqs: int = 3) -> dict:
    """Wait for a frame with sequences in flight and latencies observed, then pause the view."""

    def ready() -> bool:
        f = app.dashboard.source.current
        return bool(
            f and len(f["sequences"]) >= min_seqs and f["latency"]["itl"]["count"] and f["prefix"]["hit_tokens"]
        )

    await until(pilot, ready, "a busy engine")
    await pilot.press("space")  # pause: what is on screen stops changing
    await pilot.pause(0.5)
    assert "paused" in text(app.query_one(EngineHeader))
    return app.dashboard.source.current


@pytest.mark.anyio
async def test_every_panel_shows_the_live_engine(server: Engine):
    app = live_app(server)
    async with app.run_test(size=SIZE) as pilot:
        frame = await busy(pilot, app)
        header = text(app.query_one(EngineHeader))
        assert "● running" in header and "steps/s" in header and f"step {frame['engine']['step']}" in header
        assert str(server.socket) in header

        kv = text(app.query_one(KVPanel))
        assert kv.splitlines()[1].split()[1] == str(frame["kv"]["used"])
        assert f"{frame['scheduler']['active_tokens']} tokens" in kv
        assert "512 B · auto" in kv  # bytes per token and KV dtype

        grid = text(app.query_one(BlockMap).query_one("#block-grid"))
        assert frame["kv"]["blocks"] in grid.replace("\n", "")
        assert "Block map · 64 blocks" in str(app.query_one(BlockMap).border_title)

        table = app.query_one(SequencesTable)
        assert table.row_count == len(frame["sequences"])
        assert set(table.ids) == {s["id"] for s in frame["sequences"]}
        # the selected sequence's blocks are named under the block map
        selected = app.dashboard.state.selected_seq
        seq = next(s for s in frame["sequences"] if s["id"] == selected)
        assert f"{selected}: {len(seq['block_ids'])} blocks" in str(app.query_one(BlockMap).border_subtitle)

        prefix = text(app.query_one(PrefixPanel))
        assert f"{frame['prefix']['hit_tokens']:,} of {frame['prefix']['query_tokens']:,}" in prefix
        assert "saved" in prefix and "evictions" in prefix and "hit %" in prefix

        latency = text(app.query_one(LatencyPanel))
        for name in ("TTFT", "ITL", "e2e", "queue"):
            assert name in latency
        assert f"all n={frame['latency']['itl']['count']}" in latency
        assert "▲" in latency  # percentiles marked under the bars

        throughput = text(app.query_one(ThroughputPanel))
        for name in ("prompt tok/s", "gen tok/s", "requests/s", "preempt/s"):
            assert name in throughput

        memory = text(app.query_one(MemoryPanel))
        assert "no NVIDIA GPU" in memory and "weights" in memory

        events = app.query_one(EventsPanel)
        assert "notable" in str(events.border_title)
        await pilot.press("v")  # all events, routine ones too
        assert "all" in str(events.border_title)
        assert any(kind in text(events) for kind in ("admitted", "scheduled", "first_token", "finished"))


@pytest.mark.anyio
async def test_sort_by_column_and_filter(server: Engine):
    app = live_app(server)
    async with app.run_test(size=SIZE) as pilot:
        frame = await busy(pilot, app, min_seqs=3)
        table = app.query_one(SequencesTable)
        panel = app.query_one(SequencesPanel)

        def order() -> list[str]:
            return list(table.ids)

        assert "sort age ↓" in str(panel.border_title)
        await pilot.press("o")  # the sort picker, on the current column (age): output is four rows up
        await pilot.press("k", "k", "k", "k", "enter")
        assert app.dashboard.state.sort == "output"
        expected = sorted(frame["sequences"], key=lambda s: s["output_tokens"], reverse=True)
        assert [s["output_tokens"] for s in expected] == [
            next(s["output_tokens"] for s in frame["sequences"] if s["id"] == i) for i in order()
        ]
        assert "sort out ↓" in str(panel.border_title)
        await pilot.press("O")
        outs = [next(s["output_tokens"] for s in frame["sequences"] if s["id"] == i) for i in order()]
        assert outs == sorted(outs)

        target = frame["sequences"][-1]["id"]
        await pilot.press("slash", *target[-6:], "enter")
        assert order() == [target]
        assert f"(1 of {len(frame['sequences'])})" in str(panel.border_title)
        assert app.dashboard.state.selected_seq == target
        await pilot.press("slash", "escape")
        assert len(order()) == len(frame["sequences"])


@pytest.mark.anyio
async def test_evict_the_selected_sequence(server: Engine):
    app = live_app(server)
    async with app.run_test(size=SIZE) as pilot:
        await busy(pilot, app)
        await pilot.press("O")  # youngest first: the most tokens still to go
        app.query_one(SequencesTable).move_cursor(row=0)
        await pilot.pause(0.2)
        victim = app.dashboard.state.selected_seq
        assert victim
        await pilot.press("e")
        assert isinstance(app.screen, ConfirmScreen)
        body = text(app.screen.query_one(".dialog-body"))
        assert victim in app.screen.title_text and "finish reason `abort`" in body
        await pilot.press("y")
        await pilot.press("space")  # back to live

        seen = []

        def gone() -> bool:
            f = app.dashboard.source.current
            log = text(app.query_one(EventsPanel))
            seen.append(f"{victim[:20]}" in log and "evicted by operator" in log)
            return victim not in {s["id"] for s in f["sequences"]} and any(
                e["kind"] == "aborted" and e["seq_id"] == victim for e in app.dashboard.source.events()
            )

        await until(pilot, gone, f"{victim} to be evicted")
        await until(pilot, lambda: gone() and any(seen), "the eviction in the events log")


@pytest.mark.anyio
async def test_evict_the_prefix_cache(server: Engine):
    app = live_app(server)
    async with app.run_test(size=SIZE) as pilot:
        await busy(pilot, app)
        await pilot.press("E")
        assert isinstance(app.screen, ConfirmScreen)
        assert "cached blocks" in text(app.screen.query_one(".dialog-body"))
        await pilot.press("n")  # cancelled: nothing happens
        assert not isinstance(app.screen, ConfirmScreen)
        await pilot.press("E", "y", "space")

        def evicted() -> bool:
            return any(
                e["kind"] == "evicted" and "cached prefix blocks" in e["detail"] for e in app.dashboard.source.events()
            )

        await until(pilot, evicted, "the prefix-cache eviction event")


@pytest.mark.anyio
async def test_a_frame_landing_before_the_dashboard_is_mounted_does_not_end_kvtop(server: Engine):
    """The first poll can race the first layout, and a frame can land while the dashboard is
    being taken away panel by panel (seen in CI: a sequences panel that had lost its table but not
    its note, NoMatches ending the app). Here frames are drawn all through the removal, then a lost
    connection and a frame arrive with no dashboard: kvtop must keep running and keep polling."""
    app = live_app(server)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.dashboard.source.current is not None, "a first frame")
        removal = asyncio.ensure_future(app.query_one(Dashboard).remove())
        while not removal.done():  # frames landing while its panels are taken away one by one
            app.dashboard.redraw()
            await asyncio.sleep(0)
        await removal
        app.post_message(SourceLost("the engine went away", time.time(), 0.2))
        app.post_message(FrameArrived(app.dashboard.source.current))
        await pilot.pause(0.3)
        step = app.dashboard.source.current["engine"]["step"]
        await until(pilot, lambda: app.dashboard.source.current["engine"]["step"] > step, "polling to go on")
        assert app.is_running and app.dashboard.poll_error is None


@pytest.mark.anyio
async def test_snapshot_shows_its_path_and_writes_it(server: Engine, tmp_path: Path):
    app = live_app(server)
    async with app.run_test(size=SIZE) as pilot:
        await busy(pilot, app)
        await pilot.press("s")
        assert isinstance(app.screen, SnapshotScreen)
        field = app.screen.query_one("#snapshot-path")
        assert field.value.startswith(str(Path.cwd())) and field.value.endswith(".kvsnap")
        target = tmp_path / "incident.kvsnap"
        field.value = str(target)
        await pilot.press("enter")
        await until(pilot, target.exists, "the snapshot file")
        snap = read_snapshot(target)
        assert snap.meta["reason"] == "operator (kvtop)"
        assert snap.frames and snap.blocks


@pytest.mark.anyio
async def test_drain_then_resume(server: Engine):
    app = live_app(server)
    async with app.run_test(size=SIZE) as pilot:
        await busy(pilot, app)
        await pilot.press("space")
        await pilot.press("d")
        assert isinstance(app.screen, DrainScreen)
        assert "stops admitting" in text(app.screen.query_one(".dialog-body"))
        await pilot.press("y")  # kvctl drain's defaults: no timeout, nothing aborted

        def state() -> str:
            return app.dashboard.source.current["engine"]["state"]

        await until(pilot, lambda: state() in ("draining", "drained"), "the engine to drain")
        await until(pilot, lambda: "● drain" in text(app.query_one(EngineHeader)), "the header to say so")
        with server.client() as c:
            assert c.stats()["engine"]["state"] in ("draining", "drained")

        await pilot.press("r")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        await until(pilot, lambda: state() == "running", "the engine to resume")
        # the frame is polled in a worker: the header shows it once the app has handled it
        await until(pilot, lambda: "● running" in text(app.query_one(EngineHeader)), "the header to say so")


@pytest.mark.anyio
async def test_readonly_has_no_actions(server: Engine):
    app = live_app(server, readonly=True)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.dashboard.source.current is not None, "a frame")
        for key in ("d", "r", "e", "E", "s"):
            await pilot.press(key)
            assert app.screen is app.screen_stack[0], f"{key} opened a dialog in --readonly"
        keys = {b.binding.key for b in app.active_bindings.values()}
        assert {"d", "r", "e", "E", "s"}.isdisjoint(keys)
        assert "readonly" in text(app.query_one(EngineHeader))
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        assert all(title != "Actions (each asks first)" for title, _ in app.screen.groups)
        with server.client() as c:
            assert c.stats()["engine"]["state"] == "running"


@pytest.mark.anyio
async def test_survives_the_engine_restarting(server: Engine):
    """Last in the module: kill the server, see "disconnected since", restart it, see it back."""
    app = KvtopApp(LiveSource(server.socket, interval=0.2, max_backoff=1.0))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.dashboard.source.current is not None, "a frame")
        first_start = app.dashboard.source.current["ts"] - app.dashboard.source.current["engine"]["uptime_s"]
        server.kill()
        header = app.query_one(EngineHeader)
        await until(pilot, lambda: "disconnected since" in text(header), "the disconnected state")
        assert app.query_one(Dashboard).has_class("-stale")
        assert "KV cache" in str(app.query_one(KVPanel).border_title)  # the last frame stays on screen
        server.restart()

        def back() -> bool:
            f = app.dashboard.source.current
            return "● live" in text(header) and f["ts"] - f["engine"]["uptime_s"] > first_start + 0.5

        await until(pilot, back, "the dashboard to reconnect to the new engine", timeout=60)
        assert not app.query_one(Dashboard).has_class("-stale")
        assert "disconnected" not in text(header)


@pytest.mark.anyio
async def test_no_engine_yet(tmp_path: Path):
    """Started before any engine: a clear disconnected state, not a crash and not a blank screen."""
    app = KvtopApp(LiveSource(tmp_path / "nobody.sock", interval=0.2, max_backoff=0.5))
    async with app.run_test(size=(80, 24)) as pilot:
        header = app.query_one(EngineHeader)
        await until(pilot, lambda: "disconnected since" in text(header), "the disconnected state", timeout=10)
        assert "waiting for the first frame" in text(header)
        assert "no engine at" in text(header) and "kvctl serve" in text(header)
