"""No other local user can stand in for the engine. `kvctl serve` refuses a socket directory that
another user owns or that is open to others (one line, before the model loads) and never touches
another user's socket file; kvctl and kvtop refuse a socket, a socket directory or a listening
process of another user than the one expected, before sending a byte.

Acting as another user takes root (os.chown, os.setuid): the tests run as root here and in CI,
and those parts are skipped elsewhere."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvtop.dashboard.cli import main as kvtop_main
from tests.server_harness import kvctl, short_tmpdir, stale_socket

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user takes root")

# An engine's stand-in run by uid 65534: it prints each request line it receives ("request GET
# /v1/stats HTTP/1.1", or "closed" for a connection that sent nothing) and answers 200 with JSON.
# `bind_as`: "other" binds as 65534 (its own directory); "root" binds as root, then drops to 65534
# before listen(), so the file and its directory are root's and only the kernel's SO_PEERCRED,
# fixed at listen(), tells who is behind it.
STAND_IN = r"""
import os, socket, sys
path, bind_as = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
if bind_as == "other":
    os.setgid(65534); os.setuid(65534)
s.bind(path)
os.setgid(65534); os.setuid(65534)
s.listen(8)
print("listening", flush=True)
while True:
    conn, _ = s.accept()
    conn.settimeout(60)
    data = b""
    try:  # a connection that goes silent or breaks ends, never the stand-in
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    print("request " + data.split(b"\r\n")[0].decode() if data else "closed", flush=True)
    if data:
        body = b'{"answered_by": "uid 65534"}'
        try:
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
        except OSError:
            pass
    conn.close()
"""


class StandIn:
    """Another user's process listening where kvctl looks for the engine."""

    def __init__(self, path: Path, bind_as: str) -> None:
        self.path = path
        self.proc = subprocess.Popen([sys.executable, "-c", STAND_IN, str(path), bind_as],
                                     stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert self.proc.stdout.readline().strip() == "listening"

    def requests(self) -> list[str]:
        """The request lines it has received. It serves one connection at a time, in order: once it
        has answered a connection of ours made now, every earlier one (kvctl's) is done with."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(str(self.path))
            probe.sendall(b"SENTINEL\r\n\r\n")
            lines = []
            for line in self.proc.stdout:
                if line.strip() == "request SENTINEL":
                    break
                lines.append(line.strip())
        return [line.removeprefix("request ") for line in lines if line.startswith("request ")]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def in_their_dir():
    """A stand-in in a directory of its user's own, as if it had made $XDG_RUNTIME_DIR/kvtop-0 first."""
    tmp = short_tmpdir()
    tmp.chmod(0o711)  # uid 65534 may pass through, not look
    theirs = tmp / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    stand_in = StandIn(theirs / "engine.sock", "other")
    yield stand_in
    stand_in.stop()
    subprocess.run(["rm", "-rf", str(tmp)], check=False)


@pytest.fixture
def behind_our_file():
    """A stand-in listening as uid 65534 on a socket file (and in a directory) that are root's."""
    tmp = short_tmpdir()
    stand_in = StandIn(tmp / "engine.sock", "root")
    yield stand_in
    stand_in.stop()
    subprocess.run(["rm", "-rf", str(tmp)], check=False)


def broken_model(tmp: Path) -> Path:
    """A model that cannot load: an error about it would mean the socket was checked too late."""
    broken = tmp / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    return broken


def serve(tmp: Path, *args: str, capsys) -> tuple[int, str]:
    """`kvctl serve` in this process (torch is loaded once, not per test): its exit status and the
    one line it wrote on stderr."""
    from kvtop.ctl import cli

    try:
        cli.main(["serve", "--model", str(broken_model(tmp)), "--port", "0", *args])
        code = 0
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return code, lines[0]


def one_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


# ---- the engine's side --------------------------------------------------------------------------
@needs_root
def test_serve_refuses_a_default_socket_directory_another_user_made(tmp_path, capsys, monkeypatch):
    """The hostile tester's case: another user made $XDG_RUNTIME_DIR/kvtop-$UID first, then could
    replace the engine's socket in it and answer `kvctl drain` in its place."""
    theirs = tmp_path / f"kvtop-{os.getuid()}"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    monkeypatch.delenv("KVTOP_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    code, line = serve(tmp_path, capsys=capsys)
    assert code == 1
    assert f"the socket directory {theirs} belongs to uid {NOBODY}" in line and "remove it or pass --socket" in line
    assert "config" not in line  # refused before the model was read
    assert theirs.stat().st_uid == NOBODY and os.listdir(theirs) == []


def test_serve_refuses_a_socket_directory_open_to_others(tmp_path, capsys):
    """A 0755 directory used to be made 0700 (at the default path) or used as it was (--socket):
    whoever could write in it meanwhile may have left something there. Refused, left as it is."""
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o755)
    code, line = serve(tmp_path, "--socket", str(open_dir / "engine.sock"), capsys=capsys)
    assert code == 1
    assert f"the socket directory {open_dir} is open to other users (mode 0755)" in line
    assert f"chmod 700 {open_dir}" in line and "config" not in line
    assert oct(open_dir.stat().st_mode & 0o777) == "0o755" and os.listdir(open_dir) == []


@needs_root
def test_serve_leaves_a_socket_file_of_another_user_alone(tmp_path, capsys):
    """A socket nobody answers on is a dead engine's and is replaced, but only one of ours."""
    ours = tmp_path / "run"
    sock = ours / "engine.sock"
    stale_socket(sock)
    ours.chmod(0o700)
    os.chown(sock, NOBODY, NOBODY, follow_symlinks=False)
    code, line = serve(tmp_path, "--socket", str(sock), capsys=capsys)
    assert code == 1
    assert f"the socket {sock} belongs to uid {NOBODY}" in line and "config" not in line
    assert sock.is_socket() and sock.stat().st_uid == NOBODY


# ---- the clients' side --------------------------------------------------------------------------
@needs_root
@pytest.mark.parametrize("command", [["status"], ["drain", "--timeout", "5"], ["snapshot"]])
@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_kvctl_refuses_a_socket_in_another_users_directory(in_their_dir, command):
    proc = kvctl(*command, "--socket", str(in_their_dir.path), timeout=60)
    line = one_line(proc)
    assert proc.returncode != 0
    assert f"not talking to the control socket {in_their_dir.path}" in line
    assert f"belongs to uid {NOBODY}" in line and "not uid 0 (root)" in line
    assert in_their_dir.requests() == []


@needs_root
@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_kvctl_refuses_an_engine_process_of_another_user(behind_our_file):
    """The socket file and its directory are root's: only the kernel's word on the process
    listening (SO_PEERCRED) tells it is uid 65534's, and nothing is sent to it."""
    proc = kvctl("drain", "--timeout", "5", "--socket", str(behind_our_file.path), timeout=60)
    line = one_line(proc)
    assert proc.returncode != 0
    assert f"the process listening on it runs as uid {NOBODY}" in line and "not uid 0 (root)" in line
    assert behind_our_file.requests() == []


@needs_root
@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_the_user_named_in_kvtop_socket_owner_is_trusted(in_their_dir):
    """Root steering a service account's engine names that user; anyone else stays refused."""
    sock = str(in_their_dir.path)
    for named in (str(NOBODY), "nobody"):
        proc = kvctl("status", "--json", "--socket", sock, env={**os.environ, "KVTOP_SOCKET_OWNER": named}, timeout=60)
        assert proc.returncode == 0 and '"answered_by": "uid 65534"' in proc.stdout, proc.stderr
    assert in_their_dir.requests() == ["GET /v1/stats HTTP/1.1"] * 2
    proc = kvctl("status", "--socket", sock, env={**os.environ, "KVTOP_SOCKET_OWNER": "no-such-user-here"})
    assert proc.returncode != 0 and "KVTOP_SOCKET_OWNER=no-such-user-here names no user" in one_line(proc)
    assert in_their_dir.requests() == []


@needs_root
@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_kvtop_refuses_it_before_the_dashboard_starts(in_their_dir, behind_our_file, capsys, monkeypatch):
    monkeypatch.setattr("kvtop.dashboard.app.KvtopApp.run", lambda self, *a, **k: pytest.fail("started"))
    for stand_in, says in ((in_their_dir, "belongs to"), (behind_our_file, "the process listening on it runs as")):
        with pytest.raises(SystemExit) as exit_info:
            kvtop_main(["--socket", str(stand_in.path)])
        assert exit_info.value.code == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("kvtop: not talking to the control socket") and says in err[0]
        assert f"uid {NOBODY}" in err[0]
        assert stand_in.requests() == []
