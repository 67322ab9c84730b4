"""The client-side flight recorder: `kvctl record --url` and `record_frames` write any engine's frames as a
`.kvsnap`, and replay plays them back as they were served — from our own `kvctl serve`'s /metrics and from
an HTTP server serving pages recorded from a real vLLM 0.32.0."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import ClassVar

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtop.protocol.snapshot import SnapshotError, read_snapshot
from kvtop.sources import ReplaySource
from kvtop.sources.metrics import MetricsSource
from kvtop.sources.recorder import record_frames, source_meta
from tests.helpers import PageHandler
from tests.server_harness import KVCTL, kvctl, start_server

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"
VLLM_PAGES = ["vllm_real_t0.prom", "vllm_real_t1.prom", "vllm_real_t2.prom"]  # idle, after 12 requests, 8 at once


class Pages(PageHandler):
    """/metrics answers the recorded vLLM pages in turn, then the last one again; `/down/metrics`
    answers HTTP 503 between its 2nd and 5th scrape, as an engine that restarts does."""

    served: ClassVar[list[str]] = []

    def do_GET(self):
        if self.path.startswith("/down/") and 2 <= len(self.served) < 5:
            self.served.append("503")
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        name = VLLM_PAGES[min(len(self.served), len(VLLM_PAGES) - 1)]
        self.served.append(name)
        body = (FIXTURES / name).read_bytes()
        self.reply(200, body, "text/plain; version=0.0.4")


@pytest.fixture
def vllm_pages():
    handler = type("FreshPages", (Pages,), {"served": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler.served
    server.shutdown()
    server.server_close()


def truth(text: str) -> dict[str, float]:
    """What a page says, each name summed over its series (as the source adds them up)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_kvctl_record_from_a_vllm_page_replays_what_vllm_served(vllm_pages, tmp_path):
    url, served = vllm_pages
    out = tmp_path / "incident.kvsnap"
    r = kvctl("record", "--url", url, "-o", str(out), "--duration", "1s", "--interval", "250ms", timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(out) and "frames over" in r.stderr
    snap = read_snapshot(out)
    assert snap.meta["model"] == "smollm2-135m" and snap.meta["reason"] == "kvctl record"
    assert snap.meta["config"] == {"recorded_by": "kvtop", "source": "metrics", "engine": "vllm",
                                   "url": f"{url}/metrics", "interval_s": 0.25}  # fmt: skip
    assert len(snap.frames) == len(served) >= 3  # one now, then one every 250 ms for a second (5 unless slow)
    assert snap.blocks == [] and snap.sequences == [] and snap.events == []  # vLLM serves none of them
    for frame, page in zip(snap.frames, served, strict=True):
        t = truth((FIXTURES / page).read_text())
        assert frame["engine"]["kind"] == "vllm"
        assert frame["kv"]["usage"] == pytest.approx(t["vllm:kv_cache_usage_perc"])
        assert frame["scheduler"]["running"] == t["vllm:num_requests_running"]
        assert frame["prefix"]["hit_tokens"] == t["vllm:prefix_cache_hits_total"]
        assert frame["latency"]["ttft"]["count"] == t["vllm:time_to_first_token_seconds_count"]
        assert "blocks" not in frame["kv"] and "vLLM exposes no block map" in frame["unavailable"]

    source = ReplaySource.open(out)  # every frame passes replay's check, absent fields and all
    try:
        for i in range(len(snap.frames)):
            assert source.step(1 if i else 0)["ts"] == snap.frames[i]["ts"] and source.error is None
        assert source.current["scheduler"]["running"] == 8  # the last page: 8 requests at once
    finally:
        source.close()


@pytest.mark.integration  # an HTTP server on a real socket
def test_a_partial_frame_with_a_wrong_type_is_still_refused_by_replay(vllm_pages, tmp_path):
    url, _ = vllm_pages
    source = MetricsSource(url)
    try:
        frames = [source.poll(), source.poll()]
    finally:
        source.close()
    frames[1] = {**frames[1], "kv": {**frames[1]["kv"], "usage": "full"}}
    path = record_frames(frames, tmp_path / "bad.kvsnap", source_meta(source))
    with pytest.raises(SnapshotError, match="frame 2 is not a stats frame: kv.usage: expected number, found a JSON"):
        ReplaySource.open(path)  # checked when opened: one line, not a traceback in a panel


@pytest.mark.integration  # an HTTP server on a real socket
def test_record_frames_writes_what_the_dashboard_holds(vllm_pages, tmp_path):
    """The dashboard's `s` on a metrics source: the frames it already has, into a snapshot."""
    url, _ = vllm_pages
    source = MetricsSource(f"http://user:secret@{url.removeprefix('http://')}", interval=0.1)
    try:
        for _ in range(3):
            source.poll()
        frames = source.history()
        meta = source_meta(source, reason="s in kvtop")
        path = record_frames(frames, tmp_path, meta)  # a directory: a fresh name in it
        again = record_frames(frames, tmp_path, meta)
    finally:
        source.close()
    assert path.parent == tmp_path and path.name.startswith("kvtop-vllm-") and again != path
    snap = read_snapshot(path)
    assert snap.frames == json.loads(json.dumps(frames))  # as they were in memory
    assert snap.meta["reason"] == "s in kvtop" and "secret" not in snap.meta["config"]["url"]
    assert snap.meta["config"]["url"] == f"{url}/metrics"


@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_record_refuses_to_replace_a_file_before_recording_and_replaces_with_force(vllm_pages, tmp_path):
    url, served = vllm_pages
    out = tmp_path / "x.kvsnap"
    out.write_text("precious")
    r = kvctl("record", "--url", url, "-o", str(out), "--duration", "1h", timeout=30)  # refused at once
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "--force" in r.stderr
    assert out.read_text() == "precious" and served == []  # not even one scrape
    r = kvctl("record", "--url", url, "-o", str(tmp_path / "no" / "dir.kvsnap"), timeout=30)
    assert r.returncode == 1 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    r = kvctl("record", "--url", url, "-o", str(out), "--duration", "0.2s", "--force", timeout=60)
    assert r.returncode == 0, r.stderr
    assert read_snapshot(out).frames[0]["engine"]["kind"] == "vllm"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--url", "http://127.0.0.1:1"], "cannot read http://127.0.0.1:1/metrics"),
        (["--url", "ftp://x"], "is not an http(s) URL"),
        (["--url", "http://127.0.0.1:1", "--duration", "soon"], "is not a time"),
        (["--url", "http://127.0.0.1:1", "--interval", "0"], "more than 0"),
        (["--url", "http://127.0.0.1:1", "--engine", "tgi"], "unknown engine 'tgi'"),
        (["--url", "http://127.0.0.1:1", "--interval", "2000h"], "at most 86400 s"),
        (["--url", "http://127.0.0.1:1", "--scrape-timeout", "0"], "more than 0"),
        (["--url", "http://127.0.0.1:1", "--scrape-timeout", "soon"], "is not a time"),
    ],
)
@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_record_errors_are_one_line(args, message, tmp_path):
    r = kvctl("record", *args, "-o", str(tmp_path / "x.kvsnap"), timeout=30)
    assert r.returncode in (1, 2) and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "x.kvsnap").exists()


@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_a_trailing_slash_names_a_directory_that_must_exist(tmp_path):
    """`-o missing_dir/` is a directory that is not there: refused before recording, where it used
    to be written, a minute later, as a file named `missing_dir`."""
    r = kvctl("record", "--url", "http://127.0.0.1:1", "-o", f"{tmp_path}/missing_dir/", timeout=30)
    assert r.returncode == 1 and "does not exist" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and os.listdir(tmp_path) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_ctrl_c_stops_the_recording_and_keeps_it(vllm_pages, tmp_path, sig):
    """Ctrl-C or SIGTERM stops it, also when started from a script in the background (a
    non-interactive shell starts `cmd &` with SIGINT ignored: the recording went on for good)."""
    url, served = vllm_pages
    out = tmp_path / "stopped.kvsnap"
    proc = subprocess.Popen([*KVCTL, "record", "--url", url, "-o", str(out), "--duration", "0", "--interval", "0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(served) < 5 and time.monotonic() < deadline:
            time.sleep(0.1)
        answered = len(served)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert "until Ctrl-C" in stderr and "stopped: " in stderr and stdout.strip() == str(out)
    # every page answered before Ctrl-C is kept, but the one still on its way back when it came
    assert len(read_snapshot(out).frames) >= answered - 1 >= 4


@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_ctrl_c_before_a_slow_engine_answers_says_so_in_one_line(tmp_path):
    """A careless Ctrl-C while the engine has not answered the first scrape: one line, exit 130, no
    traceback and no file (it used to exit 130 without a word). The signal goes once the server
    holds the scrape's connection, and the scrape may wait an hour (--scrape-timeout): only the
    signal can end the wait. With the 5 s default a busy machine once let the timeout win (exit 1)."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    listener.settimeout(60)
    out = tmp_path / "never.kvsnap"
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    proc = subprocess.Popen([*KVCTL, "record", "--url", url, "-o", str(out), "--duration", "0", "--scrape-timeout", "1h"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        conn, _ = listener.accept()  # the first scrape is under way
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
        conn.close()
    finally:
        proc.kill()
        listener.close()
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines() == [
        f"kvctl: stopped before {url}/metrics answered: nothing recorded, nothing written"
    ]
    assert not out.exists()


@pytest.mark.integration  # an HTTP server on a real socket
def test_a_stop_that_lands_in_a_finalizer_still_stops_the_recording(vllm_pages):
    """Python runs a signal handler wherever the main thread is, a finalizer included, and drops an
    exception raised there: Ctrl-C as a KeyboardInterrupt was lost that way once in CI and the
    recording went on for good. The handler only sets a flag, which no finalizer can swallow."""
    from kvtop.ctl.record import _stop_on_signals
    from kvtop.sources.recorder import Recording

    url, _ = vllm_pages
    source = MetricsSource(url, interval=0.05)
    rec = Recording(source, interval=0.05, duration=None)

    class Finalizer:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)  # its handler runs here, inside __del__

    ticks: list[int] = []

    def on_tick(r: Recording) -> None:
        ticks.append(len(r.frames))
        if len(ticks) == 3:
            Finalizer()  # made and dropped at once: __del__ runs now
        assert len(ticks) < 40, "the stop was lost: the recording goes on"

    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    _stop_on_signals(rec)
    try:
        rec.first()
        rec.run(on_tick)
    finally:
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])
        source.close()
    assert rec.stopped and ticks == [2, 3, 4]  # the frame of the tick it landed in is kept


def test_kvctl_record_from_our_own_server_agrees_with_its_stats(tiny_dir, tmp_path):
    server = start_server(tiny_dir, "--kv-cache-memory", "1MiB", "--max-num-seqs", "4")
    try:
        client = server.openai()
        for i in range(3):
            client.completions.create(model=server.model, prompt=f"Hello {i}", max_tokens=4)
        server.wait_idle()
        out = tmp_path / "ours.kvsnap"
        r = kvctl("record", "--url", server.url, "-o", str(out), "--duration", "1s", "--interval", "0.5s", timeout=60)
        assert r.returncode == 0, r.stderr
        stats = server.stats()
        page = truth(httpx.get(f"{server.url}/metrics", timeout=10).text)
    finally:
        server.cleanup()
    snap = read_snapshot(out)
    assert snap.meta["config"]["engine"] == "kvtop" and len(snap.frames) >= 2  # one now, more each 0.5 s
    last = snap.frames[-1]
    assert last["engine"]["kind"] == "kvtop" and last["engine"]["model"] == server.model
    assert (last["kv"]["block_size"], last["kv"]["num_blocks"]) == (
        stats["kv"]["block_size"],
        stats["kv"]["num_blocks"],
    )
    assert last["kv"]["free"] + last["kv"]["cached"] == stats["kv"]["allocatable"]  # idle: every block allocatable
    assert last["latency"]["ttft"]["count"] == stats["latency"]["ttft"]["count"] == 3
    assert last["prefix"]["query_tokens"] == page["kvtop_prefix_cache_queries_total"]
    assert last["scheduler"]["running"] == 0 and last["kv"]["usage"] == 0


VLLM_SNAPSHOT = Path(__file__).resolve().parent.parent / "snapshots" / "engines" / "vllm-under-load.kvsnap"


def test_the_vllm_recording_is_small_real_and_from_vllm():
    assert VLLM_SNAPSHOT.stat().st_size < 1024 * 1024
    snap = read_snapshot(VLLM_SNAPSHOT)
    assert snap.meta["config"]["engine"] == "vllm" and snap.meta["config"]["recorded_by"] == "kvtop"
    busy = [f for f in snap.frames if f["scheduler"]["running"]]
    assert max(f["scheduler"]["waiting"] for f in busy) > 0  # more load than it ran at once
    assert max(f["kv"]["usage"] for f in busy) > 0.5 and snap.frames[-1]["kv"]["usage"] == 0  # then idle


@pytest.mark.anyio
@pytest.mark.slow  # 2 s of Pilot: the full suite's, not the fast lane's
async def test_kvtop_replays_the_vllm_recording_with_its_kv_usage_and_no_block_map():
    from kvtop import fmt
    from kvtop.dashboard.app import KvtopApp
    from kvtop.dashboard.widgets.block_map import BlockMap
    from kvtop.dashboard.widgets.kv_panel import KVPanel
    from kvtop.dashboard.widgets.timeline import Timeline
    from tests.helpers import widget_text as text

    snap = read_snapshot(VLLM_SNAPSHOT)
    busiest = max(range(len(snap.frames)), key=lambda i: snap.frames[i]["kv"]["usage"])
    source = ReplaySource.open(VLLM_SNAPSHOT)
    app = KvtopApp(source)
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause()
        assert f"frame 1/{len(snap.frames)}" in text(app.query_one(Timeline))
        await pilot.press(*["right"] * busiest)
        await pilot.pause()
        assert source.index == busiest and source.error is None
        usage = snap.frames[busiest]["kv"]["usage"]
        kv = text(app.query_one(KVPanel))
        assert kv.splitlines()[0].endswith(fmt.pct(usage)) and "× 128 tokens" in kv
        strip = text(app.query_one(BlockMap).query_one("#block-grid"))  # no map: used / free from the usage
        blocks = snap.frames[busiest]["kv"]["num_blocks"]
        assert strip.splitlines()[0].split()[:3] == ["█", str(round(usage * blocks)), "used"], strip
        assert "vLLM exposes no block map" in " ".join(strip.split())
        await pilot.press("q")


PRESSURE_SNAPSHOT = VLLM_SNAPSHOT.with_name("vllm-under-pressure.kvsnap")  # scripts/record_vllm_incident.py


@pytest.mark.anyio
async def test_a_real_vllm_under_pressure_replays_with_its_panels_derived_and_its_incidents_marked():
    """The recording behind docs/dashboard.md's screens: vLLM short of KV (it preempts), of queue (it
    turns requests away) and, at the end, of prefix hits. Replayed at the moment of those screens,
    the block map is a strip, the sequences panel running / waiting by reason with the requests'
    lengths, memory (which vLLM does not serve) collapsed; the timeline marks what was derived."""
    from kvtop import fmt
    from kvtop.dashboard.app import KvtopApp
    from kvtop.dashboard.widgets.block_map import BlockMap
    from kvtop.dashboard.widgets.events import EventsPanel
    from kvtop.dashboard.widgets.memory import MemoryPanel
    from kvtop.dashboard.widgets.sequences import SequencesPanel
    from kvtop.dashboard.widgets.timeline import Timeline
    from tests.helpers import widget_text as text

    source = ReplaySource.open(PRESSURE_SNAPSHOT)
    assert {e["kind"] for e in source.marked_events} >= {"preempted", "rejected", "kv_full", "prefix_collapsed"}
    app = KvtopApp(source)
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause()
        assert not source.playing  # a replay opens paused
        source.seek(29.0)
        app.dashboard.redraw()
        frame = source.current
        s = frame["scheduler"]
        strip = text(app.query_one(BlockMap).query_one("#block-grid"))
        used = round(frame["kv"]["usage"] * frame["kv"]["num_blocks"])
        assert strip.splitlines()[0].split()[:3] == ["█", str(used), "used"]
        seqs = " ".join(text(n) for n in app.query_one(SequencesPanel).query(".absent-note"))
        assert seqs.startswith(f"{s['running']} running · {s['waiting']} waiting ({s['waiting_for_capacity']} for")
        assert "prompt  P50 ≈" in seqs and "output  P50 ≈" in seqs and "queued  P50" in seqs
        assert f"{s['preemptions_total']} preempted · {s['rejections_total']} turned away" in seqs
        assert not app.query_one(MemoryPanel).display
        events = text(app.query_one(EventsPanel))
        assert "derived: " in events and "requests/s" in events  # the rejections, folded into one line
        marks = text(app.query_one(Timeline)).splitlines()[-1]
        assert all(m in marks for m in "pxkh"), marks
        assert fmt.pct(frame["kv"]["usage"]) in strip


@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_a_file_that_appears_while_recording_is_kept_and_the_recording_goes_beside_it(vllm_pages, tmp_path):
    url, served = vllm_pages
    out = tmp_path / "race.kvsnap"
    proc = subprocess.Popen([*KVCTL, "record", "--url", url, "-o", str(out), "--duration", "2s", "--interval", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not served and time.monotonic() < deadline:
            time.sleep(0.05)
        out.write_text("someone else's")
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert out.read_text() == "someone else's" and stdout.strip() == str(tmp_path / "race-1.kvsnap")
    assert read_snapshot(tmp_path / "race-1.kvsnap").frames[-1]["engine"]["kind"] == "vllm"


@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_an_engine_that_stops_answering_for_a_while_is_recorded_around_the_gap(vllm_pages, tmp_path):
    url, served = vllm_pages
    out = tmp_path / "gap.kvsnap"
    r = kvctl("record", "--url", f"{url}/down/metrics", "-o", str(out), "--duration", "2s", "--interval", "0.25",
              timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert served[2:5] == ["503"] * 3 and "(3 scrapes failed)" in r.stderr
    frames = read_snapshot(out).frames
    assert len(frames) == len(served) - 3  # every page that answered, none made up for the gap
    assert [f["scheduler"]["running"] for f in frames[:3]] == [0, 0, 8]  # t0, t1, then t2 after the gap


@pytest.mark.anyio
@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
@pytest.mark.slow  # 8 s of Pilot: the full suite's, not the fast lane's
async def test_a_vllm_replay_survives_a_burst_of_keys_and_resizes(size):
    """A careless operator on the vLLM recording: every view key in a burst, tabs, zoom on the
    derived strip, the filter on a sequences panel with no table, details with nothing selected,
    resizes between the layouts — kvtop stays up, on its dashboard, drawing the strip and the counts."""
    from kvtop.dashboard.app import KvtopApp
    from kvtop.dashboard.widgets.block_map import BlockMap
    from kvtop.dashboard.widgets.dashboard import Dashboard
    from kvtop.dashboard.widgets.sequences import SequencesPanel
    from tests.helpers import until
    from tests.helpers import widget_text as text

    app = KvtopApp(ReplaySource.open(PRESSURE_SNAPSHOT))
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        keys = ["G", "1", "z", "z", "Z", "2", "j", "k", "enter", "escape", "slash", "x", "escape", "3", "w", "4",
                "5", "v", "v", "right", "left", "bracketleft", "bracketright", "g", "space", "space", "o", "escape"]  # fmt: skip
        await pilot.press(*keys)
        for other in [(160, 48), (60, 18), size]:
            await pilot.resize_terminal(*other)
            await pilot.press("1", "2", "z", "G")
        await until(pilot, lambda: not app.query_one(Dashboard).rebuilding, "the layout to settle")
        assert app.is_running and app.screen is app.dashboard
        await pilot.press("1")
        await until(pilot, lambda: "used" in text(app.query_one(BlockMap).query_one("#block-grid")), "the strip")
        await pilot.press("2")
        await until(
            pilot,
            lambda: "running ·" in " ".join(text(n) for n in app.query_one(SequencesPanel).query(".absent-note")),
            "the sequences panel's counts",
        )
