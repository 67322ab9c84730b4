"""Hostile `/metrics` pages (issue #40): whatever another engine's page says, kvtop stays up.

A loopback server serves pages built from the engine tables themselves — every series the vLLM,
SGLang, llama.cpp and kvtop mappings read — holding values no count can have: NaN, ±Inf, -5,
1e308, histograms whose buckets decrease or are NaN. The dashboard (`kvtop --url`), the fleet,
`kvctl status --url`, `kvctl record` and a replay of a recording with such values draw `–` where a
value is unusable, never crash. A page too big is refused at the cap without being read whole, a
page sent a byte at a time is given up on at the whole-page deadline, and a dashboard that dies
of an exception ends `kvtop` with status 1 and one line, the traceback kept in a file.
"""

from __future__ import annotations

import contextlib
import copy
import http.server
import itertools
import json
import math
import os
import pty
import re
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
import typer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtop.dashboard import partial
from kvtop.dashboard.app import KvtopApp
from kvtop.dashboard.fleet_screen import FleetScreen, cells_of
from kvtop.dashboard.widgets.header import EngineHeader, engine_line, glance_line
from kvtop.dashboard.widgets.kv_panel import KVPanel
from kvtop.dashboard.widgets.latency import LatencyPanel
from kvtop.dashboard.widgets.prefix_panel import PrefixPanel
from kvtop.dashboard.widgets.throughput import ThroughputPanel
from kvtop.dashboard.widgets.timeline import Timeline
from kvtop.dashboard.widgets.view import View
from kvtop.diagnosis import diagnose
from kvtop.entry import run_cli
from kvtop.fleet import Fleet
from kvtop.fleet.poller import row_of
from kvtop.protocol.frame_schema import check_frame
from kvtop.protocol.snapshot import read_snapshot, write_snapshot
from kvtop.sources import ReplaySource, SourceUnavailable
from kvtop.sources.fetch import PageTooSlow, client, fetch
from kvtop.sources.mappings import Mapping, all_mappings, by_kind
from kvtop.sources.metrics import MetricsSource, build_frame
from kvtop.sources.prometheus import NotMetrics, parse
from tests.helpers import until
from tests.helpers import widget_text as text
from tests.server_harness import kvctl
from tests.test_kvtop_terminal import STORM, Terminal, base_env

HOSTILE = ("+Inf", "-Inf", "NaN", "-5", "1e308")
FIXTURES = Path(__file__).parent / "fixtures" / "metrics"
KINDS = [m.kind for m in all_mappings()]
DRIP_S = 0.2  # the dripping server's pause between two bytes


def page(m: Mapping, values: Iterator[str]) -> str:
    """A /metrics page of engine `m` serving every series its table reads, each sample taking the
    next of `values`: gauges, counters, rate counters, each histogram's buckets, sum and count, the
    info gauge's labels (and ours' block counts by state)."""
    lines = []
    for kind, table in (("gauge", m.gauges), ("counter", m.counters), ("counter", m.rates)):
        for name in {n for names in table.values() for n in names}:
            lines += [f"# TYPE {name} {kind}", f'{name}{{model_name="m"}} {next(values)}']
    for name in m.histograms.values():
        lines.append(f"# TYPE {name} histogram")
        lines += [f'{name}_bucket{{le="{le}"}} {next(values)}' for le in ("0.1", "1.0", "+Inf")]
        lines += [f"{name}_sum {next(values)}", f"{name}_count {next(values)}"]
    if m.start_time:
        lines += [f"# TYPE {m.start_time} gauge", f"{m.start_time} {next(values)}"]
    for name, label, value in m.selected.values():
        lines += [f"# TYPE {name} gauge", f'{name}{{{label}="{value}"}} {next(values)}']
    if m.info:
        lines.append(f'{m.info}{{block_size="{next(values)}",num_gpu_blocks="{next(values)}",cache_dtype="auto"}} 1.0')
    if m.kind == "kvtop":
        lines += [f'kvtop_kv_cache_blocks{{state="{s}"}} {next(values)}' for s in ("free", "cached", "used", "shared")]
    return "\n".join(lines) + "\n"


def numbers(frame: object) -> Iterator[float]:
    """Every number in a frame."""
    if isinstance(frame, dict):
        for v in frame.values():
            yield from numbers(v)
    elif isinstance(frame, list):
        for v in frame:
            yield from numbers(v)
    elif isinstance(frame, int | float) and not isinstance(frame, bool):
        yield frame


def figures(frame: dict) -> dict:
    """What the frame says of the engine's load, KV cache, prefix cache, latency and rates."""
    return {k: frame[k] for k in ("scheduler", "kv", "prefix", "latency", "throughput")}


class Hostile(http.server.BaseHTTPRequestHandler):
    """`pages[path]` as a page; /big (100 MB, no length), /big-declared (says 2 GB), /drip-body
    (headers, then a byte every DRIP_S), /drip-headers (the status line a byte at a time)."""

    pages: ClassVar[dict[str, str]] = {}  # each server gets its own subclass

    def do_GET(self):
        try:
            if self.path.startswith("/big"):
                self._big(declared=self.path == "/big-declared")
            elif self.path.startswith("/drip"):
                self._drip(headers_too=self.path == "/drip-headers")
            elif self.path in self.pages:
                body = self.pages[self.path].encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self.send_error(404)
        except OSError:  # the client gave up, as it should
            pass

    def _big(self, declared: bool) -> None:
        self.send_response(200)
        if declared:
            self.send_header("Content-Length", str(2 * 1024**3))
        self.end_headers()  # HTTP/1.0 without a length: the body ends when the connection does
        line = b"vllm:num_requests_running 1\n" * 37_000  # ~1 MiB
        for _ in range(100):
            self.wfile.write(line)

    def _drip(self, headers_too: bool) -> None:
        head = b"HTTP/1.0 200 OK\r\n" if headers_too else b""
        if not headers_too:
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            self.wfile.flush()
        for byte in itertools.chain(head, itertools.repeat(ord("#"), 300)):  # a minute, unless dropped
            self.wfile.write(bytes([byte]))
            self.wfile.flush()
            time.sleep(DRIP_S)

    def log_message(self, *args):
        pass


@pytest.fixture
def hostile():
    """The server's base URL; tests put their pages in `Hostile.pages`."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("Pages", (Hostile,), {"pages": {}}))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.base = f"http://127.0.0.1:{server.server_address[1]}"
    yield server
    server.shutdown()


def serve(server, path: str, body: str) -> str:
    server.RequestHandlerClass.pages[path] = body
    return server.base + path


# ---- the numbers: a page becomes a frame without them ------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("value", HOSTILE)
def test_every_series_with_an_unusable_value_is_absent_from_the_frame(kind, value):
    m = by_kind(kind)
    good = parse(page(m, itertools.repeat("1")), 100.0)
    bad = parse(page(m, itertools.repeat(value)), 105.0)
    frame = build_frame(m, bad, [good], "http://h/metrics")
    assert frame["engine"]["kind"] == kind  # still the engine: its names say so
    assert figures(frame) == {"scheduler": {}, "kv": {"dtype": "auto"} if m.info else {}, "prefix": {},
                              "latency": {}, "throughput": {}}  # fmt: skip
    assert check_frame(frame) is None and json.dumps(frame, allow_nan=False)  # a recording of it replays
    view = View(frame, [frame], [])
    assert diagnose(frame) == [] and "– running · – waiting" in glance_line(view, False).plain
    kv = KVPanel().draw(view, 80, 20).plain
    assert kv.splitlines()[0].split() == ["usage", "–", "–"]
    if m.histograms:
        assert "latency histograms ttft, itl, e2e, queue hold values kvtop cannot use" in " ".join(frame["unavailable"])
    row = [cell.plain.strip() for cell in cells_of(row_of("u", frame, [frame]))]
    assert row[2:9] == ["–"] * 7  # KV … ITL p99: nothing usable, no inf %


def test_a_histogram_whose_buckets_decrease_is_made_cumulative_as_prometheus_does():
    m = by_kind("vllm")
    text_ = page(m, itertools.cycle(["1"])).replace('le="0.1"} 1', 'le="0.1"} 9')  # 9 at 0.1 s, 1 at 1 s and +Inf
    ttft = build_frame(m, parse(text_, 100.0), [], "u")["latency"]["ttft"]
    assert ttft["counts"] == [9, 0, 0] and ttft["count"] == 9  # not -8, and +Inf holds at least the 9
    assert 0 < ttft["p99"] <= 0.1


def without_start_time(text_: str) -> str:
    return "\n".join(line for line in text_.splitlines() if "process_start_time_seconds" not in line) + "\n"


def test_a_counter_that_goes_back_was_reset():
    """Where the engine does not say when it started, a counter that went back was reset, as
    Prometheus' rate() reads it."""
    m = by_kind("vllm")
    before = parse(without_start_time(page(m, itertools.repeat("1000"))), 100.0)
    after = parse(without_start_time(page(m, itertools.repeat("20"))), 110.0)  # a restart: 20 since it came back
    frame = build_frame(m, after, [before], "u")
    assert frame["throughput"]["generation_tokens_per_s"] == pytest.approx(2.0)  # 20 in 10 s, not 0 or -98
    history = [build_frame(m, before, [], "u"), build_frame(m, after, [], "u")]
    assert row_of("u", history[-1], history).preemptions_per_s == 2.0


def test_a_new_process_start_time_is_a_new_run_with_no_rate_yet():
    """vLLM serves process_start_time_seconds: the first scrape of a new run has nothing to compare with."""
    m = by_kind("vllm")
    before = parse(page(m, itertools.repeat("1000")), 100.0)
    after = parse(page(m, itertools.repeat("20")), 110.0)  # started at 20, not 1000: another run
    assert build_frame(m, after, [before], "u")["throughput"] == {}
    history = [build_frame(m, before, [], "u"), build_frame(m, after, [], "u")]
    assert row_of("u", history[-1], history).preemptions_per_s is None


# ---- the dashboard, the fleet, kvctl status, kvctl record, replay --------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.integration  # an HTTP server on a real socket
async def test_the_dashboard_stays_up_and_draws_a_dash_for_every_unusable_value(hostile, kind):
    m = by_kind(kind)
    url = serve(hostile, "/metrics", page(m, itertools.cycle(HOSTILE)))  # each value somewhere
    app = KvtopApp(MetricsSource(url, interval=0.2))
    async with app.run_test(size=(160, 48)) as pilot:
        await until(pilot, lambda: len(app.dashboard.source.history()) >= 3, "three scrapes")
        await pilot.pause(0.3)
        assert app.dashboard.poll_error is None and app.dashboard.source.disconnected_since is None
        header = text(app.query_one(EngineHeader))
        assert f"{m.label} via /metrics" in header and "– running · – waiting" in header
        assert text(app.query_one(KVPanel)).splitlines()[0].split() == ["usage", "–", "–"]
        if m.histograms:
            assert "hold values kvtop cannot use" in text(app.query_one(LatencyPanel))


@pytest.mark.anyio
@pytest.mark.integration  # an HTTP server on a real socket
async def test_one_hostile_engine_in_a_fleet_is_a_row_the_good_one_is_another(hostile):
    bad = serve(hostile, "/bad/metrics", page(by_kind("vllm"), itertools.repeat("+Inf")))
    good = serve(hostile, "/good/metrics", (FIXTURES / "vllm_real_t2.prom").read_text())
    fleet = Fleet([bad, good], timeout=5.0)
    rows = {r.url: r for r in fleet.poll()}
    assert rows[bad].state == "ok" and rows[bad].kind == "vllm" and rows[bad].waiting is None
    assert rows[good].state == "ok" and rows[good].running == 8
    app = KvtopApp(fleet=fleet)
    async with app.run_test(size=(160, 48)) as pilot:
        screen = app.screen
        assert isinstance(screen, FleetScreen)
        await until(pilot, lambda: screen.polled_at is not None and not screen.error, "a round")
        assert {r.url: r.state for r in screen.rows} == {bad: "ok", good: "ok"}
        assert "2 engines, 2 ok" in text(screen.query_one("#fleet-header"))


@pytest.mark.integration  # a kvctl process: seconds of start-up each
def test_kvctl_status_of_a_hostile_page_prints_dashes_and_exits_0(hostile):
    url = serve(hostile, "/metrics", page(by_kind("vllm"), itertools.repeat("+Inf")))
    r = kvctl("status", "--url", url, "--json", timeout=60)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    frame = json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert frame["scheduler"] == {} and frame["kv"] == {"dtype": "auto"}
    r = kvctl("status", "--url", url, timeout=60, env={**os.environ, "COLUMNS": "160"})
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "- running, - waiting" in r.stdout and re.search(r"KV cache +- *\n", r.stdout), r.stdout


@pytest.mark.integration  # a kvctl process: seconds of start-up each
def test_kvctl_record_of_a_hostile_page_writes_a_recording_that_replays(hostile, tmp_path: Path):
    url = serve(hostile, "/metrics", page(by_kind("vllm"), itertools.cycle(HOSTILE)))
    out = tmp_path / "hostile.kvsnap"
    r = kvctl("record", "--url", url, "-o", str(out), "--duration", "1.5s", "--interval", "0.5s", timeout=60)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    replay = ReplaySource.open(out)
    try:
        frames = [replay.frames[i] for i in range(len(replay.frames))]
        assert len(frames) >= 2 and all(check_frame(f) is None for f in frames)
        assert all(f["scheduler"] == {} and f["latency"] == {} for f in frames)
    finally:
        replay.close()


def hostile_recording(path: Path) -> Path:
    """preemption-storm's frames, the last holding numbers a frame's types allow but no panel can
    draw (a 400-digit count, 1e308 where a fraction goes, negative counts), the one before it NaN
    (which is no stats frame), and earlier ones huge counters (for the sparklines)."""
    snap = read_snapshot(STORM)
    frames = [copy.deepcopy(f) for f in snap.frames]
    huge = 10**400
    for f in frames[-12:-2]:
        f["scheduler"]["preemptions_total"] = huge
        f["prefix"]["hit_tokens"] = huge
    last = frames[-1]
    last["kv"].update(usage=1e308, peak_usage=1e308, used=huge, free=-5)
    last["scheduler"].update(waiting=-5, active_tokens=huge)
    last["prefix"].update(saved_prefill_s=huge, query_tokens=huge, hit_rate=1e308)
    last["engine"]["uptime_s"] = 1e308
    last["memory"].update(device_used=huge, kv=huge)
    last["latency"]["ttft"]["buckets"][0] = huge
    last["throughput"]["prompt_tokens_per_s"] = 1e308
    assert check_frame(last) is None
    frames[-2]["kv"]["usage"] = math.nan
    return write_snapshot(path, model="m", config={}, reason="hostile", frames=frames, events=[])


@pytest.mark.anyio
async def test_a_replayed_recording_with_such_values_draws_dashes_and_flags_the_bad_frame(tmp_path: Path):
    app = KvtopApp(ReplaySource.open(hostile_recording(tmp_path / "h.kvsnap")))
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.press("G")  # the last frame
        await until(pilot, lambda: app.dashboard.replay.index == len(app.dashboard.replay.frames) - 1, "the last frame")
        await pilot.pause(0.3)
        kv = text(app.query_one(KVPanel))
        assert kv.splitlines()[0].split()[-1] == "–"  # usage 1e308: no gauge, no 1e310 %
        assert "– s of prefill" in text(app.query_one(PrefixPanel))
        assert re.search(r"prompt tok/s +– ", text(app.query_one(ThroughputPanel)))
        await pilot.press("left")  # the NaN frame: the last good one stays, and the timeline says why
        await until(pilot, lambda: app.dashboard.replay.error is not None, "the bad frame")
        await pilot.pause(0.3)
        assert "is not a stats frame" in text(app.query_one(Timeline))


# ---- a page too big, a page too slow ----------------------------------------------------------


@pytest.mark.parametrize("path", ["/big", "/big-declared"])
@pytest.mark.integration  # an HTTP server on a real socket
def test_a_100_mb_page_is_refused_at_the_cap_without_being_read_whole(hostile, path):
    source = MetricsSource(hostile.base + path, timeout=10.0)
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(NotMetrics, match="the /metrics page is larger than 8 MiB"):
            source.scrape()
        elapsed, (_, peak) = time.monotonic() - t0, tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        source.close()
    assert peak < 48 * 1024**2, f"{peak / 1024**2:.0f} MiB held to refuse it"  # the cap and a join, not 100 MB
    assert elapsed < 20, elapsed  # its first 8 MiB over loopback, not 100 MB


@pytest.mark.integration  # a kvctl process: seconds of start-up each
def test_kvctl_status_refuses_a_100_mb_page_in_one_line(hostile):
    r = kvctl("status", "--url", hostile.base + "/big", timeout=120)
    said = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(said) == 1, r.stderr
    assert said[0].startswith("kvctl: cannot read ") and said[0].endswith(": the /metrics page is larger than 8 MiB")


@pytest.mark.parametrize("path", ["/drip-body", "/drip-headers"])
@pytest.mark.integration  # an HTTP server on a real socket
def test_a_page_sent_a_byte_at_a_time_is_given_up_at_the_deadline(hostile, path):
    http = client(timeout=5.0)  # each byte comes well within the per-read timeout
    t0 = time.monotonic()
    with pytest.raises(PageTooSlow, match="the page did not arrive in 1 s"):
        fetch(http, hostile.base + path, max_bytes=1024**2, deadline_s=1.0)
    assert time.monotonic() - t0 < 15  # the deadline (and a busy machine's slack), not the minute the page takes
    http.close()
    source = MetricsSource(hostile.base + path, timeout=5.0, deadline=1.0)
    with pytest.raises(SourceUnavailable, match="did not arrive in 1 s"):
        source.poll()
    assert source.failure == "slow"
    source.close()


# ---- a crash: status 1 and one line ------------------------------------------------------------


def exit_status(term: Terminal, timeout: float = 60.0) -> int:
    """Wait for the program on `term` to end by itself, reading what it writes meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid, status = os.waitpid(term.pid, os.WNOHANG)
        if pid:
            with contextlib.suppress(AssertionError):
                term.read_until("\x00", timeout=0.5)  # the rest of what it wrote
            os.close(term.fd)
            return status
        with contextlib.suppress(AssertionError):
            term.read_until("\x00", timeout=0.2)
    return term.hang_up()


@pytest.mark.integration  # a real terminal (a pty)
def test_a_dashboard_that_raises_in_a_handler_exits_1_with_one_line(tmp_path: Path):
    env = base_env(TERM="xterm", KVTOP_CACHE=str(tmp_path))
    code = "from kvtop.dashboard.dashboard_screen import DashboardScreen as D\nD.action_help = lambda self: 1 / 0\n" + (
        "from kvtop.dashboard.cli import main\nmain()"
    )
    term = Terminal.__new__(Terminal)
    term.output = b""
    term.pid, term.fd = pty.fork()
    if term.pid == 0:
        os.execve(sys.executable, [sys.executable, "-c", code, "--replay", str(STORM)], env)
    term.read_until("Block map")
    term.press("?")  # the help key: its handler raises
    status = exit_status(term)
    out = re.sub(r"\x1b\[[0-9;]*m", "", term.output.decode(errors="replace"))  # kvtop: is red
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 1, status
    said = out[out.index("kvtop: crashed") :].strip()
    assert said.startswith("kvtop: crashed: ZeroDivisionError: division by zero (traceback in ")
    assert "\n" not in said and "Traceback" not in out
    kept = Path(said.split("(traceback in ", 1)[1].rstrip(")"))
    assert kept.parent == tmp_path / "crashes" and "ZeroDivisionError" in kept.read_text()


def test_any_command_that_crashes_is_one_line_and_status_1(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setenv("KVTOP_CACHE", str(tmp_path))
    app = typer.Typer()

    @app.command()
    def boom() -> None:
        {}["missing"]

    with pytest.raises(SystemExit) as exit_info:
        run_cli(app, "kvctl", [])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvctl: crashed: KeyError: 'missing' (traceback in ")
    assert len(list((tmp_path / "crashes").glob("kvctl-*.txt"))) == 1


# ---- any values at all: a property over the whole path -----------------------------------------


def prom(v: float) -> str:
    """A float as Prometheus text writes it."""
    return "NaN" if math.isnan(v) else "+Inf" if v == math.inf else "-Inf" if v == -math.inf else repr(v)


def samples_in(m: Mapping) -> int:
    counter = itertools.count()
    page(m, (str(next(counter)) for _ in itertools.count()))
    return next(counter)


VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 1.0, -5.0, 0.5, 2.0, 1e308, -1e308, 2.0**53, 1e15]),
    st.integers(0, 10**6).map(float),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(KINDS), data=st.data())
def test_any_values_through_mapping_frame_diagnosis_and_drawing(kind, data):
    m = by_kind(kind)
    n = samples_in(m)
    before, now = (data.draw(st.lists(VALUES, min_size=n, max_size=n)) for _ in range(2))
    scrapes = [parse(page(m, map(prom, values)), ts) for values, ts in ((before, 100.0), (now, 105.0))]
    frames = [build_frame(m, scrapes[0], [], "u"), build_frame(m, scrapes[1], scrapes[:1], "u")]
    frame = frames[1]
    assert check_frame(frame) is None and json.dumps(frame, allow_nan=False)
    for v in numbers(figures(frame)):  # counts, times, rates: finite, not negative, never 1e308
        assert 0 <= v < 2**53, v
    for fraction in (frame["kv"].get("usage"), frame["prefix"].get("hit_rate")):
        assert fraction is None or fraction <= 1
    for h in frame["latency"].values():
        assert all(c >= 0 for c in h["counts"]) and h["count"] == sum(h["counts"])
    view = View(frame, frames, [])
    assert all(isinstance(line, str) for line in diagnose(frame, frames[:1]))
    engine_line(view, None), glance_line(view, False), partial.kv_partial(frame, 80)
    for panel in (KVPanel, LatencyPanel, ThroughputPanel, PrefixPanel):
        panel().draw(view, 80, 30)
    cells_of(row_of("u", frame, frames))


@pytest.mark.integration  # a kvctl process: seconds of start-up each
def test_kvctl_status_with_prefix_queries_but_unusable_hits_prints_the_rest(hostile):
    """A usable query counter beside a +Inf hit counter: the prefix row leaves the hits out
    instead of ending `kvctl status` (it read `hit_tokens` whenever `query_tokens` was there)."""
    body = "vllm:num_requests_running 2\nvllm:prefix_cache_queries_total 100\nvllm:prefix_cache_hits_total +Inf\n"
    url = serve(hostile, "/metrics", body)
    r = kvctl("status", "--url", url, timeout=60, env={**os.environ, "COLUMNS": "160"})
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "2 running" in r.stdout, r.stdout
