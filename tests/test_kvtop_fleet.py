"""The fleet screen (issue #15): 24 engines on loopback — recorded vLLM, SGLang and llama.cpp pages,
one that hangs, one that drips, one that answers garbage — and a real Prometheus scraping two of
them (`kvtop --prometheus`). The screen stays live while a round waits on the hanging one, the bad
ones are marked, sorting works, Enter opens one engine's dashboard and Escape comes back."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import ClassVar
from urllib.parse import parse_qs, urlsplit

import pytest
from textual.widgets import DataTable

from kvtop.dashboard.app import KvtopApp
from kvtop.dashboard.fleet_screen import FleetScreen
from kvtop.dashboard.widgets.block_map import BlockMap
from kvtop.dashboard.widgets.header import EngineHeader
from kvtop.dashboard.widgets.help import HelpScreen
from kvtop.dashboard.widgets.sort_picker import SortScreen
from kvtop.fleet import Fleet
from kvtop.fleet.poller import Row
from kvtop.fleet.prometheus import PrometheusFleet
from kvtop.sources.prometheus import delta, histogram_quantile, parse
from tests import prometheus_server
from tests.helpers import PageHandler
from tests.helpers import widget_text as text
from tests.prometheus_server import require_prometheus
from tests.test_fleet import PAGES, Server, Targets
from tests.vllm_server import free_port

SIZE = (160, 48)


@pytest.fixture
def base():
    server = Server(("127.0.0.1", 0), type("FreshTargets", (Targets,), {"seen": set()}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


async def until(pilot, condition, what: str, timeout: float = 30.0) -> float:
    """Seconds it took for `condition` to hold."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if condition():
            return time.monotonic() - t0
        await pilot.pause(0.05)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def table_rows(screen: FleetScreen) -> list[Row]:
    """The rows in the order the table shows them."""
    table = screen.query_one(DataTable)
    by_url = {r.url: r for r in screen.rows}
    return [by_url[table.coordinate_to_cell_key((i, 0)).row_key.value] for i in range(table.row_count)]


@pytest.mark.anyio
@pytest.mark.integration  # an HTTP server on a real socket
async def test_at_80_columns_each_engine_shows_its_state_and_the_cursors_whole_error(base):
    """An 80×24 terminal over SSH: the state is the second column, so the bad engine is seen without
    scrolling sideways; the header's second line gives the engine under the cursor its whole error."""
    ok_url, garbage = f"{base}/vllm/0/metrics", f"{base}/garbage"
    app = KvtopApp(fleet=Fleet([ok_url, garbage], timeout=6.0, interval=0.5), interval=0.2)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = app.screen
        await until(pilot, lambda: {r.state for r in screen.rows} == {"ok", "not metrics"}, "a round")
        table = screen.query_one(DataTable)
        await pilot.pause(0.1)
        visible = "\n".join(table.render_line(y).text for y in range(table.size.height))
        assert "ok" in visible and "not metrics" in visible, visible
        assert table.scroll_x == 0
        await until(pilot, lambda: screen.selected() is not None, "a cursor")
        for _ in range(2):  # two rows: the cursor reaches the bad one
            if screen.selected().url != garbage:
                await pilot.press("j")
        bad = screen.selected()
        await until(pilot, lambda: f"{garbage}: not metrics: {bad.error}" in text(screen.query_one("#fleet-header")),
                    "the whole error")  # fmt: skip


@pytest.mark.anyio
@pytest.mark.integration  # an HTTP server on a real socket
async def test_a_fleet_of_24_stays_live_marks_the_bad_ones_sorts_and_drills_in(base):
    good = [f"{base}/{kind}/{n}/metrics" for n in range(7) for kind in PAGES]  # 21 engines
    bad = {f"{base}/hang": "slow", f"{base}/drip": "slow", f"{base}/garbage": "not metrics"}
    fleet = Fleet([*good, *bad], timeout=6.0, interval=0.5)  # a round waits 7 s on the hanging ones
    app = KvtopApp(fleet=fleet, interval=0.2)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen
        assert isinstance(screen, FleetScreen)
        await until(pilot, lambda: len(screen.rows) == 24 and screen.rows[0].state != "unreachable", "a round")
        states = {r.url: r.state for r in screen.rows}
        assert all(states[u] == "ok" for u in good), states
        assert {u: states[u] for u in bad} == bad
        header = text(screen.query_one("#fleet-header"))
        assert "24 engines, 21 ok, 3 not ok" in header

        # the rounds wait 7 s on the hanging targets: a key is answered well within that (a screen
        # that waited on the round would take the rest of it)
        took = []
        for _ in range(3):
            await pilot.press("o")
            took.append(await until(pilot, lambda: isinstance(app.screen, SortScreen), "the sort picker", 5))
            await pilot.press("escape")
            await until(pilot, lambda: app.screen is screen, "the picker closing", 5)
        assert max(took) < 3.0, took

        # sort: `o`, then `waiting` (two below the current column, KV usage), enter
        await pilot.press("o", "j", "j", "enter")
        await until(pilot, lambda: screen.sort == "waiting", "sorting by waiting")
        waiting = [r.waiting for r in table_rows(screen)]
        known = [w for w in waiting if w is not None]
        assert known == sorted(known, reverse=True) and waiting[len(known) :] == [None] * (24 - len(known))
        assert table_rows(screen)[0].kind == "sglang"  # its page has 2826 waiting
        await pilot.press("O")  # reversed: fewest waiting first, the bad (unknown) ones still last
        assert [r.waiting for r in table_rows(screen)][: len(known)] == sorted(known)

        # enter on the row under the cursor (it stayed on its engine through the sorts): its dashboard;
        # escape: the fleet again, still polling
        first = screen.selected()
        assert first is not None and first.state == "ok"
        await pilot.press("enter")
        await until(pilot, lambda: app.screen is app.dashboard and app.dashboard.source is not None, "the dashboard")
        assert app.dashboard.source.url == first.url
        await until(pilot, lambda: app.dashboard.source.current is not None, "the engine's frame")
        await pilot.pause(0.3)
        assert first.url in text(app.query_one(EngineHeader))
        assert "esc: back to the fleet" in text(app.query_one(EngineHeader))
        block_map = " ".join(text(app.query_one(BlockMap).query_one("#block-grid")).split())  # as read, unwrapped
        assert "exposes no block map" in block_map and "derived from the KV usage" in block_map  # a usage strip
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is screen, "the fleet screen")
        before = screen.polled_at
        await until(pilot, lambda: screen.polled_at != before, "a new round")

        await pilot.press("question_mark")  # the fleet's own keys
        await until(pilot, lambda: isinstance(app.screen, HelpScreen), "the help screen")
        assert app.screen.mode == "fleet" and {b.key for _, keys in app.screen.groups for b in keys} >= {"enter", "o"}
        await pilot.press("escape")
        await pilot.press("q")  # q quits from the fleet screen too (it is not the dashboard's q)
        await until(pilot, lambda: app.return_code == 0, "kvtop to quit")


@pytest.fixture
def prometheus(tmp_path):
    """A real Prometheus scraping three loopback targets every second: a recorded vLLM, a recorded
    SGLang, and one that answers garbage. Yields (its URL, {job: the target's scrape URL})."""
    require_prometheus()
    servers, targets = [], {}
    for job, path in (("vllm", "/vllm/0/metrics"), ("sglang", "/sglang/0/metrics"), ("garbage", "/garbage")):
        server = Server(("127.0.0.1", 0), type("FreshTargets", (Targets,), {"seen": set()}))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        targets[job] = f"http://127.0.0.1:{server.server_address[1]}{path}"
    try:
        with prometheus_server.prometheus(targets, tmp_path) as url:
            yield url, targets
    finally:
        for server in servers:
            server.shutdown()


def by_hand(page: str, earlier: str):
    """What Prometheus should find for the vLLM target, computed from the two pages it scraped."""
    from tests.test_fleet import FIXTURES

    now, then = (parse((FIXTURES / p).read_text(), 0) for p in (page, earlier))
    name = "vllm:time_to_first_token_seconds"
    p99 = histogram_quantile(0.99, delta(now.buckets[name], then.buckets[name]))
    return now, p99


@pytest.mark.anyio
async def test_the_fleet_from_a_real_prometheus(prometheus):
    url, scraped = prometheus
    fleet = PrometheusFleet(url, interval=0.5)
    app = KvtopApp(fleet=fleet, interval=0.2)
    page, p99 = by_hand(PAGES["vllm"], "vllm_real_t1.prom")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen

        def row(job: str) -> Row | None:
            return next((r for r in screen.rows if r.url == scraped[job]), None)

        # two scrapes of each target (the vLLM one's first page, then its second) give the rates
        await until(pilot, lambda: row("vllm") and row("vllm").ttft_p99 is not None, "two scrapes", 60)
        await until(pilot, lambda: row("garbage") and row("garbage").state != "unreachable", "the garbage", 30)
        vllm, sglang, garbage = row("vllm"), row("sglang"), row("garbage")
        assert len(screen.rows) == 3
        assert (vllm.state, vllm.kind, vllm.model, vllm.running) == ("ok", "vllm", "smollm2-135m", 8)
        assert vllm.kv_usage == pytest.approx(page.values["vllm:kv_cache_usage_perc"])
        assert vllm.ttft_p99 == pytest.approx(p99)  # histogram_quantile over rate(…[1m]): the same buckets
        hits, queries = page.values["vllm:prefix_cache_hits_total"], page.values["vllm:prefix_cache_queries_total"]
        assert vllm.prefix_hit_rate == pytest.approx(hits / queries)
        assert (sglang.state, sglang.kind, sglang.waiting) == ("ok", "sglang", 2826)
        assert garbage.state == "not metrics" and garbage.error
        assert "engines scraped by Prometheus" in text(screen.query_one("#fleet-header"))

        # enter on the vLLM row: its own /metrics, read by kvtop (the scrape URL Prometheus uses)
        table = screen.query_one(DataTable)
        table.move_cursor(row=table.get_row_index(scraped["vllm"]))
        await pilot.press("enter")
        await until(
            pilot,
            lambda: app.dashboard.source is not None and app.dashboard.source.current is not None,
            "the vLLM dashboard",
        )
        assert app.dashboard.source.url == scraped["vllm"] and app.dashboard.source.current["scheduler"]["running"] == 8
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is screen, "the fleet screen")


def test_a_prometheus_that_is_not_there_is_one_row_saying_so():
    fleet = PrometheusFleet(f"http://127.0.0.1:{free_port()}", timeout=1.0)
    try:
        rows = fleet.poll()
    finally:
        fleet.close()
    assert len(rows) == 1 and rows[0].state == "unreachable" and rows[0].error.startswith("Prometheus: ConnectError")


class FakePrometheus(PageHandler):
    """Prometheus' HTTP API as far as `PrometheusFleet` reads it: one vLLM target, and every
    figure's query answered with `value` (what Prometheus answers for a target whose page says
    NaN, +Inf, -5 or 1e308); with `drip`, /api/v1/targets comes a byte every 0.2 s."""

    value = "0"
    drip = False
    clock: ClassVar[object] = {"resultType": "scalar", "result": [1e9, "1e9"]}  # what time() answers

    def do_GET(self):
        url = urlsplit(self.path)
        if url.path == "/api/v1/targets":
            body = {"status": "success", "data": {"activeTargets": [
                {"scrapeUrl": "http://e:8000/metrics", "health": "up", "labels": {"instance": "e:8000"}}]}}  # fmt: skip
            if self.drip:
                self._drip(json.dumps(body).encode())
                return
        elif (promql := parse_qs(url.query)["query"][0]) == "time()":  # the instant a round is read at
            body = {"status": "success", "data": self.clock}
        else:
            value = "1" if promql.startswith("count by") else self.value  # the model query counts series
            found = [{"metric": {"instance": "e:8000", "model_name": "m"}, "value": [0, value]}]
            body = {"status": "success", "data": {"resultType": "vector", "result": found if "vllm:" in promql else []}}
        self.reply(200, json.dumps(body).encode(), "application/json")

    def _drip(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(OSError):  # until the client gives up
            for byte in body:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.2)


@pytest.fixture
def fake_prometheus():
    def start(**behaviour) -> str:
        server = Server(("127.0.0.1", 0), type("Fake", (FakePrometheus,), behaviour))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    servers: list[Server] = []
    yield start
    for server in servers:
        server.shutdown()


@pytest.mark.integration  # an HTTP server on a real socket
def test_figures_prometheus_answers_that_no_engine_can_have_are_left_out(fake_prometheus):
    for value in ("NaN", "+Inf", "-Inf", "-5", "1e308"):
        fleet = PrometheusFleet(fake_prometheus(value=value), timeout=60.0)  # a ceiling: it answers at once
        try:
            (row,) = fleet.poll()
        finally:
            fleet.close()
        assert (row.state, row.kind, row.model) == ("ok", "vllm", "m")
        figures = (row.kv_usage, row.running, row.waiting, row.preemptions_per_s, row.prefix_hit_rate, row.ttft_p99)
        assert figures == (None,) * 6, value  # `-` on the screen, never -5 running or 1e310 %


@pytest.mark.integration  # an HTTP server on a real socket
def test_a_prometheus_whose_clock_answer_is_odd_is_one_unreachable_row(fake_prometheus):
    odd = ({"resultType": "scalar", "result": []}, {"resultType": "scalar", "result": ["x", "y"]},
           {"resultType": "vector", "result": []}, {"resultType": "scalar", "result": None}, [])  # fmt: skip
    for clock in odd:
        fleet = PrometheusFleet(fake_prometheus(clock=clock), timeout=60.0)  # a ceiling: it answers at once
        try:
            (row,) = fleet.poll()
        finally:
            fleet.close()
        assert row.state == "unreachable" and row.error.startswith("Prometheus: ValueError"), clock


@pytest.mark.integration  # an HTTP server on a real socket
def test_a_prometheus_that_answers_a_byte_at_a_time_is_given_up_on_at_the_timeout(fake_prometheus):
    fleet = PrometheusFleet(fake_prometheus(drip=True), timeout=1.0)
    t0 = time.monotonic()
    try:
        (row,) = fleet.poll()
    finally:
        fleet.close()
    assert time.monotonic() - t0 < 15  # the answer would take a minute; each byte comes within the timeout
    assert row.state == "unreachable" and "did not arrive in 1 s" in row.error
