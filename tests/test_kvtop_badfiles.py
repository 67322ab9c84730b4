"""kvtop --replay on a file it cannot read: one clear line on stderr, a non-zero exit, no traceback,
and the app never starts; crafted frames and events the same (kvtop and kvctl); a bad frame met
while replaying is a status line; a 20,000-frame recording opens at once, quits on `q`, and
costs about the memory of a small one."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtop.dashboard.cli import main

SNAPSHOTS = sorted((Path(__file__).resolve().parent.parent / "snapshots").glob("*.kvsnap"))


def _foreign_sqlite(path: Path) -> None:
    con = sqlite3.connect(path)
    con.execute("create table notes (id integer primary key, body text)")
    con.execute("insert into notes (body) values ('not a snapshot')")
    con.commit()
    con.close()


def _wrong_version(path: Path) -> None:
    path.write_bytes(SNAPSHOTS[0].read_bytes())
    con = sqlite3.connect(path)
    con.execute("update meta set schema_version = 99")
    con.commit()
    con.close()


def _truncated(path: Path) -> None:
    data = SNAPSHOTS[0].read_bytes()
    path.write_bytes(data[: len(data) // 3])


BAD_FILES = {
    "missing": (lambda p: None, "no such file"),
    "directory": (lambda p: p.mkdir(), "not a file"),
    "empty": (lambda p: p.write_bytes(b""), "not an SQLite file"),
    "text": (lambda p: p.write_text("hello, this is not a snapshot\n" * 20), "not an SQLite file"),
    "foreign-sqlite": (_foreign_sqlite, "not a kvtop snapshot"),
    "wrong-version": (_wrong_version, "schema version 99"),
    "truncated": (_truncated, "truncated"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_is_one_line_and_a_nonzero_exit(case: str, tmp_path: Path, capsys, monkeypatch):
    make, expected = BAD_FILES[case]
    path = tmp_path / f"{case}.kvsnap"
    make(path)
    started = []
    monkeypatch.setattr("kvtop.dashboard.app.KvtopApp.run", lambda self, *a, **k: started.append(self))
    with pytest.raises(SystemExit) as exit_info:
        main(["--replay", str(path)])
    assert exit_info.value.code not in (0, None)
    assert not started, "the dashboard must not start on a bad file"
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kvtop: ")
    assert expected in lines[0]
    assert "Traceback" not in err


@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_bad_file_from_the_console_script(tmp_path: Path):
    """The installed entry point: nothing but the one line reaches the terminal."""
    path = tmp_path / "garbage.kvsnap"
    path.write_bytes(b"\x00\x01garbage" * 100)
    proc = subprocess.run(
        [sys.executable, "-c", "from kvtop.dashboard.cli import main; main()", "--replay", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr == f"kvtop: {path}: not a kvtop snapshot (not an SQLite file)\n"


# ---- crafted files: frames that are not stats frames, events without a usable time --------------
def _first_frame() -> dict:
    con = sqlite3.connect(f"file:{SNAPSHOTS[0]}?mode=ro", uri=True)
    try:
        return json.loads(con.execute("select frame from frames order by ts limit 1").fetchone()[0])
    finally:
        con.close()


def _edit(*statements: tuple[str, tuple]):
    """A copy of a real snapshot with `statements` applied."""

    def make(path: Path) -> None:
        path.write_bytes(SNAPSHOTS[0].read_bytes())
        con = sqlite3.connect(path)
        for sql, args in statements:
            con.execute(sql, args)
        con.commit()
        con.close()

    return make


def _frame(n: int, text: str):
    """The n-th frame (1-based, in time order) replaced by `text`."""
    nth = "(select rowid from frames order by ts, rowid limit 1 offset ?)"
    return _edit((f"update frames set frame = ? where rowid = {nth}", (text, n - 1)))


CRAFTED = {
    "number": (_frame(3, "123"), "frame 3 is not a stats frame: a JSON number, not an object"),
    "list": (_frame(3, "[]"), "frame 3 is not a stats frame: a JSON array, not an object"),
    "empty object": (_frame(3, "{}"), "frame 3 is not a stats frame: the frame: missing schema, ts, engine"),
    "nested 200k deep": (_frame(3, "[" * 200_000 + "]" * 200_000), "frame 3 is not a stats frame"),
    "not JSON": (_frame(1, "{oops"), "frame 1 is not a stats frame: not JSON"),
    "kv without counts": (lambda p: _frame(2, json.dumps({**_first_frame(), "kv": {"blocks": 7}}))(p),
                          "frame 2 is not a stats frame: kv: missing block_size"),
    "sequence id a number": (
        lambda p: _frame(2, json.dumps({**_first_frame(), "sequences": [{**SEQ, "id": 5}]}))(p),
        "frame 2 is not a stats frame: sequences[0].id: expected string",
    ),
    "event ts NULL": (_edit(("update events set ts = NULL where rowid = 5", ())), "event 5 has no usable timestamp (NULL)"),
    "event ts text": (_edit(("update events set ts = 'soon' where rowid = 7", ())), "event 7 has no usable timestamp"),
    "frame ts NULL": (_edit(("update frames set ts = NULL where rowid = 9", ())), "frame 1 has no usable timestamp"),
}  # fmt: skip
SEQ = {"id": "s", "state": "running", "prompt_tokens": 1, "output_tokens": 1, "cached_tokens": 0, "num_blocks": 1,
       "kv_bytes": 1, "age_s": 1.0, "ttft_s": None, "block_ids": [0]}  # fmt: skip


@pytest.mark.parametrize("tool", ["kvtop", "kvctl"])
@pytest.mark.parametrize("case", sorted(CRAFTED))
@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_crafted_snapshot_is_one_line_and_exit_1(case: str, tool: str, tmp_path: Path):
    make, expected = CRAFTED[case]
    path = tmp_path / "crafted.kvsnap"
    make(path)
    cmd = (
        ["-m", "kvtop.ctl.cli", "replay", str(path)]
        if tool == "kvctl"
        else ["-m", "kvtop.dashboard.cli", "--replay", str(path)]
    )
    proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(("kvtop: ", "kvctl: ")) and f"{path}: " in lines[0]
    assert expected in lines[0], lines[0]


@pytest.mark.anyio
@pytest.mark.slow  # 5 s of Pilot: the full suite's, not the fast lane's
async def test_a_bad_frame_met_while_replaying_is_a_status_line(tmp_path: Path):
    from kvtop.dashboard.app import KvtopApp
    from kvtop.dashboard.widgets.header import EngineHeader
    from kvtop.dashboard.widgets.timeline import Timeline
    from kvtop.sources import ReplaySource
    from tests.helpers import widget_text

    path = tmp_path / "late.kvsnap"
    _frame(60, "{}")(path)  # past the frames checked at open: the file opens
    source = ReplaySource.open(path)
    async with KvtopApp(source).run_test(size=(160, 48)) as pilot:
        await pilot.pause()
        await pilot.press(*["right"] * 58)
        good = source.current
        await pilot.press("right")
        assert source.index == 59
        timeline = widget_text(pilot.app.query_one(Timeline))
        assert "frame 60 is not a stats frame: the frame: missing schema" in timeline
        assert source.current is good  # the last good frame stays on screen
        assert f"step {good['engine']['step']}" in widget_text(pilot.app.query_one(EngineHeader))
        await pilot.press("space")  # playing over it does not crash either
        await pilot.pause(0.5)
        await pilot.press("space", "right")
        assert "not a stats frame" not in widget_text(pilot.app.query_one(Timeline))


def test_a_jump_to_a_time_that_is_not_finite_is_refused():
    from kvtop.sources import parse_offset

    for text in ("nan", "inf", "-inf", "1e999", "nan%", "inf%", "1:nan", "1:1e999", "9" * 400 + ":00"):
        with pytest.raises(ValueError, match="time"):
            parse_offset(text, 60.0)
    assert parse_offset("50%", 60.0) == 30.0 and parse_offset("-5", 60.0) == 55.0


# ---- a big recording ----------------------------------------------------------------------------
BIG_FRAMES = 20_000


@pytest.fixture(scope="module")
def big_snapshot(tmp_path_factory) -> Path:
    """20,000 frames (~10 KB each, ~200 MB): rows written straight into a copy of a real snapshot."""
    import sqlite_utils

    path = tmp_path_factory.mktemp("big") / "big.kvsnap"
    path.write_bytes(SNAPSHOTS[0].read_bytes())
    base = _first_frame()
    base["pad"] = "x" * 8000  # more weight per frame, as a wide block map or many sequences give
    t0 = base["ts"]
    text = json.dumps({**base, "ts": -1.0, "engine": {**base["engine"], "step": -2}})
    head, rest = text.split('"ts": -1.0', 1)
    mid, tail = rest.split('"step": -2', 1)
    db = sqlite_utils.Database(path)
    db["frames"].delete_where()
    db["frames"].insert_all(
        ({"ts": t0 + i * 0.5, "step": i, "frame": f'{head}"ts": {t0 + i * 0.5!r}{mid}"step": {i}{tail}'}
         for i in range(BIG_FRAMES)),
        batch_size=1000,
    )  # fmt: skip
    db.close()
    return path


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def _open_look_and_quit(path: Path, frames: int) -> float:
    """kvtop --replay in a terminal: it shows the first frame, goes to the end, `q` quits; its peak RSS."""
    from tests.test_kvtop_terminal import Terminal, base_env

    term = Terminal(["--replay", str(path)], base_env(TERM="xterm-256color"), size=(120, 40))
    try:
        term.read_until(f"frame 1/{frames}", timeout=90)
        term.press("G")
        term.read_until(f"frame {frames}/{frames}", timeout=90)
        peak = _peak_rss_mib(term.pid)
        term.press("q")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pid, status = os.waitpid(term.pid, os.WNOHANG)
            if pid:
                assert os.waitstatus_to_exitcode(status) == 0
                return peak
            with contextlib.suppress(AssertionError):  # keep reading: a full terminal would block it
                term.read_until("\x00", timeout=0.2)
        raise AssertionError("kvtop did not quit on q")
    finally:
        with contextlib.suppress(OSError):
            os.close(term.fd)
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(term.pid, 9)
            os.waitpid(term.pid, 0)


@pytest.mark.integration  # a real terminal (a pty)
def test_a_big_recording_opens_at_once_answers_q_and_stays_small(big_snapshot: Path):
    small = _open_look_and_quit(SNAPSHOTS[0], 100)
    big = _open_look_and_quit(big_snapshot, BIG_FRAMES)
    print(f"\npeak RSS: {small:.0f} MiB on a {SNAPSHOTS[0].stat().st_size >> 20} MiB snapshot, {big:.0f} MiB on "
          f"{big_snapshot.stat().st_size >> 20} MiB ({BIG_FRAMES} frames)")  # fmt: skip
    assert big < small + 200, (small, big)


def test_lazy_frames_keep_a_bounded_cache(big_snapshot: Path):
    from kvtop.protocol.snapshot_reader import CACHE_BYTES, CACHE_FRAMES
    from kvtop.sources import ReplaySource

    source = ReplaySource.open(big_snapshot)
    try:
        assert len(source.frames) == BIG_FRAMES
        for offset in range(0, int(source.end_ts - source.start_ts), 997):
            source.seek(offset)
            history = source.history()
            assert history[-1] is source.current and history[-1]["ts"] == source._ts[source.index]
        cache = source.frames
        assert len(cache._cache) <= CACHE_FRAMES and cache._bytes <= CACHE_BYTES + 64 * 1024
        assert source.end()["engine"]["step"] == BIG_FRAMES - 1
    finally:
        source.close()


@pytest.mark.anyio
@pytest.mark.slow  # 2 s of Pilot: the full suite's, not the fast lane's
async def test_a_frame_with_100k_sequences_draws_a_window_of_them(tmp_path: Path):
    from kvtop.dashboard.app import KvtopApp
    from kvtop.dashboard.widgets.sequences import MAX_ROWS, SequencesPanel, SequencesTable
    from kvtop.sources import ReplaySource

    path = tmp_path / "crowd.kvsnap"
    crowd = _first_frame()
    crowd["sequences"] = [{**SEQ, "id": f"cmpl-{i:024x}-0", "output_tokens": i} for i in range(100_000)]
    _frame(100, json.dumps(crowd))(path)  # the snapshot's moment
    source = ReplaySource.open(path)
    async with KvtopApp(source).run_test(size=(160, 48)) as pilot:
        await pilot.pause()
        await pilot.press("G")
        await pilot.pause()
        assert source.index == 99 and source.error is None
        panel = pilot.app.query_one(SequencesPanel)
        assert pilot.app.query_one(SequencesTable).row_count == MAX_ROWS
        assert f"first {MAX_ROWS:,} of 100,000; … and {100_000 - MAX_ROWS:,} more" in str(panel.border_title)
        await pilot.press("left", "right")  # away and back: still a window
        assert pilot.app.query_one(SequencesTable).row_count == MAX_ROWS


# ---- the frame check itself ---------------------------------------------------------------------
@pytest.mark.parametrize("path", SNAPSHOTS, ids=lambda p: p.stem)
def test_recorded_incidents_pass_the_frame_check(path: Path):
    """If the schema gains a required key, old files must still replay (kvtop.protocol.frame.normalize_frame)."""
    from kvtop.protocol.snapshot_reader import SnapshotReader

    with SnapshotReader(path) as reader:
        for i in range(len(reader)):
            reader.frame(i)


def test_the_frame_check_refuses_what_the_json_schema_refuses():
    from jsonschema import Draft202012Validator

    from kvtop.protocol.frame import normalize_frame
    from kvtop.protocol.frame_schema import check_frame, frame_schema

    validator = Draft202012Validator(frame_schema())
    good = normalize_frame(_first_frame())
    assert check_frame(good) is None
    mutations = {
        "ts": "yesterday", "schema": 2, "engine": [], "kv": None, "sequences": {}, "events": [{"ts": 1}],
        "scheduler": {"running": 1}, "memory": {**good["memory"], "nvml": 7},
        "latency": {**good["latency"], "ttft": {**good["latency"]["ttft"], "counts": [1, "2"]}},
        "prefix": {**good["prefix"], "hit_rate": "high"},
    }  # fmt: skip
    for key, bad in mutations.items():
        frame = {**good, key: bad}
        assert not validator.is_valid(frame), key
        assert check_frame(frame), key
    del good["kv"]["blocks"]
    assert not validator.is_valid(good) and check_frame(good) == "kv: missing blocks"
