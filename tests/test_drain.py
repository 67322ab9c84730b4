"""The engine's drain, one state machine (engine/drain.py): running → draining → drained, resume
back to running; its events, its deadline, and the three strings the frame carries."""

from __future__ import annotations

from typing import get_args

from engine.drain import Drain, EngineState
from kvtop.protocol.frame import EngineState as FrameEngineState


def machine() -> tuple[Drain, list[str]]:
    events: list[str] = []
    return Drain(lambda kind, *_: events.append(kind)), events


def test_the_states_are_the_frames_strings():
    assert tuple(s.value for s in EngineState) == get_args(FrameEngineState)
    assert EngineState.DRAINING == "draining" and f"{EngineState.DRAINED}" == "drained"


def test_running_draining_drained_and_back():
    d, events = machine()
    assert d.state is EngineState.RUNNING and d.as_dict() is None
    d.start(in_flight=2)
    assert d.state is EngineState.DRAINING and d.info is not None and d.info.deadline is None
    d.settle(in_flight=1)
    assert d.state is EngineState.DRAINING
    d.settle(in_flight=0)
    assert d.state is EngineState.DRAINED
    d.settle(in_flight=0)
    d.resume()
    assert d.state is EngineState.RUNNING and d.info is None
    d.settle(in_flight=0)  # running stays running: only a drain settles
    assert d.state is EngineState.RUNNING
    assert events == ["drain_started", "drain_finished", "resumed"]


def test_a_drain_with_nothing_in_flight_is_drained_at_once():
    d, events = machine()
    d.start(in_flight=0)
    assert d.state is EngineState.DRAINED and events == ["drain_started", "drain_finished"]


def test_a_second_drain_keeps_its_start_and_sets_a_deadline_that_fires_once():
    d, events = machine()
    d.start(in_flight=3)
    started = d.info.started
    d.start(in_flight=3, timeout_s=0.0, abort_after=True)
    assert d.info.started == started and d.info.timeout_s == 0.0 and d.info.abort_after
    d.start(in_flight=3)  # abort_after sticks
    assert d.info.abort_after and events == ["drain_started"]
    assert d.deadline_passed(d.info.deadline)
    d.note_aborted(3)
    assert not d.deadline_passed(d.info.started + 1e9)
    assert d.as_dict() == {"started": started, "timeout_s": 0.0, "deadline": None, "abort_after": True, "aborted": 3}


def test_a_deadline_without_abort_after_aborts_nothing():
    d, _ = machine()
    d.start(in_flight=1, timeout_s=0.0)
    assert not d.deadline_passed(d.info.deadline + 1)
