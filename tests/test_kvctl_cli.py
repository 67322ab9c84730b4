"""kvctl without an engine: where it looks, replay's checks, shell completions, argument errors."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from kvtop.ctl import cli, summary
from kvtop.ctl.completion import generate
from kvtop.dashboard.widgets.block_map import render_cells
from kvtop.protocol.snapshot import write_snapshot
from tests.server_harness import kvctl, start_server

ROOT = Path(__file__).parents[1]
COMPLETIONS = ROOT / "completions"


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "KVTOP_SOCKET"}
    return {**env, **extra}


def run(args: list[str], capsys) -> tuple[int, str, str]:
    """kvctl in this process (the entry point, as the console script calls it): code, stdout, stderr."""
    code = 0
    try:
        cli.main(args)
    except SystemExit as exc:
        code = exc.code or 0
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_no_engine_is_one_line_and_exit_2(tmp_path):
    sock = tmp_path / "nobody.sock"
    proc = kvctl("status", "--socket", str(sock))  # as a user runs it
    assert proc.returncode == 2
    assert (
        proc.stderr.strip() == f"kvctl: no engine at {sock} (no socket); start one with `kvctl serve` or pass --socket"
    )


@pytest.mark.parametrize("args", [["drain"], ["resume"], ["snapshot"], ["evict", "--prefix-cache", "--yes"]])
def test_every_control_command_says_where_it_looked(args, tmp_path, capsys):
    sock = tmp_path / "nobody.sock"
    code, _, err = run([*args, "--socket", str(sock)], capsys)
    assert code == 2
    assert err.strip() == f"kvctl: no engine at {sock} (no socket); start one with `kvctl serve` or pass --socket"


def test_socket_from_env_then_default(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVTOP_SOCKET", str(tmp_path / "env.sock"))
    code, _, err = run(["status"], capsys)
    assert code == 2 and str(tmp_path / "env.sock") in err
    monkeypatch.delenv("KVTOP_SOCKET")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    code, _, err = run(["status"], capsys)
    assert code == 2 and f"{tmp_path}/kvtop-{os.getuid()}/engine.sock" in err
    # a socket file nobody listens on (a dead engine) reads the same
    dead = tmp_path / "dead.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(dead))
    s.close()
    code, _, err = run(["status", "--socket", str(dead)], capsys)
    assert code == 2 and f"no engine at {dead}" in err and "Traceback" not in err


def test_argument_errors_before_any_connection(tmp_path, capsys):
    sock = str(tmp_path / "x.sock")
    cases = [
        (["evict", "--socket", sock], "give exactly one of --seq ID, --prefix-cache or --blocks N"),
        (["evict", "--seq", "a", "--prefix-cache", "--socket", sock], "give exactly one of"),
        (["evict", "--prefix-cache", "--requeue", "--socket", sock], "--requeue goes with --seq ID"),
        (["drain", "--abort-after", "--socket", sock], "--abort-after needs --timeout"),
        (["serve", "--snapshot-on", "sometimes"], "unknown snapshot trigger sometimes"),
        (["completion", "tcsh"], "unknown shell 'tcsh'"),
    ]
    for args, message in cases:
        code, _, err = run(args, capsys)
        assert code == 1, (args, err)
        assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e309", "-1", "86401"])
def test_a_drain_timeout_that_cannot_be_used_is_one_line(value, tmp_path, capsys):
    """nan, inf and 1e309 (inf to Python) used to reach the engine as JSON it cannot hold: a traceback."""
    code, _, err = run(["drain", "--timeout", value, "--socket", str(tmp_path / "x.sock")], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "--timeout" in err and "from 0 to 86400" in err, err


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--drain-timeout", "nan"),
        ("--drain-timeout", "inf"),
        ("--drain-timeout", "1e309"),
        ("--drain-timeout", "86401"),
        ("--stats-interval", "nan"),
        ("--history", "inf"),
        ("--request-timeout", "inf"),
        ("--read-timeout", "nan"),
        ("--snapshot-cooldown", "-1"),
    ],
)
def test_serve_refuses_a_duration_it_cannot_use_in_one_line(flag, value, capsys):
    """nan passed every `< 0` check and inf every `> 0` one: a drain deadline of nan never came, an
    infinite one overflowed Retry-After. Refused before the model loads (no model named here)."""
    code, _, err = run(["serve", "--model", "/nonexistent-model", flag, value], capsys)
    assert code == 1
    assert len(err.strip().splitlines()) == 1 and "is not a number of seconds" in err, err
    assert flag.removeprefix("--").replace("-", "_") in err


BAD_URLS = {
    "http://127.0.0.1:abc": "the port 'abc' is not a number",
    "http://[::1": "the [ of its IPv6 address is not closed",
}


@pytest.mark.parametrize("url", list(BAD_URLS))
@pytest.mark.parametrize(
    "command",
    [
        ["status", "--url"],
        ["status", "--url", "http://127.0.0.1:1", "--url"],
        ["record", "-o", "{tmp}/x.kvsnap", "--url"],
        ["bench", "--url"],
        ["bench", "--base-url"],
    ],
)
def test_a_url_that_cannot_be_used_is_one_line(command, url, tmp_path, capsys):
    """httpx's InvalidURL from deep inside the first request used to end kvctl in a traceback."""
    code, _, err = run([part.format(tmp=tmp_path) for part in command] + [url], capsys)
    assert code != 0
    assert len(err.strip().splitlines()) == 1, err
    assert f"{url!r} is not a URL that can be reached: {BAD_URLS[url]}" in err
    assert os.listdir(tmp_path) == []


@pytest.mark.integration  # an HTTP server on a real socket
def test_serve_refuses_a_busy_port_before_loading_anything(tmp_path, capsys):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        code, _, err = run(
            ["serve", "--port", str(port), "--socket", str(tmp_path / "e.sock"), "--model", "nope"], capsys
        )
    finally:
        busy.close()
    assert code == 1
    assert err.strip() == f"kvctl: port {port} on 127.0.0.1 is in use: pass another --port (0 picks a free one)"


def test_serve_help_lists_engine_and_server_flags():
    result = CliRunner().invoke(cli.app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for flag in ("--host", "--port", "--socket", "--api-key", "--max-queue", "--stats-interval", "--history",
                 "--snapshot-on", "--snapshot-dir", "--kv-cache-memory", "--block-size", "--max-num-seqs",
                 "--kv-cache-dtype", "--enable-prefix-caching", "--served-model-name"):  # fmt: skip
        assert flag in result.output, flag


def test_serve_flags_reach_the_server(tiny_dir):
    """Each server flag becomes the server's setting (they are declared once, from ServerConfig)."""
    server = start_server(tiny_dir, "--max-queue", "5", "--stats-interval", "0.25", "--history", "30",
                          "--max-request-body", "2KiB", "--no-warmup", api_key="sesame")  # fmt: skip
    try:
        assert "warm-up   off (--no-warmup)" in server.log
        frame = server.stats()["server"]
        assert (frame["max_queue"], frame["stats_interval_s"], frame["history_s"]) == (5, 0.25, 30.0)
        with server.control() as c:  # --snapshot-dir: where a snapshot goes when no path is given
            assert Path(c.snapshot()["path"]).parent == server.snapshot_dir
        with httpx.Client(base_url=server.url, timeout=30) as http:
            assert http.get("/v1/models").status_code == 401  # --api-key from KVTOP_API_KEY
            big = {"model": server.model, "prompt": "x" * 4096}
            assert http.post("/v1/completions", json=big, headers={"Authorization": "Bearer sesame"}).status_code == 413
    finally:
        server.cleanup()


def _cell_styles(rows) -> list[str]:
    """The style of every character of rich Text rows, row after row."""
    out = []
    for row in rows:
        for line in row.split("\n"):
            styles = [""] * len(line.plain)
            for span in line.spans:
                styles[span.start : span.end] = [str(span.style)] * (span.end - span.start)
            out += styles
    return out


def test_status_and_dashboard_colour_a_range_the_same_way():
    # 768 blocks: `kvctl status` folds them into 4 rows of 96 (2 blocks a character), the dashboard
    # at 2 blocks a cell: the same ranges. Every range is a tie, where counting alone cannot choose.
    ties = ["uc", "cu", "su", "us", "c.", ".c", "ou", "uo", "s.", "co", "oc", ".s"]
    chars = "".join(ties[i % len(ties)] for i in range(384))
    status = summary.block_map(chars, 96)
    dashboard = render_cells(chars, 2, 96, set())
    assert _cell_styles([status]) == _cell_styles(dashboard)
    # the busier state wins a tie, on both: used over cached, shared over used, cached over free
    assert status.plain.replace("\n", "")[:6] == "uusscc"
    assert _cell_styles(dashboard)[:3] == ["green", "green", "magenta"]


def _good_snapshot(path: Path) -> Path:
    frame = {
        "schema": 1, "ts": 1.0, "engine": {"state": "running", "model": "m", "device": "cpu", "uptime_s": 1.0, "step": 3},
        "kv": {"blocks": "uc..", "num_blocks": 4}, "sequences": [{"id": "a", "state": "running", "block_ids": [0]}],
    }  # fmt: skip
    return write_snapshot(path, model="m", config={}, reason="test", frames=[frame, {**frame, "ts": 2.0}], events=[])


@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_replay_refuses_a_bad_file_in_one_line(tmp_path, capsys):
    missing = tmp_path / "missing.kvsnap"
    proc = kvctl("replay", str(missing))  # as a user runs it
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"kvctl: {missing}: no such file"
    for content, message in ((b"hello", "not an SQLite file"), (b"SQLite format 3\x00" + b"\x00" * 50, "damaged")):
        path = tmp_path / "bad.kvsnap"
        path.write_bytes(content)
        code, _, err = run(["replay", str(path)], capsys)
        assert code == 1 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.integration  # a real terminal (a pty)
def test_replay_opens_the_dashboard_on_the_file(tmp_path):
    """`kvctl replay FILE` on a terminal: the dashboard comes up replaying that file, `q` quits, exit 0."""
    snap = shutil.copy(ROOT / "snapshots" / "preemption-storm.kvsnap", tmp_path / "storm.kvsnap")
    pid, fd = pty.fork()
    if pid == 0:  # the child: a 160×40 terminal, then kvctl as a user types it
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
        os.execve(sys.executable, [sys.executable, "-m", "kvtop.ctl.cli", "replay", str(snap)], _env(TERM="xterm"))
    screen, deadline = b"", time.monotonic() + 90
    try:  # the header names the file it replays, the timeline the frame shown
        while "◆ replay".encode() not in screen or b"storm.kvsnap" not in screen or b"frame 1/" not in screen:
            assert time.monotonic() < deadline, f"the dashboard never showed the replay: {screen[-600:]!r}"
            if select.select([fd], [], [], 0.2)[0]:
                screen += os.read(fd, 65536)
        os.write(fd, b"q")
        done, status = 0, 0
        while not done:
            assert time.monotonic() < deadline, "q did not quit"
            if select.select([fd], [], [], 0.2)[0]:
                with contextlib.suppress(OSError):
                    os.read(fd, 65536)
            done, status = os.waitpid(pid, os.WNOHANG)
        pid = 0
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)


def test_completions_are_up_to_date(tmp_path):
    written = generate(tmp_path)
    assert written, "no completion script generated"
    expected = {p.name for p in written}
    present = {p.name for p in COMPLETIONS.iterdir() if p.name != ".gitkeep" and not p.name.startswith("README")}
    assert present == expected, "completions/ is stale: run `make completions`"
    for p in written:
        assert (COMPLETIONS / p.name).read_text() == p.read_text(), (
            f"completions/{p.name} is stale: run `make completions`"
        )


@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_kvctl_completion_prints_the_checked_in_scripts(capsys):
    proc = kvctl("completion", "bash")
    assert proc.returncode == 0 and proc.stdout == (COMPLETIONS / "kvctl.bash").read_text()
    for shell, name in (("zsh", "_kvctl"), ("fish", "kvctl.fish")):
        code, out, _ = run(["completion", shell], capsys)
        assert code == 0 and out == (COMPLETIONS / name).read_text()


def _bash_complete(words: list[str]) -> list[str]:
    script = f'source {COMPLETIONS / "kvctl.bash"}; COMP_WORDS=({" ".join(repr(w) for w in words)}); ' \
             f'COMP_CWORD={len(words) - 1}; _kvctl_complete; printf "%s\\n" "${{COMPREPLY[@]}}"'  # fmt: skip
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    return [w for w in out.splitlines() if w]


@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_bash_completion_completes():
    assert _bash_complete(["kvctl", "dr"]) == ["drain"]
    assert _bash_complete(["kvctl", "serve", "--kv-cache-d"]) == ["--kv-cache-dtype"]
    assert _bash_complete(["kvctl", "serve", "--kv-cache-dtype", ""]) == ["auto", "fp8_e4m3", "int8"]
    assert _bash_complete(["kvctl", "evict", "--pre"]) == ["--prefix-cache"]
    assert _bash_complete(["kvctl", "completion", ""]) == ["bash", "zsh", "fish"]


@pytest.mark.parametrize("shell", ["zsh", "fish"])
def test_zsh_and_fish_scripts_parse(shell):
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed")
    for path in COMPLETIONS.iterdir():
        if (shell == "zsh" and path.name.startswith("_")) or (shell == "fish" and path.suffix == ".fish"):
            subprocess.run([shell, "-n", str(path)], check=True)


@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_version_of_kvctl_and_kvtop():
    from kvtop import __version__

    for prog in ("kvtop.ctl.cli", "kvtop.dashboard.cli"):
        proc = subprocess.run([sys.executable, "-m", prog, "--version"], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        name = {"kvtop.ctl.cli": "kvctl", "kvtop.dashboard.cli": "kvtop"}[prog]
        assert proc.stdout.strip() == f"{name} {__version__}"  # not "Missing command"


def test_serve_warns_and_advertises_the_real_context_limit(tiny_dir):
    # max_model_len 8192 but 360 KiB of KV at 512 B/token holds 720 tokens
    server = start_server(tiny_dir, "--max-model-len", "8192", "--kv-cache-memory", "360KiB")
    try:
        with server.http() as http:
            card = http.get("/v1/models").json()["data"][0]
            assert card["max_model_len"] == 720  # what a request can really use, as vLLM's field
            long = http.post("/v1/completions", json={"model": server.model, "prompt": [5] * 800, "max_tokens": 1})
            assert long.status_code == 400 and "the 719 tokens a prompt may have" in long.json()["error"]["message"]
        warnings = [line for line in server.log.splitlines() if "warning" in line]
        assert len(warnings) == 1, server.log
        assert "max_model_len 8192 but the KV cache holds 720 tokens" in warnings[0]
        # the default warm-up ran before the first request, in prompts of 256 that fit the small cache
        assert "warm-up   a prefill of 512 tokens (2 × 256) and a decode step of 2 in" in server.log
        assert "raise --kv-cache-memory or lower --max-model-len" in warnings[0]
    finally:
        server.cleanup()
