"""The OpenAI API as third-party clients expect it (issue #14), through the official `openai` client
against a real `kvctl serve` on the tiny model."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server_harness import API_KEY, start_server

PROMPT = "The quick brown fox"
# The second of two identical requests finds its prompt in the prefix cache, so its last step
# multiplies fewer rows and attends over cached blocks (another attention path; without AVX-512 the
# linears are MKL's, whose sums depend on the row count): the same tokens, logprobs equal to fp32
# rounding (~1e-7).
SAME_NUMBERS = dict(rel=1e-5, abs=1e-6)


@pytest.fixture(scope="module")
def server(tiny_dir):
    # room for n=128 choices of one prompt at once (max_num_seqs + max_queue)
    s = start_server(tiny_dir, "--kv-cache-memory", "4MiB", "--max-num-seqs", "8", "--max-queue", "128",
                     api_key=API_KEY)  # fmt: skip
    yield s
    s.cleanup()


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def post(server, path: str, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.post(f"{server.url}/v1{path}", json=body, headers=headers, timeout=60)


def events(server, path: str, body: dict) -> list[dict]:
    """The raw JSON of every chunk of a stream, as sent (the client fills in missing fields)."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    out = []
    with httpx.stream("POST", f"{server.url}/v1{path}", json={**body, "stream": True}, headers=headers,
                      timeout=60) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def greedy(**kw) -> dict:
    return dict(temperature=0, extra_body={"ignore_eos": True}, **kw)


def test_completion_logprobs_are_the_k_most_likely_tokens(server, client):
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5, logprobs=3, **greedy())
    lp = r.choices[0].logprobs
    assert len(lp.top_logprobs) == 5
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        values = list(top.values())
        assert 2 <= len(values) <= 3  # three token ids (two may decode to the same text)
        assert values == sorted(values, reverse=True)
        assert chosen == pytest.approx(values[0])  # greedy picks the most likely one
    stream = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5, logprobs=3, stream=True,
                                       **greedy())  # fmt: skip
    streamed = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.top_logprobs]
    assert [list(t) for t in streamed] == [list(t) for t in lp.top_logprobs]  # the same tokens, in order
    assert [list(t.values()) for t in streamed] == [
        pytest.approx(list(t.values()), **SAME_NUMBERS) for t in lp.top_logprobs
    ]


def test_chat_top_logprobs_streamed_and_not(server, client):
    kw = greedy(model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, logprobs=True,
                top_logprobs=5)  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(whole) == 4
    for entry in whole:
        assert len(entry.top_logprobs) == 5
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and entry.logprob == pytest.approx(values[0])
        assert bytes(entry.bytes).decode() == entry.token
    chunks = client.chat.completions.create(**kw, stream=True)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in streamed] == [
        (e.token, [t.token for t in e.top_logprobs]) for e in whole
    ]
    assert [[t.logprob for t in e.top_logprobs] for e in streamed] == [
        pytest.approx([t.logprob for t in e.top_logprobs], **SAME_NUMBERS) for e in whole
    ]


def test_logprobs_describe_exactly_the_returned_text(server, client):
    full = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, **greedy()).choices[0].text
    stop = full[len(full) // 2 :][:3]
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, stop=[stop], logprobs=1,
                                  **greedy()).choices[0]  # fmt: skip
    assert r.finish_reason == "stop" and r.text == full[: full.index(stop)]
    assert "".join(r.logprobs.tokens) == r.text  # the stop string's tokens are not listed
    assert r.logprobs.text_offset == [sum(len(t) for t in r.logprobs.tokens[:j]) for j in range(len(r.logprobs.tokens))]
    stream = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, stop=[stop], logprobs=1,
                                       stream=True, **greedy())  # fmt: skip
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(t for c in chunks if c.logprobs for t in c.logprobs.tokens) == r.text
    chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=12, stop=[stop], logprobs=True, **greedy()).choices[0]  # fmt: skip
    assert "".join(e.token for e in chat.logprobs.content) == chat.message.content


def test_null_means_the_default(server, client):
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 3, "n": None, "logprobs": None, "stream": None,
            "echo": None, "temperature": None, "top_p": None, "stop": None, "seed": None, "suffix": None,
            "best_of": None, "user": None, "stream_options": None, "presence_penalty": None, "ignore_eos": None}  # fmt: skip
    r = post(server, "/completions", body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    chat = {"model": server.model, "messages": [{"role": "user", "content": "Hi", "name": None}], "max_tokens": 2,
            "logprobs": None, "top_logprobs": None, "n": None, "stream": None, "max_completion_tokens": None,
            "response_format": None, "tools": None, "tool_choice": None}  # fmt: skip
    r = post(server, "/chat/completions", chat)
    assert r.status_code == 200, r.text
    # the official client sends None as null too
    c = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2, n=None, logprobs=None, echo=None)
    assert len(c.choices) == 1


def test_spec_limits(server, client):
    r = client.completions.create(model=server.model, prompt="Hi", max_tokens=1, n=128, temperature=1.0, seed=1)
    assert len(r.choices) == 128 and r.usage.completion_tokens == 128
    zero = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=0)
    assert zero.choices[0].text == "" and zero.choices[0].finish_reason == "length"
    assert zero.usage.completion_tokens == 0 and zero.usage.prompt_tokens > 0
    want = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6, **greedy()).choices[0].text
    top_p0 = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6, top_p=0, temperature=1.0,
                                       extra_body={"ignore_eos": True}).choices[0].text  # fmt: skip
    assert top_p0 == want  # only the most likely token survives
    two = post(server, "/completions", {"model": server.model, "prompt": PROMPT, "max_tokens": 2.0, "n": 2.0,
                                        "ignore_eos": True})  # fmt: skip
    assert two.status_code == 200 and two.json()["usage"]["completion_tokens"] == 4
    bad = post(server, "/completions", {"model": server.model, "prompt": PROMPT, "max_tokens": 2.5})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="n"):
        client.completions.create(model=server.model, prompt=PROMPT, n=129)


def test_echo(server, client):
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4, echo=True, **greedy())
    plain = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4, **greedy())
    assert r.choices[0].text == PROMPT + plain.choices[0].text
    only = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=0, echo=True)
    assert only.choices[0].text == PROMPT
    stream = list(client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4, echo=True, stream=True,
                                            **greedy()))  # fmt: skip
    assert stream[0].choices[0].text == PROMPT
    assert "".join(c.choices[0].text for c in stream if c.choices) == r.choices[0].text
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2, echo=True, logprobs=1)


def test_models_retrieve(server, client):
    m = client.models.retrieve(server.model)
    assert m.id == server.model and m.object == "model"
    with pytest.raises(openai.NotFoundError, match="not served"):
        client.models.retrieve("gpt-4o")


def test_response_shape(server, client):
    body = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    raw = post(server, "/chat/completions", body).json()
    assert raw["choices"][0]["message"]["refusal"] is None and "refusal" in raw["choices"][0]["message"]
    assert isinstance(raw["system_fingerprint"], str) and raw["system_fingerprint"]
    c = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2)
    assert c.system_fingerprint == raw["system_fingerprint"]
    plain = events(server, "/chat/completions", body)
    assert plain and all("usage" not in e for e in plain)  # not asked for: not there
    asked = events(server, "/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert all(e["usage"] is None for e in asked[:-1]) and asked[-1]["usage"]["completion_tokens"] == 3
    assert all(isinstance(e["system_fingerprint"], str) for e in asked)
    opts = {"include_usage": True, "continuous_usage_stats": True}
    every = events(server, "/completions", {"model": server.model, "prompt": PROMPT, "max_tokens": 4,
                                            "ignore_eos": True, "stream_options": opts})  # fmt: skip
    counts = [e["usage"]["completion_tokens"] for e in every]
    assert counts == sorted(counts) and counts[-1] == 4 and counts[0] >= 1
    assert all(e["usage"]["prompt_tokens"] == every[-1]["usage"]["prompt_tokens"] for e in every)


def test_openapi_document_describes_the_server(server):
    doc = httpx.get(f"{server.url}/openapi.json", timeout=10).json()  # no key needed, like /health
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model_id}", "/health"} <= set(
        doc["paths"]
    )
    schemas = doc["components"]["schemas"]
    n = schemas["CompletionRequest"]["properties"]["n"]
    assert any(t.get("maximum") == 128 for t in n.get("anyOf", [n]))
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    ok = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert "application/json" in ok and "text/event-stream" in ok
