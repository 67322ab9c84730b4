"""The server's pure parts: streaming detokenization, snapshot triggers, request validation."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
from transformers import AutoTokenizer

from engine.server.app import _Server
from engine.server.connections import uvicorn_config
from engine.server.detokenize import IncrementalDetokenizer
from engine.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, validate
from engine.server.sockets import bind_tcp
from engine.server.triggers import SnapshotTriggers
from kvtop.protocol.config import ServerConfig


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def _stream(tok, text: str, stop: list[str] | None = None, final: str | None = None) -> tuple[list[str], str]:
    ids = tok.encode(text, add_special_tokens=False)
    decode = lambda t: tok.decode(t, skip_special_tokens=True)  # noqa: E731
    detok = IncrementalDetokenizer(decode, stop)
    deltas = [detok.update(ids[: i + 1]) for i in range(len(ids) - 1)]
    deltas.append(detok.update(ids, final if final is not None else decode(ids)))
    return deltas, decode(ids)


def test_deltas_add_up_and_never_split_a_character(tokenizer):
    text = "Zürich ☀️ 你好，世界 — naïve café 🙂🙃 done"
    deltas, whole = _stream(tokenizer, text)
    assert "".join(deltas) == whole == text
    assert not any("\ufffd" in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 0  # multi-token characters were held back


def test_a_possible_stop_string_is_held_back(tokenizer):
    text = "alpha beta\n\nThe end"
    ids = tokenizer.encode(text, add_special_tokens=False)
    decode = lambda t: tokenizer.decode(t)  # noqa: E731
    detok = IncrementalDetokenizer(decode, ["\n\nThe"])
    shown = ""
    for i in range(len(ids)):
        text = decode(ids[: i + 1])
        if "\n\nThe" in text:  # the engine finishes here and cuts the text where the stop string starts
            shown += detok.update(ids[: i + 1], final_text=text[: text.index("\n\nThe")])
            break
        shown += detok.update(ids[: i + 1])
        assert "\n\n" not in shown  # never shows what might turn into the stop string
    assert shown == "alpha beta"


def _frame(ts: float, preemptions: int = 0, ttft_p99: float | None = None, count: int = 0) -> dict:
    window = {"count": count, "p99": ttft_p99}
    return {
        "ts": ts,
        "scheduler": {"preemptions_total": preemptions},
        "latency": {"ttft": {"window": window}, "itl": {"window": {"count": 0, "p99": None}}},
    }


def test_preemption_storm_fires_once_per_cooldown():
    t = SnapshotTriggers(ServerConfig(snapshot_on=("preemption-storm",), storm_preemptions=5, storm_window=2.0,
                                      snapshot_cooldown=10.0))  # fmt: skip
    assert t.check(_frame(0.0, 0)) == []
    assert t.check(_frame(1.0, 4)) == []
    (f,) = t.check(_frame(1.5, 6))
    assert f.trigger == "preemption-storm" and "6 preemptions" in f.detail
    assert t.check(_frame(2.0, 20)) == []  # cooling down
    assert t.check(_frame(12.0, 20)) == []  # the window has no new preemptions
    assert [x.trigger for x in t.check(_frame(12.5, 30))] == ["preemption-storm"]


def test_slo_breach_and_queue_full_only_when_enabled():
    t = SnapshotTriggers(ServerConfig(snapshot_on=("slo-breach",), slo_ttft=1.0, slo_min_requests=5))
    assert t.check(_frame(0.0, ttft_p99=3.0, count=2)) == []  # too few samples
    (f,) = t.check(_frame(1.0, ttft_p99=3.0, count=5))
    assert f.trigger == "slo-breach" and "TTFT P99" in f.detail
    t.note_queue_full("6 in flight")
    assert t.check(_frame(2.0)) == []  # queue-full is not enabled
    q = SnapshotTriggers(ServerConfig(snapshot_on=("queue-full",)))
    q.note_queue_full("6 in flight")
    assert [x.trigger for x in q.check(_frame(0.0))] == ["queue-full"]
    assert q.check(_frame(1.0)) == []


def test_validation_names_the_parameter():
    with pytest.raises(APIError) as exc:
        validate(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}, {"role": "bot"}]})
    assert exc.value.param == "messages[1].role" and exc.value.status == 400
    with pytest.raises(APIError) as exc:
        validate(CompletionRequest, {"model": "m", "prompt": [[1, 2], "x"]})
    assert exc.value.param == "prompt" and "token-id lists" in exc.value.message
    with pytest.raises(APIError) as exc:
        validate(CompletionRequest, {"model": "m"})
    assert exc.value.code == "missing_required_parameter" and exc.value.message == "missing required parameter 'prompt'"
    req = validate(CompletionRequest, {"model": "m", "prompt": [1, 2], "temperature": 1, "extra_field": True})
    assert req.temperature == 1.0  # an integer is a number; unknown fields are ignored as OpenAI does


def test_server_config_refuses_unknown_triggers():
    from kvtop.protocol.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown snapshot trigger"):
        ServerConfig(snapshot_on=("sometimes",))


def test_token_texts_describe_exactly_the_returned_text(tokenizer):
    """Log-probs list the tokens of the text a client gets: not a final <|im_end|>, not a stop string's tokens,
    and a character split over tokens is described once, by the token that completes it."""
    from engine.server.detokenize import TokenCursor

    decode = lambda t: tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = [*tokenizer.encode("Hi 你好 there. The end", add_special_tokens=False), eos]
    text = decode(ids)
    items = TokenCursor(decode).take(ids, len(text), finished=True)
    assert "".join(t for _, t, _ in items) == text == "Hi 你好 there. The end"
    assert len(items) == len(ids) - 1  # the EOS adds no text: not listed
    cut = text.index(" The")  # a stop string " The end" matched: the text ends before it
    items = TokenCursor(decode).take(ids, cut, finished=True)
    assert "".join(t for _, t, _ in items) == text[:cut]
    # while streaming, only tokens whose whole text is out are described
    cursor = TokenCursor(decode)
    assert cursor.take(ids[:3], 2, finished=False) == [(0, "Hi", 0)]


@pytest.mark.integration  # an HTTP server on a real socket
def test_connections_are_accepted_with_nagle_off():
    """The API's connections send each write at once: with Nagle on (asyncio leaves it on for a
    socket made by `socket.create_server`), a kept-alive client's every later request waited ~40 ms
    for its own delayed ACK, and a stream's first chunk did too."""

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    sock = bind_tcp("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = _Server(uvicorn_config(app, "warning"))
    thread = threading.Thread(target=asyncio.run, args=(server.serve(sockets=[sock]),), daemon=True)
    thread.start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            for _ in range(100):
                if server.started:
                    break
                time.sleep(0.05)
            assert [http.get("/").text for _ in range(3)] == ["ok"] * 3  # one kept-alive connection
            (conn,) = server.server_state.connections
            accepted = conn.transport.get_extra_info("socket")
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        server.should_exit = True
        thread.join(10)
