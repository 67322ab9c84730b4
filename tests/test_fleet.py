"""The fleet poller: 24 targets polled at once, among them one that hangs, one that drips a byte at a time
(its reads never time out) and one that answers garbage. Each round ends in bounded time, the bad
targets are marked, the good ones carry their figures, and rates come from a target's own scrapes."""

from __future__ import annotations

import http.server
import json
import os
import threading
import time
from pathlib import Path
from typing import ClassVar

import pytest

from kvtop.fleet import Fleet

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"
PAGES = {"vllm": "vllm_real_t2.prom", "sglang": "sglang.prom", "llamacpp": "llamacpp.prom"}
FIRST = {"vllm": "vllm_real_t1.prom"}  # a vLLM's first page: before 8 more requests came in


class Targets(http.server.BaseHTTPRequestHandler):
    """/<kind>/<n>/metrics serves a recorded page; /hang, /drip and /garbage misbehave."""

    seen: ClassVar[set[str]] = set()  # paths asked before (each server gets its own subclass)

    def do_GET(self):
        if self.path == "/hang":
            time.sleep(60)
            return
        if self.path == "/drip":  # headers, then a byte every 0.3 s: no single read ever times out
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(100):
                self.wfile.write(b"#")
                self.wfile.flush()
                time.sleep(0.3)
            return
        kind = self.path.strip("/").split("/")[0]
        if kind == "garbage":
            body = b"<html>502 \x00\xff {{"
        else:
            body = (
                FIXTURES / (FIRST.get(kind, PAGES[kind]) if self.path not in self.seen else PAGES[kind])
            ).read_bytes()
            self.seen.add(self.path)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class Server(http.server.ThreadingHTTPServer):
    request_queue_size = 128  # 24 engines connect at once; the default backlog of 5 would drop SYNs
    daemon_threads = True


@pytest.fixture
def base():
    server = Server(("127.0.0.1", 0), type("FreshTargets", (Targets,), {"seen": set()}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.integration  # an HTTP server on a real socket
def test_a_fleet_round_is_bounded_and_marks_the_bad_targets(base):
    good = [f"{base}/{kind}/{n}/metrics" for n in range(7) for kind in PAGES]  # 21 engines
    urls = [*good, f"{base}/hang", f"{base}/drip", f"{base}/garbage"]
    fleet = Fleet(urls, timeout=1.5)
    try:
        for _ in range(2):  # the second round too: a target still stuck from the first never blocks it
            t0 = time.monotonic()
            rows = fleet.poll()
            assert time.monotonic() - t0 < 10  # bounded by the timeout, not by the slowest target
            by_url = {r.url: r for r in rows}
            assert len(rows) == 24
            assert all(by_url[u].state == "ok" for u in good), [(r.url, r.error) for r in rows if r.state != "ok"]
            hang = by_url[f"{base}/hang"]  # its read timeout, or the round's deadline on a loaded machine
            assert hang.state == "slow" and "no answer in 1.5 s" in hang.error
            assert by_url[f"{base}/drip"].state == "slow"
            garbage = by_url[f"{base}/garbage"]
            assert garbage.state == "not metrics" and "not Prometheus text" in garbage.error
        vllm = by_url[f"{base}/vllm/0/metrics"]
        assert (vllm.kind, vllm.model, vllm.running) == ("vllm", "smollm2-135m", 8)
        assert vllm.kv_usage == pytest.approx(0.024793388429752095)
        assert vllm.preemptions_per_s == 0.0  # two scrapes of the same page: no new preemption
        assert vllm.prefix_hit_rate == pytest.approx(896 / 2194)
        assert vllm.ttft_p99 is None  # two rounds seconds apart: too short a minute for a P99 that holds still
        llama = by_url[f"{base}/llamacpp/0/metrics"]
        assert (
            llama.kind == "llamacpp" and llama.ttft_p99 is None and llama.running == 1
        )  # llama.cpp serves no histogram
        assert llama.preemptions_per_s is None  # nor preemptions: absent, not 0
    finally:
        fleet.close()


def test_a_bad_url_in_the_list_is_refused_up_front():
    with pytest.raises(ValueError, match="not an http"):
        Fleet(["http://127.0.0.1:1", "ftp://x/y"])


@pytest.mark.integration  # a kvctl process: seconds of start-up each
def test_kvctl_status_with_several_urls_prints_one_line_per_engine(base):
    from tests.server_harness import kvctl

    urls = [f"{base}/vllm/0/metrics", f"{base}/sglang/0/metrics", f"{base}/llamacpp/0/metrics", f"{base}/garbage"]
    r = kvctl("status", *[a for u in urls for a in ("--url", u)], "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    rows = {row["url"]: row for row in json.loads(r.stdout)}
    assert [rows[u]["kind"] for u in urls[:3]] == ["vllm", "sglang", "llamacpp"]
    assert rows[urls[0]]["running"] == 8 and rows[urls[1]]["waiting"] == 2826
    assert rows[urls[3]]["state"] == "not metrics"
    r = kvctl("status", *[a for u in urls for a in ("--url", u)], timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert "4 engines" in r.stdout and "not Prometheus text" in r.stdout


@pytest.mark.integration  # a kvctl process: seconds of start-up each
def test_kvctl_status_fails_when_no_engine_of_the_fleet_answers():
    from tests.server_harness import kvctl

    r = kvctl("status", "--url", "http://127.0.0.1:1", "--url", "http://127.0.0.1:2", timeout=60)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == "kvctl: no engine answered"
    assert "Traceback" not in r.stderr
