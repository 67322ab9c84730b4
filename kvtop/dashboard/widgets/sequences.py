"""Sequences: one row per request in the engine, sortable by any column, filterable with `/`.

The table is rebuilt from each frame in the chosen order; the cursor follows the selected
sequence by id, so a row keeps its highlight as others come and go. Moving the cursor selects
(the block map then highlights that sequence's blocks; `e` evicts it); enter opens its details.
Ids and filter text come from clients and files: they are drawn as plain text, never as markup.
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.content import Content
from textual.widgets import DataTable, Input

from kvtop.dashboard.messages import FilterChanged, SequenceOpened, SequenceSelected, SortChosen
from kvtop.dashboard.widgets import fmt
from kvtop.dashboard.widgets.view import SORT_COLUMNS, View

ID_WIDTH = 12
MAX_ROWS = 500  # rows drawn, in the chosen order; the title says how many more there are


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
assert tuple(COLUMNS) == SORT_COLUMNS
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


def row_cells(s: dict, id_width: int) -> list[Text]:
    """A sequence's cells, in COLUMNS order."""
    cells = []
    for key, (_, field, formatter) in COLUMNS.items():
        v = s.get(field)
        text = "-" if v is None else short_id(v, id_width) if key == "id" else formatter(v)
        if key == "state":
            cells.append(Text(text, STATE_STYLES.get(text, "")))
        elif key == "id":
            cells.append(Text(text))  # a str cell would be read as markup
        else:
            cells.append(Text(text, justify="right"))
    return cells


class SequencesTable(DataTable):
    """The table itself; row keys are sequence ids. Enter opens the row's details (a click only selects)."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("enter", "select_cursor", "Details")]

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        stack = self.app.screen_stack  # empty while shutting down
        return bool(stack) and stack[-1] is self.screen  # under a dialog, the keys (and footer) are its

    def action_select_cursor(self) -> None:
        seq_id = self.cursor_id()
        if seq_id is not None:
            self.post_message(SequenceOpened(seq_id))

    def cursor_id(self) -> str | None:
        if not self.row_count:
            return None
        return self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value


class SequencesPanel(Vertical):
    DEFAULT_CLASSES = "panel"
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "clear_filter", "Clear filter", show=False)]

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.view: View | None = None
        self.border_title = "Sequences"
        self._syncing = False
        self._built: list[tuple[str, list[Text]]] | None = None  # the rows in the table now

    def compose(self) -> ComposeResult:
        table = SequencesTable(cursor_type="row", zebra_stripes=False, id="seq-table")
        for key, (header, _, _) in COLUMNS.items():
            table.add_column(header, key=key)
        yield table
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
        rows = matching[:MAX_ROWS]  # a table of 100,000 rows takes minutes to build: the top ones
        table = self.table
        scroll_y = table.scroll_y
        id_width = min(40, max(ID_WIDTH, self.size.width - 78))  # wide panels show whole ids
        self._syncing = True
        try:
            built = [(s["id"], row_cells(s, id_width)) for s in rows]
            before, self._built = self._built, built
            if before is not None and [k for k, _ in before] == [k for k, _ in built]:
                # the same rows in the same order: only the cells that changed (a rebuild costs a
                # new layout each frame, and an idle engine's table is not touched at all)
                for (key, cells), (_, was) in zip(built, before):
                    for column, cell, old in zip(COLUMNS, cells, was):
                        if cell != old:
                            table.update_cell(key, column, cell, update_width=True)
            else:
                table.clear()
                for key, cells in built:
                    table.add_row(*cells, key=key)
            ids = [s["id"] for s in rows]
            if st.selected_seq in ids:
                table.move_cursor(row=ids.index(st.selected_seq), animate=False, scroll=False)
            table.scroll_y = scroll_y
        finally:
            self._syncing = False
        if rows and st.selected_seq not in ids:  # it finished or was filtered out: the row under the cursor
            self.post_message(SequenceSelected(ids[min(max(table.cursor_row, 0), len(ids) - 1)]))
        arrow = "↓" if st.sort_reverse else "↑"
        shown = f"{len(rows)}" if len(rows) == len(all_seqs) else f"{len(rows)} of {len(all_seqs)}"
        if len(rows) < len(matching):
            shown = f"first {len(rows):,} of {len(matching):,}; … and {len(matching) - len(rows):,} more, / filters"
        self.border_title = f"Sequences ({shown}) · sort {COLUMNS[st.sort][0]} {arrow}"
        self.border_subtitle = Content(f"filter: {st.filter}") if st.filter else ""

    @on(DataTable.RowHighlighted)
    def _highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        if not self._syncing and event.row_key.value is not None:
            self.post_message(SequenceSelected(event.row_key.value))

    @on(DataTable.HeaderSelected)
    def _header(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        self.post_message(SortChosen(str(event.column_key.value)))

    def move_cursor(self, step: int) -> None:
        table = self.table
        if table.row_count:
            table.move_cursor(row=min(max(table.cursor_row + step, 0), table.row_count - 1))

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
        return self.screen.focused is self.query_one("#seq-filter", Input)

    def close_filter(self, keep: bool) -> None:
        """Enter (keep) or esc (clear) in the filter box, handled as the key arrives (priority keys
        of the app): the keys typed after it are keys again. The box itself finishes after the
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
