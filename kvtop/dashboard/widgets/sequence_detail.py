"""Enter on a sequence: everything the frame says about it, with its whole id, its block ids and
its events. It follows the frames while open (a finished sequence shows its last state, marked as
gone); esc / q / enter close it. Ids come from clients and files: all of it is plain Text.
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.content import Content
from textual.widgets import Static

from kvtop import fmt
from kvtop.dashboard.widgets.dialog import Dialog
from kvtop.dashboard.widgets.view import View


def block_ranges(ids: list[int]) -> str:
    """Block ids as runs, in table order: [3, 4, 5, 9, 12, 13] → `3–5, 9, 12–13`."""
    runs: list[list[int]] = []
    for b in ids:
        if runs and b == runs[-1][1] + 1:
            runs[-1][1] = b
        else:
            runs.append([b, b])
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in runs) or "none"


def detail_text(seq_id: str, seq: dict, gone: bool, events: list[dict], now: float) -> Text:
    rows = [
        ("id", seq_id),
        ("state", "gone: finished or evicted since (its last frame below)" if gone else str(seq.get("state"))),
        (
            "tokens",
            f"prompt {seq.get('prompt_tokens', 0)} · output {seq.get('output_tokens', 0)} · "
            f"cached {seq.get('cached_tokens', 0)} (from the prefix cache)",
        ),
        ("KV", f"{seq.get('num_blocks', 0)} blocks · {fmt.size(seq.get('kv_bytes'))}"),
        ("age", fmt.duration(seq.get("age_s"))),
        ("TTFT · ITL", f"{fmt.secs(seq.get('ttft_s'))} · {fmt.secs(seq.get('itl_s'))} mean"),
        (f"blocks ({len(seq.get('block_ids', []))})", block_ranges(list(seq.get("block_ids", [])))),
    ]
    out = Text()
    for label, value in rows:
        out.append(f"{label:>12}  ", "bold")
        out.append(f"{value}\n")
    out.append(f"\nEvents ({len(events)})\n", "bold underline")
    for e in events:
        out.append(f"{e.get('ts', now) - now:>+9.1f}s ", "dim")
        out.append(f"{e.get('kind', '?'):<14}")
        out.append(f"{e.get('detail') or ''}\n")
    if not events:
        out.append("none in the events kept\n", "dim italic")
    return out


class SequenceScreen(Dialog[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q,enter", "close", "Close")]

    def __init__(self, seq_id: str, view: View) -> None:
        super().__init__(classes="dialog-screen")
        self.seq_id = seq_id
        self.last: dict = {}
        self.latest = view  # what on_mount draws: a frame can land before the screen is built

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog detail") as box:
            box.border_title = Content(f"Sequence {self.seq_id}")
            box.border_subtitle = "esc closes"
            yield Static(id="seq-detail")

    def on_mount(self) -> None:
        self.show(self.latest)

    def show(self, view: View) -> None:
        """Draw the sequence as `view`'s frame has it (or as last seen, once it has gone)."""
        self.latest = view
        body = self.query("#seq-detail")
        if not body:  # pushed but not composed yet: on_mount draws the newest view
            return
        seq = next((s for s in view.frame.get("sequences", []) if s.get("id") == self.seq_id), None)
        if seq is not None:
            self.last = seq
        events = [e for e in view.events if e.get("seq_id") == self.seq_id]
        text = detail_text(self.seq_id, self.last, seq is None, events, view.frame.get("ts", 0))
        body.first(Static).update(text)

    def action_close(self) -> None:
        self.dismiss(None)
