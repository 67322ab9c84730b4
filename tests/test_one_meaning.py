"""One meaning per number: the KV block counts are the same on every surface at one moment.

A real `kvctl serve` (tiny model, prefix caching) holds a shared prefix between two running
requests, a cached prefix of a finished one, and free blocks. Its steps are slowed down
(KVTOP_FAULT_INJECT=stall) so that the block map holds still while the stats frame, `kvctl status
--json`, `kvctl status`, `/metrics` and the dashboard's KV panel are read; each must show the
block map's counts: free '.', cached 'c', used 'u', shared 's', adding up to the cache.
"""

from __future__ import annotations

import json
import os
import re
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtop.dashboard.app import KvtopApp
from kvtop.dashboard.widgets.kv_panel import KVPanel
from kvtop.dashboard.widgets.view import View
from kvtop.sources import LiveSource
from tests.helpers import widget_text
from tests.server_harness import kvctl, start_server

STALL_S = 3.0  # per step: a block boundary (16 decode steps) is ~48 s away; a loaded box still sees a prefill
PREFIX = list(range(1000, 1048))  # three full blocks of 16 tokens
STATES = ("free", "cached", "used", "shared")


@pytest.fixture(scope="module")
def server(tiny_dir):
    # 256 KiB at 512 B/token: 32 blocks of 16 tokens
    s = start_server(tiny_dir, "--kv-cache-memory", "256KiB", "--stats-interval", "0.2",
                     env={"KVTOP_FAULT_INJECT": f"stall={STALL_S}"})  # fmt: skip
    yield s
    s.cleanup()


def _complete(server, prompt: list[int], max_tokens: int) -> None:
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    try:
        with server.http(timeout=600) as http:
            http.post("/v1/completions", json=body)
    except httpx.HTTPError:
        pass  # the server is stopped under the long ones at the end of the module


def _send(server, prompt: list[int], max_tokens: int) -> threading.Thread:
    t = threading.Thread(target=_complete, args=(server, prompt, max_tokens), daemon=True)
    t.start()
    return t


def _counts(kv: dict) -> dict[str, int]:
    return {s: kv[s] for s in STATES}


def _status_text_counts(text: str) -> dict[str, int]:
    flat = " ".join(text.split())
    m = re.search(r"(\d+) used, (\d+) shared, (\d+) cached, (\d+) free of (\d+) blocks", flat)
    assert m, flat
    used, shared, cached, free, _ = map(int, m.groups())
    return {"free": free, "cached": cached, "used": used, "shared": shared}


def _metrics_counts(text: str) -> dict[str, int]:
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == "kvtop_kv_cache_blocks":
            out = {s.labels["state"]: int(s.value) for s in family.samples}
    return {s: out[s] for s in STATES}


def _panel_counts(text: str) -> dict[str, int]:
    pairs = dict(re.findall(r"(used|shared|cached|free)\s+(\d+)", text))
    return {s: int(pairs[s]) for s in STATES}


def _held_still(server) -> dict:
    """Two requests sharing PREFIX run, a finished one's prefix sits cached: that frame."""
    _send(server, list(range(2000, 2040)), 1)  # finishes at once: its 2 full blocks stay cached
    server.wait_for(lambda f: f["kv"]["cached"] == 2 and not f["sequences"], 60, "a cached prefix")
    _send(server, [*PREFIX, 7], 300)
    # a prompt in prefill holds its blocks (and its tokens) from the step that schedules it
    prefill = server.wait_for(
        lambda f: f["scheduler"]["running"] == 1 and f["sequences"][0]["output_tokens"] == 0, 60, "a prefill"
    )
    assert prefill["sequences"][0]["computed_tokens"] == 0  # the model is still writing its KV…
    assert prefill["scheduler"]["active_tokens"] == len(PREFIX) + 1  # …and its tokens count already
    server.wait_for(lambda f: f["sequences"] and f["sequences"][0]["output_tokens"] >= 1, 60, "the first token")
    _send(server, [*PREFIX, 8], 300)  # finds PREFIX's three blocks cached by the first one
    return server.wait_for(lambda f: f["kv"]["shared"] == 3, 60, "a shared prefix")


@pytest.mark.anyio
async def test_free_cached_used_shared_agree_on_every_surface(server):
    frame = _held_still(server)
    env = {**os.environ, "COLUMNS": "200"}
    for _attempt in range(3):  # a sequence may cross a block boundary mid-reading: then read again
        frame = server.stats()
        status_json = json.loads(kvctl("status", "--json", "--socket", str(server.socket), env=env).stdout)
        status_text = kvctl("status", "--socket", str(server.socket), env=env).stdout
        with server.http() as http:
            metrics = http.get("/metrics").text
        app = KvtopApp(LiveSource(server.socket, interval=0.2), readonly=True)
        async with app.run_test(size=(160, 48)) as pilot:
            while not (
                app.dashboard.source.current and app.dashboard.source.current["kv"]["blocks"] == frame["kv"]["blocks"]
            ):
                await pilot.pause(0.1)
            # the poll thread sets `current` before the app draws it: wait for the panel's counts
            # (a loaded machine took longer than one pause; the counts may not have been there)
            for _ in range(50):
                panel = widget_text(app.query_one(KVPanel))
                if re.search(r"free\s+\d+", panel):
                    break
                await pilot.pause(0.1)
        after = server.stats()
        if after["kv"]["blocks"] == frame["kv"]["blocks"] == status_json["kv"]["blocks"]:
            break
    else:
        pytest.fail("the block map never held still for one reading")
    expected = _counts(frame["kv"])
    kv = frame["kv"]
    assert expected == {"free": kv["blocks"].count("."), "cached": 2, "used": 2, "shared": 3}
    assert sum(expected.values()) == kv["num_blocks"] == 32
    assert kv["allocatable"] == expected["free"] + expected["cached"]
    assert kv["usage"] == pytest.approx(5 / 32)  # held by requests: used + shared
    assert _counts(status_json["kv"]) == expected
    assert _status_text_counts(status_text) == expected
    assert re.search(r"diagnosis\s+nothing stands out", status_text)  # 2 running, none waiting: not KV-bound
    assert _metrics_counts(metrics) == expected
    assert _panel_counts(panel) == expected
    assert f"total       {kv['num_blocks']}" in panel


def test_peak_is_never_below_usage(server):
    for _ in range(10):
        f = server.stats()
        assert f["kv"]["peak_usage"] >= f["kv"]["usage"] > 0
    with server.http() as http:
        text = http.get("/metrics").text
    samples = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if set(s.labels) == {"model_name", "engine"}}  # fmt: skip
    assert samples["kvtop_kv_cache_peak_usage_perc"] >= samples["kvtop_kv_cache_usage_perc"] > 0


def test_an_eviction_the_engine_has_not_stepped_to_is_queued_not_done(server):
    """Steps here take 3 s: asked not to wait, the socket answers 202 with `applied` false (the
    sequence still runs until the next step); asked to wait, `kvctl evict` answers once the engine
    applied it — the sequence gone — and says "evicted"."""
    for token in (7, 8)[len(server.stats()["sequences"]) :]:  # the first test's two requests, when run alone
        _send(server, [*PREFIX, token], 300)
    first, second = [
        s["id"] for s in server.wait_for(lambda f: len(f["sequences"]) == 2, 60, "two requests")["sequences"]
    ]
    with server.control() as c:
        answer = c.evict(seq_id=first, wait_s=0)
        assert answer == {"evicted": "sequence", "seq_id": first, "requeue": False, "applied": False}
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(server.socket)), base_url="http://kvtop") as raw:
        r = raw.post("/v1/evict", json={"seq_id": second, "wait_s": 0})  # the status code itself
    assert r.status_code == 202 and r.json()["applied"] is False
    server.wait_for(lambda f: not f["sequences"], 60, "both evictions applied at the next step")
    _send(server, [*PREFIX, 9], 300)
    third = server.wait_for(lambda f: f["sequences"], 60, "a third request")["sequences"][0]["id"]
    proc = kvctl("evict", "--seq", third, "--yes", "--wait", "30", "--socket", str(server.socket))
    assert proc.returncode == 0 and f"evicted {third}" in proc.stdout, proc.stdout + proc.stderr
    assert not server.stats()["sequences"]
    refused = kvctl("evict", "--seq", third, "--yes", "--wait", "61", "--socket", str(server.socket))
    assert refused.returncode != 0 and "--wait must be a number of seconds from 0 to 60" in refused.stderr


def test_kv_panel_shows_a_dash_where_there_is_no_data():
    panel = KVPanel()
    empty = panel.draw(View(frame={}, history=[], events=[]), 40, 12).plain
    assert "0" not in empty  # no data is not a measurement of zero
    assert "used" in empty and "–" in empty
    # an old recording's peak can lag its usage: the panel never shows peak below usage
    stale = {"kv": {"usage": 0.778, "peak_usage": 0.0, "num_blocks": 9}, "scheduler": {"active_tokens": 12}}
    text = panel.draw(View(frame=stale, history=[], events=[]), 40, 12).plain
    assert "77.8%" in text.splitlines()[-1] and "12 tokens" in text


@pytest.mark.parametrize("name", ["preemption-storm", "prefix-thrash"])
def test_old_snapshot_frames_are_read_in_todays_meaning(name):
    """The shipped recordings predate `allocatable`: their cached blocks sat inside `free` and
    their shared ones inside `used`. Read back, every frame counts as the block map draws."""
    from pathlib import Path

    from kvtop.protocol.frame import normalize_kv
    from kvtop.protocol.snapshot import read_snapshot

    snap = read_snapshot(Path(__file__).parents[1] / "snapshots" / f"{name}.kvsnap")
    converted = 0
    for f in snap.frames:
        kv = f["kv"]
        device = kv["blocks"][: kv["num_blocks"]]
        assert {s: kv[s] for s in STATES} == {s: device.count(c) for s, c in zip(STATES, ".cus", strict=True)}
        assert kv["allocatable"] == kv["free"] + kv["cached"]
        assert normalize_kv(kv) == kv  # converting twice changes nothing
        converted += kv["cached"] > 0 or kv["shared"] > 0
    assert name == "preemption-storm" or converted > 0  # the thrash holds cached blocks: a real conversion
