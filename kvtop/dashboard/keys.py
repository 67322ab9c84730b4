"""kvtop's keys, by mode: what the footer, the help screen and `check_action` all read. The
dashboard's screens bind them (`DashboardScreen` the view's and the filter's, `LiveDashboard` the
live and fleet keys, `ReplayDashboard` the replay keys); the app binds only `QUIT_NOW`.

View keys work everywhere; the live actions exist only where the source has the engine's controls
(our socket: not another engine's `/metrics`, not a replay) and without `--readonly`; the replay
keys only in replay (← and → are priority keys there, so that the sequences table does not take
them, and give way to any dialog or text box). Escape goes back to the fleet screen from a
dashboard opened there.

While a dialog or the filter box has the keyboard, no app key fires but ctrl+c and F10
(`DashboardScreen.check_action`; `q` is then a letter): keys typed after `/` are filter text, never actions. `/` is a
priority key so that the filter box takes the keyboard before the keys typed after it are read.
"""

from __future__ import annotations

from textual.binding import Binding

# the app's one key: it quits from any screen, dialog or text box
QUIT_NOW = Binding(
    "ctrl+c,f10", "quit_now", "Quit", show=False, priority=True, tooltip="quit, even from a dialog or the filter"
)
VIEW_KEYS = [
    Binding("q", "quit", "Quit"),
    QUIT_NOW,
    Binding("question_mark", "help", "Help"),
    Binding("space", "pause", "Pause", tooltip="live: pause/resume the view · replay: play/pause"),
    Binding(
        "slash", "filter", "Filter", priority=True, tooltip="filter sequences by id or state (enter keeps, esc clears)"
    ),
    Binding("j", "cursor(1)", "Down", show=False, tooltip="sequences: cursor down (↓ too)"),
    Binding("k", "cursor(-1)", "Up", show=False, tooltip="sequences: cursor up (↑ too)"),
    Binding(
        "enter",
        "open_sequence",
        "Details",
        show=False,  # the footer shows the sequences table's own enter while it has the focus
        tooltip="the sequence under the cursor: id, tokens, blocks, events",
    ),
    Binding("o", "sort_pick", "Sort", tooltip="sort sequences: pick a column (the same one again reverses)"),
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
# enter and esc in the filter box: priority keys, so that the keys typed after them are read as keys
FILTER_KEYS = [
    Binding("enter", "filter_done(True)", "Keep filter", show=False, priority=True),
    Binding("escape", "filter_done(False)", "Clear filter", show=False, priority=True),
]
LIVE_KEYS = [
    Binding("d", "drain", "Drain", tooltip="drain: stop admitting, let requests finish (y confirms)"),
    Binding("r", "resume", "Resume", tooltip="resume admitting requests (y confirms)"),
    Binding("e", "evict_sequence", "Evict seq", tooltip="evict the selected sequence (y confirms)"),
    Binding("E", "evict_prefix", "Evict cache", show=False, tooltip="evict the free prefix cache (y confirms)"),
    Binding("s", "snapshot", "Snapshot", tooltip="write a .kvsnap snapshot (shows the path; enter writes)"),
]
REPLAY_KEYS = [
    Binding("left", "step(-1)", "-1 frame", priority=True, tooltip="one frame back"),
    Binding("right", "step(1)", "+1 frame", priority=True, tooltip="one frame on"),
    Binding("left_square_bracket", "skip(-10)", "-10s", tooltip="10 seconds back"),
    Binding("right_square_bracket", "skip(10)", "+10s", tooltip="10 seconds on"),
    Binding("g", "start", "Start", show=False, tooltip="the first frame"),
    Binding("G", "end", "End", show=False, tooltip="the last frame (the snapshot's moment)"),
    Binding("t", "jump", "Jump", tooltip="jump to a time"),
    Binding("f", "whatif", "What if", tooltip="this recording under another configuration (kvctl whatif)"),
    Binding("plus", "speed(1)", "Faster", show=False, tooltip="play faster (×0.25 … ×16)"),
    Binding("minus", "speed(-1)", "Slower", show=False, tooltip="play slower"),
]
# an engine without controls (another engine's /metrics): `s` records the frames kvtop read, on this side
RECORD_KEY = Binding("s", "snapshot", "Record", tooltip="write the frames read so far as a .kvsnap (kvtop writes it)")
# a dashboard opened from the fleet screen (Enter on a row): escape goes back (after the filter's and dialogs' own)
FLEET_KEYS = [Binding("escape", "fleet", "Fleet", priority=True, tooltip="back to the fleet of engines")]
LIVE_ACTIONS = {b.action for b in LIVE_KEYS}
REPLAY_ACTIONS = {b.action.split("(")[0] for b in REPLAY_KEYS}
# the dashboard's own actions (not Textual's, such as tab's focus_next, which dialogs need)
DASHBOARD_ACTIONS = {b.action.split("(")[0] for b in [*VIEW_KEYS, *FILTER_KEYS, *LIVE_KEYS, *REPLAY_KEYS]}
