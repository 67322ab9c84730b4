"""kvtop tells the truth: one meaning per number, nothing stale, no zeros where there is no data.
The diagnosis on hand-made and recorded frames, panels on hand-made frames, NO_COLOR on a pty,
and a real `kvctl serve`: 429s, draining, the engine killed (the header) and restarted (an event)."""

from __future__ import annotations

import copy
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvtop.dashboard.app import KvtopApp
from kvtop.dashboard.widgets.dashboard import Dashboard
from kvtop.dashboard.widgets.events import EventsPanel
from kvtop.dashboard.widgets.header import EngineHeader, engine_line, glance_line
from kvtop.dashboard.widgets.latency import bound, histogram
from kvtop.dashboard.widgets.prefix_panel import PrefixPanel
from kvtop.dashboard.widgets.throughput import ThroughputPanel
from kvtop.dashboard.widgets.view import View, ViewState
from kvtop.diagnosis import diagnose
from kvtop.protocol.snapshot import read_snapshot
from kvtop.sources import LiveSource
from tests.helpers import widget_text as text
from tests.server_harness import Server, start_server
from tests.test_kvtop_terminal import Terminal, base_env

ROOT = Path(__file__).resolve().parent.parent
STORM = ROOT / "snapshots" / "preemption-storm.kvsnap"
THRASH = ROOT / "snapshots" / "prefix-thrash.kvsnap"


def frame(ts: float = 1000.0, uptime: float = 100.0, **parts: dict) -> dict:
    """A frame of a healthy engine (DESIGN §6), with `parts` merged over it section by section."""
    f = {
        "schema": 1,
        "ts": ts,
        "engine": {"state": "running", "model": "m", "device": "cpu", "uptime_s": uptime, "step": int(uptime * 10)},
        "kv": {"block_size": 16, "num_blocks": 64, "free": 30, "cached": 10, "allocatable": 40, "used": 24,
               "shared": 0, "usage": 0.375, "blocks": "." * 30 + "c" * 10 + "u" * 24},
        "sequences": [],
        "scheduler": {"running": 4, "waiting": 0, "swapped": 0, "max_num_seqs": 8, "active_tokens": 400,
                      "preemptions_total": 0},
        "prefix": {"enabled": True, "query_tokens": 1000, "hit_tokens": 500, "hit_rate": 0.5, "queries": 10,
                   "hit_requests": 5, "request_hit_rate": 0.5, "evictions": 0},
        "counters": {"requests_finished": 10, "requests_aborted": 0, "requests_failed": 0},
        "server": {"in_flight": 4, "max_queue": 16, "rejected": {}, "drain": None},
        "events": [],
    }  # fmt: skip
    for section, values in parts.items():
        f[section] = {**f[section], **values} if isinstance(f[section], dict) else values
    return f


def later(f: dict, seconds: float, **parts: dict) -> dict:
    """The same engine `seconds` later, with `parts` changed."""
    g = copy.deepcopy(f)
    g["ts"] += seconds
    g["engine"]["uptime_s"] += seconds
    for section, values in parts.items():
        g[section] = {**g[section], **values}
    return g


# ---- the diagnosis on hand-made frames ------------------------------------------------------
def test_a_healthy_engine_has_nothing_to_say():
    f = frame()
    assert diagnose(f) == []
    assert diagnose(later(f, 2), [f]) == []


def test_waiting_with_no_free_block_is_kv_bound():
    f = frame(kv={"free": 0, "cached": 0, "allocatable": 0}, scheduler={"waiting": 7})
    (line,) = diagnose(f)
    assert line.startswith("7 waiting, 0 free blocks: KV-bound")
    assert "--kv-cache-memory" in line and "--max-model-len" in line


def test_cached_blocks_are_free_for_a_new_request():
    """Cached blocks can be reallocated, so a queue with cached blocks is not KV-bound."""
    f = frame(kv={"free": 0, "cached": 5, "allocatable": 5}, scheduler={"waiting": 3})
    assert not any("KV-bound" in line for line in diagnose(f))


def test_an_old_frame_without_allocatable_counts_cached_in_free():
    f = frame(scheduler={"waiting": 2})
    del f["kv"]["allocatable"]
    f["kv"].update(free=5, cached=5)  # the old meaning: 5 allocatable, 5 of them cached
    assert diagnose(f) == []
    f["kv"].update(free=0, cached=0)
    assert diagnose(f)[0].startswith("2 waiting, 0 free blocks: KV-bound")


def test_preemptions_need_history_and_give_a_rate():
    f = frame(scheduler={"preemptions_total": 10})
    g = later(f, 4, scheduler={"preemptions_total": 18})
    assert diagnose(g) == []  # one frame cannot say how often
    (line,) = diagnose(g, [f])
    assert line.startswith("preempting 2.0/s (over 4 s):")


def test_prefix_thrash_from_the_last_seconds():
    f = frame(prefix={"query_tokens": 1000, "hit_tokens": 500, "evictions": 10})
    g = later(f, 5, prefix={"query_tokens": 2000, "hit_tokens": 500, "evictions": 25})
    (line,) = diagnose(g, [f])
    assert line.startswith("prefix hit rate 0 % with evictions 3.0 blocks/s: prefix thrash")
    healthy = later(f, 5, prefix={"query_tokens": 2000, "hit_tokens": 1000, "evictions": 25})
    assert diagnose(healthy, [f]) == []  # evicting while hitting half the time: not a thrash


def test_draining_and_drained_say_so():
    f = frame(engine={"state": "draining"}, server={"in_flight": 3})
    assert diagnose(f)[0].startswith("draining: admitting nothing (503), 3 in flight")
    f = frame(engine={"state": "drained"}, server={"in_flight": 0})
    assert diagnose(f)[0].startswith("drained: admitting nothing")


def test_queue_full_rejections_in_the_window():
    f = frame(server={"rejected": {"queue_full": 3}})
    g = later(f, 4, server={"rejected": {"queue_full": 15, "draining": 2}})
    (line,) = diagnose(g, [f])
    assert line.startswith("queue full: 12 requests refused (429) in 4s")


def test_bound_by_max_num_seqs_when_kv_has_room():
    f = frame(scheduler={"running": 8, "waiting": 5})
    (line,) = diagnose(f)
    assert line.startswith("5 waiting, 8/8 running: bound by --max-num-seqs with 40 blocks free")


def test_a_restart_in_the_window_is_not_a_rate():
    """Counters of a new engine run start again: comparing them with the old run would lie."""
    old = frame(ts=1000, uptime=500, scheduler={"preemptions_total": 100})
    new = frame(ts=1003, uptime=2, scheduler={"preemptions_total": 4})
    assert diagnose(new, [old]) == []


def test_several_findings_most_pressing_first():
    f = frame(kv={"free": 0, "cached": 0, "allocatable": 0}, scheduler={"waiting": 4, "preemptions_total": 0})
    g = later(f, 2, scheduler={"preemptions_total": 6}, engine={"state": "draining"})
    lines = diagnose(g, [f])
    assert [line.split(":")[0] for line in lines] == [
        "draining",
        "4 waiting, 0 free blocks",
        "preempting 3.0/s (over 2 s)",
    ]


def vllm_frame(ts: float = 1000.0, **parts: dict) -> dict:
    """A partial frame as kvtop reads vLLM's /metrics: a usage, waiting by reason, no block counts, no cap."""
    f = {
        "schema": 1, "ts": ts, "source": {"kind": "metrics", "url": "http://vllm:8000/metrics"},
        "engine": {"kind": "vllm", "model": "m", "state": "running", "start_time": 900.0},
        "kv": {"usage": 0.107, "num_blocks": 39, "block_size": 128},
        "scheduler": {"running": 4, "waiting": 8, "waiting_for_capacity": 8, "preemptions_total": 1},
        "prefix": {}, "events": [],
    }  # fmt: skip
    for section, values in parts.items():
        f[section] = {**f.get(section, {}), **values}
    return f


def test_vllm_waiting_with_kv_to_spare_is_a_sequence_cap_not_kv():
    """The issue's run: --max-num-seqs 4, 12 clients, KV 10.7 %, 8 waiting for capacity."""
    f = vllm_frame()
    g = vllm_frame(ts=1005.0)
    (line,) = diagnose(g, [f])
    assert line.startswith("8 waiting for capacity, 4 running, KV 10.7 % used: a sequence cap, not KV")
    assert "--max-num-seqs" in line and "free blocks" not in line and "KV-bound" not in line


def test_vllm_kv_bound_only_from_its_usage_and_never_a_free_block_count():
    f = vllm_frame(kv={"usage": 0.718})
    assert diagnose(vllm_frame(ts=1005.0, kv={"usage": 0.718}), [f]) == []  # 72 %: neither KV-bound nor spare
    (line,) = diagnose(vllm_frame(kv={"usage": 0.95}))
    assert line.startswith("8 waiting for capacity, KV 95.0 % used: KV-bound")
    assert "--gpu-memory-utilization" in line and "--kv-cache-memory" not in line and "free blocks" not in line


def test_vllm_preempting_is_not_a_sequence_cap():
    f = vllm_frame(kv={"usage": 0.6})
    g = vllm_frame(ts=1010.0, kv={"usage": 0.6}, scheduler={"preemptions_total": 11})
    (line,) = diagnose(g, [f])
    assert line.startswith("preempting 1.0/s (over 10 s): the batch outgrows the KV cache")


def test_vllm_rates_need_no_uptime_and_a_restart_is_a_new_run():
    """vLLM serves process_start_time_seconds, not an uptime: frames of one run give a rate."""
    f = vllm_frame(kv={"usage": 0.6})
    g = vllm_frame(ts=1002.0, kv={"usage": 0.6}, scheduler={"preemptions_total": 5})
    assert diagnose(g, [f])[0].startswith("preempting 2.0/s")
    restarted = vllm_frame(ts=1002.0, engine={"start_time": 1001.0}, kv={"usage": 0.6},
                           scheduler={"preemptions_total": 5})  # fmt: skip
    assert diagnose(restarted, [f]) == []


# ---- the diagnosis on real frames (the recorded incidents) --------------------------------------
def findings(path: Path) -> list[list[str]]:
    frames = read_snapshot(path).frames
    return [diagnose(f, frames[max(0, i - 50) : i]) for i, f in enumerate(frames)]


def test_the_preemption_storm_is_diagnosed_as_preempting_and_kv_bound():
    seen = [line for lines in findings(STORM) for line in lines]
    assert any(line.startswith("preempting ") for line in seen)
    assert any("waiting, 0 free blocks: KV-bound" in line for line in seen)
    assert findings(STORM)[0] == []  # the first frame, before the storm: nothing yet


def test_the_prefix_thrash_is_diagnosed_as_a_thrash():
    per_frame = findings(THRASH)
    assert "prefix thrash" in per_frame[-1][0]
    assert per_frame[0] == []
    assert not any("preempting" in line for lines in per_frame for line in lines)


@pytest.mark.parametrize("path", [STORM, THRASH], ids=["storm", "thrash"])
def test_every_finding_says_what_to_do(path: Path):
    for lines in findings(path):
        for line in lines:
            assert ": " in line and " — " in line, line


# ---- panels on hand-made frames: no zeros without data, one meaning per number -------------------
def view(f: dict, history: list[dict] | None = None, **state) -> View:
    return View(f, history or [f], f.get("events", []), ViewState(**state))


def test_no_lookups_show_a_dash_not_a_zero_hit_rate():
    f = frame(prefix={"query_tokens": 0, "hit_tokens": 0, "hit_rate": 0.0, "queries": 0, "request_hit_rate": 0.0})
    text = PrefixPanel().draw(view(f), 50, 8).plain
    assert "hit rate    – of tokens · – of requests" in text
    assert "0.0%" not in text
    assert text.splitlines()[6].rstrip().endswith("–")  # the sparkline's latest hit %: none yet
    g = later(f, 2, prefix={"query_tokens": 200, "hit_tokens": 100, "hit_rate": 0.5, "queries": 2})
    g["prefix"]["request_hit_rate"] = 0.5
    text = PrefixPanel().draw(view(g, [f, g]), 50, 8).plain
    assert "hit rate    50.0% of tokens · 50.0% of requests" in text
    assert text.splitlines()[6].rstrip().endswith("50.0%")


def test_rates_from_a_single_frame_are_dashes():
    f = frame()
    text = ThroughputPanel().draw(view(f), 60, 6).plain
    assert "preempt/s          –" in text and "rejected/s         –" in text
    assert "– steps/s" in engine_line(view(f), None).plain
    g = later(f, 2, engine={"step": f["engine"]["step"] + 20})
    assert "10.0 steps/s" in engine_line(view(g, [f, g]), None).plain


def test_rejections_are_counted_and_rated():
    f = frame(server={"rejected": {"queue_full": 10, "draining": 3}})
    g = later(f, 4, server={"rejected": {"queue_full": 22, "draining": 3}})
    text = ThroughputPanel().draw(view(g, [f, g]), 80, 6).plain
    assert "rejected/s       3.0" in text
    assert "25 rejected (429 ×22, 503 ×3)" in text
    glance = glance_line(view(g, [f, g]), stale=False).plain
    assert glance.startswith("4 running · 0 waiting · 25 rejected (429 ×22, 503 ×3)")
    assert "⚠ queue full: 12 requests refused (429) in 4s" in glance
    no_server = frame()
    del no_server["server"]  # frames of `kvctl run`: nothing refuses requests there
    assert "rejected/s         –" in ThroughputPanel().draw(view(no_server), 60, 6).plain


def test_unreachable_replaces_the_engine_state():
    f = frame()
    lost = f["ts"] + 30
    line = engine_line(view(f), lost).plain
    assert "✖ unreachable since" in line
    assert "● running" not in line and "up " not in line and "steps/s" not in line
    assert glance_line(view(f), stale=True).plain.startswith("last frame: 4 running")


def test_a_burst_of_prefix_evictions_is_one_line_and_pushes_nothing_out():
    base = frame()
    t0 = base["ts"] - 400
    events = [
        {
            "ts": t0 + i,
            "kind": "prefix_evicted",
            "seq_id": None,
            "detail": f"{i % 7 + 1} cached prefix blocks reallocated",
        }
        for i in range(312)
    ]
    events.insert(100, {"ts": t0 + 99.5, "kind": "drain_started", "seq_id": None, "detail": "3 requests in flight"})
    events.insert(200, {"ts": t0 + 198.5, "kind": "snapshot", "seq_id": None, "detail": "manual: /tmp/a.kvsnap"})
    events.append({"ts": t0 + 380, "kind": "prefix_evicted", "seq_id": None, "detail": "2 cached prefix blocks"})
    lines = EventsPanel().draw(View(base, [base], events, ViewState()), 100, 6).plain.splitlines()
    assert [line.split()[1] for line in lines] == ["drain_started", "snapshot", "prefix_evicted", "prefix_evicted"]
    blocks = sum(i % 7 + 1 for i in range(312))
    assert f"×312 in 5m11s: {blocks:,} blocks" in lines[2]
    assert "blocks/s" in lines[2]
    assert "×" not in lines[3] and "2 cached prefix blocks" in lines[3]  # a lone one, after a gap, as it is
    every = EventsPanel().draw(View(base, [base], events, ViewState(verbose_events=True)), 100, 6).plain
    assert "×" not in every  # `v`: every event on its own line


def test_latency_axis_labels_keep_three_figures():
    assert [bound(v) for v in (0.0025, 0.08, 1.0, 7.5, 80.0, 640.0, 2560.0, 7680.0)] == [
        "2.5ms", "80ms", "1s", "7.5s", "80s", "10.7m", "42.7m", "2.13h",
    ]  # fmt: skip
    buckets = [0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0, 7680.0]
    counts = [0] * 9 + [3, 5, 2, 1, 0]
    axis = histogram(counts, buckets, {"p50": 160.0, "p95": 640.0, "p99": 2560.0}, 60, 4)[-1].plain
    labels = axis.split()[1:]
    assert "10.7m" in labels and "2.13h" in labels
    assert all(re.fullmatch(r"\d{1,3}(\.\d{1,2})?(ms|s|m|h)|\+Inf", label) for label in labels), labels


# ---- a real terminal under NO_COLOR ----------------------------------------------------------------
@pytest.mark.integration  # a real terminal (a pty)
def test_no_color_means_no_colour_escape_at_all():
    """NO_COLOR: no foreground or background colour of any kind (not even greys); bold, dim and
    reverse video may stay, and the default colours (39, 49) are not colours."""
    env = base_env(TERM="xterm-256color", COLORTERM="truecolor", NO_COLOR="1")
    term = Terminal(["--replay", str(STORM)], env)
    try:
        term.read_until("Block map")
        term.press("G")
        term.read_until(f"frame {len(read_snapshot(STORM).frames)}/")
    finally:
        term.hang_up()
    params = [p for codes in term.colours for p in codes.split(";")]
    assert "1" in params or "7" in params  # styles still reach the terminal
    colour_codes = {"38", "48", *map(str, [*range(30, 38), *range(40, 48), *range(90, 98), *range(100, 108)])}
    colours = {p for p in params if p in colour_codes}
    assert not colours, f"colour escapes under NO_COLOR: {sorted(colours)}"


# ---- against a real `kvctl serve` ------------------------------------------------------------------
# two run at a time, one more may wait: the rest of the load is refused with 429
SERVE_ARGS = ("--kv-cache-memory", "512KiB", "--max-num-seqs", "2", "--max-queue", "1", "--stats-interval", "0.2")


class Load:
    """Six clients sending long completions back to back, more than the server admits."""

    def __init__(self, server: Server, n: int = 6) -> None:
        self.server, self.stopping = server, threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        while not self.stopping.is_set():
            try:
                with self.server.http(timeout=60) as http:
                    body = {"model": self.server.model, "prompt": f"Client {i}: count to ten.", "max_tokens": 64}
                    http.post("/v1/completions", json={**body, "ignore_eos": True})
            except httpx.HTTPError:
                pass  # the server is down (the restart test): try again
            self.stopping.wait(0.3)


@pytest.fixture(scope="module")
def engine(tiny_dir):
    box = {"server": start_server(tiny_dir, *SERVE_ARGS)}
    load = Load(box["server"])
    yield box
    load.stopping.set()
    box["server"].stop(signal.SIGKILL)
    for t in load.threads:
        t.join(70)
    box["server"].cleanup()


async def until(pilot, condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        await pilot.pause(0.1)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def lines_of(app: KvtopApp) -> list[str]:
    """The header's three lines (before the first frame is drawn, the third is empty)."""
    return [*text(app.query_one(EngineHeader)).splitlines(), "", "", ""][:3]


@pytest.mark.anyio
async def test_rejections_running_and_waiting_and_the_diagnosis_on_screen(engine):
    app = KvtopApp(LiveSource(engine["server"].socket, interval=0.2))
    async with app.run_test(size=(80, 24)) as pilot:  # the KV tab of a small terminal

        def refusing() -> bool:
            f = app.dashboard.source.current
            return bool(f and f["server"]["rejected"].get("queue_full") and len(app.dashboard.source.history()) > 5)

        await until(pilot, refusing, "requests refused with 429")
        await pilot.press("space")  # paused: the frame on screen stays
        await pilot.pause(0.3)
        f, history = app.dashboard.source.current, app.dashboard.source.history()
        glance = lines_of(app)[2]
        s, rejected = f["scheduler"], f["server"]["rejected"]
        assert glance.startswith(f"{s['running']} running · {s['waiting']} waiting · ")
        assert f"429 ×{rejected['queue_full']}" in glance
        findings = diagnose(f, history)
        assert glance.partition("  ")[2].startswith(f"⚠ {findings[0]}" if findings else "✓ nothing stands out")
        await pilot.press("4")  # throughput: rejections per second and in total
        await pilot.pause(0.3)
        rates = text(app.query_one(ThroughputPanel))
        assert f"429 ×{rejected['queue_full']}" in rates
        assert re.search(r"rejected/s +\d", rates), rates


@pytest.mark.anyio
async def test_draining_is_diagnosed(engine):
    server = engine["server"]
    app = KvtopApp(LiveSource(server.socket, interval=0.2))
    async with app.run_test(size=(160, 48)) as pilot:
        await until(pilot, lambda: app.dashboard.source.current is not None, "a frame")
        with server.control() as c:
            c.drain(timeout_s=30)
        try:
            await until(pilot, lambda: "⚠ draining: admitting nothing (503)" in lines_of(app)[2]
                        or "⚠ drained: admitting nothing" in lines_of(app)[2], "the diagnosis")  # fmt: skip
        finally:
            with server.control() as c:
                c.resume()
        await until(pilot, lambda: "● running" in lines_of(app)[0], "the engine to resume")


@pytest.mark.anyio
async def test_killed_engine_replaces_the_state_and_a_restart_is_an_event(engine):
    """Last in the module: the engine is killed, then a new one starts on the same socket."""
    server = engine["server"]
    app = KvtopApp(LiveSource(server.socket, interval=0.2, max_backoff=0.5))
    async with app.run_test(size=(160, 48)) as pilot:
        await until(pilot, lambda: len(app.dashboard.source.history()) > 2, "frames")
        assert "● running" in lines_of(app)[0]
        server.stop(signal.SIGKILL)
        await until(pilot, lambda: "✖ unreachable since" in lines_of(app)[0], "the header to say unreachable")
        header = lines_of(app)
        assert "● running" not in header[0] and "steps/s" not in header[0] and " up " not in header[0]
        assert header[2].startswith("last frame: ")
        dashboard = app.query_one(Dashboard)
        assert dashboard.has_class("-stale")
        for panel in dashboard.query(".panel"):  # every panel still there, and dimmed
            assert panel.styles.text_style.dim, f"{panel.id} is not dimmed"

        engine["server"] = start_server(server.model, *SERVE_ARGS, socket_path=server.socket, tmp=server.tmp)
        events = app.query_one(EventsPanel)
        await until(pilot, lambda: "engine_restarted" in text(events), "the restart in the events", timeout=90)
        assert "● running" in lines_of(app)[0] and "unreachable" not in lines_of(app)[0]
        assert not dashboard.has_class("-stale")
        restart = next(e for e in app.dashboard.source.events() if e["kind"] == "engine_restarted")
        assert "the last one was up" in restart["detail"]


# ---- events derived from another engine's counters (kvtop/derived.py) ----------------------------
def test_derived_events_from_counter_jumps_and_crossings_are_labelled_derived():
    from kvtop.derived import derive

    f = vllm_frame(kv={"usage": 0.5}, scheduler={"waiting": 0, "preemptions_total": 1})
    g = vllm_frame(ts=1002.0, kv={"usage": 0.95}, scheduler={"waiting": 6, "preemptions_total": 5})
    events = derive(f, g)
    assert [e["kind"] for e in events] == ["preempted", "kv_full", "queue_grew"]
    assert all(e["derived"] and e["detail"].startswith("derived: ") and e["ts"] == 1002.0 for e in events)
    assert events[0]["detail"] == "derived: 4 preempted (the preemption counter 1 → 5)"
    assert derive(g, vllm_frame(ts=1004.0, kv={"usage": 0.97}, scheduler={"waiting": 6, "preemptions_total": 5})) == []
    restarted = vllm_frame(ts=1004.0, engine={"start_time": 1003.0}, scheduler={"preemptions_total": 9})
    assert derive(g, restarted) == []  # another run: its counters began again


def test_rejections_and_a_collapsing_prefix_hit_rate_are_derived_once():
    """vLLM's admission rejections rising is an event; so is the prefix cache's hit rate over the
    last window falling below half of the run's — once, when it crosses, not every frame after."""
    from kvtop.derived import derive

    def at(ts: float, rejected: int, recent: float) -> dict:
        return vllm_frame(ts=ts, scheduler={"rejections_total": rejected},
                          prefix={"hit_rate": 0.6, "window_hit_rate": recent}, throughput={"window_s": 30.0})  # fmt: skip

    a, b, c = at(1000.0, 2, 0.62), at(1001.0, 7, 0.1), at(1002.0, 7, 0.05)
    events = derive(a, b)
    assert [e["kind"] for e in events] == ["rejected", "prefix_collapsed"]
    assert events[0]["detail"] == "derived: 5 turned away by a queue limit (the counter 2 → 7)"
    assert events[1]["detail"] == (
        "derived: prefix hit rate over the last 30 s 10.0 % (was 62.0 %), below half the run's 60.0 %"
    )
    assert derive(b, c) == []  # still collapsed: no new event
    low = vllm_frame(prefix={"hit_rate": 0.1, "window_hit_rate": 0.08})
    assert (
        derive(low, vllm_frame(ts=1001.0, prefix={"hit_rate": 0.1, "window_hit_rate": 0.0})) == []
    )  # no cache to lose


@pytest.mark.anyio
async def test_a_vllm_recording_replays_with_derived_markers_on_the_timeline(tmp_path):
    """A recording of vLLM's /metrics has no event log: the preemptions and the KV filling up are
    derived from its frames, marked on the timeline and listed in the events panel as derived."""
    from kvtop.dashboard.widgets.timeline import Timeline
    from kvtop.protocol.snapshot import write_snapshot
    from kvtop.sources import ReplaySource

    frames = [vllm_frame(ts=1000.0 + i, kv={"usage": 0.5 if i < 20 else 0.95},
                         scheduler={"waiting": 0, "preemptions_total": 1 if i < 30 else 4,
                                    "rejections_total": 0 if i < 35 else 2}) for i in range(40)]  # fmt: skip
    path = write_snapshot(tmp_path / "vllm.kvsnap", model="m", config={}, reason="recorded", frames=frames, events=[])
    source = ReplaySource.open(path)
    assert [e["kind"] for e in source.marked_events] == ["kv_full", "preempted", "rejected"]
    app = KvtopApp(source)
    async with app.run_test(size=(160, 48)) as pilot:
        marks = lambda: text(app.query_one(Timeline)).splitlines()[-1]  # noqa: E731
        await until(pilot, lambda: all(m in marks() for m in "kpx"), "the derived marks")
        assert marks().index("k") < marks().index("p") < marks().index("x")  # KV filled, then preempted, rejected
        await pilot.press("G")
        await until(pilot, lambda: "derived: 3 preempted" in text(app.query_one(EventsPanel)), "the derived event")
