"""The control socket of a real `kvctl serve` under hostile and careless input: bad snapshot paths
are 4xx and leave the event ring clean, nothing is replaced without --force (and never a symlink
or a device), no directory is created, no secret is stored, files are 0600, nested or fuzzed
bodies never 5xx, and a socket path that cannot work fails before the model loads."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.telemetry.metrics import Metrics
from kvtop.protocol.snapshot import REDACTED, SnapshotExists, write_snapshot
from kvtop.protocol.snapshot_reader import load_snapshot
from tests.server_harness import API_KEY, KVCTL, kvctl, short_tmpdir, start_server


@pytest.fixture(scope="module")
def server(tiny_dir):
    s = start_server(tiny_dir, "--kv-cache-memory", "2MiB", "--stats-interval", "0.2", api_key=API_KEY)
    yield s
    s.cleanup()


@pytest.fixture
def out(server) -> Path:
    """A fresh directory the test's snapshots go to (under the server's tmp, removed with it)."""
    d = Path(short_tmpdir(prefix="kvo"))
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


def post_raw(server, path: str, body: bytes) -> httpx.Response:
    with server.control() as c:
        return c._http.post(path, content=body, headers={"content-type": "application/json"})


def snapshot_body(path: str, **extra) -> bytes:
    return json.dumps({"path": path, "reason": "hostile test", **extra}).encode()  # ascii: surrogates as \ud800


def assert_control_still_works(server, out: Path) -> None:
    """What a poisoned event ring used to break: status, stats, history and the next snapshot."""
    proc = kvctl("status", "--socket", str(server.socket))
    assert proc.returncode == 0, proc.stderr
    with server.control() as c:
        assert c.stats()["engine"]["state"] == "running"
        assert c.history()["frames"]
        good = c.snapshot(str(out / f"good-{time.monotonic_ns()}.kvsnap"), "after a bad path")["path"]
    assert load_snapshot(good).meta["reason"] == "after a bad path"


# ---- bad paths --------------------------------------------------------------------------------
def bad_paths(out: Path) -> dict[str, tuple[str, tuple[int, ...], str]]:
    (out / "exists.kvsnap").write_text("precious")
    return {  # case: (path, statuses, words in the message)
        "lone surrogate": (f"{out}/snap-\ud800.kvsnap", (400,), "surrogate"),
        "NUL": (f"{out}/snap\x00.kvsnap", (400,), "NUL"),
        "proc file": ("/proc/self/status", (409, 400), "/proc/self"),  # exists (root) or not writable
        "missing parent": (f"{out}/no/such/dir/x.kvsnap", (400,), "does not exist"),
        "existing file": (f"{out}/exists.kvsnap", (409,), "--force"),
        "empty": ("", (400,), "empty"),
        "dev null": ("/dev/null", (400,), "character device"),
        "dev null, forced": ("/dev/null", (400,), "character device"),
    }


def test_bad_snapshot_paths_are_4xx_and_the_ring_survives(server, out):
    for case, (path, statuses, words) in bad_paths(out).items():
        r = post_raw(server, "/v1/snapshot", snapshot_body(path, force="forced" in case))
        assert r.status_code in statuses, (case, r.text)
        assert words in r.json()["error"]["message"], (case, r.text)
        assert_control_still_works(server, out)
    assert (out / "exists.kvsnap").read_text() == "precious"
    assert not (out / "no").exists()
    # the last survivor: SIGUSR1 still writes its snapshot
    before = set(server.snapshot_dir.glob("*.kvsnap"))
    server.proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while set(server.snapshot_dir.glob("*.kvsnap")) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    (new,) = set(server.snapshot_dir.glob("*.kvsnap")) - before
    assert load_snapshot(new).meta["reason"] == "sigusr1"


def test_events_are_always_json_safe():
    """Defence in depth: text that is not UTF-8 is escaped when logged, so the ring cannot be poisoned."""
    m = Metrics()
    m.event("snapshot", "seq-\udcff", "manual: /tmp/\ud800.kvsnap")
    encoded = json.dumps(list(m.events), ensure_ascii=False).encode("utf-8")
    assert b"\\ud800" in encoded and b"\\udcff" in encoded


def test_deeply_nested_bodies_are_400(server):
    deep = b"[" * 5000 + b"]" * 5000
    wrapped = b'{"path": ' + deep + b"}"
    for route in ("/v1/snapshot", "/v1/evict", "/v1/drain"):
        for body in (deep, wrapped):
            r = post_raw(server, route, body)
            assert r.status_code == 400, (route, r.text)
            assert "deeper" in r.json()["error"]["message"]
    assert server.stats()["engine"]["state"] == "running"


# ---- nothing replaced, nothing created -------------------------------------------------------
def test_kvctl_snapshot_never_replaces_without_force(server, out):
    existing = out / "incident.kvsnap"
    existing.write_text("yesterday's incident")
    target = out / "target.txt"
    target.write_text("not yours")
    link = out / "link.kvsnap"
    link.symlink_to(target)
    fifo = out / "fifo.kvsnap"
    os.mkfifo(fifo)
    dangling = out / "dangling.kvsnap"
    dangling.symlink_to(out / "made-through-a-link")
    sock = ["--socket", str(server.socket)]

    proc = kvctl("snapshot", "-o", str(existing), *sock)
    assert proc.returncode == 1 and "already exists" in proc.stderr and "--force" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and existing.read_text() == "yesterday's incident"

    for path, words in ((link, "symbolic link"), (dangling, "symbolic link"), (fifo, "fifo")):  # nor with --force
        for force in ([], ["--force"]):
            proc = kvctl("snapshot", "-o", str(path), *force, *sock)
            assert proc.returncode == 1 and words in proc.stderr, proc.stderr
            assert "Traceback" not in proc.stderr
    assert link.is_symlink() and target.read_text() == "not yours"
    assert dangling.is_symlink() and not (out / "made-through-a-link").exists()
    assert stat.S_ISFIFO(fifo.lstat().st_mode)

    if os.geteuid() == 0:  # as root, `-o /dev/null --force` would have replaced /dev/null
        proc = kvctl("snapshot", "-o", "/dev/null", "--force", *sock)
        assert proc.returncode == 1 and "character device" in proc.stderr
        assert stat.S_ISCHR(os.lstat("/dev/null").st_mode)

    proc = kvctl("snapshot", "-o", str(existing), "--force", "--reason", "replaced", *sock)
    assert proc.returncode == 0, proc.stderr
    assert load_snapshot(existing).meta["reason"] == "replaced"
    assert stat.S_IMODE(existing.stat().st_mode) == 0o600


def test_kvctl_snapshot_never_creates_directories(server, out):
    proc = kvctl("snapshot", "-o", str(out / "a" / "b" / "x.kvsnap"), "--socket", str(server.socket))
    assert proc.returncode == 1 and "does not exist" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (out / "a").exists()
    # a directory that exists, or a link to one: a fresh name in it
    proc = kvctl("snapshot", "-o", str(out), "--socket", str(server.socket))
    assert proc.returncode == 0 and Path(proc.stdout.strip()).parent == out
    (out / "dir-link").symlink_to(out)
    proc = kvctl("snapshot", "-o", str(out / "dir-link"), "--socket", str(server.socket))
    assert proc.returncode == 0 and Path(proc.stdout.strip()).parent == out / "dir-link"
    assert (out / "dir-link").is_symlink() and len(list(out.glob("*.kvsnap"))) == 2


def test_a_path_that_looks_like_markup_is_printed_as_typed(server, out):
    """`[/x]` is rich markup: printed as markup, a path (and the event that names it) used to
    break `kvctl snapshot`, its errors and `kvctl status` with a traceback."""
    (out / "[").mkdir()
    path = f"{out}/[/x].kvsnap"
    proc = kvctl("snapshot", "-o", path, "--socket", str(server.socket))
    assert proc.returncode == 0 and proc.stdout.strip() == path, proc.stderr
    status = kvctl("status", "--socket", str(server.socket))
    assert status.returncode == 0 and "[/x].kvsnap" in status.stdout.replace("\n", ""), status.stderr
    proc = kvctl("snapshot", "-o", path, "--socket", str(server.socket))  # exists: the error names it
    assert proc.returncode == 1 and "[/x].kvsnap already exists" in proc.stderr and "Traceback" not in proc.stderr


def test_kvctl_snapshot_with_a_non_utf8_name_is_one_line(server, out):
    name = os.fsencode(str(out)) + b"/incident-\xff\xfe.kvsnap"
    proc = subprocess.run([*KVCTL, "snapshot", "-o", name, "--socket", str(server.socket)],
                          capture_output=True, timeout=60)  # fmt: skip
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 1, err
    assert len(err.strip().splitlines()) == 1 and "not valid UTF-8" in err and "Traceback" not in err
    assert os.listdir(out) == []


def test_a_trailing_slash_names_a_directory(server, out):
    """`-o incidents/` used to write a file named `incidents` when there was no such directory. A
    path ending in / names a directory: a missing one is refused (snapshots never create one), an
    existing one gets a fresh name in it, a file is not one."""
    sock = ["--socket", str(server.socket)]
    proc = kvctl("snapshot", "-o", f"{out}/missing_dir/", *sock)
    assert proc.returncode == 1 and "does not exist" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and os.listdir(out) == []
    (out / "incidents").mkdir()
    proc = kvctl("snapshot", "-o", f"{out}/incidents/", *sock)
    assert proc.returncode == 0 and Path(proc.stdout.strip()).parent == out / "incidents", proc.stderr
    (out / "notes.txt").write_text("mine")
    proc = kvctl("snapshot", "-o", f"{out}/notes.txt/", "--force", *sock)
    assert proc.returncode == 1 and "is not a directory" in proc.stderr
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="no /sys here")
def test_a_snapshot_that_cannot_be_written_is_no_event(server):
    """Root passes every permission check on /sys, which then refuses a new file: the write failed
    after its `snapshot` event was logged, so the events (and kvctl status, and the dashboard) said
    a snapshot was taken that never was."""
    proc = kvctl("snapshot", "-o", "/sys/kernel/x.kvsnap", "--socket", str(server.socket))
    assert proc.returncode == 1 and "/sys/kernel" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    with server.control() as c:
        events = c.history()["events"]
        snapshots = c.stats()["server"]["snapshots"]
    assert not [e for e in events if "/sys/kernel" in e["detail"]], events
    assert not [s for s in snapshots if "/sys/kernel" in s["path"]]


def test_a_drain_timeout_is_bounded(server):
    """`timeout_s: 1e308` drained with a deadline at the end of time: the OpenAI API's 503 then
    carried a 309-digit Retry-After. A day at most, at validation; 0 is a deadline of now."""
    try:
        for bad in (b"1e308", b"86401", b"-1", b"1e999", b"NaN", b"Infinity"):
            r = post_raw(server, "/v1/drain", b'{"timeout_s": ' + bad + b"}")
            assert r.status_code == 400 and r.json()["error"]["message"], (bad, r.text)
            assert server.stats()["engine"]["state"] == "running"  # a refused drain drains nothing
        r = post_raw(server, "/v1/drain", b'{"timeout_s": 1e308}')
        assert r.json()["error"]["param"] == "timeout_s" and "86400" in r.json()["error"]["message"], r.text
        r = post_raw(server, "/v1/drain", b'{"timeout_s": 86400}')
        assert r.status_code == 200 and r.json()["drain"]["timeout_s"] == 86400
        late = server.http().post("/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 1})
        assert late.status_code == 503 and 86390 <= int(late.headers["retry-after"]) <= 86400
    finally:
        post_raw(server, "/v1/resume", b"{}")


# ---- what a snapshot holds ----------------------------------------------------------------------
def test_snapshots_hold_no_secret_and_are_0600(server, out):
    path = out / "secret-check.kvsnap"
    proc = kvctl("snapshot", "-o", str(path), "--socket", str(server.socket))
    assert proc.returncode == 0, proc.stderr
    assert API_KEY.encode() not in path.read_bytes()
    config = load_snapshot(path).meta["config"]
    assert config["server"]["api_key"] == REDACTED
    assert config["engine"]["max_num_batched_tokens"] > 0  # a name with "token" in it is not a secret
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for auto in server.snapshot_dir.glob("*.kvsnap"):  # SIGUSR1's, the test above
        assert stat.S_IMODE(auto.stat().st_mode) == 0o600 and API_KEY.encode() not in auto.read_bytes()


def test_automatic_snapshots_pick_fresh_names(tmp_path):
    frame = {"ts": 1.0, "engine": {"step": 1}, "kv": {"blocks": ".."}, "sequences": []}
    kw = dict(model="m", config={"hf_token": "hf_abc", "nested": {"password": "pw"}}, frames=[frame], events=[])
    paths = [write_snapshot(tmp_path / "auto" / "kvtop-x.kvsnap", reason=f"r{i}", fresh=True, **kw) for i in range(3)]
    assert [p.name for p in paths] == ["kvtop-x.kvsnap", "kvtop-x-1.kvsnap", "kvtop-x-2.kvsnap"]
    assert [load_snapshot(p).meta["reason"] for p in paths] == ["r0", "r1", "r2"]
    assert load_snapshot(paths[0]).meta["config"] == {"hf_token": REDACTED, "nested": {"password": REDACTED}}
    with pytest.raises(SnapshotExists):
        write_snapshot(paths[0], reason="again", force=False, **kw)
    assert load_snapshot(paths[0]).meta["reason"] == "r0"


# ---- the socket path ----------------------------------------------------------------------------
@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_a_socket_path_too_long_fails_before_the_model_loads(tmp_path):
    """The model here cannot load: the socket's error, not the model's, proves the check came first."""
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    long = tmp_path / ("d" * 120) / "engine.sock"
    proc = kvctl("serve", "--model", str(broken), "--socket", str(long), "--port", "0", timeout=60)
    assert proc.returncode != 0
    assert "longer than the 107" in proc.stderr and "config" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not long.parent.exists()


# ---- fuzzing ----------------------------------------------------------------------------------
NASTY = ["\ud800", "\udcff", "\x00", "../", "/dev/null", "/proc/self/status", "~", "\n", "é", "\U0001f600"]
nasty_text = st.lists(st.one_of(st.sampled_from(NASTY), st.text(max_size=6)), max_size=6).map("".join)
scalar = st.one_of(
    st.none(), st.booleans(), nasty_text, st.floats(), st.integers(-(10**30), 10**30),
    st.integers(min_value=10**300, max_value=10**1000),
)  # fmt: skip
value = st.recursive(scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(nasty_text, inner, max_size=3),
                     max_leaves=8)  # fmt: skip
FIELDS = ["path", "reason", "force", "seq_id", "requeue", "prefix_cache", "blocks", "timeout_s", "abort_after"]


def _raw(draw_body) -> bytes:
    if isinstance(draw_body, bytes):
        return draw_body
    return json.dumps(draw_body, allow_nan=True).encode()  # NaN/Infinity are sent as JS constants: also bad


bodies = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), value, max_size=4),
    value,
    st.integers(1, 20_000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(1, 20_000).map(lambda n: b'{"reason": ' + b"[" * n + b"]" * n + b"}"),
    st.integers(4000, 6000).map(lambda n: b'{"blocks": ' + b"9" * n + b"}"),
    st.binary(max_size=40),
)


def test_fuzzed_control_endpoints_never_5xx(server, out):
    statuses: Counter[int] = Counter()

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(route=st.sampled_from(["/v1/snapshot", "/v1/evict", "/v1/drain", "/v1/resume"]), body=bodies)
    def one(route: str, body) -> None:
        if route == "/v1/snapshot" and isinstance(body, dict) and isinstance(body.get("path"), str):
            body = {**body, "path": f"{out}/{body['path'].replace('..', '__')}"}  # never outside the test's dir
        if route == "/v1/drain" and isinstance(body, dict):
            body = {**body, "timeout_s": 0.01}
        r = post_raw(server, route, _raw(body))
        statuses[r.status_code] += 1
        assert r.status_code < 500, (route, body, r.text)
        if r.status_code >= 400:
            assert r.json()["error"]["message"]
        post_raw(server, "/v1/resume", b"{}")

    one()
    queries: Counter[int] = Counter()
    with server.control() as c:
        for q in ("nan", "inf", "-inf", "1e999", "9" * 5000, "\x00", "abc", "-1"):
            r = c._http.get("/v1/history", params={"since": q})
            queries[r.status_code] += 1
            assert r.status_code < 500, (q, r.text)
            with c._http.stream("GET", "/v1/stats/stream", params={"interval": q}) as s:
                queries[s.status_code] += 1
                assert s.status_code == 400, q
    print(f"\nfuzzed control bodies: {sum(statuses.values())} requests, by status {dict(sorted(statuses.items()))}; "
          f"queries: {dict(queries)}")  # fmt: skip
    assert sum(statuses.values()) >= 300 and not [s for s in statuses if s >= 500]
    assert_control_still_works(server, out)
