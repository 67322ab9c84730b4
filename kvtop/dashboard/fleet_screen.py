"""The fleet screen: one line per engine — KV usage bar, running/waiting, preemptions/s, prefix hit
rate, TTFT/ITL P99 over the last minute, state — sortable, Enter opens that engine's dashboard.

Rounds come from a `FleetPoller` (`kvtop.fleet.Fleet`: each target's /metrics; or
`PrometheusFleet`: what a Prometheus server scrapes) in a thread worker that a timer re-arms after
each round, so rounds never overlap and the keys never wait on a slow engine. The screen stops
polling while the dashboard is on top and polls again at once when it comes back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import ClassVar, Protocol

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import DataTable, Footer, Static

from kvtop import fmt
from kvtop.dashboard.messages import FleetPolled
from kvtop.dashboard.widgets.help import HelpScreen
from kvtop.dashboard.widgets.sort_picker import SortScreen
from kvtop.fleet.poller import Row

BAR = 10  # cells of the KV usage bar
STATE_WIDTH = 24  # cells of a state with its error
STATE_STYLES = {"ok": "green", "slow": "yellow"}  # unreachable and not metrics: red


class FleetPoller(Protocol):
    title: str  # where the fleet comes from, for the screen's first line
    interval: float  # seconds between rounds

    def poll(self) -> list[Row]: ...  # blocking, bounded in time

    def close(self) -> None: ...


def _kv(r: Row) -> Text:
    if r.kv_usage is None:
        return Text(f"{'':{BAR}} {fmt.NONE:>6}")
    return Text.assemble(fmt.gauge(r.kv_usage, BAR), f" {fmt.pct(r.kv_usage):>6}")


def _state(r: Row) -> Text:
    if r.state == "ok":
        return Text("ok", "green")
    # second on the line, so short: 80 columns keep it beside the KV bar (the whole error: the header's line 2)
    return Text(f"{r.state}: {r.error or ''}"[:STATE_WIDTH], STATE_STYLES.get(r.state, "red"))


# key: (header, sort key, cell, what sorting by it answers)
COLUMNS: dict[str, tuple[str, Callable[[Row], object], Callable[[Row], object], str]] = {
    "engine": ("engine", lambda r: r.url, lambda r: Text(r.url), "the engine's URL"),
    "state": ("state", lambda r: (r.state == "ok", r.state), _state, "state (bad ones first)"),
    "kv": ("KV", lambda r: r.kv_usage, _kv, "KV cache usage"),
    "running": ("run", lambda r: r.running, lambda r: fmt.count(r.running), "requests running"),
    "waiting": ("wait", lambda r: r.waiting, lambda r: fmt.count(r.waiting), "requests waiting"),
    "preempt": (
        "preempt/s",
        lambda r: r.preemptions_per_s,
        lambda r: fmt.rate(r.preemptions_per_s),
        "preemptions/s over the last 30 s",
    ),
    "hit": ("prefix hit", lambda r: r.prefix_hit_rate, lambda r: fmt.pct(r.prefix_hit_rate), "prefix-cache hit rate"),
    "ttft": ("TTFT p99 ms", lambda r: r.ttft_p99, lambda r: fmt.ms(r.ttft_p99), "TTFT P99 over the last minute"),
    "itl": ("ITL p99 ms", lambda r: r.itl_p99, lambda r: fmt.ms(r.itl_p99), "ITL P99 over the last minute"),
    "kind": ("kind", lambda r: r.kind, lambda r: r.kind or fmt.NONE, "kind (vllm, sglang, llamacpp, kvtop)"),
}
TEXT_COLUMNS = ("engine", "kind", "state")


def cells_of(r: Row) -> list[Text]:
    cells = [cell(r) for _, _, cell, _ in COLUMNS.values()]
    return [c if isinstance(c, Text) else Text(str(c), justify="right") for c in cells]


def ordered(rows: list[Row], column: str, reverse: bool) -> list[Row]:
    """Rows sorted by `column`; rows without a value there come last whichever the direction."""
    key = COLUMNS[column][1]
    known = [r for r in rows if key(r) is not None]
    return sorted(known, key=key, reverse=reverse) + [r for r in rows if key(r) is None]


class FleetScreen(Screen):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit_fleet", "Quit"),
        Binding("question_mark", "help", "Help"),
        Binding("enter", "open", "Open engine", tooltip="the engine under the cursor: its dashboard (esc comes back)"),
        Binding("o", "sort_pick", "Sort", tooltip="sort engines: pick a column (the same one again reverses)"),
        Binding("O", "sort_reverse", "Reverse", show=False, tooltip="reverse the sort order"),
        Binding("j", "cursor(1)", "Down", show=False, tooltip="cursor down (↓ too)"),
        Binding("k", "cursor(-1)", "Up", show=False, tooltip="cursor up (↑ too)"),
    ]

    def __init__(self, fleet: FleetPoller) -> None:
        super().__init__(id="fleet")
        self.fleet = fleet
        self.rows: list[Row] = []
        self.sort, self.reverse = "kv", True
        self.polled_at: float | None = None
        self.error: str | None = None  # the last round's, when it failed as a whole
        self._built: list[tuple[str, list[Text]]] = []  # the rows in the table now
        self._cells: dict[str, tuple[Row, list[Text]]] = {}  # each engine's last row and its cells
        self._timer: Timer | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="fleet-header")
        table = DataTable(cursor_type="row", zebra_stripes=True, id="fleet-table")
        for key, (header, *_) in COLUMNS.items():
            table.add_column(header, key=key)
        yield table
        yield Footer()

    def on_mount(self) -> None:
        self.draw()
        self.query_one(DataTable).focus()

    def on_screen_resume(self) -> None:
        self._poll()

    def on_screen_suspend(self) -> None:
        if self._timer is not None:
            self._timer.stop()

    @work(thread=True, exclusive=True, group="fleet", exit_on_error=False)
    def _poll(self) -> None:
        try:
            rows, error = self.fleet.poll(), None
        except Exception as exc:  # a round that failed must not stop the rounds: say so, keep the rows
            rows, error = self.rows, f"{type(exc).__name__}: {exc}"
        self.post_message(FleetPolled(rows, time.time(), error))

    @on(FleetPolled)
    def _polled(self, message: FleetPolled) -> None:
        self.rows, self.polled_at, self.error = message.rows, message.at, message.error
        self.draw()
        if self.is_current:  # hidden under the dashboard: polled again when it comes back
            self._timer = self.set_timer(self.fleet.interval, self._poll, name="fleet-poll")

    def draw(self) -> None:
        self._fill(self.query_one(DataTable))
        self._draw_header()

    def _draw_header(self) -> None:
        """Line 1: the fleet, its round and sort; line 2: the engine under the cursor — its whole
        error where it is not ok (the table's state column holds STATE_WIDTH cells of it)."""
        bad = sum(r.state != "ok" for r in self.rows)
        when = f"round at {fmt.clock(self.polled_at)}, every {self.fleet.interval:g}s" if self.polled_at else "polling…"
        if self.error:
            when = f"the last round failed ({self.error}); rows from the one before"
        arrow = "↓" if self.reverse else "↑"
        self.query_one("#fleet-header", Static).update(
            Text.assemble(
                ("kvtop fleet ", "bold reverse"),
                f" {self.fleet.title} · ",
                (f"{len(self.rows)} engines", "bold"),
                f", {len(self.rows) - bad} ok",
                (f", {bad} not ok" if bad else "", "bold red"),
                f" · {when} · sort {COLUMNS[self.sort][0]} {arrow} · enter opens one\n",
                self._cursor_line(),
            )
        )

    def _cursor_line(self) -> Text:
        row = self.selected()
        if row is None:
            return Text("")
        if row.state != "ok":
            return Text(f"{row.url}: {row.state}: {row.error or ''}", STATE_STYLES.get(row.state, "red"))
        return Text(f"{row.url} · {row.kind or fmt.NONE} · {row.model or fmt.NONE}", "dim")

    @on(DataTable.RowHighlighted)
    def _row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        self._draw_header()

    def _fill(self, table: DataTable) -> None:
        """The rows in the chosen order. An engine whose row did not change keeps its cells (a big
        fleet's round changes few); the same engines in the same order: only the changed cells are
        set; otherwise the table is rebuilt, the cursor kept on its engine."""
        built, changed, cells = [], set(), {}
        for r in ordered(self.rows, self.sort, self.reverse):
            last = self._cells.get(r.url)
            cells[r.url] = (r, last[1] if last is not None and last[0] == r else cells_of(r))
            built.append((r.url, cells[r.url][1]))
            if last is None or last[0] != r:
                changed.add(r.url)
        if [k for k, _ in built] == [k for k, _ in self._built]:
            for key in changed:
                for column, new, old in zip(COLUMNS, cells[key][1], self._cells[key][1], strict=True):
                    if new != old:
                        table.update_cell(key, column, new)
        else:
            at = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value if table.row_count else None
            table.clear()
            for key, row_cells in built:
                table.add_row(*row_cells, key=key)
            if at is not None and at in cells:
                table.move_cursor(row=table.get_row_index(at), animate=False)
        self._built, self._cells = built, cells

    def selected(self) -> Row | None:
        table = self.query_one(DataTable)
        if not table.row_count:
            return None
        url = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        return next((r for r in self.rows if r.url == url), None)

    @on(DataTable.RowSelected)
    def _row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.action_open()

    @on(DataTable.HeaderSelected)
    def _header(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        self.sort_by(str(event.column_key.value))

    def action_open(self) -> None:
        row = self.selected()
        if row is not None:
            self.app.drill(row.url)  # type: ignore[attr-defined]

    def sort_by(self, column: str) -> None:
        """By `column`; the same column again reverses. Numbers start high, text starts at A."""
        if column == self.sort:
            self.reverse = not self.reverse
        else:
            self.sort, self.reverse = column, column not in TEXT_COLUMNS
        self.draw()

    def action_sort_pick(self) -> None:
        choices = {key: help_ for key, (_, _, _, help_) in COLUMNS.items()}
        self.app.push_screen(
            SortScreen(self.sort, self.reverse, choices, "engines"), lambda c: self.sort_by(c) if c else None
        )

    def action_sort_reverse(self) -> None:
        self.sort_by(self.sort)

    def action_cursor(self, step: int) -> None:
        table = self.query_one(DataTable)
        if table.row_count:
            table.move_cursor(row=min(max(table.cursor_row + step, 0), table.row_count - 1))

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen([("Fleet", list(self.BINDINGS))], "fleet"))  # type: ignore[arg-type]

    def action_quit_fleet(self) -> None:
        self.app.exit(0)
