"""Signals to a real `kvctl serve`: SIGUSR1 writes a snapshot; SIGTERM drains, then exits 0."""

from __future__ import annotations

import signal
import threading
import time

import httpx

from kvtop.protocol.snapshot import read_snapshot
from tests.server_harness import start_server


def test_sigusr1_snapshots_and_sigterm_drains_then_exits(tiny_dir):
    server = start_server(tiny_dir, "--kv-cache-memory", "4MiB", "--drain-timeout", "400", "--stats-interval", "0.2")
    try:
        client = server.openai(timeout=420)
        chunks: list = []

        def consume() -> None:
            for c in client.completions.create(model=server.model, prompt="Go", max_tokens=2000, stream=True,
                                               extra_body={"ignore_eos": True}):  # fmt: skip
                chunks.append(c)

        t = threading.Thread(target=consume)
        t.start()
        server.wait_for(lambda f: f["server"]["in_flight"] == 1 and f["engine"]["step"] > 2, what="a running request")

        server.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 15
        while not list(server.snapshot_dir.glob("*.kvsnap")) and time.monotonic() < deadline:
            time.sleep(0.05)
        (snap,) = server.snapshot_dir.glob("*.kvsnap")
        assert read_snapshot(snap).meta["reason"] == "sigusr1"

        server.proc.send_signal(signal.SIGTERM)
        # ask at once, not after a stats frame: the drain lasts only as long as the request in flight
        deadline = time.monotonic() + 15
        late = httpx.post(f"{server.url}/v1/completions", json={"model": server.model, "prompt": "x"})
        while late.status_code != 503 and time.monotonic() < deadline:
            assert late.status_code == 200  # sent before the signal was handled: served as usual
            late = httpx.post(f"{server.url}/v1/completions", json={"model": server.model, "prompt": "x"})
        assert late.status_code == 503 and "retry-after" in late.headers
        t.join(420)  # the drain waits for the request however busy the machine: no race with its deadline
        assert chunks[-1].choices[0].finish_reason == "length"  # the request in flight finished
        assert server.proc.wait(60) == 0
        assert not server.socket.exists()  # cleaned up
        assert "SIGTERM: draining" in server.log and "drained; exiting" in server.log
    finally:
        server.cleanup()
