"""The OpenAI API of a real `kvctl serve` on the tiny model, driven by the official client."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.telemetry.metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS
from kvtop.protocol.snapshot import read_snapshot
from tests.server_harness import API_KEY, start_server

# 512 KiB of KV at 512 B/token holds 1024 tokens, below the tiny model's 2048 positions: both
# "too long for the model" and "too long for the KV cache" are reachable.
KV_TOKENS = 1024
SHARED = "You are a terse assistant. Answer in one short line, without any preamble or apology. " * 3


@pytest.fixture(scope="module")
def server(tiny_dir):
    s = start_server(tiny_dir, "--kv-cache-memory", "512KiB", "--max-num-seqs", "4", "--max-queue", "2",
                     "--snapshot-on", "queue-full", "--stats-interval", "0.2", api_key=API_KEY,
                     env={"KVTOP_FAULT_INJECT": "token=31337"})  # a step carrying token 31337 raises  # fmt: skip
    yield s
    s.cleanup()


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"  # no key needed


def test_completion_matches_the_offline_engine(server, client, tiny_llm):
    from engine import SamplingParams

    prompt = "The quick brown fox"
    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    want = tiny_llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_n_seed_stop_and_token_prompts(server, client):
    kw = dict(model=server.model, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=7, n=3,
              extra_body={"ignore_eos": True})  # fmt: skip
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # seed + i per choice: not three copies
    greedy = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text  # fmt: skip
    stop = greedy[len(greedy) // 2 :][:3]
    cut = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=10, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True}).choices[0]  # fmt: skip
    assert cut.finish_reason == "stop"
    assert cut.text == greedy[: greedy.index(stop)]
    # a list of prompts, and token ids
    r = client.completions.create(model=server.model, prompt=[[5, 6, 7, 8], [9, 10, 11]], max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert len(r.choices) == 2 and r.usage.prompt_tokens == 7 and r.usage.completion_tokens == 6


def test_chat_stream_equals_chat(server, client):
    messages = [{"role": "system", "content": SHARED}, {"role": "user", "content": "Name a colour. ☀️ 你好"}]
    kw = dict(model=server.model, messages=messages, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])
    assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens


def test_usage_reports_cached_prefix_tokens(server, client):
    messages = [{"role": "system", "content": SHARED}, {"role": "user", "content": "Question one?"}]
    first = client.chat.completions.create(model=server.model, messages=messages, max_tokens=2)
    messages[1]["content"] = "Another question?"
    second = client.chat.completions.create(model=server.model, messages=messages, max_tokens=2)
    shared_tokens = second.usage.prompt_tokens - 8  # the user turn differs at its end
    assert first.usage.prompt_tokens > 48
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 32 and cached % 16 == 0 and cached <= shared_tokens
    client.completions.create(model=server.model, prompt=SHARED + "First.", max_tokens=2)
    stream = client.completions.create(model=server.model, prompt=SHARED + "Second.", max_tokens=2, stream=True,
                                       stream_options={"include_usage": True})  # fmt: skip
    usage = [c.usage for c in stream if c.usage][-1]
    assert usage.prompt_tokens_details.cached_tokens >= 32


def test_logprobs(server, client):
    r = client.completions.create(model=server.model, prompt="Hello", max_tokens=4, temperature=0, logprobs=1,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 4 and all(x <= 0 for x in lp.token_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    c = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                       logprobs=True, top_logprobs=1, temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and content[0].top_logprobs[0].token == content[0].token


def test_metrics_parse_with_prometheus(server, client):
    client.completions.create(model=server.model, prompt=SHARED, max_tokens=2)
    client.completions.create(model=server.model, prompt=SHARED, max_tokens=2)  # a prefix hit
    text = httpx.get(f"{server.url}/metrics").text  # no API key needed, as vLLM
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("kvtop_num_requests_running", "kvtop_num_requests_waiting", "kvtop_kv_cache_usage_perc",
                 "kvtop_prefix_cache_queries", "kvtop_prefix_cache_hits", "kvtop_num_preemptions",
                 "kvtop_time_to_first_token_seconds", "kvtop_inter_token_latency_seconds",
                 "kvtop_e2e_request_latency_seconds", "kvtop_kv_cache_blocks", "kvtop_cpu_cache_usage_perc",
                 "kvtop_prefix_cache_saved_prefill_seconds", "kvtop_engine_draining", "kvtop_engine_state"):  # fmt: skip
        assert name in families, name
    blocks = {s.labels["state"]: s.value for s in families["kvtop_kv_cache_blocks"].samples}
    assert set(blocks) == {"free", "cached", "used", "shared", "offloaded"}
    assert blocks["free"] + blocks["cached"] + blocks["used"] + blocks["shared"] == KV_TOKENS // 16
    hits = next(s.value for s in families["kvtop_prefix_cache_hits"].samples if s.name.endswith("_total"))
    assert hits >= 32
    for name, bounds in (("kvtop_time_to_first_token_seconds", TTFT_BUCKETS),
                         ("kvtop_inter_token_latency_seconds", ITL_BUCKETS),
                         ("kvtop_e2e_request_latency_seconds", E2E_BUCKETS)):  # fmt: skip
        les = [float(s.labels["le"]) for s in families[name].samples if s.name.endswith("_bucket")]
        assert les == [*bounds, float("inf")]
        count = next(s.value for s in families[name].samples if s.name.endswith("_count"))
        assert count > 0
    states = {s.labels["state"]: s.value for s in families["kvtop_engine_state"].samples}
    assert states == {"running": 1.0, "draining": 0.0, "drained": 0.0}
    success = {s.labels["finished_reason"]: s.value for s in families["kvtop_request_success"].samples
               if s.name.endswith("_total")}  # fmt: skip
    assert success["length"] > 0


def test_api_key_is_required_on_v1(server):
    for key in ("wrong", ""):
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key or "x", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
    r = httpx.post(f"{server.url}/v1/completions", json={"model": server.model, "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/metrics").status_code == 200


LONG_IDS = list(range(100, 100 + KV_TOKENS + 10))

BAD_INPUTS = [
    # (name, path, body (dict, or raw bytes), status, param)
    ("malformed json", "/v1/completions", b'{"model": "m", "prompt": ', 400, None),
    ("not an object", "/v1/completions", b"[1, 2, 3]", 400, None),
    ("empty body", "/v1/chat/completions", b"", 400, None),
    ("NaN", "/v1/completions", b'{"model": "M", "prompt": "x", "temperature": NaN}', 400, None),
    ("missing model", "/v1/completions", {"prompt": "x"}, 400, "model"),
    ("missing prompt", "/v1/completions", {"model": "M"}, 400, "prompt"),
    ("missing messages", "/v1/chat/completions", {"model": "M"}, 400, "messages"),
    ("prompt a number", "/v1/completions", {"model": "M", "prompt": 12}, 400, "prompt"),
    ("prompt mixed list", "/v1/completions", {"model": "M", "prompt": ["a", 1]}, 400, "prompt"),
    ("prompt empty", "/v1/completions", {"model": "M", "prompt": ""}, 400, "prompt"),
    ("prompt empty list", "/v1/completions", {"model": "M", "prompt": []}, 400, "prompt"),
    ("token outside vocab", "/v1/completions", {"model": "M", "prompt": [1, 10**9]}, 400, "prompt"),
    ("max_tokens a string", "/v1/completions", {"model": "M", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("max_tokens a float", "/v1/completions", {"model": "M", "prompt": "x", "max_tokens": 1.5}, 400, "max_tokens"),
    ("max_tokens negative", "/v1/completions", {"model": "M", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("temperature negative", "/v1/completions", {"model": "M", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("temperature too high", "/v1/completions", {"model": "M", "prompt": "x", "temperature": 2.5}, 400, "temperature"),
    ("top_p negative", "/v1/completions", {"model": "M", "prompt": "x", "top_p": -0.1}, 400, "top_p"),
    ("top_p above one", "/v1/completions", {"model": "M", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("n zero", "/v1/completions", {"model": "M", "prompt": "x", "n": 0}, 400, "n"),
    ("n huge", "/v1/completions", {"model": "M", "prompt": "x", "n": 1000}, 400, "n"),
    ("stop a number", "/v1/completions", {"model": "M", "prompt": "x", "stop": 5}, 400, "stop"),
    ("seed a string", "/v1/completions", {"model": "M", "prompt": "x", "seed": "x"}, 400, "seed"),
    ("stream a string", "/v1/completions", {"model": "M", "prompt": "x", "stream": "yes"}, 400, "stream"),
    ("logprobs too many", "/v1/completions", {"model": "M", "prompt": "x", "logprobs": 10}, 400, "logprobs"),
    (
        "stream_options without stream",
        "/v1/completions",
        {"model": "M", "prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    (
        "penalty unsupported",
        "/v1/completions",
        {"model": "M", "prompt": "x", "presence_penalty": 0.5},
        400,
        "presence_penalty",
    ),
    ("messages empty", "/v1/chat/completions", {"model": "M", "messages": []}, 400, "messages"),
    ("messages a string", "/v1/chat/completions", {"model": "M", "messages": "hi"}, 400, "messages"),
    (
        "unknown role",
        "/v1/chat/completions",
        {"model": "M", "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages[0].role",
    ),
    (
        "content a number",
        "/v1/chat/completions",
        {"model": "M", "messages": [{"role": "user", "content": 3}]},
        400,
        "messages[0].content",
    ),
    (
        "image part",
        "/v1/chat/completions",
        {"model": "M", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages[0].content[0].type",
    ),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        {"model": "M", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    ("unknown model", "/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("prompt too long for the KV cache", "/v1/completions", {"model": "M", "prompt": LONG_IDS}, 400, "prompt"),
    (
        "prompt + max_tokens over max_model_len",
        "/v1/completions",
        {"model": "M", "prompt": [5, 6, 7], "max_tokens": 2046},
        400,
        "max_tokens",
    ),
    (
        "prompt + max_tokens over the KV cache",
        "/v1/completions",
        {"model": "M", "prompt": [5] * 600, "max_tokens": 600},
        400,
        "max_tokens",
    ),
    (
        "chat too long",
        "/v1/chat/completions",
        {"model": "M", "messages": [{"role": "user", "content": "word " * 1100}]},
        400,
        "messages",
    ),
]


@pytest.mark.parametrize(("name", "path", "body", "status", "param"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_a_4xx_with_an_openai_error(server, name, path, body, status, param):
    if isinstance(body, dict):
        raw = json.dumps(body).replace('"M"', json.dumps(server.model)).encode()
    else:
        raw = body.replace(b'"M"', json.dumps(server.model).encode())
    with server.http() as http:
        r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param, err


def test_wrong_method_and_route(server):
    with server.http() as http:
        assert http.get("/v1/completions").status_code == 405
        r = http.get("/v1/nope")
        assert r.status_code == 404 and "error" in r.json()


def _stream_lines(server, body: dict, sink: list, stop: threading.Event | None = None) -> None:
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as r:
        sink.append(r.status_code)
        for line in r.iter_lines():
            if line.startswith("data: {"):
                sink.append(json.loads(line[6:]))
            if stop is not None and stop.is_set():
                return


def test_queue_full_answers_429_at_once_and_snapshots(server):
    server.wait_idle()
    body = {"model": server.model, "prompt": "Count:", "max_tokens": 200, "stream": True, "ignore_eos": True}
    stop = threading.Event()
    sinks: list[list] = [[] for _ in range(6)]  # 4 run (max_num_seqs) + 2 wait (max_queue)
    threads = [threading.Thread(target=_stream_lines, args=(server, body, s, stop)) for s in sinks]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 20
        while not all(s for s in sinks) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [s[0] for s in sinks] == [200] * 6
        t0 = time.monotonic()
        with server.http() as http:
            r = http.post("/v1/completions", json={**body, "stream": False})
        assert time.monotonic() - t0 < 2.0
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    server.wait_idle()  # the closed streams were aborted and freed their blocks
    deadline = time.monotonic() + 10
    while not list(server.snapshot_dir.glob("*.kvsnap")) and time.monotonic() < deadline:
        time.sleep(0.1)
    snaps = list(server.snapshot_dir.glob("*.kvsnap"))
    assert len(snaps) == 1, server.log
    assert read_snapshot(snaps[0]).meta["reason"].startswith("queue-full")


def test_disconnecting_clients_leave_no_used_block(server):
    server.wait_idle()
    # streaming: read two chunks, hang up
    with server.http() as http, http.stream("POST", "/v1/completions", json={
        "model": server.model, "prompt": "Tell me a long story", "max_tokens": 900, "stream": True, "ignore_eos": True,
    }) as r:  # fmt: skip
        lines = r.iter_lines()
        seen = 0
        for line in lines:
            seen += line.startswith("data: {")
            if seen == 2:
                break
    frame = server.wait_idle(timeout=15)
    assert frame["kv"]["used"] == 0
    # not streaming: give up waiting
    with server.http(timeout=httpx.Timeout(60, read=0.5)) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={"model": server.model, "prompt": "Another long story", "max_tokens": 900,
                                           "ignore_eos": True})  # fmt: skip
    server.wait_idle(timeout=15)
    aborted = [e for e in server.stats()["events"] if e["kind"] == "aborted"]
    assert aborted and aborted[-1]["detail"] == "client disconnected"


def test_a_failing_step_is_a_500_and_the_server_goes_on(server, client):
    server.wait_idle()
    with server.http() as http:
        r = http.post("/v1/completions", json={"model": server.model, "prompt": [5, 31337, 6], "max_tokens": 4})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    server.wait_idle()  # its blocks went back
    ok = client.completions.create(model=server.model, prompt="still here?", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_streaming_n_and_logprobs(server, client):
    chunks = list(
        client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": "Two answers"}],
            max_tokens=5,
            n=2,
            temperature=1.0,
            seed=3,
            stream=True,
            logprobs=True,
            extra_body={"ignore_eos": True},
        )
    )
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    finished = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason == "length")
    assert finished == [0, 1]
    for i in (0, 1):
        tokens = [t for c in chunks if c.choices and c.choices[0].index == i and c.choices[0].logprobs
                  for t in c.choices[0].logprobs.content]  # fmt: skip
        assert len(tokens) == 5
    stream = client.completions.create(model=server.model, prompt="Hi", max_tokens=6, logprobs=0, stream=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    got = [c.choices[0] for c in stream if c.choices]
    assert sum(len(ch.logprobs.tokens) for ch in got if ch.logprobs) == 6
