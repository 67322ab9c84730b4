"""/metrics as Prometheus and vLLM dashboards read it (issue #14), parsed with prometheus_client's
own parser from a real `kvctl serve` on the tiny model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_harness import start_server

SHARED = "You are a terse assistant. Answer in one short line, without any preamble. " * 3
# vLLM V1's names, as kvtop_ + the same suffix
VLLM_NAMES = {
    "num_requests_running": "gauge", "num_requests_waiting": "gauge", "kv_cache_usage_perc": "gauge",
    "prefix_cache_queries": "counter", "prefix_cache_hits": "counter", "num_preemptions": "counter",
    "prompt_tokens": "counter", "generation_tokens": "counter", "request_success": "counter",
    "time_to_first_token_seconds": "histogram", "inter_token_latency_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram", "request_queue_time_seconds": "histogram",
    "request_prompt_tokens": "histogram", "request_generation_tokens": "histogram",
    "iteration_tokens_total": "histogram", "request_params_n": "histogram", "request_params_max_tokens": "histogram",
    "request_max_num_generation_tokens": "histogram", "request_prefill_time_seconds": "histogram",
    "request_decode_time_seconds": "histogram", "request_inference_time_seconds": "histogram",
    "request_time_per_output_token_seconds": "histogram", "cache_config_info": "gauge",
}  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_dir):
    s = start_server(tiny_dir, "--kv-cache-memory", "1MiB", "--max-num-seqs", "4")
    yield s
    s.cleanup()


def scrape(server) -> dict:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict, name: str, suffix: str = "", **labels) -> float:
    family = families[name]
    return sum(s.value for s in family.samples if s.name == name + suffix and labels.items() <= s.labels.items())


def test_every_vllm_name_with_model_name_and_engine_labels(server):
    client = server.openai()
    client.completions.create(model=server.model, prompt="Hello", max_tokens=3, n=2)
    families = scrape(server)
    for suffix, kind in VLLM_NAMES.items():
        assert families["kvtop_" + suffix].type == kind, suffix
    for name, family in families.items():
        if name.startswith("kvtop_"):
            for s in family.samples:
                assert s.labels["model_name"] == server.model and s.labels["engine"] == "0", s
    assert any(name.startswith("process_") for name in families)  # prometheus-client's default collectors
    assert value(families, "process_resident_memory_bytes") > 0
    info = families["kvtop_cache_config_info"].samples[0]
    assert info.value == 1 and info.labels["block_size"] == "16" and info.labels["enable_prefix_caching"] == "True"
    assert int(info.labels["num_gpu_blocks"]) == value(families, "kvtop_kv_cache_num_blocks")
    # n=2: one observation of n=2, two of each per-request histogram
    assert value(families, "kvtop_request_params_n", "_bucket", le="1.0") == 0
    assert value(families, "kvtop_request_params_n", "_bucket", le="2.0") == 1
    assert value(families, "kvtop_request_generation_tokens", "_count") == 2
    assert value(families, "kvtop_request_generation_tokens", "_sum") == 6
    assert value(families, "kvtop_request_params_max_tokens", "_sum") == 6
    assert value(families, "kvtop_request_max_num_generation_tokens", "_sum") == 3
    assert value(families, "kvtop_request_decode_time_seconds", "_count") == 2
    assert value(families, "kvtop_iteration_tokens_total", "_count") >= 3


def test_prompt_tokens_count_whole_prompts_like_vllm(server):
    client = server.openai()
    before = scrape(server)
    usages = [client.completions.create(model=server.model, prompt=SHARED + q, max_tokens=2).usage
              for q in ("First?", "Second?")]  # fmt: skip
    after = scrape(server)
    hits = value(after, "kvtop_prefix_cache_hits", "_total") - value(before, "kvtop_prefix_cache_hits", "_total")
    assert hits >= 32  # the second prompt reused the first's blocks
    added = value(after, "kvtop_prompt_tokens", "_total") - value(before, "kvtop_prompt_tokens", "_total")
    assert added == sum(u.prompt_tokens for u in usages)  # prefix hits included, as vLLM's
    computed = value(after, "kvtop_prompt_tokens_computed", "_total") - value(
        before, "kvtop_prompt_tokens_computed", "_total"
    )
    assert computed == added - hits


def test_saved_prefill_seconds_is_a_counter_that_never_goes_down(server):
    client = server.openai()
    seen = []
    for i in range(4):
        client.completions.create(model=server.model, prompt=SHARED + f"Question {i}?" * (i + 1), max_tokens=2)
        families = scrape(server)
        assert families["kvtop_prefix_cache_saved_prefill_seconds"].type == "counter"
        seen.append(value(families, "kvtop_prefix_cache_saved_prefill_seconds", "_total"))
    assert seen == sorted(seen) and seen[-1] > 0


def test_grafana_dashboard_reads_only_names_kvtop_and_vllm_share(server):
    """docs/grafana-dashboard.json swaps `prefix` between kvtop_ and vllm:; each series it queries
    must exist here under kvtop_ and be one of the names that mean the same as vLLM's."""
    server.openai().completions.create(model=server.model, prompt="Hello", max_tokens=2)
    dashboard = json.loads((Path(__file__).parents[1] / "docs" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\$\{prefix\}(\w+)", e)}
    assert len(used) >= 15
    samples = {s.name for f in scrape(server).values() for s in f.samples}
    for name in used:
        assert "kvtop_" + name in samples, name
        base = re.sub(r"_(bucket|sum|count|total)$", "", name)
        assert base in VLLM_NAMES or base + "_total" in VLLM_NAMES, name
    assert all('model_name="$model_name"' in e for e in exprs)


def test_an_observation_on_a_bucket_bound_counts_in_that_bucket_as_prometheus_le_does():
    """A value equal to a bound falls in that bound's bucket (`le`), one just past it in the next, one
    past the last bound in +Inf: what a histogram_quantile over the exported buckets expects."""
    from engine.telemetry.metrics import ITL_BUCKETS, Histogram

    h = Histogram(ITL_BUCKETS)
    for v in (0.0, ITL_BUCKETS[0], ITL_BUCKETS[3], ITL_BUCKETS[3] + 1e-9, ITL_BUCKETS[-1] + 1.0):
        h.observe(v, now=1.0)
    counts = h.counts_only()["counts"]
    assert counts[0] == 2 and counts[3] == 1 and counts[4] == 1 and counts[-1] == 1
    assert sum(counts) == h.count == 5
