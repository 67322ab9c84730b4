"""`kvctl whatif` as a user runs it: three columns, `--json` with the same names, and each bad
input one line on stderr with a non-zero exit, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.whatif.synthetic import synthetic_trace
from engine.whatif.timing import StepTimeModel
from kvtop.ctl import cli
from kvtop.protocol.snapshot import write_snapshot
from kvtop.protocol.trace_file import write_jsonl
from tests.test_trace import record

SNAPSHOTS = Path(__file__).parent.parent / "snapshots"
HEADER = {"model": "m", "dtype": "float32", "num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "block_size": 16,
          "num_blocks": 64, "kv_cache_dtype": "auto", "bytes_per_token": 512, "kv_cache_memory": 64 * 16 * 512,
          "max_num_seqs": 8, "max_num_batched_tokens": 256, "max_model_len": 2048, "enable_prefix_caching": True,
          "schedule_policy": "fcfs", "preemption_mode": "recompute", "cpu_blocks": 0}  # fmt: skip


def run(args: list[str], capsys) -> tuple[int, str, str]:
    code = 0
    try:
        cli.main(["whatif", *args])
    except SystemExit as exc:
        code = exc.code or 0
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def snapshot(tiny_dir, tmp_path_factory) -> Path:
    engine = record(tiny_dir)
    return write_snapshot(tmp_path_factory.mktemp("cli") / "r.kvsnap", model="tiny", config={}, reason="test",
                          frames=[engine.stats()], events=[], trace=engine.trace_tables())  # fmt: skip


@pytest.fixture
def calibration(tmp_path) -> Path:
    path = tmp_path / "cal.json"
    StepTimeModel((0.005, 2e-5, 2e-4, 1e-8), 0.0005, source="test").save(path)
    return path


def test_three_columns_side_by_side(snapshot, capsys):
    code, out, err = run([str(snapshot), "--kv-cache-memory", "640KiB"], capsys)
    assert code == 0, err
    assert "recorded" in out and "simulated (self-check)" in out and "what-if" in out
    assert "preemptions" in out and "TTFT P99 ms" in out and "self-check (simulated vs recorded)" in out
    assert "80 blocks × 16" in out


def test_json_has_one_object_per_column_with_the_same_names(snapshot, capsys):
    code, out, _ = run([str(snapshot), "--kv-cache-memory", "640KiB", "--json"], capsys)
    doc = json.loads(out)
    assert code == 0 and set(doc) >= {"recorded", "simulated", "whatif", "self_check"}
    assert set(doc["recorded"]) == set(doc["simulated"]) == set(doc["whatif"])
    assert doc["recorded"]["preemptions"] > 0 and doc["whatif"]["preemptions"] == 0
    assert doc["recorded"]["preemptions"] == doc["simulated"]["preemptions"] or doc["simulated"]["preemptions"] > 0
    assert doc["whatif"]["ttft_p50_s"] > 0 and doc["recorded"]["itl_p50_s"] is None


def test_a_jsonl_trace_with_a_calibration_and_load(tmp_path, calibration, capsys):
    write_jsonl(tmp_path / "t.jsonl", synthetic_trace(300, rate=5, config=HEADER, prompt_len=(32, 256)), "test")
    code, out, err = run([str(tmp_path / "t.jsonl"), "--calibration", str(calibration), "--load", "2x",
                          "--max-num-seqs", "4", "--json"], capsys)  # fmt: skip
    assert code == 0, err
    doc = json.loads(out)
    assert doc["recorded"]["completed"] == doc["whatif"]["completed"] == 300
    assert doc["whatif"]["concurrency_mean"] <= 4 < doc["simulated"]["concurrency_mean"] + 4


def _one_line_failure(code: int, out: str, err: str, *words: str) -> None:
    assert code != 0 and "Traceback" not in err + out
    assert len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, err


def test_an_old_snapshot_has_no_trace(capsys):
    code, out, err = run([str(SNAPSHOTS / "preemption-storm.kvsnap")], capsys)
    _one_line_failure(code, out, err, "schema version 1", "take a new snapshot")


def test_another_engines_recording_has_no_trace(capsys):
    code, out, err = run([str(SNAPSHOTS / "engines" / "vllm-under-load.kvsnap")], capsys)
    _one_line_failure(code, out, err, "what-if needs one")


def test_a_truncated_trace(tmp_path, calibration, capsys):
    write_jsonl(tmp_path / "t.jsonl", synthetic_trace(50, config=HEADER), "test")
    text = (tmp_path / "t.jsonl").read_text()
    (tmp_path / "cut.jsonl").write_text(text[: len(text) * 2 // 3])
    code, out, err = run([str(tmp_path / "cut.jsonl"), "--calibration", str(calibration)], capsys)
    _one_line_failure(code, out, err, "truncated")


def test_a_configuration_that_cannot_hold_one_request(snapshot, capsys):
    code, out, err = run([str(snapshot), "--max-model-len", "8"], capsys)
    _one_line_failure(code, out, err, "cannot hold even one request", "--kv-cache-memory")
    code, out, err = run([str(snapshot), "--kv-cache-memory", "1KiB"], capsys)
    _one_line_failure(code, out, err, "holds no block")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--kv-cache-dtype", "fp4"], ["--kv-cache-dtype 'fp4'", "int8"]),
        (["--kv-cache-memory", "lots"], ["lots"]),
        (["--load", "fast"], ["--load", "1.5x"]),
        (["--max-num-seqs", "many"], ["--max-num-seqs", "integer"]),
        (["--preemption-mode", "swap"], ["--cpu-offload-memory"]),
    ],
)
def test_an_unknown_flag_value(snapshot, capsys, args, words):
    code, out, err = run([str(snapshot), *args], capsys)
    _one_line_failure(code, out, err, *words)


def test_too_few_steps_to_fit_asks_for_a_calibration(tmp_path, capsys):
    write_jsonl(tmp_path / "t.jsonl", synthetic_trace(20, config=HEADER), "test")
    code, out, err = run([str(tmp_path / "t.jsonl")], capsys)
    _one_line_failure(code, out, err, "too few to fit", "--calibration")


def test_a_sweep_finds_the_smallest_kv_memory_meeting_the_slo(snapshot, capsys):
    code, out, err = run([str(snapshot), "--sweep", "kv-cache-memory=10KiB..1MiB", "--points", "5",
                          "--slo", "ttft_p99=60s", "--json"], capsys)  # fmt: skip
    assert code == 0, err
    doc = json.loads(out)
    rows = doc["points"]
    assert [r["value"] for r in rows] == sorted(r["value"] for r in rows) and len(rows) == 5
    assert "error" in rows[0], "10 KiB holds one block: no prompt of the trace fits"
    first_ok = next(r for r in rows if "error" not in r and not r["rejected"])
    assert doc["meets"] == first_ok["label"], "the smallest setting serving every request within the SLO"
    assert rows[-1]["preemptions"] == 0 and rows[-1]["preemptions"] <= first_ok["preemptions"]


def test_a_sweep_prints_a_chart_and_the_answer(snapshot, capsys):
    code, out, err = run(
        [str(snapshot), "--sweep", "max-num-seqs=1..8", "--points", "4", "--slo", "ttft_p99=1ms"], capsys
    )
    assert code == 0, err
    assert "█" in out and "no setting in the range meets it" in out


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--sweep", "colour=1..2"], ["--sweep", "kv-cache-memory"]),
        (["--sweep", "load=2..1"], ["LO < HI"]),
        (["--sweep", "load=1..2", "--slo", "ttft=3"], ["--slo", "ttft_p99=2s"]),
    ],
)
def test_a_bad_sweep_is_one_line(snapshot, capsys, args, words):
    code, out, err = run([str(snapshot), *args], capsys)
    _one_line_failure(code, out, err, *words)


def test_kvctl_calibrate_writes_a_model_whatif_takes(tiny_dir, snapshot, tmp_path, capsys):
    cal = tmp_path / "cal.json"
    code = 0
    try:
        cli.main(["calibrate", "--model", str(tiny_dir), "--dtype", "float32", "--kv-cache-memory", "8MiB",
                  "--requests", "30", "--max-prompt", "64", "--max-output", "12", "-o", str(cal)])  # fmt: skip
    except SystemExit as exc:
        code = exc.code or 0
    out = capsys.readouterr().out
    assert code == 0 and "fitted on" in out and "kvctl calibrate" in out
    model = StepTimeModel.load(cal)
    assert model.steps >= 20 and min(model.coef) >= 0 and model.coef[0] + model.coef[2] > 0
    code, out, err = run([str(snapshot), "--calibration", str(cal), "--json"], capsys)
    assert code == 0, err
    assert "kvctl calibrate" in json.loads(out)["timing"]


def test_a_calibration_that_is_not_one_is_one_line(snapshot, tmp_path, capsys):
    (tmp_path / "x.json").write_text('{"coef": [1, 2]}')
    code, out, err = run([str(snapshot), "--calibration", str(tmp_path / "x.json")], capsys)
    _one_line_failure(code, out, err, "not a step-time calibration", "kvctl calibrate")


@pytest.mark.anyio
async def test_kvtop_replay_opens_the_same_comparison(snapshot):
    """`f` in kvtop --replay: the three columns for the snapshot on screen, the what-if typed as
    knob=value; a word that is not a knob, and a snapshot without a trace, say so in the dialog."""
    from textual.widgets import DataTable

    from kvtop.dashboard.app import KvtopApp
    from kvtop.dashboard.widgets.whatif_dialog import WhatifScreen
    from kvtop.sources import ReplaySource
    from tests.helpers import until
    from tests.helpers import widget_text as text

    app = KvtopApp(ReplaySource.open(snapshot))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("f")
        await until(pilot, lambda: isinstance(app.screen, WhatifScreen), "the what-if dialog")
        status = app.screen.query_one("#whatif-status")
        await pilot.press(*"max-seqs=3", "enter")
        await until(pilot, lambda: "is not a knob" in text(status), "the bad knob's error")
        app.screen.query_one("#whatif-flags").value = ""
        await pilot.press(*"kv-cache-memory=640KiB", "enter")
        table = app.screen.query_one("#whatif-table", DataTable)
        await until(pilot, lambda: table.display and table.row_count > 0, "the comparison", timeout=240)
        labels = [str(table.get_row_at(i)[0]) for i in range(table.row_count)]
        assert "preemptions" in labels and "TTFT P99 ms" in labels
        assert [str(c.label) for c in table.columns.values()][1:] == ["recorded", "simulated", "what-if"]
        assert "80 blocks × 16" in text(status) and "self-check" in text(status)
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, WhatifScreen), "the dialog to close")

    old = KvtopApp(ReplaySource.open(SNAPSHOTS / "preemption-storm.kvsnap"))  # recorded before traces existed
    async with old.run_test(size=(120, 40)) as pilot:
        await pilot.press("f", "enter")
        await until(pilot, lambda: isinstance(old.screen, WhatifScreen), "the what-if dialog")
        status = old.screen.query_one("#whatif-status")
        await until(pilot, lambda: "written before request traces" in text(status), "the trace error", 60)
