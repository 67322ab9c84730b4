"""Careless and hostile HTTP against a real `kvctl serve` (issue #11): every such request ends in a
4xx naming what is wrong, and never costs an unrelated request its answer, the server its
responsiveness, or the host its memory."""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.helpers import random_prompts
from tests.server_harness import start_server

MAX_MODEL_LEN = 256
READ_TIMEOUT = 1.0
FAULT_TOKEN = 31337  # a step carrying this prompt token raises (KVTOP_FAULT_INJECT)


@pytest.fixture(scope="module")
def server(tiny_dir):
    # 200 half-sent requests come from this one address at once (test 7): over the default per-address cap
    s = start_server(tiny_dir, "--kv-cache-memory", "2MiB", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs",
                     "4", "--max-queue", "2", "--read-timeout", str(READ_TIMEOUT), "--max-connections-per-ip", "256",
                     env={"KVTOP_FAULT_INJECT": f"token={FAULT_TOKEN}"})  # fmt: skip
    yield s
    s.cleanup()


def _chat(server, **kw) -> dict:
    return {"model": server.model, "messages": [{"role": "user", "content": "Say hi"}], **kw}


def _completion(server, **kw) -> dict:
    return {"model": server.model, "prompt": "The quick brown fox", **kw}


def _raw(server, payload: bytes, path: str = "/v1/completions") -> httpx.Response:
    with server.http() as http:
        return http.post(path, content=payload, headers={"content-type": "application/json"})


def _assert_400(r: httpx.Response, param: str | None) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def _address(server) -> tuple[str, int]:
    u = urlsplit(server.url)
    return u.hostname, u.port


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _stream_text(server, body: dict, into: dict, started: threading.Event | None = None) -> None:
    """Collect a streamed completion's text and finish reason into `into`; `started` is set at its
    first chunk (the stream is in flight then)."""
    text, reasons = [], []
    with server.http(timeout=120) as http, http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        into["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: {"):
                if started is not None:
                    started.set()
                chunk = json.loads(line[6:])
                text.append(chunk["choices"][0]["text"])
                reasons.append(chunk["choices"][0]["finish_reason"])
    into["text"], into["finish_reason"] = "".join(text), next((x for x in reasons if x), None)


# ---- 1. every numeric field is range-checked; a failed step says why in the log ----------------
def test_a_huge_top_k_is_a_400_and_a_greedy_stream_beside_it_completes_intact(server):
    # long enough to still be streaming while the 400s go by (the tiny model decodes a 48-token
    # stream faster than a stats frame comes round, so the test now waits for its first chunk)
    body = _completion(server, prompt="Once upon a time", max_tokens=200, temperature=0, ignore_eos=True)
    with server.http() as http:
        want = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    got: dict = {}
    started = threading.Event()
    stream = threading.Thread(target=_stream_text, args=(server, body, got, started))
    stream.start()
    assert started.wait(60), "the stream never started"
    with server.http() as http:
        for top_k in (2**63, 2**64 + 5, 10**20):
            _assert_400(http.post("/v1/completions", json=_completion(server, top_k=top_k)), "top_k")
            _assert_400(http.post("/v1/chat/completions", json=_chat(server, top_k=top_k)), "top_k")
    stream.join(120)
    assert got == {"status": 200, "text": want, "finish_reason": "length"}


@pytest.mark.parametrize(
    "field,value",
    [("top_k", -2), ("n", 2**63), ("max_tokens", 2**63), ("max_tokens", -1), ("seed", 2**64), ("seed", -(2**63) - 1),
     ("logprobs", 2**63), ("temperature", 1e308), ("top_p", -0.5), ("min_p", 1.5), ("min_tokens", -1),
     ("min_tokens", 2**63), ("repetition_penalty", 0), ("repetition_penalty", 1e-300),
     ("repetition_penalty", 1e300), ("presence_penalty", 1e300),
     ("frequency_penalty", -3), ("best_of", 2**63), ("stop_token_ids", [2**63])],
)  # fmt: skip
def test_every_numeric_field_out_of_range_is_a_400_naming_it(server, field, value):
    with server.http() as http:
        r = http.post("/v1/completions", json=_completion(server, **{field: value}))
    _assert_400(r, field)


def test_chat_numeric_fields_out_of_range_are_400s(server):
    with server.http() as http:
        for field, value in [("top_logprobs", 2**63), ("max_completion_tokens", 2**70), ("n", -1), ("top_k", 10**30)]:
            _assert_400(http.post("/v1/chat/completions", json=_chat(server, **{field: value})), field)


def test_a_failed_step_logs_its_traceback(server):
    with server.http() as http:
        r = http.post("/v1/completions", json=_completion(server, prompt=[5, FAULT_TOKEN, 6], max_tokens=2))
    assert r.status_code == 500 and "server log" in r.json()["error"]["message"]
    deadline = time.monotonic() + 10
    while "InjectedFault" not in server.log and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "Traceback (most recent call last)" in server.log and "InjectedFault" in server.log


# ---- 2. bodies are bounded; big prompts do not stall the event loop -----------------------------
class _HealthWatch:
    """Polls /health from a thread; remembers the slowest answer (or failure)."""

    def __init__(self, server) -> None:
        self.server, self.worst, self.failures, self._stop = server, 0.0, [], threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        with httpx.Client(base_url=self.server.url, timeout=10) as http:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    code = http.get("/health").status_code
                except httpx.HTTPError as exc:
                    code = repr(exc)
                self.worst = max(self.worst, time.monotonic() - t0)
                if code != 200:
                    self.failures.append(code)
                time.sleep(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(20)


def _send_then_read(address, head: bytes, body_chunks, total_limit: int) -> bytes:
    """Send a request head and then body chunks until the server stops taking them; the answer."""
    conn = socket.create_connection(address, timeout=30)
    answer = bytearray()

    def read() -> None:
        try:
            while chunk := conn.recv(65536):
                answer.extend(chunk)
        except OSError:
            pass

    reader = threading.Thread(target=read)
    reader.start()
    sent = 0
    try:
        conn.sendall(head)
        for chunk in body_chunks:
            if answer or sent > total_limit:
                break
            conn.sendall(chunk)
            sent += len(chunk)
    except OSError:  # the server answered and closed while we were still sending: expected
        pass
    reader.join(30)
    conn.close()
    return bytes(answer)


def test_a_50mb_body_is_refused_with_413_while_health_answers_and_rss_stays_bounded(server):
    address = _address(server)
    rss0 = _rss_bytes(server.proc.pid)
    megabyte = b"x" * 1024**2
    with _HealthWatch(server) as watch:
        # declared: refused from the Content-Length, before a byte of the body is read
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                f"Content-Length: {50 * 1024**2}\r\n\r\n").encode()  # fmt: skip
        declared = _send_then_read(address, head, (megabyte for _ in range(50)), 50 * 1024**2)
        # chunked: no length to check up front, so the bytes are counted as they arrive
        head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        chunk = b"%x\r\n%s\r\n" % (len(megabyte), megabyte)
        chunked = _send_then_read(address, head, (chunk for _ in range(50)), 50 * 1024**2)
        # 6 MB of prompt fits in the body limit but could never fit the model: refused untokenized
        with server.http() as http:
            t0 = time.monotonic()
            big = http.post("/v1/completions", json=_completion(server, prompt="word " * 1_200_000))
            big_seconds = time.monotonic() - t0
    for answer in (declared, chunked):
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert b'"code": "request_too_large"' in answer
    err = _assert_400(big, "prompt")
    assert err["code"] == "context_length_exceeded" and big_seconds < 10
    assert not watch.failures and watch.worst < 3.0, (watch.failures, watch.worst)
    assert _rss_bytes(server.proc.pid) - rss0 < 200 * 1024**2
    with server.http() as http:
        assert http.post("/v1/completions", json=_completion(server, max_tokens=2)).status_code == 200


def test_a_prompt_of_long_tokens_that_fits_is_served_not_refused_by_its_length_in_characters(server):
    # "\n" and 80 spaces is one token of SmolLM2's vocabulary (the longest): 200 of them are 16,200
    # characters but 200 tokens, which fit in max_model_len 256; a fixed characters-per-token guess
    # (16) refused them unread
    prompt = ("\n" + " " * 80) * 200
    with server.http() as http:
        r = http.post("/v1/completions", json=_completion(server, prompt=prompt, max_tokens=1))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 200


def test_token_id_lists_longer_than_the_model_are_refused_at_once(server):
    with server.http() as http:
        r = http.post("/v1/completions", json=_completion(server, prompt=[[7] * (MAX_MODEL_LEN * 1000)]))
    assert _assert_400(r, "prompt")["code"] == "context_length_exceeded"


# ---- 3. surrogates and deep nesting ---------------------------------------------------------------
@pytest.mark.parametrize(
    "path,payload,param",
    [
        ("/v1/completions", b'{"model": "M", "prompt": "a\\ud800b"}', "prompt"),
        ("/v1/completions", b'{"model": "M", "prompt": "a\xed\xa0\x80b"}', "prompt"),
        ("/v1/completions", b'{"model": "M", "prompt": ["ok", "\\udfff"]}', "prompt[1]"),
        ("/v1/chat/completions", b'{"model": "M", "messages": [{"role": "user", "content": "x\\udc00"}]}',
         "messages[0].content"),
        ("/v1/chat/completions",
         b'{"model": "M", "messages": [{"role": "user", "content": [{"type": "text", "text": "\xed\xb0\x80"}]}]}',
         "messages[0].content[0].text"),
    ],
)  # fmt: skip
def test_lone_surrogates_are_a_400(server, path, payload, param):
    err = _assert_400(_raw(server, payload.replace(b'"M"', json.dumps(server.model).encode()), path), param)
    assert "surrogate" in err["message"]


@pytest.mark.parametrize("depth", [100, 5000, 100_000])
def test_deeply_nested_json_is_a_400_even_in_an_ignored_field(server, depth):
    for path in ("/v1/completions", "/v1/chat/completions"):
        payload = b'{"model": "m", "prompt": "x", "extra": ' + b"[" * depth + b"]" * depth + b"}"
        err = _assert_400(_raw(server, payload, path), None)
        assert "nests deeper" in err["message"]


# ---- 4. can never fit (400) is not full now (429) --------------------------------------------------
def test_more_prompts_than_can_ever_be_in_flight_is_a_400_on_an_idle_server(server):
    server.wait_idle()
    with server.http() as http:  # max_num_seqs 4 + max_queue 2 = 6
        many = http.post("/v1/completions", json=_completion(server, prompt=["hello"] * 7, max_tokens=1))
        n_times = http.post("/v1/completions", json=_completion(server, prompt=["a", "b"], n=4, max_tokens=1))
        chat = http.post("/v1/chat/completions", json=_chat(server, n=7, max_tokens=1))
        fits = http.post("/v1/completions", json=_completion(server, prompt=["hello"] * 6, max_tokens=1))
    for r, param in ((many, "prompt"), (n_times, "prompt"), (chat, "n")):
        err = _assert_400(r, param)
        assert err["code"] == "too_many_sequences" and "at most 6" in err["message"]
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 6


# ---- 5. tiny temperature and top_p are greedy --------------------------------------------------------
def test_tiny_temperature_or_top_p_gives_the_greedy_tokens(server):
    body = _completion(server, max_tokens=10, ignore_eos=True)
    with server.http() as http:
        greedy = http.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]["text"]
        for extra in ({"temperature": 1e-300}, {"temperature": 1e-40}, {"temperature": 1e-7},
                      {"top_p": 1e-300, "temperature": 1.0}, {"top_p": 1e-300, "temperature": 2.0, "seed": 3}):  # fmt: skip
            r = http.post("/v1/completions", json={**body, **extra})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy, extra
            chat = http.post("/v1/chat/completions", json=_chat(server, max_tokens=6, ignore_eos=True, **extra))
            want = http.post("/v1/chat/completions", json=_chat(server, max_tokens=6, ignore_eos=True, temperature=0))
            assert chat.json()["choices"][0]["message"] == want.json()["choices"][0]["message"]


# ---- 6. the cheap vLLM parameters work; the rest are refused by name -------------------------------
def test_min_tokens_holds_back_a_stop_token(server, tiny_llm):
    from engine import SamplingParams

    prompt = random_prompts(1, (12, 12), seed=21)[0]
    free = tiny_llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    stop = free[3]
    first = free.index(stop)
    body = {"model": server.model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stop_token_ids": [stop]}
    with server.http() as http:
        stopped = http.post("/v1/completions", json=body).json()
        held = http.post("/v1/completions", json={**body, "min_tokens": first + 3}).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == first + 1
    assert held["usage"]["completion_tokens"] >= first + 3, held


def test_repetition_penalty_changes_greedy_output_on_a_repetitive_prompt(server):
    body = _completion(server, prompt="the cat the cat the cat the cat the cat", max_tokens=24, temperature=0,
                       ignore_eos=True)  # fmt: skip
    with server.http() as http:
        plain = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        neutral = http.post("/v1/completions", json={**body, "repetition_penalty": 1.0}).json()["choices"][0]["text"]
        penalized = [
            http.post("/v1/completions", json={**body, "repetition_penalty": 1.8}).json()["choices"][0]["text"]
            for _ in range(2)
        ]
    assert neutral == plain
    assert penalized[0] != plain
    assert penalized[0] == penalized[1]  # still deterministic
    assert len(set(penalized[0].split())) > len(set(plain.split()))  # fewer repeats, more distinct words


def test_min_p_one_equals_greedy_and_seeded_sampling_stays_reproducible(server):
    body = _completion(server, max_tokens=12, ignore_eos=True)
    with server.http() as http:
        greedy = http.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]["text"]
        min_p = http.post("/v1/completions", json={**body, "temperature": 1.5, "min_p": 1.0}).json()
        sampled = {**body, "temperature": 1.0, "seed": 5, "min_p": 0.05, "repetition_penalty": 1.2, "n": 2}
        seeded = [http.post("/v1/completions", json=sampled).json() for _ in range(2)]
    assert min_p["choices"][0]["text"] == greedy
    assert [c["text"] for c in seeded[0]["choices"]] == [c["text"] for c in seeded[1]["choices"]]


REFUSED = [
    ("/v1/chat/completions", "functions", [{"name": "f", "parameters": {}}]),
    ("/v1/chat/completions", "tool_choice", "required"),
    ("/v1/chat/completions", "tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
    ("/v1/chat/completions", "guided_json", {"type": "object"}),
    ("/v1/completions", "guided_regex", "[a-z]+"),
    ("/v1/chat/completions", "use_beam_search", True),
    ("/v1/completions", "response_format", {"type": "json_object"}),
    ("/v1/chat/completions", "response_format", {"type": "json_schema", "json_schema": {}}),
    ("/v1/chat/completions", "logit_bias", {"5": 10}),
    ("/v1/completions", "include_stop_str_in_output", True),
    ("/v1/completions", "skip_special_tokens", False),
]


@pytest.mark.parametrize("path,name,value", REFUSED)
def test_unsupported_parameters_are_refused_by_name(server, path, name, value):
    body = _completion(server) if path == "/v1/completions" else _chat(server)
    with server.http() as http:
        err = _assert_400(http.post(path, json={**body, name: value}), name)
    assert name in err["message"]


def test_neutral_values_of_unsupported_parameters_are_accepted(server):
    with server.http() as http:
        for path, extra in [
            ("/v1/chat/completions", {"tool_choice": "none"}),
            ("/v1/chat/completions", {"response_format": {"type": "text"}}),
            ("/v1/completions", {"response_format": {"type": "text"}}),
            ("/v1/completions", {"use_beam_search": False, "skip_special_tokens": True}),
        ]:
            body = _completion(server, max_tokens=2) if path == "/v1/completions" else _chat(server, max_tokens=2)
            r = http.post(path, json={**body, **extra})
            assert r.status_code == 200, (extra, r.text)


# ---- 7. half-sent requests are cut off -----------------------------------------------------------
def test_half_sent_requests_are_closed_within_the_read_timeout(server):
    address = _address(server)
    partial = [
        b"",  # connects, says nothing
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n",  # headers never finish
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n{",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n",
    ]  # fmt: skip
    conns = []
    for i in range(200):
        c = socket.create_connection(address, timeout=15)
        c.sendall(partial[i % len(partial)])
        conns.append(c)
    t0 = time.monotonic()
    with server.http() as http:  # a well-behaved client is served meanwhile
        assert http.get("/health").status_code == 200
    answers = []
    for c in conns:
        data = b""
        try:
            while chunk := c.recv(4096):
                data += chunk
        except OSError as exc:
            data = repr(exc).encode()
        answers.append(data)
        c.close()
    elapsed = time.monotonic() - t0
    assert elapsed < READ_TIMEOUT + 6, elapsed  # every connection was closed by the server, none hung
    timed_out = [a for a in answers if a.startswith(b"HTTP/1.1 408")]
    assert len(timed_out) >= len(answers) // 2, set(a[:40] for a in answers)
    assert all(a == b"" or a.startswith(b"HTTP/1.1 408") for a in answers), set(a[:60] for a in answers)


# ---- 8. HEAD /health ------------------------------------------------------------------------------
def test_head_health_answers_200_without_a_body(server):
    r = httpx.head(f"{server.url}/health", timeout=5)
    assert r.status_code == 200 and r.content == b""
