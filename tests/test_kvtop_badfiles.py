"""kvtop --replay on a file it cannot read: one clear line on stderr, a non-zero exit, no traceback,
and the app never starts."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from kvtop.app import main

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
    monkeypatch.setattr("kvtop.app.KvtopApp.run", lambda self, *a, **k: started.append(self))
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


def test_bad_file_from_the_console_script(tmp_path: Path):
    """The installed entry point: nothing but the one line reaches the terminal."""
    path = tmp_path / "garbage.kvsnap"
    path.write_bytes(b"\x00\x01garbage" * 100)
    proc = subprocess.run(
        [sys.executable, "-c", "from kvtop.app import main; main()", "--replay", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr == f"kvtop: {path}: not a kvtop snapshot (not an SQLite file)\n"
