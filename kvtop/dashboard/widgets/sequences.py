"""Sequences: one row per request in the engine, sortable by any column, filterable with `/`.

The table is plain lines of text, drawn from each frame in the chosen order (a header, then the
rows that fit): like every other panel it repaints only the lines that changed, where a
`DataTable` re-rendered every cell each frame (half of kvtop's CPU). The cursor follows the
selected sequence by id, so a row keeps its highlight as others come and go. Moving the cursor
(j/k, ↑/↓, page keys, the wheel, a click) selects: the block map then highlights that
sequence's blocks and `e` evicts it; enter, or a click on the selected row, opens its details;
a click on a column's header sorts by it. Ids and filter text come from clients and files: they
are drawn as plain text, never as markup.
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual import events, on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.content import Content
from textual.widgets import Input

from kvtop import fmt
from kvtop.dashboard.messages import FilterChanged, SequenceOpened, SequenceSelected, SortChosen
from kvtop.dashboard.widgets.view import SORT_COLUMNS, LinesStatic, View, ViewState, set_border

ID_WIDTH = 12
MAX_ROWS = 500  # rows kept, in the chosen order; the title says how many more there are
GAP = 2  # spaces between columns (1 where the panel is too narrow for 2)


def short_id(seq_id: str, width: int = ID_WIDTH) -> str:
    """Server ids are long (`cmpl-` + 24 hex): keep both ends, which tell them apart."""
    if len(seq_id) <= width:
        return seq_id
    return f"{seq_id[: width // 2]}…{seq_id[-(width - width // 2 - 1) :]}"


COLUMNS = {  # key: (header, frame field, formatter)
    "id": ("id", "id", short_id),
    "state": ("state", "state", str),
    "prompt": ("prompt", "prompt_tokens", str),
    "output": ("out", "output_tokens", str),
    "cached": ("cached", "cached_tokens", str),
    "blocks": ("blks", "num_blocks", str),
    "kv": ("KV MiB", "kv_bytes", fmt.mib),
    "age": ("age", "age_s", fmt.age),
    "ttft": ("TTFT", "ttft_s", fmt.secs),
    "itl": ("ITL", "itl_s", fmt.secs),
}
KEYS = tuple(COLUMNS)
assert KEYS == SORT_COLUMNS
LEFT = ("id", "state")  # left-aligned columns; numbers are right-aligned
# Where the panel is too narrow for every column (the 120x40 overview), these go first, in this
# order, so that the latency columns stay whole; the sort column never goes (Enter shows them all).
HIDE_FIRST = ("blocks", "cached", "age", "prompt")
STATE_STYLES = {"running": "green", "waiting": "yellow", "swapped": "magenta"}


def visible(sequences: list[dict], text: str, column: str, reverse: bool) -> list[dict]:
    """The rows to show: those whose id or state contains `text`, sorted by `column`; rows
    without a value there (no TTFT yet) come last whichever the direction."""
    needle = text.strip().lower()
    rows = [s for s in sequences if not needle or needle in f"{s.get('id', '')} {s.get('state', '')}".lower()]
    field = COLUMNS[column][1]
    known = [s for s in rows if s.get(field) is not None]
    missing = [s for s in rows if s.get(field) is None]
    key = (lambda s: str(s[field]).lower()) if column in ("id", "state") else (lambda s: s[field])
    return sorted(known, key=key, reverse=reverse) + missing


def row_cells(s: dict, id_width: int) -> list[str]:
    """A sequence's cells, in COLUMNS order, as the plain text shown."""
    cells = []
    for key, (_, field, formatter) in COLUMNS.items():
        v = s.get(field)
        cells.append("-" if v is None else short_id(str(v), id_width) if key == "id" else formatter(v))
    return cells


def draw_row(cells: list[str], widths: list[int], gap: int, shown: list[int], style: str = "") -> Text:
    """One line of the columns `shown` (indices into COLUMNS): each cell padded to its column (text
    left, numbers right); the state coloured, or all of it in `style` (the header). The cells are
    plain text (a `[/x]` id is shown as typed)."""
    line = Text()
    for n, i in enumerate(shown):
        if n:
            line.append(" " * gap)
        key, cell = KEYS[i], cells[i]
        padded = cell.ljust(widths[i]) if key in LEFT else cell.rjust(widths[i])
        line.append(padded, style or (STATE_STYLES.get(cell, "") if key == "state" else ""))
    return line


def fit_columns(widths: list[int], width: int, sort: str | None) -> tuple[list[int], int]:
    """The columns to show (indices into COLUMNS) and the gap between them: every column two spaces
    apart where that fits, else one space apart, else without HIDE_FIRST's columns, in its order,
    until the rest fits (never the sort column)."""
    shown = list(range(len(KEYS)))

    def need(gap: int) -> int:
        return sum(widths[i] for i in shown) + gap * (len(shown) - 1)

    if need(GAP) <= width:
        return shown, GAP
    for key in HIDE_FIRST:
        if need(1) <= width:
            break
        if key != sort:
            shown.remove(KEYS.index(key))
    return shown, 1


class SequencesTable(LinesStatic):
    """The rows as lines of text: a header, then the rows that fit, the cursor's row reversed.
    `ids` are the sequence ids in the order shown; the cursor is an index into them."""

    can_focus = True
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "open", "Details"),
        Binding("up", "move(-1)", "Up", show=False),
        Binding("down", "move(1)", "Down", show=False),
        Binding("pageup", "page(-1)", "Page up", show=False),
        Binding("pagedown", "page(1)", "Page down", show=False),
        Binding("home", "move(-1_000_000)", "First", show=False),
        Binding("end", "move(1_000_000)", "Last", show=False),
    ]

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.ids: list[str] = []
        self.cursor_row = 0
        self.top = 0  # the first row on screen
        self.state: ViewState | None = None
        self._cells: list[list[str]] = []
        self._headers: list[str] = [h for h, _, _ in COLUMNS.values()]
        self._widths: list[int] = [len(h) for h in self._headers]
        self._gap = GAP
        self._shown: list[int] = list(range(len(KEYS)))  # the columns that fit, as drawn last

    @property
    def row_count(self) -> int:
        return len(self.ids)

    def cursor_id(self) -> str | None:
        return self.ids[self.cursor_row] if self.ids else None

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        stack = self.app.screen_stack  # empty while shutting down
        return bool(stack) and stack[-1] is self.screen  # under a dialog, the keys (and footer) are its

    def set_rows(self, ids: list[str], cells: list[list[str]], state: ViewState) -> None:
        """Show these rows; the cursor goes to the selected sequence, or stays where it was and
        selects the row now under it (the selected one finished or was filtered out)."""
        self.ids, self._cells, self.state = ids, cells, state
        arrow = "↓" if state.sort_reverse else "↑"
        self._headers = [f"{h}{arrow}" if key == state.sort else h for key, (h, _, _) in COLUMNS.items()]
        self._widths = [max([len(h), *(len(row[i]) for row in cells)]) for i, h in enumerate(self._headers)]
        if state.selected_seq in ids:
            self.cursor_row = ids.index(state.selected_seq)
        elif ids:
            self.cursor_row = min(max(self.cursor_row, 0), len(ids) - 1)
            self._select()
        self.draw()

    def move_cursor(self, row: int) -> None:
        """Put the cursor on `row` (clamped to the rows there are) and select its sequence."""
        if self.ids:
            self.cursor_row = min(max(row, 0), len(self.ids) - 1)
            self._select()
            self.draw()

    def _select(self) -> None:
        """The view state learns the selection now, so that a frame drawn before the screen has read
        the message keeps this cursor; the message makes the block map follow."""
        seq_id = self.ids[self.cursor_row]
        if self.state is not None and self.state.selected_seq != seq_id:
            self.state.selected_seq = seq_id
            self.post_message(SequenceSelected(seq_id))

    def draw(self) -> None:
        width, height = self.content_size
        if width <= 0 or height <= 0:
            return  # not laid out yet: on_resize draws
        shown = max(1, height - 1)
        self.top = min(self.top, self.cursor_row)
        self.top = max(self.top, self.cursor_row - shown + 1, 0)
        self.top = max(0, min(self.top, len(self.ids) - shown))
        self._shown, self._gap = fit_columns(self._widths, width, self.state.sort if self.state else None)
        lines = [draw_row(self._headers, self._widths, self._gap, self._shown, style="bold")]
        for i in range(self.top, min(len(self.ids), self.top + shown)):
            line = draw_row(self._cells[i], self._widths, self._gap, self._shown)
            if i == self.cursor_row:
                line.truncate(width, pad=True)
                line.stylize("reverse")
            lines.append(line)
        lines.extend(Text() for _ in range(1 + shown - len(lines)))  # as many lines each frame
        for line in lines:
            line.truncate(width, overflow="ellipsis")
        self.paint(Text("\n").join(lines))

    def on_resize(self) -> None:
        self.draw()

    def action_move(self, step: int) -> None:
        self.move_cursor(self.cursor_row + step)

    def action_page(self, direction: int) -> None:
        self.move_cursor(self.cursor_row + direction * max(1, self.content_size.height - 2))

    def action_open(self) -> None:
        if (seq_id := self.cursor_id()) is not None:
            self.post_message(SequenceOpened(seq_id))

    def on_click(self, event: events.Click) -> None:
        """A header sorts by its column; a row selects it, and a click on the selected row opens it."""
        offset = event.get_content_offset(self)
        if offset is None:
            return
        if offset.y == 0:
            x = 0
            for i in self._shown:
                if x <= offset.x < x + self._widths[i] + self._gap:
                    self.post_message(SortChosen(KEYS[i]))
                    return
                x += self._widths[i] + self._gap
            return
        row = self.top + offset.y - 1
        if row < len(self.ids):
            if row == self.cursor_row:
                self.action_open()
            else:
                self.move_cursor(row)

    def on_mouse_scroll_down(self, event: events.MouseScrollDown) -> None:
        event.stop()
        self.action_move(3)

    def on_mouse_scroll_up(self, event: events.MouseScrollUp) -> None:
        event.stop()
        self.action_move(-3)


class SequencesPanel(Vertical):
    DEFAULT_CLASSES = "panel"
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "clear_filter", "Clear filter", show=False)]

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.view: View | None = None
        self.border_title = "Sequences"

    def compose(self) -> ComposeResult:
        yield SequencesTable(id="seq-table")
        yield Input(placeholder="filter by id or state (enter: keep, esc: clear)", id="seq-filter")

    def on_mount(self) -> None:
        self.query_one("#seq-filter", Input).display = False

    @property
    def table(self) -> SequencesTable:
        return self.query_one(SequencesTable)

    def show(self, view: View) -> None:
        self.view = view
        st = view.state
        all_seqs = view.frame.get("sequences", [])
        matching = visible(all_seqs, st.filter, st.sort, st.sort_reverse)
        rows = matching[:MAX_ROWS]  # the top ones: nobody reads 100,000 rows, and each costs
        id_width = min(40, max(ID_WIDTH, self.size.width - 78))  # wide panels show whole ids
        self.table.set_rows([str(s.get("id")) for s in rows], [row_cells(s, id_width) for s in rows], st)
        shown = f"{len(rows)}" if len(rows) == len(all_seqs) else f"{len(rows)} of {len(all_seqs)}"
        if len(rows) < len(matching):
            shown = f"first {len(rows):,} of {len(matching):,}; … and {len(matching) - len(rows):,} more, / filters"
        arrow = "↓" if st.sort_reverse else "↑"
        title = f"Sequences ({shown}) · sort {COLUMNS[st.sort][0]} {arrow}"
        set_border(self, title, Content(f"filter: {st.filter}") if st.filter else "")

    def move_cursor(self, step: int) -> None:
        self.table.action_move(step)

    # ---- filter ---------------------------------------------------------------------------
    def open_filter(self) -> None:
        """Show the filter box and give it the keyboard now, not after a refresh as `focus()`
        does: keys already typed after `/` (a paste, tmux send-keys) must land in it."""
        box = self.query_one("#seq-filter", Input)
        box.display = True
        if self.view is not None:
            box.value = self.view.state.filter
            box.cursor_position = len(box.value)
        self.screen.set_focus(box)

    @on(Input.Changed, "#seq-filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        event.stop()
        self.post_message(FilterChanged(event.value))

    @property
    def filtering(self) -> bool:
        boxes = self.query("#seq-filter")  # none yet while a resize rebuilds the layout and this panel
        return bool(boxes) and self.screen.focused is boxes.first()

    def close_filter(self, keep: bool) -> None:
        """Enter (keep) or esc (clear) in the filter box, handled as the key arrives (priority keys
        of the screen): the keys typed after it are keys again. The box itself finishes after the
        letters typed before it, which may still be on their way to it."""
        box = self.query_one("#seq-filter", Input)
        self.screen.set_focus(self.table)
        box.call_later(self._filter_closed, keep)

    def _filter_closed(self, keep: bool) -> None:
        box = self.query_one("#seq-filter", Input)
        if not keep:
            box.value = ""
            self.post_message(FilterChanged(""))
        box.display = bool(box.value)

    @on(Input.Submitted, "#seq-filter")
    def _filter_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.close_filter(keep=True)

    def action_clear_filter(self) -> None:
        self.close_filter(keep=False)
