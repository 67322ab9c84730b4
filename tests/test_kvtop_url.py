"""kvtop --url: the dashboard over an engine's Prometheus /metrics (issue #15).

Against our own `kvctl serve` (its /metrics, not its socket) and against a recorded vLLM page on a
loopback HTTP server: the KV panel shows what /metrics says, the panels /metrics cannot feed say so
in one line, and no operator key (drain, resume, evict, snapshot) is offered or answers. The
command line: one line and a non-zero exit for what it cannot act on; which source each form opens.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from textual.widgets import Input

from kvtop import fmt
from kvtop.dashboard.app import KvtopApp
from kvtop.dashboard.cli import main
from kvtop.dashboard.widgets.block_map import BlockMap
from kvtop.dashboard.widgets.header import EngineHeader
from kvtop.dashboard.widgets.help import HelpScreen
from kvtop.dashboard.widgets.kv_panel import KVPanel
from kvtop.dashboard.widgets.latency import LatencyPanel
from kvtop.dashboard.widgets.memory import MemoryPanel
from kvtop.dashboard.widgets.sequences import SequencesPanel, SequencesTable
from kvtop.dashboard.widgets.snapshot_dialog import SnapshotScreen
from kvtop.fleet import Fleet
from kvtop.sources import ReplaySource
from kvtop.sources.metrics import MetricsSource
from tests.helpers import until
from tests.helpers import widget_text as text
from tests.server_harness import start_server
from tests.test_fleet import Server, Targets

SIZE = (160, 48)
ACTION_KEYS = ("d", "r", "e", "E")  # drain, resume, evict a sequence, evict the prefix cache


@pytest.fixture
def base():
    server = Server(("127.0.0.1", 0), type("FreshTargets", (Targets,), {"seen": set()}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def figure(panel_text: str, label: str) -> str:
    """The value printed after `label` in a panel."""
    return panel_text.split(f"{label} ", 1)[1].split()[0]


def grid(app: KvtopApp) -> str:
    return text(app.query_one(BlockMap).query_one("#block-grid"))


def notes(app: KvtopApp, panel) -> str:
    return " ".join(text(s) for s in app.query_one(panel).query(".absent-note"))


async def no_action_answers(pilot, app: KvtopApp) -> None:
    """Neither the footer nor the keys offer drain, resume or evict (`s` records on kvtop's side)."""
    offered = {key for key, b in app.active_bindings.items() if b.enabled}
    assert not offered & set(ACTION_KEYS), offered
    for key in ACTION_KEYS:
        await pilot.press(key)
        await pilot.pause(0.1)
        assert app.screen is app.dashboard, f"{key} opened {type(app.screen).__name__}"
    await pilot.press("question_mark")
    await until(pilot, lambda: isinstance(app.screen, HelpScreen), "the help screen")
    assert [name for name, _ in app.screen.groups] == ["View", "Record"] and "no controls" in app.screen.mode
    await pilot.press("escape")


@pytest.mark.anyio
async def test_our_own_server_over_its_metrics_shows_the_kv_panel_and_no_drain_key(tiny_dir):
    server = start_server(tiny_dir, "--kv-cache-memory", "512KiB", "--max-num-seqs", "8")
    try:
        with server.http() as http:  # one request: latency and prefix counts to compare
            r = http.post("/v1/completions", json={"model": str(tiny_dir), "prompt": "hello there", "max_tokens": 8})
            assert r.status_code == 200
        socket_frame = server.stats()
        app = KvtopApp(MetricsSource(server.url, interval=0.2))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.dashboard.source.current is not None, "a frame from /metrics")
            await pilot.pause(0.3)
            frame = app.dashboard.source.current
            assert frame["source"]["kind"] == "metrics" and frame["engine"]["kind"] == "kvtop"
            kv = text(app.query_one(KVPanel))
            assert kv.splitlines()[0].endswith(fmt.pct(frame["kv"]["usage"]))
            assert figure(kv, "total") == str(socket_frame["kv"]["num_blocks"])  # the socket's count, from /metrics
            assert f"{socket_frame['kv']['block_size']} tok/block" in kv
            ttft = socket_frame["latency"]["ttft"]["count"]
            assert ttft == 1 and f"all n={ttft}" in text(app.query_one(LatencyPanel))
            # no block map over /metrics: a strip of the counts by state, saying it is derived and where the map is
            strip = " ".join(grid(app).split())
            assert "/metrics carries no block map (kvtop --socket shows it)" in strip and "derived from" in strip
            counts = socket_frame["kv"]
            assert f"{counts['used']} used" in strip and f"{counts['free']} free" in strip, strip
            assert "kvtop via /metrics, no controls" in text(app.query_one(EngineHeader))
            await no_action_answers(pilot, app)
    finally:
        server.cleanup()


@pytest.mark.anyio
@pytest.mark.integration  # an HTTP server on a real socket
async def test_a_recorded_vllm_says_what_it_cannot_show_and_offers_no_action(base, tmp_path: Path):
    app = KvtopApp(MetricsSource(f"{base}/vllm/0/metrics", interval=0.2))
    async with app.run_test(size=SIZE) as pilot:
        await until(
            pilot, lambda: app.dashboard.source.current and app.dashboard.source.current["throughput"], "two scrapes"
        )
        await pilot.pause(0.3)
        # no block map: a strip of used / free from vLLM's usage over its 363 blocks, labelled as derived
        usage = app.dashboard.source.current["kv"]["usage"]
        strip = grid(app)
        assert strip.splitlines()[0].split() == [
            "█",
            str(round(usage * 363)),
            "used",
            "░",
            str(363 - round(usage * 363)),
            "free",
        ]
        assert "derived from the KV usage" in " ".join(strip.split()) and "vLLM exposes no block map" in " ".join(
            strip.split()
        )
        assert app.query_one(BlockMap).query_one("#block-grid").size.height == len(strip.splitlines())  # on screen
        # no per-sequence table: running and waiting by reason, and the finished requests' lengths
        seqs = notes(app, SequencesPanel)
        assert seqs.startswith("8 running · 0 waiting (0 for capacity, 0 deferred)"), seqs
        assert (
            "prompt  P50 ≈75 · P95 ≈98 · P99 ≈100 tokens" in seqs
            and "derived: vLLM serves no per-sequence table" in seqs
        )
        assert not app.query_one(SequencesTable).display
        assert not app.query_one(MemoryPanel).display  # nothing to feed it: collapsed, the throughput beside it widens
        assert "no figures for: memory" in text(app.query_one(KVPanel))
        kv = text(app.query_one(KVPanel))
        assert kv.splitlines()[0].endswith("2.5%") and "blocks 363 × 128 tokens" in kv  # less the null block
        # vLLM serves no used / cached / free blocks: a line says so (wrapped to the panel, not cut), no dashes or zeros
        assert "\nvLLM serves no block counts by state\n(used, cached, free)\n" in kv, kv
        assert "–" not in kv and " 0 " not in kv
        assert "smollm2-135m" in text(app.query_one(EngineHeader))
        await no_action_answers(pilot, app)

        # `s`: kvtop writes the frames it read as a .kvsnap, which replays as vLLM's
        await pilot.press("space")  # paused: the frames on hand stop changing
        await pilot.press("s")
        await until(pilot, lambda: isinstance(app.screen, SnapshotScreen), "the snapshot dialog")
        assert "kvtop writes the" in text(app.screen.query_one(".dialog-body"))
        app.screen.query_one(Input).value = str(tmp_path / "vllm.kvsnap")
        await pilot.press("enter")
        await until(pilot, lambda: (tmp_path / "vllm.kvsnap").exists(), "the snapshot file")
        shown = app.dashboard.source.history()
    replay = ReplaySource.open(tmp_path / "vllm.kvsnap")
    try:
        assert len(replay.frames) == len(shown) >= 2
        last = replay.frames[len(replay.frames) - 1]
        assert last["engine"]["kind"] == "vllm" and last["kv"]["usage"] == shown[-1]["kv"]["usage"]
        assert "blocks" not in last["kv"]  # absent stays absent
    finally:
        replay.close()


def run_cli(monkeypatch, *argv: str) -> KvtopApp:
    started: list[KvtopApp] = []
    monkeypatch.setattr("kvtop.dashboard.app.KvtopApp.run", lambda self, *a, **k: started.append(self))
    main(list(argv))  # returns (exit status 0) once the dashboard has run
    assert len(started) == 1
    return started[0]


def test_the_command_line_opens_the_source_it_names(monkeypatch, tmp_path: Path):
    app = run_cli(monkeypatch, "--url", "http://node-1:8000", "--engine", "vllm")
    assert isinstance(app.dashboard.source, MetricsSource) and app.dashboard.source.url == "http://node-1:8000/metrics"
    assert app.dashboard.source.mapping.kind == "vllm" and app.fleet is None
    targets = tmp_path / "fleet.txt"
    targets.write_text("# the fleet\nhttp://node-1:8000\n\nnode-2:8000  # a comment\n")
    app = run_cli(monkeypatch, "--url", "http://node-0:30000", "--targets", str(targets))
    assert app.dashboard.source is None and isinstance(app.fleet, Fleet)
    assert [s.url for s in app.fleet.sources] == [
        "http://node-0:30000/metrics", "http://node-1:8000/metrics", "http://node-2:8000/metrics"
    ]  # fmt: skip
    app.fleet.close()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--url", "ftp://x/metrics"], "is not an http(s) URL"),
        (["--url", "http://a:1", "--engine", "tgi"], "--engine 'tgi': use one of"),
        (["--url", "http://a:1", "--socket", "/tmp/x.sock"], "not with --socket or --replay"),
        (["--engine", "vllm"], "--engine goes with --url or --targets"),
        (["--targets", "/nonexistent/fleet.txt"], "cannot read --targets /nonexistent/fleet.txt"),
        (["--prometheus", "http://p:9090", "--url", "http://a:1"], "not with --url or --targets"),
        (["--url", "http://127.0.0.1:abc"], "'http://127.0.0.1:abc' is not a URL that can be reached: the port 'abc'"),
        (["--url", "http://[::1"], "the [ of its IPv6 address is not closed"),
        (["--url", "http://a:1", "--url", "http://b:99999"], "the port 99999 is not between 1 and 65535"),
        (["--prometheus", "http://p:abc"], "--prometheus 'http://p:abc' is not a URL that can be reached"),
        (["--interval", "nan"], "--interval nan: give seconds from 0.05 to 3600"),
        (["--interval", "inf"], "--interval inf: give seconds from 0.05 to 3600"),
    ],
)
def test_a_command_line_it_cannot_act_on_is_one_line(argv, says, capsys, monkeypatch):
    monkeypatch.setattr("kvtop.dashboard.app.KvtopApp.run", lambda self, *a, **k: pytest.fail("started"))
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvtop: ") and says in err[0], err


def test_an_empty_targets_file_is_refused(tmp_path: Path, capsys):
    empty = tmp_path / "none.txt"
    empty.write_text("# nobody yet\n\n")
    with pytest.raises(SystemExit):
        main(["--targets", str(empty)])
    assert "names no engine" in capsys.readouterr().err


def test_a_targets_file_with_a_url_that_cannot_be_used_names_it(tmp_path: Path, capsys):
    targets = tmp_path / "fleet.txt"
    targets.write_text("http://node-1:8000\nhttp://node-2:eighty\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["--targets", str(targets)])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kvtop: --targets {targets}: 'http://node-2:eighty' is not a URL that can be reached: "
                   "the port 'eighty' is not a number"]  # fmt: skip
