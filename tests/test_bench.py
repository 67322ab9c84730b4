"""`kvctl bench` against a real server: client-side latencies, the server's own view, compare."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from kvtop.ctl import bench
from tests.server_harness import kvctl, start_server


@pytest.fixture(scope="module")
def server(tiny_dir):
    # a small step budget admits a few requests per step, so later ones find the shared prefixes
    # cached however the arrivals bunch up on a loaded machine
    s = start_server(tiny_dir, "--kv-cache-memory", "4MiB", "--max-num-batched-tokens", "256")
    yield s
    s.cleanup()


def test_bench_shared_prefix_reports_client_and_server_view(server, tmp_path):
    out = tmp_path / "a.json"
    proc = kvctl("bench", "--base-url", server.url, "--dataset", "shared-prefix", "--num-prompts", "24",
                 "--groups", "2", "--system-len", "64", "--question-len", "8", "--output-len", "6:10",
                 "--slo", "ttft=60000,tpot=60000", "--request-rate", "40", "--json", str(out), timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(out.read_text())
    assert rep["completed"] == 24 and rep["failed"] == 0
    assert 24 * 6 <= rep["total_output_tokens"] <= 24 * 10  # ignore_eos: exactly what was asked
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert rep[key]["p50"] > 0 and rep[key]["p99"] >= rep[key]["p50"]
    assert rep["goodput_requests_per_s"] == pytest.approx(rep["request_throughput"])
    assert rep["server"]["prefix_hit_rate"] > 0  # two system prompts shared by 24 requests
    assert rep["server"]["peak_kv_usage"] > 0
    assert "TTFT ms" in proc.stdout and "prefix hit rate" in proc.stdout
    server.wait_idle()


def test_bench_compare_two_runs(server, tmp_path):
    paths = []
    for rate, name in (("inf", "burst.json"), ("30", "paced.json")):
        p = tmp_path / name
        proc = kvctl("bench", "--base-url", server.url, "--num-prompts", "12", "--input-len", "8:32",
                     "--output-len", "4", "--request-rate", rate, "--json", str(p), timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        paths.append(p)
    proc = kvctl("bench", "compare", *map(str, paths))
    assert proc.returncode == 0, proc.stderr
    assert "output tok/s" in proc.stdout and "×" in proc.stdout


@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_bench_without_a_server_is_one_line(tmp_path):
    proc = kvctl("bench", "--base-url", "http://127.0.0.1:9", "--num-prompts", "2")
    assert proc.returncode == 2
    assert "no OpenAI-compatible server answers at http://127.0.0.1:9" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_bench_bad_arguments(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    for args, msg in (
        (["--dataset", "nope"], "use one of random, shared-prefix"),
        (["--input-len", "9:3"], "MIN <= MAX"),
        (["--slo", "p99=3"], "bad --slo part"),
        (["--scrape-interval", "-1"], "must be 0 or more"),
        (["--scrape-interval", "nan"], "must be 0 or more"),
        (["--dataset", "jsonl", "--file", str(bad)], "expected a JSON object"),
    ):
        proc = kvctl("bench", *args)
        assert proc.returncode == 2, proc.stderr
        assert msg in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # one line, no usage panel


def test_poisson_and_gamma_arrivals_have_the_asked_rate():
    for burstiness in (1.0, 0.5):
        gaps = bench.arrival_gaps(4000, request_rate=20.0, burstiness=burstiness, seed=1)
        assert np.mean(gaps) == pytest.approx(1 / 20, rel=0.08)
    # burstier arrivals spread more
    assert np.std(bench.arrival_gaps(4000, 20.0, 0.5, 1)) > np.std(bench.arrival_gaps(4000, 20.0, 1.0, 1))
    assert bench.arrival_gaps(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]


@pytest.fixture(scope="module")
def tight_server(tiny_dir):
    # 64 KiB at 512 B/token: 8 blocks of 16 tokens, where 8 requests of ~50 tokens need ~32
    s = start_server(tiny_dir, "--kv-cache-memory", "64KiB", "--stats-interval", "0.2")
    yield s
    s.cleanup()


def test_bench_peak_under_forced_preemption_is_the_servers_own(tight_server, tmp_path):
    out = tmp_path / "tight.json"
    # the URL as `kvctl serve` prints it, with /v1: the bench must not ask for /v1/v1/models
    proc = kvctl("bench", "--base-url", f"{tight_server.url}/v1", "--num-prompts", "8", "--input-len", "6:10",
                 "--output-len", "40", "--json", str(out), timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(out.read_text())
    assert rep["completed"] == 8 and rep["failed"] == 0
    frame = tight_server.stats()
    assert rep["server"]["preemptions"] == frame["scheduler"]["preemptions_total"] > 0
    # a decode step preempts only when no block is left: the cache was 100 % held at that moment
    assert frame["kv"]["peak_usage"] == 1.0
    assert rep["server"]["peak_kv_usage"] == 1.0
    assert "peak KV usage 100.0 %" in proc.stdout


def test_scrapes_do_not_wait_behind_the_load(server, monkeypatch):
    """Every connection of the load's pool held by a streaming request (one here) must not starve the
    /metrics poll: with a scrape timeout far shorter than the request, no scrape fails."""
    import asyncio

    monkeypatch.setattr(bench, "SCRAPE_TIMEOUT", 0.3)
    # long enough to outlast two scrape timeouts even on a fast machine (400 tokens took 0.48 s once the
    # server kept one OpenMP team)
    reqs = [bench.BenchRequest(prompt="one two three", max_tokens=1500)]
    model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    run = bench.run_bench(server.url, model, reqs, bench.Load(max_concurrency=1, scrape_interval=0.1))
    results, duration, view = asyncio.run(run)
    assert results[0].ok and duration > 0.6, "the request must outlast two scrape timeouts"
    assert view["failed_scrapes"] == 0 and view["peak_kv_usage"] > 0


def test_bench_base_url_forms_are_the_same_server():
    root = "http://127.0.0.1:8401"
    for pasted in (root, f"{root}/", f"{root}/v1", f"{root}/v1/", f" {root}/v1 "):
        assert bench.api_base(pasted) == root


@pytest.mark.integration  # an HTTP server on a real socket
def test_the_metrics_poller_survives_failed_scrapes():
    """A busy server that fails a few scrapes (here a plain HTTP server that answers 503, then
    times out once, then serves) must not end the sampling: the later peak is still seen."""
    import asyncio
    import contextlib
    import http.server
    import threading
    import time

    answers = iter([503, 503, "slow", 200])

    class Flaky(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            a = next(answers, 200)
            if a == "slow":
                time.sleep(6)  # beyond the poller's 5 s timeout
                a = 200
            body = b"kvtop_kv_cache_usage_perc 0.75\n" if a == 200 else b""
            with contextlib.suppress(OSError):  # the poller gave up on the slow one
                self.send_response(a)
                self.end_headers()
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=srv.serve_forever, daemon=True).start()

    async def sample() -> dict:
        peak: dict = {}
        stop = asyncio.Event()
        async with httpx.AsyncClient() as client:
            task = asyncio.create_task(
                bench._poll_server(client, f"http://127.0.0.1:{srv.server_port}", stop, peak, 0.1)
            )
            deadline = time.monotonic() + 30
            while "kv" not in peak and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            stop.set()
            await task
        return peak

    try:
        peak = asyncio.run(sample())
    finally:
        srv.shutdown()
    assert peak["failed_scrapes"] == 3
    assert peak["kv"] == 0.75
