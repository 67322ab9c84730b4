"""kvtop against a real vLLM (the CPU build `make vllm` installs) on SmolLM2-135M: the metrics source's
frame and kvtop's dashboard must agree with vLLM's own /metrics.

Where vLLM is not installed these are skipped, saying so — except in CI (`CI=true`), where `.ci/run`
installs it first and its absence is a failure. vLLM takes about a minute to start on 2 idle cores.
"""

from __future__ import annotations

import os
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtop.sources.metrics import MetricsSource
from tests.helpers import widget_text as text
from tests.server_harness import kvctl, short_tmpdir
from tests.vllm_server import vllm_server, vllm_venv

NUM_BLOCKS = 64  # of 128 tokens: a small load shows in the KV usage


@pytest.fixture(scope="module", autouse=True)
def vllm_installed() -> None:
    if vllm_venv() is None:
        why = "vLLM is not installed: run `make vllm` (it goes to $KVTOP_CACHE/venv-vllm)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{why}; in CI (CI=true) these tests must run: .ci/run installs it")
        pytest.skip(why)


@pytest.fixture(scope="module")
def vllm_url(smollm2_dir):
    tmp = short_tmpdir("vllm")
    try:
        with vllm_server(smollm2_dir, tmp / "vllm.log", "--num-gpu-blocks-override", str(NUM_BLOCKS)) as url:
            yield url
    except RuntimeError as exc:
        pytest.fail(str(exc))


def samples(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


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
    assert frame["kv"]["block_size"] == 128 and frame["kv"]["num_blocks"] == NUM_BLOCKS  # from cache_config_info
    assert frame["latency"]["ttft"]["count"] == truth["vllm:time_to_first_token_seconds_count"] == before + 4
    assert frame["prefix"]["query_tokens"] == truth["vllm:prefix_cache_queries_total"]
    assert frame["prefix"]["hit_tokens"] == truth["vllm:prefix_cache_hits_total"] > 0  # the shared prompt hit
    assert "blocks" not in frame["kv"] and "vLLM exposes no block map" in frame["unavailable"]

    r = kvctl("status", "--url", vllm_url, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "vLLM exposes no block map" in r.stdout and "smollm2-135m" in r.stdout


class Load:
    """`clients` threads sending completions (64 tokens, ignore_eos) until stopped."""

    def __init__(self, url: str, clients: int = 4) -> None:
        import openai

        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        while not self.stop.is_set():
            self.client.completions.create(model="smollm2-135m", prompt=f"Tell me a long story, number {i}. " * 20,
                                           max_tokens=64, extra_body={"ignore_eos": True})  # fmt: skip

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(300)


async def until(pilot, condition, what: str, timeout: float = 120.0) -> None:
    for _ in range(int(timeout * 10)):
        if condition():
            return
        await pilot.pause(0.1)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@pytest.mark.anyio
async def test_kvtop_on_a_real_vllm_under_load_shows_its_kv_usage_and_no_drain_key(vllm_url):
    from kvtop.dashboard.app import KvtopApp
    from kvtop.dashboard.widgets import fmt
    from kvtop.dashboard.widgets.block_map import BlockMap
    from kvtop.dashboard.widgets.kv_panel import KVPanel

    load = Load(vllm_url)
    app = KvtopApp(MetricsSource(vllm_url, interval=0.5, timeout=10))
    try:
        async with app.run_test(size=(160, 48)) as pilot:
            await until(pilot, lambda: (app.source.current or {}).get("scheduler", {}).get("running"), "a busy frame")
            agreed = None
            for _ in range(40):  # usage moves as sequences grow: compare a frame read between two equal pages
                truth = samples(vllm_url)["vllm:kv_cache_usage_perc"]
                seen = app.source.current["ts"]
                await until(pilot, lambda s=seen: app.source.current["ts"] != s, "the next scrape")
                frame = app.source.current
                if samples(vllm_url)["vllm:kv_cache_usage_perc"] == truth and truth > 0:
                    agreed = frame["kv"]["usage"], truth
                    break
            assert agreed is not None, "vLLM's KV usage never held still for one scrape"
            assert agreed[0] == pytest.approx(agreed[1])
            kv_line = lambda: text(app.query_one(KVPanel)).splitlines()[0]  # noqa: E731
            await until(pilot, lambda: kv_line().endswith(fmt.pct(app.source.current["kv"]["usage"])), "the KV panel")
            assert "vLLM exposes no block map" in text(app.query_one(BlockMap).query_one("#block-grid"))
            assert not {"d", "r", "e", "E"} & {k for k, b in app.active_bindings.items() if b.enabled}
            await pilot.press("d")  # no drain dialog: vLLM has no control over HTTP
            await pilot.pause(0.2)
            assert app.screen is app.base
    finally:
        load.close()
