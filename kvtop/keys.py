"""kvtop's keys, by mode: what the footer, the help screen and `check_action` all read.

View keys work everywhere; the live actions exist only against an engine and without
`--readonly`; the replay keys only in replay (← and → are priority keys there, so that the
sequences table does not take them, and give way to any dialog or text box).
"""

from __future__ import annotations

from textual.binding import Binding

VIEW_KEYS = [
    Binding("q", "quit", "Quit"),
    Binding("question_mark", "help", "Help"),
    Binding("space", "pause", "Pause", tooltip="live: pause/resume the view · replay: play/pause"),
    Binding("slash", "filter", "Filter", tooltip="filter sequences by id or state (esc clears)"),
    Binding("o", "sort_next", "Sort", tooltip="sort sequences by the next column"),
    Binding("O", "sort_reverse", "Reverse", show=False, tooltip="reverse the sort order"),
    Binding("z", "zoom(1)", "Zoom in", show=False, tooltip="block map: fewer blocks per cell"),
    Binding("Z", "zoom(-1)", "Zoom out", show=False, tooltip="block map: more blocks per cell (back to fit)"),
    Binding("w", "latency_range", "Latency range", show=False, tooltip="latency bars: last minute ⇄ since start"),
    Binding("v", "verbose_events", "All events", show=False, tooltip="events: notable only ⇄ all"),
    *(
        Binding(str(i), f"tab({i})", f"Tab {i}", show=False, tooltip=f"small terminals: show tab {i}")
        for i in range(1, 6)
    ),
]
LIVE_KEYS = [
    Binding("d", "drain", "Drain", tooltip="drain: stop admitting, let requests finish (confirm, timeout)"),
    Binding("r", "resume", "Resume", tooltip="resume admitting requests (confirm)"),
    Binding("e", "evict_sequence", "Evict seq", tooltip="evict the selected sequence (confirm)"),
    Binding("E", "evict_prefix", "Evict cache", show=False, tooltip="evict the free prefix cache (confirm)"),
    Binding("s", "snapshot", "Snapshot", tooltip="write a .kvsnap snapshot (confirm, shows the path)"),
]
REPLAY_KEYS = [
    Binding("left", "step(-1)", "-1 frame", priority=True, tooltip="one frame back"),
    Binding("right", "step(1)", "+1 frame", priority=True, tooltip="one frame on"),
    Binding("left_square_bracket", "skip(-10)", "-10s", tooltip="10 seconds back"),
    Binding("right_square_bracket", "skip(10)", "+10s", tooltip="10 seconds on"),
    Binding("g", "start", "Start", show=False, tooltip="the first frame"),
    Binding("G", "end", "End", show=False, tooltip="the last frame (the snapshot's moment)"),
    Binding("j", "jump", "Jump", tooltip="jump to a time"),
    Binding("plus", "speed(1)", "Faster", show=False, tooltip="play faster (×0.25 … ×16)"),
    Binding("minus", "speed(-1)", "Slower", show=False, tooltip="play slower"),
]
LIVE_ACTIONS = {b.action for b in LIVE_KEYS}
REPLAY_ACTIONS = {b.action.split("(")[0] for b in REPLAY_KEYS}
