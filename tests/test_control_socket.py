"""The stats/control socket of a real `kvctl serve`: frames, drain, evict, snapshots, permissions,
with `kvctl` run as a user runs it."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from jsonschema import Draft202012Validator

from kvtop.client import EngineClient, EngineRequestError
from kvtop.protocol.frame_schema import frame_schema
from kvtop.protocol.snapshot import read_snapshot
from tests.server_harness import KVCTL, kvctl, short_tmpdir, stale_socket, start_server

VALIDATOR = Draft202012Validator(frame_schema())
LONG = 1900  # tokens: long enough to still be running while a test acts on it


def assert_valid(frame: dict) -> None:
    errors = sorted(VALIDATOR.iter_errors(frame), key=lambda e: list(e.path))
    assert not errors, "; ".join(f"{list(e.path)}: {e.message}" for e in errors[:5])


@pytest.fixture(scope="module")
def server(tiny_dir):
    tmp = short_tmpdir()
    # the default path, $XDG_RUNTIME_DIR/kvtop-$UID/engine.sock, where a dead engine left its socket:
    # it is replaced (a directory too open, or another user's, is refused: tests/test_local_trust.py)
    sock = tmp / f"kvtop-{os.getuid()}" / "engine.sock"
    stale_socket(sock)
    sock.parent.chmod(0o700)
    env = {"XDG_RUNTIME_DIR": str(tmp)}
    s = start_server(tiny_dir, "--kv-cache-memory", "4MiB", "--max-num-seqs", "8", "--stats-interval", "0.2",
                     "--history", "60", socket_path=sock, tmp=tmp, env=env, pass_socket=False)  # fmt: skip
    yield s
    s.cleanup()


@pytest.fixture
def idle(server):
    """Each test starts from a running, idle engine."""
    with server.control() as c:
        if c.stats()["engine"]["state"] != "running":
            c.resume()
    server.wait_idle()
    return server


class Stream(threading.Thread):
    """A streaming completion consumed in the background; `chunks` fill as tokens arrive."""

    def __init__(self, server, max_tokens: int = LONG, chat: bool = False) -> None:
        super().__init__(daemon=True)
        self.client = server.openai(timeout=120)
        self.model, self.max_tokens, self.chat = server.model, max_tokens, chat
        self.chunks: list = []
        self.error: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            kw = dict(model=self.model, max_tokens=self.max_tokens, stream=True, extra_body={"ignore_eos": True})
            if self.chat:
                it = self.client.chat.completions.create(messages=[{"role": "user", "content": "Go on"}], **kw)
            else:
                it = self.client.completions.create(prompt="Keep counting:", **kw)
            for chunk in it:
                self.chunks.append(chunk)
        except Exception as exc:
            self.error = exc

    def wait_started(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while len(self.chunks) < 2 and time.monotonic() < deadline and self.error is None:
            time.sleep(0.01)
        assert len(self.chunks) >= 2, self.error

    @property
    def finish_reason(self) -> str | None:
        reasons = [c.choices[0].finish_reason for c in self.chunks if c.choices and c.choices[0].finish_reason]
        return reasons[-1] if reasons else None

    @property
    def text_tokens(self) -> int:
        return sum(1 for c in self.chunks if c.choices and not self.chat and c.choices[0].text)


def running_ids(frame: dict) -> list[str]:
    return [s["id"] for s in frame["sequences"] if s["state"] == "running"]


def test_socket_permissions_and_a_second_engine_is_refused(server):
    assert stat.S_IMODE(server.socket.stat().st_mode) == 0o600
    assert stat.S_IMODE(server.socket.parent.stat().st_mode) == 0o700
    assert stat.S_ISSOCK(server.socket.stat().st_mode)  # the stale one was replaced
    proc = kvctl("serve", "--model", server.model, "--port", "0", "--socket", str(server.socket), timeout=60)
    assert proc.returncode == 1
    assert "already listening at" in proc.stderr and str(server.socket) in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert EngineClient(server.socket).healthz()["status"] == "ok"  # the first one is untouched


def test_frames_are_valid_against_the_schema(idle):
    s = Stream(idle, max_tokens=300)
    s.wait_started()
    with idle.control() as c:
        frame = c.stats()
        assert_valid(frame)
        assert frame["sequences"] and frame["kv"]["used"] > 0
        streamed = []
        for f in c.stream(interval=0.1):
            streamed.append(f)
            if len(streamed) == 3:
                break
        for f in streamed:
            assert_valid(f)
        stamps = [f["ts"] for f in streamed]
        # a fresh frame each time, no faster than asked (slower is the machine's load, not a fault)
        assert stamps == sorted(set(stamps)) and stamps[-1] - stamps[0] >= 0.15
        history = c.history()
    s.join(60)
    assert history["interval_s"] == 0.2 and len(history["frames"]) >= 2
    for f in history["frames"][-5:]:
        assert_valid(f)
    kinds = {e["kind"] for e in history["events"]}
    assert {"admitted", "scheduled", "first_token"} <= kinds
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(idle.socket)), base_url="http://kvtop") as h:
        assert h.get("/v1/stats/stream", params={"interval": 0}).status_code == 400


def test_kvctl_status(idle):
    proc = kvctl("status", "--socket", str(idle.socket))
    assert proc.returncode == 0, proc.stderr
    for label in ("engine", "running", "KV cache", "requests", "prefix", "TTFT", "throughput"):
        assert label in proc.stdout
    proc = kvctl("status", "--json", "--socket", str(idle.socket))
    assert_valid(json.loads(proc.stdout))


def test_evict_a_running_sequence(idle):
    s = Stream(idle)
    s.wait_started()
    seq_id = running_ids(idle.stats())[0]
    refused = kvctl("evict", "--seq", seq_id, "--socket", str(idle.socket), input="n\n")
    assert refused.returncode == 1 and "nothing evicted" in refused.stderr
    assert seq_id in running_ids(idle.stats())
    proc = kvctl("evict", "--seq", seq_id, "--yes", "--socket", str(idle.socket))
    assert proc.returncode == 0, proc.stderr
    assert f"evicted {seq_id}" in proc.stdout
    assert seq_id not in [x["id"] for x in idle.stats()["sequences"]]  # "evicted" means done: its blocks are back
    s.join(30)
    assert s.error is None and s.finish_reason == "abort"
    frame = idle.wait_idle()
    assert any(e["kind"] == "aborted" and e["seq_id"] == seq_id and "evicted" in e["detail"] for e in frame["events"])
    with idle.control() as c, pytest.raises(EngineRequestError, match="no sequence") as exc:
        c.evict(seq_id=seq_id)
    assert exc.value.status_code == 404


def test_evict_with_requeue_recomputes(idle):
    s = Stream(idle, max_tokens=400)
    s.wait_started()
    seq_id = running_ids(idle.stats())[0]
    with idle.control() as c:
        answer = c.evict(seq_id=seq_id, requeue=True)
    assert answer["requeue"] is True and answer["applied"] is True
    requeued = [e for e in idle.stats()["events"] if e["kind"] == "evicted" and e["seq_id"] == seq_id]
    assert requeued and "requeued" in requeued[0]["detail"]  # applied by the time the answer came
    s.join(60)
    assert s.error is None and s.finish_reason == "length" and s.text_tokens >= 390


def test_evict_cached_blocks(idle):
    client = idle.openai()
    for i in range(3):
        client.completions.create(model=idle.model, prompt=f"{i} " + "shared words here " * 20, max_tokens=1)
    cached = idle.stats()["kv"]["cached"]
    assert cached >= 3
    with idle.control() as c:
        assert c.evict(blocks=2) == {"evicted": "prefix_cache", "blocks": 2}
        assert idle.stats()["kv"]["cached"] == cached - 2
        with pytest.raises(EngineRequestError, match="exactly one"):
            c.evict(blocks=1, prefix_cache=True)
    proc = kvctl("evict", "--prefix-cache", "--yes", "--socket", str(idle.socket))
    assert proc.returncode == 0 and f"dropped {cached - 2} cached" in proc.stdout
    assert idle.stats()["kv"]["cached"] == 0


def test_snapshot_contents(idle, tmp_path):
    s = Stream(idle, max_tokens=LONG)
    s.wait_started()
    time.sleep(0.5)  # a few recorder frames with the request in them
    out = tmp_path / "incident.kvsnap"
    proc = kvctl("snapshot", "-o", str(out), "--reason", "test incident", "--socket", str(idle.socket))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    snap = read_snapshot(out)
    assert snap.meta["reason"] == "test incident" and snap.meta["model"] == idle.model
    assert snap.meta["config"]["engine"]["kv_cache_memory"] == 4 * 1024**2
    assert len(snap.frames) >= 3
    for f in snap.frames[-3:]:
        assert_valid(f)
    assert any(e["kind"] == "snapshot" and "test incident" in e["detail"] for e in snap.events)
    assert {"admitted", "first_token"} <= {e["kind"] for e in snap.events}
    seq = next(q for q in snap.sequences if q["state"] == "running")
    assert seq["block_ids"]
    assert len(snap.blocks) == snap.frames[-1]["kv"]["num_blocks"]
    for b in seq["block_ids"]:
        assert snap.blocks[b]["state"] in "us" and seq["id"] in snap.blocks[b]["seq_ids"]
    # the default place: the server's snapshot dir
    with idle.control() as c:
        path = Path(c.snapshot(reason="manual")["path"])
    assert path.parent == idle.snapshot_dir and read_snapshot(path).meta["reason"] == "manual"
    with idle.control() as c, pytest.raises(EngineRequestError, match="cannot write"):
        c.snapshot(path="/proc/nope/x.kvsnap")
    with idle.control() as c:
        for seq_id in running_ids(idle.stats()):
            c.evict(seq_id=seq_id)
    s.join(30)


def test_drain_with_streams_in_flight(idle):
    streams = [Stream(idle, max_tokens=300), Stream(idle, max_tokens=300, chat=True), Stream(idle, max_tokens=200)]
    for s in streams:
        s.wait_started()
    with idle.control() as c:
        assert c.drain()["in_flight"] == 3
    drain = subprocess.Popen([*KVCTL, "drain", "--timeout", "120", "--socket", str(idle.socket)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert idle.stats()["engine"]["state"] == "draining"
        with pytest.raises(openai.APIStatusError) as exc:
            idle.openai().completions.create(model=idle.model, prompt="late", max_tokens=2)
        assert exc.value.status_code == 503
        assert int(exc.value.response.headers["retry-after"]) >= 1
        assert exc.value.body["code"] == "engine_draining"
        for s in streams:
            s.join(120)
        assert [s.error for s in streams] == [None] * 3
        assert [s.finish_reason for s in streams] == ["length"] * 3  # nothing dropped
        out, err = drain.communicate(timeout=60)
    finally:
        if drain.poll() is None:
            drain.kill()
    assert drain.returncode == 0, err
    assert "drained" in out
    assert idle.stats()["engine"]["state"] == "drained"
    assert httpx.get(f"{idle.url}/health").status_code == 503
    proc = kvctl("resume", "--socket", str(idle.socket))
    assert proc.returncode == 0 and "running" in proc.stdout
    r = idle.openai().completions.create(model=idle.model, prompt="back", max_tokens=2)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_drain_timeout(idle):
    s = Stream(idle, max_tokens=LONG)
    s.wait_started()
    proc = kvctl("drain", "--timeout", "0.3", "--socket", str(idle.socket))
    assert proc.returncode == 1 and "still 1 requests in flight" in proc.stderr
    assert idle.stats()["engine"]["state"] == "draining"
    proc = kvctl("drain", "--timeout", "0.3", "--abort-after", "--socket", str(idle.socket))
    assert proc.returncode == 0, proc.stderr
    assert "1 aborted" in proc.stdout
    s.join(30)
    assert s.finish_reason == "abort"
    aborted = [e for e in idle.stats()["events"] if e["kind"] == "aborted"]
    assert "drain timeout" in aborted[-1]["detail"]


def test_kvctl_status_says_when_the_drain_deadline_comes(idle):
    """The drain row used to read `deadline in` and then a number that did not fit (a timeout of
    1e308 s, now refused), and `deadline in 0 s` forever once a deadline without --abort-after had
    passed. It shows how long is left, or that the deadline passed."""

    def drain_row() -> str:
        proc = kvctl("status", "--socket", str(idle.socket))
        assert proc.returncode == 0, proc.stderr
        return next(line for line in proc.stdout.splitlines() if line.startswith("drain "))

    try:
        with idle.control() as c:
            c.drain(timeout_s=86400)
        assert "deadline in 23h59m" in drain_row()
        with idle.control() as c:
            c.drain(timeout_s=0)
        assert "deadline passed" in drain_row()
    finally:
        with idle.control() as c:
            c.resume()
