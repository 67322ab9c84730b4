"""A stats frame (DESIGN §6) as a short readable report: what `kvctl status` prints."""

from __future__ import annotations

import time

from rich.console import Group
from rich.table import Table
from rich.text import Text

from kvtop import blocks
from kvtop.fmt import duration, ms
from kvtop.protocol.config import format_bytes

MAP_WIDTH = 96
MAX_SEQUENCES = 12
MAX_EVENTS = 6


def _bar(frac: float, width: int = 20) -> str:
    full = round(max(0.0, min(1.0, frac)) * width)
    return "█" * full + "░" * (width - full)


def block_map(chars: str, width: int = MAP_WIDTH) -> Text:
    """The block map, one char per block in rows of `width`; past four rows, each char stands for a
    range of blocks, its dominant state folded as the dashboard's map folds it (kvtop.blocks)."""
    per_cell = blocks.blocks_per_cell(len(chars), width * 4)
    if per_cell > 1:
        chars = "".join(state for state, _ in blocks.fold(chars, per_cell))
    text = Text()
    for i in range(0, len(chars), width):
        if i:
            text.append("\n")
        for ch in chars[i : i + width]:
            text.append(ch, style=blocks.STYLES.get(ch, ""))
    return text


def render_status(frame: dict, width: int = 120, history: list[dict] | None = None) -> Group:
    """The report for a terminal `width` columns wide; `history` (earlier frames, oldest first)
    lets the diagnosis see rates."""
    if (frame.get("source") or {}).get("kind") == "metrics":
        return render_partial(frame, history or [])
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    _engine_rows(t, frame)
    _kv_rows(t, frame, width, history or [])
    _load_rows(t, frame)
    parts: list = [t]
    if frame.get("sequences"):
        parts.append(_sequences(frame["sequences"]))
    if frame.get("events"):
        parts.append(_events(frame["events"][-MAX_EVENTS:]))
    return Group(*parts)


def _engine_rows(t: Table, frame: dict) -> None:
    eng = frame["engine"]
    state_style = {"running": "green", "draining": "yellow", "drained": "red"}.get(eng["state"], "")
    t.add_row(
        "engine",
        Text.assemble(
            (eng["state"], state_style),
            f" · {eng['model']} on {eng['device']}"
            + (f" ({eng['dtype']}, attention {eng['attention_backend']})" if "dtype" in eng else "")
            + f" · up {duration(eng['uptime_s'])} · step {eng['step']}",
        ),
    )
    drain = frame.get("server", {}).get("drain")
    if drain and eng["state"] != "running":
        left = f", {_deadline(drain['deadline'])}" if drain.get("deadline") else ""
        then = " then abort" if drain.get("abort_after") else ""
        t.add_row(
            "drain", f"{len(frame.get('sequences', []))} requests left{left}{then}; aborted {drain.get('aborted', 0)}"
        )


def _deadline(at: float) -> str:
    """`deadline in 4m10s`, or `deadline passed`: without --abort-after a drain goes on past it."""
    left = at - time.time()
    return f"deadline in {duration(left)}" if left > 0 else "deadline passed"


def _kv_rows(t: Table, frame: dict, width: int, history: list[dict]) -> None:
    from kvtop.diagnosis import diagnose

    kv = frame["kv"]
    t.add_row(
        "KV cache",
        f"{_bar(kv['usage'])} {kv['usage'] * 100:.1f} % held (peak {kv.get('peak_usage', kv['usage']) * 100:.1f} %)"
        f" · {kv['used']} used, {kv.get('shared', 0)} shared, {kv['cached']} cached, {kv['free']} free"
        f" of {kv['num_blocks']} blocks × {kv['block_size']} tokens · {kv['bytes_per_token']} B/token ({kv['dtype']})",
    )
    t.add_row("", block_map(kv["blocks"], max(16, min(MAP_WIDTH, width - 14))))
    findings = diagnose(frame, history)
    t.add_row("diagnosis", Text("\n".join(findings), style="yellow") if findings else "nothing stands out")
    cpu = kv.get("cpu") or {}
    if cpu.get("num_blocks"):
        t.add_row("CPU tier", f"{cpu['used']} / {cpu['num_blocks']} blocks")


def _load_rows(t: Table, frame: dict) -> None:
    sched, prefix, thr, server = frame["scheduler"], frame["prefix"], frame["throughput"], frame.get("server", {})
    queue = f" · {server['in_flight']} in flight (queue {server['max_queue']})" if "in_flight" in server else ""
    t.add_row(
        "requests",
        f"{sched['running']} running, {sched['waiting']} waiting, {sched['swapped']} swapped (max {sched['max_num_seqs']})"
        f" · {sched['active_tokens']} active tokens · {sched['preemptions_total']} preemptions{queue}",
    )
    rate = f"{prefix['hit_rate'] * 100:.1f} %" if prefix["query_tokens"] else "-"  # nothing looked up: no rate
    t.add_row(
        "prefix",
        f"{rate} of prompt tokens hit ({prefix['hit_tokens']} / {prefix['query_tokens']})"
        f" · saved ≈{prefix['saved_prefill_s']:.2f} s of prefill",
    )
    _latency_rows(t, frame["latency"])
    _throughput_row(t, thr)
    mem = frame.get("memory") or {}
    if mem:
        t.add_row(
            "memory",
            f"weights {format_bytes(mem['weights'])}"
            + (f" + {format_bytes(mem['prefill_copy'])} prefill copy" if mem.get("prefill_copy") else "")
            + f" · KV {format_bytes(mem['kv'])} · device "
            f"{format_bytes(mem['device_used'])} / {format_bytes(mem['device_total'])}",
        )


def _latency_rows(t: Table, lat: dict) -> None:
    """TTFT, ITL and e2e percentiles, one row each; a histogram the frame lacks has no row."""
    for key, label in (("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "e2e")):
        if h := lat.get(key):
            t.add_row(label, f"p50 {ms(h['p50'])} · p95 {ms(h['p95'])} · p99 {ms(h['p99'])} ms  ({h['count']} samples)")


def _throughput_row(t: Table, thr: dict) -> None:
    """Tokens/s generated and read; requests/s where the frame has it (a /metrics frame may not)."""
    parts = [f"{_opt(thr.get('generation_tokens_per_s'), '{:.1f}')} gen tok/s",
             f"{_opt(thr.get('prompt_tokens_per_s'), '{:.1f}')} prompt tok/s"]  # fmt: skip
    if thr.get("requests_per_s") is not None:
        parts.append(f"{thr['requests_per_s']:.2f} req/s")
    over = f"  (over {thr['window_s']:.0f} s)" if thr.get("window_s") else ""  # a /metrics frame's window
    t.add_row("throughput", " · ".join(parts) + over)


def _sequences(seqs: list[dict]) -> Table:
    st = Table(title=f"sequences ({len(seqs)})", title_justify="left", box=None, header_style="bold")
    for col in ("id", "state", "prompt", "output", "cached", "blocks", "KV", "age", "TTFT ms"):
        st.add_column(col, justify="left" if col in ("id", "state") else "right")
    for s in seqs[:MAX_SEQUENCES]:
        st.add_row(
            s["id"], s["state"], str(s["prompt_tokens"]), str(s["output_tokens"]), str(s["cached_tokens"]),
            str(s["num_blocks"]), format_bytes(s["kv_bytes"]), duration(s["age_s"]), ms(s.get("ttft_s")),
        )  # fmt: skip
    if len(seqs) > MAX_SEQUENCES:
        st.add_row(f"… {len(seqs) - MAX_SEQUENCES} more", *[""] * 8)
    return st


def _events(events: list[dict]) -> Table:
    et = Table(title="recent events", title_justify="left", box=None, show_header=False)
    for e in events:
        et.add_row(
            time.strftime("%H:%M:%S", time.localtime(e["ts"])),
            Text(e["kind"]),  # text, not markup: a snapshot path in a detail may hold [/brackets]
            Text(e.get("seq_id") or ""),
            Text(e.get("detail") or ""),
        )
    return et


def _opt(v, fmt: str = "{}") -> str:
    return "-" if v is None else fmt.format(v)


def render_partial(frame: dict, history: list[dict] | None = None) -> Group:
    """A frame read from an engine's /metrics: what it serves, the findings over it and `history`
    (earlier scrapes, oldest first), and one line for each thing it cannot show."""
    from kvtop.diagnosis import diagnose

    eng, kv, sched, prefix = (frame.get(k) or {} for k in ("engine", "kv", "scheduler", "prefix"))
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    t.add_row(
        "engine", Text(f"{eng.get('kind')} · {eng.get('model') or 'model not served'} · {frame['source']['url']}")
    )
    usage = kv.get("usage")
    blocks = f" of {kv['num_blocks']} blocks × {kv.get('block_size', '?')} tokens" if "num_blocks" in kv else ""
    used = f" · {kv['used_tokens']} tokens held" if "used_tokens" in kv else ""
    t.add_row("KV cache", "-" if usage is None else f"{_bar(usage)} {usage * 100:.1f} % held{blocks}{used}")
    t.add_row(
        "requests",
        f"{_opt(sched.get('running'))} running, {_opt(sched.get('waiting'))} waiting"
        f" · {_opt(sched.get('preemptions_total'))} preemptions",
    )
    rate = prefix.get("hit_rate")
    hits = (
        f" ({prefix['hit_tokens']} / {prefix['query_tokens']})"
        if {"hit_tokens", "query_tokens"} <= prefix.keys()
        else ""
    )
    t.add_row("prefix", "-" if rate is None else f"{rate * 100:.1f} % of prompt tokens hit{hits}")
    _latency_rows(t, frame.get("latency") or {})
    if thr := frame.get("throughput"):
        _throughput_row(t, thr)
    findings = diagnose(frame, history or [])
    t.add_row("diagnosis", Text("\n".join(findings), style="yellow") if findings else "nothing stands out")
    t.add_row("not shown", Text("\n".join(frame.get("unavailable") or []), style="dim"))
    return Group(t)
