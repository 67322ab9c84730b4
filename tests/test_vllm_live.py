"""kvtop against a real vLLM (the CPU build `make vllm` installs) on SmolLM2-135M: the metrics source's
frame and kvtop's dashboard must agree with vLLM's own /metrics.

One server for the module, with 20 KV blocks of 128 tokens (`--num-gpu-blocks-override`): four
clients fit; twelve (three blocks each by the end of a request) make it preempt, and the
dashboard and `kvctl status --url` must say KV-bound or preempting, never a free-block count
vLLM does not serve, and preempt/s must be the counter's own rate over the same 30 s.
tests/test_vllm_capped.py has the other configuration, a sequence cap.

Where vLLM is not installed these are skipped, saying so — except in CI (`CI=true`), where `.ci/run`
installs it first and its absence is a failure. vLLM takes about a minute to start on 2 idle cores.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import pytest

from kvtop.rates import RATE_WINDOW_S
from kvtop.sources.metrics import MetricsSource
from tests.helpers import until
from tests.helpers import widget_text as text
from tests.server_harness import kvctl, short_tmpdir
from tests.vllm_server import CounterLog, Load, require_vllm, samples, vllm_server

NUM_BLOCKS = 20  # of 128 tokens (vLLM's least for --max-model-len 2048 is 17): 12 clients preempt
PREEMPTING_CLIENTS = 12
SLACK_S = 1.0  # where a frame's window ends, against vLLM's own counter: a scrape's latency at most


@pytest.fixture(scope="module", autouse=True)
def vllm_installed() -> None:
    require_vllm()


@pytest.fixture(scope="module")
def vllm_url(smollm2_dir):
    tmp = short_tmpdir("vllm")
    try:
        with vllm_server(smollm2_dir, tmp / "vllm.log", "--num-gpu-blocks-override", str(NUM_BLOCKS)) as url:
            yield url
    except RuntimeError as exc:
        pytest.fail(str(exc))


def test_the_frame_agrees_with_vllms_own_metrics(vllm_url):
    import openai

    client = openai.OpenAI(base_url=f"{vllm_url}/v1", api_key="none", max_retries=0, timeout=120)
    before = samples(vllm_url).get("vllm:time_to_first_token_seconds_count", 0)
    shared = "You are a terse assistant. Answer in one word. " * 16  # > one 128-token block: a prefix hit
    for i in range(4):
        client.completions.create(model="smollm2-135m", prompt=shared + f"Question {i}?", max_tokens=8)
    source = MetricsSource(vllm_url, timeout=10)
    try:
        frame = source.poll()
    finally:
        source.close()
    truth = samples(vllm_url)
    assert frame["engine"]["kind"] == "vllm" and frame["engine"]["model"] == "smollm2-135m"
    assert frame["scheduler"]["running"] == truth["vllm:num_requests_running"] == 0  # idle after the load
    assert frame["kv"]["usage"] == pytest.approx(truth["vllm:kv_cache_usage_perc"])
    assert frame["kv"]["block_size"] == 128 and frame["kv"]["num_blocks"] == NUM_BLOCKS - 1  # less the null block
    assert frame["latency"]["ttft"]["count"] == truth["vllm:time_to_first_token_seconds_count"] == before + 4
    assert frame["prefix"]["query_tokens"] == truth["vllm:prefix_cache_queries_total"]
    assert frame["prefix"]["hit_tokens"] == truth["vllm:prefix_cache_hits_total"] > 0  # the shared prompt hit
    assert "blocks" not in frame["kv"] and "vLLM exposes no block map" in frame["unavailable"]

    r = kvctl("status", "--url", vllm_url, "--window", "2", timeout=60)
    assert r.returncode == 0, r.stderr
    assert "vLLM exposes no block map" in r.stdout and "smollm2-135m" in r.stdout
    assert re.search(r"diagnosis\s+nothing stands out", r.stdout), r.stdout  # idle: nothing to say


@pytest.mark.anyio
async def test_kvtop_on_a_real_vllm_under_load_shows_its_kv_usage_and_no_drain_key(vllm_url):
    from kvtop import fmt
    from kvtop.dashboard.app import KvtopApp
    from kvtop.dashboard.widgets.block_map import BlockMap
    from kvtop.dashboard.widgets.kv_panel import KVPanel

    load = Load(vllm_url)
    app = KvtopApp(MetricsSource(vllm_url, interval=0.5, timeout=10))
    try:
        async with app.run_test(size=(160, 48)) as pilot:
            await until(
                pilot,
                lambda: (app.dashboard.source.current or {}).get("scheduler", {}).get("running"),
                "a busy frame",
                120,
            )
            agreed = None
            for _ in range(40):  # usage moves as sequences grow: compare a frame read between two equal pages
                truth = samples(vllm_url)["vllm:kv_cache_usage_perc"]
                seen = app.dashboard.source.current["ts"]
                await until(pilot, lambda s=seen: app.dashboard.source.current["ts"] != s, "the next scrape", 60)
                frame = app.dashboard.source.current
                if samples(vllm_url)["vllm:kv_cache_usage_perc"] == truth and truth > 0:
                    agreed = frame["kv"]["usage"], truth
                    break
            assert agreed is not None, "vLLM's KV usage never held still for one scrape"
            assert agreed[0] == pytest.approx(agreed[1])
            kv_line = lambda: text(app.query_one(KVPanel)).splitlines()[0]  # noqa: E731
            await until(
                pilot,
                lambda: kv_line().endswith(fmt.pct(app.dashboard.source.current["kv"]["usage"])),
                "the KV panel",
                60,
            )
            strip = " ".join(text(app.query_one(BlockMap).query_one("#block-grid")).split())
            assert "vLLM exposes no block map" in strip and "derived from the KV usage" in strip
            assert not {"d", "r", "e", "E"} & {k for k, b in app.active_bindings.items() if b.enabled}
            await pilot.press("d")  # no drain dialog: vLLM has no control over HTTP
            await pilot.pause(0.2)
            assert app.screen is app.dashboard
    finally:
        load.close()


def glance(app) -> str:
    """The header's third line: running, waiting and the first finding."""
    from kvtop.dashboard.widgets.header import EngineHeader

    lines = text(app.query_one(EngineHeader)).splitlines()
    return lines[2] if len(lines) > 2 else ""


def shown_rate(app, label: str) -> float | None:
    """The figure the throughput panel shows beside `label` (None for –)."""
    from kvtop.dashboard.widgets.throughput import ThroughputPanel

    for line in text(app.query_one(ThroughputPanel)).splitlines():
        if line.startswith(label):
            figure = line[len(label) :].split()[0]
            return None if figure == "–" else float(figure)
    raise AssertionError(f"no {label} row in the throughput panel")


async def paused_view(pilot, app) -> tuple[float, float | None]:
    """Pause the dashboard (space) and, once no scrape is in flight, the frame it shows: (its ts,
    preempt/s as drawn). Space again resumes."""
    await pilot.press("space")
    await until(pilot, lambda: app.dashboard.paused and all(w.is_finished for w in app.workers if w.group == "poll"),
                "the dashboard to pause", 60)  # fmt: skip
    app.dashboard.redraw()  # the panels from the frame kept, whatever landed as it paused
    return app.dashboard.source.current["ts"], shown_rate(app, "preempt/s")


@pytest.mark.anyio
async def test_a_preempting_vllm_is_kv_bound_and_preempt_per_s_is_its_counters_rate(vllm_url):
    """Twelve clients on 19 usable blocks: vLLM preempts. The header says KV-bound or preempting
    (never '0 free blocks', never a sequence cap), the events panel lists the preemptions derived
    from vLLM's counter, preempt/s is that counter's own rate over the same 30 s within 25 %, and
    `kvctl status --url` says the same."""
    from kvtop.dashboard.app import KvtopApp
    from kvtop.dashboard.widgets.events import EventsPanel

    load = Load(vllm_url, clients=PREEMPTING_CLIENTS)
    truth = CounterLog(vllm_url, "vllm:num_preemptions_total")
    app = KvtopApp(MetricsSource(vllm_url, interval=1.0, timeout=10))
    seen: list[str] = []
    try:
        async with app.run_test(size=(160, 48)) as pilot:

            def kv_finding() -> bool:
                seen.append(glance(app))
                return "KV-bound" in seen[-1] or "preempting" in seen[-1]

            await until(pilot, kv_finding, "a KV-bound or preempting finding in the header", 300)
            events = lambda: text(app.query_one(EventsPanel))  # noqa: E731
            await until(pilot, lambda: "derived: " in events() and "preempted" in events(), "a derived event", 120)
            started = app.dashboard.source.history()[0]["ts"]
            await until(
                pilot, lambda: app.dashboard.source.current["ts"] - started > RATE_WINDOW_S + 2, "a full window", 120
            )
            compared = None
            for _ in range(30):  # a frame whose window saw preemptions
                ts, shown = await paused_view(pilot, app)
                seen.append(glance(app))
                begin = ts - RATE_WINDOW_S
                # the counter's own increase over the same 30 s, read straight from vLLM every 0.25 s;
                # where the window's ends fall between two of its readings is uncertain by a scrape's
                # latency, so the truth is a range: the fewest and the most preemptions it can hold
                await until(pilot, lambda t=ts: bool(truth.readings) and truth.readings[-1][0] > t + SLACK_S,
                            "vLLM's counter read past the frame", 30)  # fmt: skip
                if None not in (truth.at(begin - SLACK_S), truth.at(ts - SLACK_S)):
                    fewest = (truth.at(ts - SLACK_S) - truth.at(begin + SLACK_S)) / RATE_WINDOW_S
                    most = (truth.at(ts + SLACK_S) - truth.at(begin - SLACK_S)) / RATE_WINDOW_S
                    if most > 0:
                        compared = shown, fewest, most
                        break
                await pilot.press("space")  # resume: the next frame
                await until(pilot, lambda t=ts: app.dashboard.source.current["ts"] > t, "the next scrape", 60)
            assert compared is not None, f"no window with a preemption: {truth.readings[-20:]}"
            shown, fewest, most = compared
            print(f"preempt/s shown {shown}, vLLM's counter over the same {RATE_WINDOW_S:.0f} s "
                  f"{fewest:.3f}–{most:.3f}/s")  # fmt: skip
            assert shown is not None and 0.75 * fewest <= shown <= 1.25 * most, compared
    finally:
        truth.close()
    try:
        assert not [line for line in seen if "free blocks" in line or "sequence cap" in line], seen
        for _ in range(5):  # 10 s of scrapes: one that held no preemption and no full cache says nothing
            r = kvctl("status", "--url", vllm_url, timeout=120)
            assert r.returncode == 0, r.stderr
            said = " ".join(r.stdout.split())  # as read: the table wraps a finding at the terminal's width
            if "KV-bound" in said or "preempting" in said:
                break
        assert "KV-bound" in said or "preempting" in said, r.stdout
        assert "free blocks" not in said and "sequence cap" not in said, r.stdout
        assert re.search(r"throughput .* \(over \d+ s\)", said), r.stdout  # not a one-second rate
    finally:
        load.close()


GRAFANA = Path(__file__).resolve().parents[1] / "docs" / "grafana-dashboard.json"


def grafana_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of docs/grafana-dashboard.json, its variables set as
    Grafana would for this server: the dashboard's default prefix, the model, a one-minute rate."""
    dashboard = json.loads(GRAFANA.read_text())
    prefix = next(v for v in dashboard["templating"]["list"] if v["name"] == "prefix")["current"]["value"]
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("${prefix}", prefix).replace("$model_name", "smollm2-135m")
            out.append((panel["title"], expr.replace("$__rate_interval", "1m")))
    return out


def test_every_grafana_query_returns_data_from_a_real_prometheus_scraping_vllm(vllm_url, tmp_path):
    """Each query of the Grafana dashboard, asked of a real Prometheus that scrapes this vLLM
    every second under a load, answers a number for this server's instance (one series per
    instance: several servers are several lines)."""
    from tests.prometheus_server import prometheus, query, require_prometheus

    require_prometheus()
    queries = grafana_queries()
    assert len(queries) >= 20 and not any("time_per_output_token_seconds_bucket" in q and "request_" not in q
                                          for _, q in queries)  # fmt: skip
    instance = vllm_url.removeprefix("http://")
    load = Load(vllm_url)
    try:
        with prometheus({"vllm": f"{vllm_url}/metrics"}, tmp_path) as prom:
            missing = queries
            deadline = time.monotonic() + 300
            while missing and time.monotonic() < deadline:  # until each has seen requests finish in its minute
                missing = [(title, q) for title, q in missing if not _answers(query(prom, q), instance)]
                time.sleep(1)
            assert not missing, f"no data for: {missing}"
            (series,) = query(prom, 'count by (model_name) (vllm:num_requests_running{model_name="smollm2-135m"})')
            assert series["metric"]["model_name"] == "smollm2-135m"  # the dashboard's model variable
    finally:
        load.close()


def _answers(result: list[dict], instance: str) -> bool:
    """A finite number for `instance` in an instant query's result."""
    return any(s["metric"].get("instance") == instance and math.isfinite(float(s["value"][1])) for s in result)
