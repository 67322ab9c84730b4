"""`kvctl serve` on the real SmolLM2-135M-Instruct, through the official OpenAI client."""

from __future__ import annotations

import pytest

from tests.server_harness import start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(smollm2_dir):
    s = start_server("smollm2-135m", "--kv-cache-memory", "64MiB", "--max-num-seqs", "8")
    yield s
    s.cleanup()


def test_chat_on_smollm2(server):
    client = server.openai(timeout=120)
    assert [m.id for m in client.models.list().data] == ["smollm2-135m"]
    messages = [
        {"role": "system", "content": "You are a helpful assistant. Answer with one word."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    whole = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=12, temperature=0)
    assert "Paris" in whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop"  # the model ends its turn itself
    chunks = list(client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=12,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    usage = chunks[-1].usage
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 16  # the same chat again: its full blocks were cached


def test_completion_stream_on_smollm2(server):
    client = server.openai(timeout=120)
    prompt = "The three primary colours are"
    whole = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=16, temperature=0)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="smollm2-135m", prompt=prompt, max_tokens=16, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == whole.choices[0].text and len(whole.choices[0].text) > 10
