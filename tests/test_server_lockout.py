"""Clients without the API key, or with all the time in the world, against a real `kvctl serve`
(issue #40): they cannot hold the server's connections, so /health and authenticated requests
are answered while they try; a second SIGTERM still ends every stream properly; a prompt that
cannot fit is refused before it is tokenized; the server starts without warnings.

Every client here comes from a loopback address of its own (127.0.0.1, .2, .3…), so per-address
limits are seen as they would be from separate machines."""

from __future__ import annotations

import json
import select
import signal
import socket
import threading
import time
from types import SimpleNamespace
from urllib.parse import urlsplit

import httpx
import pytest

from engine.server.prompts import max_token_chars
from tests.server_harness import API_KEY, start_server

READ_TIMEOUT = 1.0
REQUEST_TIMEOUT = 2.0
KV_TOKENS = 128  # 64 KiB of KV at the tiny model's 512 B/token (fp32): far less than max_model_len 2048
AUTH = f"Authorization: Bearer {API_KEY}\r\n".encode()


@pytest.fixture(scope="module")
def guarded(tiny_dir):
    """Tight time limits, and a KV cache much smaller than the model's context."""
    s = start_server(tiny_dir, "--no-warmup", "--read-timeout", str(READ_TIMEOUT), "--request-timeout",
                     str(REQUEST_TIMEOUT), "--kv-cache-memory", "64KiB", api_key=API_KEY)  # fmt: skip
    yield s
    s.cleanup()


@pytest.fixture(scope="module")
def capped(tiny_dir):
    """Few connections, fewer per address, and time enough that a slow client is still held while
    the test looks."""
    s = start_server(tiny_dir, "--no-warmup", "--read-timeout", "60", "--request-timeout", "120",
                     "--max-connections", "8", "--max-connections-per-ip", "3", api_key=API_KEY)  # fmt: skip
    yield s
    s.cleanup()


def _connect(server, source: str = "127.0.0.1") -> socket.socket:
    u = urlsplit(server.url)
    return socket.create_connection((u.hostname, u.port), timeout=30, source_address=(source, 0))


def _client(server, source: str) -> httpx.Client:
    transport = httpx.HTTPTransport(local_address=source)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.Client(base_url=server.url, transport=transport, headers=headers, timeout=60)


def _read_all(conn: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := conn.recv(65536):
            data += chunk
    except OSError:  # reset after the answer: the server closed with our bytes unread
        pass
    return data


def _error(answer: bytes) -> dict:
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]


def _answers(conns: list[socket.socket], count: int, timeout: float = 30) -> dict[socket.socket, bytes]:
    """Wait until `count` of `conns` have been answered and closed by the server; their answers."""
    answered: dict[socket.socket, bytes] = {}
    deadline = time.monotonic() + timeout
    while len(answered) < count and time.monotonic() < deadline:
        ready, _, _ = select.select([c for c in conns if c not in answered], [], [], 0.5)
        for c in ready:
            answered[c] = _read_all(c)
    return answered


# ---- 1. a client without the key is answered from its headers and its body is never read -----
UNREAD = [
    (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n",
     401),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n", 401),
    (b"GET /health HTTP/1.1\r\nHost: t\r\nContent-Length: 1000000000\r\n\r\n", 200),  # answered, body unread
]  # fmt: skip


@pytest.mark.parametrize("head,status", UNREAD)
def test_a_request_answered_from_its_headers_has_its_connection_closed_and_its_body_unread(guarded, head, status):
    conn = _connect(guarded)
    answer: list[bytes] = []
    reader = threading.Thread(target=lambda: answer.append(_read_all(conn)))
    reader.start()
    chunk = b"x" * 65536
    if b"chunked" in head:
        chunk = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    sent, t0 = 0, time.monotonic()
    try:
        conn.sendall(head)
        while sent < 512 * 1024**2:  # the gigabyte declared: the server reads on only if it never closes
            conn.sendall(chunk)
            sent += len(chunk)
    except OSError:  # the server closed the connection: what we still send is refused
        pass
    reader.join(30)
    conn.close()
    assert answer and answer[0].startswith(b"HTTP/1.1 %d" % status), answer[:1]
    assert sent < 64 * 1024**2, f"the server read {sent} bytes of a body it had answered without"
    assert time.monotonic() - t0 < 20
    if status == 401:
        assert b"connection: close" in answer[0].lower()
        assert _error(answer[0])["code"] == "invalid_api_key"


# ---- 2. a body trickled a byte at a time is cut off at the whole request's deadline ---------------
def test_a_trickled_body_is_cut_off_at_the_request_deadline_though_no_byte_is_late(guarded):
    conn = _connect(guarded)
    conn.settimeout(READ_TIMEOUT / 4)  # a byte every quarter of the read timeout: never silent for long
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n" + AUTH + b"Content-Length: 1000\r\n\r\n{")
    answer, t0 = b"", time.monotonic()
    while time.monotonic() - t0 < 60:  # the whole body, at this pace, would take 250 s
        try:
            conn.sendall(b" ")
            chunk = conn.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            break
        answer += chunk
        if not chunk or answer.endswith(b"}}"):
            break
    elapsed = time.monotonic() - t0
    conn.settimeout(10)
    answer += _read_all(conn)
    conn.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    err = _error(answer)
    assert err["code"] == "request_timeout" and "--request-timeout" in err["message"], err
    assert REQUEST_TIMEOUT - 0.5 < elapsed < 30


# ---- 3. connection limits: per address, in all; refusals are JSON and logged sparingly -----------
def test_slow_clients_from_one_address_cannot_lock_out_the_others(capped):
    # 12 connections from one address that never finish their headers: 3 are held (the per-address
    # cap), the 9 others are refused at once
    slow = [_connect(capped, "127.0.0.1") for _ in range(12)]
    try:
        for c in slow:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")
        refused = _answers(slow, 9)
        assert len(refused) == 9, f"{len(refused)} of 12 refused"
        for answer in refused.values():
            assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
            head = answer.split(b"\r\n\r\n")[0].lower()
            assert b"content-type: application/json" in head and b"retry-after: 1" in head
            err = _error(answer)
            assert err["code"] == "too_many_connections" and "--max-connections-per-ip 3" in err["message"]
        with _client(capped, "127.0.0.2") as http:  # another client, meanwhile
            assert http.get("/health").status_code == 200
            r = http.post("/v1/completions", json={"model": capped.model, "prompt": "Hello", "max_tokens": 2})
            assert r.status_code == 200, r.text
    finally:
        for c in slow:
            c.close()
    log = capped.log
    assert "Exceeded concurrency limit" not in log
    refusal_lines = [line for line in log.splitlines() if "refused" in line and "connection" in line]
    assert 1 <= len(refusal_lines) <= 2, refusal_lines  # at once, then at most one line per 10 s


def test_beyond_max_connections_new_connections_get_json_503_with_retry_after(capped):
    # 3 addresses × 3 slow connections = 9, over the 8 the server holds in all
    conns = [_connect(capped, f"127.0.0.{3 + i // 3}") for i in range(9)]
    try:
        for c in conns:
            c.sendall(b"GET /health HTTP/1.1\r\n")
        refused = _answers(conns, 1)
        assert refused, "no connection refused"
        answer = next(iter(refused.values()))
        head = answer.split(b"\r\n\r\n")[0].lower()
        assert answer.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head, answer[:200]
        err = _error(answer)
        assert err["type"] == "service_unavailable" and "--max-connections 8" in err["message"], err
    finally:
        for c in conns:
            c.close()
    deadline = time.monotonic() + 30  # the slots are given back as the server sees the connections close
    while time.monotonic() < deadline:
        with _client(capped, "127.0.0.2") as http:
            if http.get("/health").status_code == 200:
                return
        time.sleep(0.1)
    raise AssertionError("the server did not take new connections again")


def test_malformed_requests_on_many_connections_make_one_log_line(guarded):
    for _ in range(20):
        conn = _connect(guarded)
        conn.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        assert _read_all(conn).startswith(b"HTTP/1.1 400")
        conn.close()
    assert guarded.log.count("Invalid HTTP request received") <= 3, guarded.log[-2000:]  # one per 10 s, not 20


# ---- 4. a second SIGTERM ends every stream properly ------------------------------------------------
def _stream(server, into: dict, started: threading.Event) -> None:
    body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with _client(server, "127.0.0.1") as http, http.stream("POST", "/v1/completions", json=body) as r:
        into["status"] = r.status_code
        into["lines"] = []
        for line in r.iter_lines():
            if line:
                into["lines"].append(line)
                started.set()


def _whole(server, into: dict) -> None:
    body = {"model": server.model, "prompt": "Hello", "max_tokens": 1000, "ignore_eos": True}
    with _client(server, "127.0.0.1") as http:
        r = http.post("/v1/completions", json=body)
    into["status"], into["body"] = r.status_code, r.json()


def test_a_second_sigterm_ends_every_stream_with_abort_and_done_and_no_traceback(tiny_dir):
    # every step waits 0.5 s, as a big model's would take: the answers are still coming when the
    # signals arrive, and the aborts reach the streams only at the next step
    server = start_server(tiny_dir, "--no-warmup", api_key=API_KEY, env={"KVTOP_FAULT_INJECT": "stall=0.5"})
    try:
        streams = [({}, threading.Event()) for _ in range(3)]
        whole: dict = {}
        threads = [threading.Thread(target=_stream, args=(server, into, started)) for into, started in streams]
        threads.append(threading.Thread(target=_whole, args=(server, whole)))
        for t in threads:
            t.start()
        assert all(started.wait(60) for _, started in streams), "the streams never started"
        server.wait_for(lambda f: f["server"]["in_flight"] == 4, what="4 requests in flight")
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while "draining" not in server.log and time.monotonic() < deadline:
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
        for t in threads:
            t.join(30)
        log = server.log
    finally:
        server.cleanup()
    for into, _ in streams:
        assert into["status"] == 200
        *chunks, done = into["lines"]
        assert done == "data: [DONE]", into["lines"][-3:]
        assert json.loads(chunks[-1].removeprefix("data: "))["choices"][0]["finish_reason"] == "abort"
    assert whole["status"] == 200 and whole["body"]["choices"][0]["finish_reason"] == "abort", whole
    assert "again: aborting" in log
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]


# ---- 5. a prompt that cannot fit is refused before it is tokenized, naming the limit -------------------
def test_a_prompt_longer_than_the_kv_cache_can_hold_is_refused_unread_naming_the_limit(guarded):
    text = "hello " * 4000  # 24,000 characters: under max_model_len 2048 × 16, far over 127 tokens' worth
    with _client(guarded, "127.0.0.1") as http:
        completion = http.post("/v1/completions", json={"model": guarded.model, "prompt": text})
        messages = [{"role": "user", "content": text}]
        chat = http.post("/v1/chat/completions", json={"model": guarded.model, "messages": messages})
    for r, param in ((completion, "prompt"), (chat, "messages")):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == param
        assert "24000 characters" in err["message"] and f"{KV_TOKENS - 1} tokens" in err["message"], err
        assert f"KV cache holds {KV_TOKENS} tokens" in err["message"]


def test_the_characters_per_token_bound_is_the_longest_token_unless_the_tokenizer_drops_text(smollm2_dir):
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    longest = max(map(len, tokenizer.get_vocab()))
    assert max_token_chars(tokenizer) == longest == 81  # "\n" and 80 spaces
    text = ("\n" + " " * 80) * 10 + "#" * 80 + " hello world"
    assert len(text) <= len(tokenizer.encode(text)) * longest  # what the bound promises

    def bound(normalizer=None, pre_tokenizer=None) -> int | None:
        backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        backend.normalizer = normalizer
        if pre_tokenizer is not None:
            backend.pre_tokenizer = pre_tokenizer
        return max_token_chars(SimpleNamespace(backend_tokenizer=backend))

    assert bound(normalizers.NFC()) == 4 * longest  # composing: 4 code points can become 1
    assert bound(normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase()])) == longest
    assert bound(normalizers.Strip()) is None  # drops whitespace: no bound
    assert bound(pre_tokenizer=pre_tokenizers.WhitespaceSplit()) is None


# ---- 6. no warning at start-up or when the API document is built ---------------------------------------
def test_the_openapi_document_has_no_duplicate_operation_ids(guarded):
    doc = httpx.get(f"{guarded.url}/openapi.json", timeout=30).json()
    ids = [op["operationId"] for path in doc["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids)), ids
    assert "Duplicate Operation ID" not in guarded.log
