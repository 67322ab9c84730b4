"""Replay: `kvctl whatif` on the snapshot on screen — what happened, the recorded configuration
simulated (the self-check) and a what-if typed as `knob=value` pairs, side by side.

The simulation runs the engine's own scheduler (engine.whatif), so it needs the engine installed;
it runs in a thread, and the dialog stays answerable (esc) while it does."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.content import Content
from textual.widgets import DataTable, Input, Static

from kvtop.ctl.engine_gate import load_engine
from kvtop.dashboard.widgets.dialog import Dialog
from kvtop.entry import CLIError
from kvtop.protocol.errors import KvtopError
from kvtop.protocol.trace_file import load_trace

INT_KNOBS = ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len")
ON, OFF = ("on", "true", "yes", "1"), ("off", "false", "no", "0")
NEEDS_ENGINE = 'what-if runs the engine\'s scheduler: install it with pip install "kvtop[engine]"'
HELP = (
    "What if the recorded workload had run under another configuration? Type knob=value pairs, e.g.\n"
    "kv-cache-memory=2GiB max-num-seqs=32 kv-cache-dtype=int8 prefix-caching=off load=1.5x\n"
    "(the knobs of kvctl whatif; empty: the recorded configuration). enter simulates, esc closes."
)


def parse_whatif(text: str, knobs: tuple[str, ...]) -> tuple[dict, str]:
    """`kv-cache-memory=2GiB load=1.5x` -> ({"kv_cache_memory": "2GiB"}, "1.5x"). ValueError, one
    line, for a word that is not a known knob=value."""
    overrides: dict = {}
    load = "1x"
    for word in text.split():
        name, eq, value = word.partition("=")
        key = name.lstrip("-").replace("-", "_")
        key = "enable_prefix_caching" if key == "prefix_caching" else key
        if not eq or not value:
            raise ValueError(f"{word!r}: write knob=value, e.g. max-num-seqs=32")
        if key == "load":
            load = value
        elif key not in knobs:
            raise ValueError(f"{name!r} is not a knob: use load or {', '.join(k.replace('_', '-') for k in knobs)}")
        elif key in INT_KNOBS:
            if not value.isdigit():
                raise ValueError(f"{name}={value}: a whole number, please")
            overrides[key] = int(value)
        elif key == "enable_prefix_caching":
            if value.lower() not in ON + OFF:
                raise ValueError(f"{name}={value}: on or off")
            overrides[key] = value.lower() in ON
        else:
            overrides[key] = value
    return overrides, load


class WhatifScreen(Dialog[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Close")]

    def __init__(self, snapshot: Path) -> None:
        super().__init__(classes="dialog-screen")
        self.snapshot = snapshot

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog whatif") as box:
            box.border_title = f"What if · {self.snapshot.name}"
            yield Static(HELP, classes="dialog-body")
            yield Input(placeholder="e.g. kv-cache-memory=2GiB max-num-seqs=32", id="whatif-flags")
            yield Static("", id="whatif-status")
            yield DataTable(id="whatif-table", show_cursor=False, zebra_stripes=True)

    def on_mount(self) -> None:
        self.query_one("#whatif-flags", Input).focus()
        self.query_one("#whatif-table", DataTable).display = False

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self._say("simulating…", error=False)
        self.simulate(event.value)

    @work(thread=True, exclusive=True, group="whatif")
    def simulate(self, text: str) -> None:
        try:
            whatif = load_engine("engine.whatif.compare", "whatif")
            knobs = load_engine("engine.whatif.config", "whatif").KNOBS
        except CLIError:
            self.app.call_from_thread(self._say, NEEDS_ENGINE)
            return
        try:
            overrides, load = parse_whatif(text, knobs)
            result = whatif.compare(load_trace(self.snapshot), overrides, whatif.parse_load(load))
        except (ValueError, KvtopError) as exc:  # the trace's, the configuration's and the fit's errors
            self.app.call_from_thread(self._say, str(exc))
            return
        self.app.call_from_thread(self._show, result)

    def _say(self, text: str, error: bool = True) -> None:
        status = self.query_one("#whatif-status", Static)
        status.set_class(error, "dialog-error")
        status.update(Content(text))  # it may quote what was typed

    def _show(self, result) -> None:
        from kvtop.ctl.whatif_cmd import CHECK_LABELS, ROWS, format_figure

        table = self.query_one("#whatif-table", DataTable)
        table.clear(columns=True)
        load = "" if result.load == 1 else f" at {result.load:g}x load"
        table.add_columns("", "recorded", "simulated", f"what-if{load}")
        cols = result.columns()
        for label, key, kind in ROWS:
            table.add_row(label, *(format_figure(cols[c].get(key), kind) for c in ("recorded", "simulated", "whatif")))
        table.display = True
        check = ", ".join(
            f"{CHECK_LABELS[k]} {v * 100:+.1f} %" for k, v in result.self_check().items() if v is not None
        )
        said = f"what-if: {result.whatif_config.describe()}" + (
            f"\nself-check (simulated vs recorded): {check}" if check else ""
        )
        self._say("\n".join([said, *result.notes]), error=False)

    def action_cancel(self) -> None:
        self.dismiss(None)
