"""llama.cpp's `llama-server --metrics`: `llamacpp:` names, and its `/slots` as the per-sequence table.

Both from llama.cpp's tools/server/README.md (GET /metrics, GET /slots) and the server's source
(`server_slot::to_json`). A slot that is processing a request is a running sequence: its prompt,
cached and decoded token counts, where the build serves them. Idle slots are not sequences.
"""

from __future__ import annotations

from typing import Any

import httpx

from kvtop.sources import fetch
from kvtop.sources.mappings.mapping import Mapping

MAPPING = Mapping(
    kind="llamacpp",
    label="llama.cpp",
    prefix="llamacpp:",
    gauges={
        "scheduler.running": ("llamacpp:requests_processing",),
        "scheduler.waiting": ("llamacpp:requests_deferred",),
        "kv.usage": ("llamacpp:kv_cache_usage_ratio",),  # dropped by newer llama-server builds
        "kv.used_tokens": ("llamacpp:kv_cache_tokens",),
    },
    counters={},
    rates={
        "prompt_tokens_per_s": ("llamacpp:prompt_tokens_total",),
        "generation_tokens_per_s": ("llamacpp:tokens_predicted_total",),
    },
    histograms={},  # llama-server serves averages, not histograms: no P50/P95/P99
    cannot_show=(
        "llama.cpp exposes no block map",
        "llama.cpp exposes no latency histograms (no P50/P95/P99)",
        "llama.cpp exposes no prefix-cache counts",
        "llama.cpp has no drain, evict or snapshot control kvtop can use",
    ),
)
MAX_SLOTS = 4096  # a /slots answer listing more is not one we draw
MAX_SLOTS_BYTES = 8 * 1024**2  # nor one longer than this (a slot is ~2 KiB of JSON)
MAX_COUNT = 2**53  # a token count past this is not one


def slots_url(metrics_url: str) -> str:
    """`/slots` beside the `/metrics` page (its query kept: a router's `?model=`)."""
    u = httpx.URL(metrics_url)
    base = u.path.rsplit("/", 1)[0] if u.path.endswith("/metrics") else u.path.rstrip("/")
    return str(u.copy_with(path=f"{base}/slots"))


def _count(value: Any) -> int | None:
    return value if type(value) is int and 0 <= value < MAX_COUNT else None


def slot_sequences(slots: Any) -> list[dict]:
    """The sequences table of a `/slots` answer: one running row per processing slot. ValueError
    for an answer that is not a list of slots; fields a build does not serve stay absent."""
    if not isinstance(slots, list) or len(slots) > MAX_SLOTS:
        raise ValueError("not a list of slots")
    rows = []
    for slot in slots:
        if not isinstance(slot, dict) or _count(slot.get("id")) is None:
            raise ValueError("a slot without an id")
        if slot.get("is_processing") is not True:
            continue
        row: dict = {"id": f"slot {slot['id']}", "state": "running", "slot": slot["id"]}
        following = slot.get("next_token")
        following = following[0] if isinstance(following, list) and following else following  # newer: a list
        following = following if isinstance(following, dict) else {}
        # n_prompt_tokens is the slot's whole sequence (it grows as it decodes, seen on a real
        # llama-server): the prompt is what was evaluated plus what came from its cache
        prompt = _prompt_tokens(slot)
        for key, value in (("task", slot.get("id_task")), ("n_ctx", slot.get("n_ctx")),
                           ("prompt_tokens", prompt),
                           ("cached_tokens", slot.get("n_prompt_tokens_cache")),
                           ("output_tokens", following.get("n_decoded")),
                           ("remaining_tokens", following.get("n_remain"))):  # fmt: skip
            if _count(value) is not None:  # n_remain is -1 when unbounded: absent
                row[key] = value
        rows.append(row)
    return rows


def _prompt_tokens(slot: dict) -> int | None:
    done, cached = _count(slot.get("n_prompt_tokens_processed")), _count(slot.get("n_prompt_tokens_cache"))
    return None if done is None or cached is None else done + cached


def read_slots(client: httpx.Client, metrics_url: str, deadline_s: float = 10.0) -> dict:
    """`/slots` beside `metrics_url` (read through `client`, made by `fetch.client`, within
    MAX_SLOTS_BYTES and `deadline_s`): {"sequences": rows, "slots": how many}, or {"unavailable": why}."""
    try:
        r = fetch.fetch(client, slots_url(metrics_url), max_bytes=MAX_SLOTS_BYTES, deadline_s=deadline_s,
                        what="llama.cpp's /slots")  # fmt: skip
        if r.status_code == 200:
            slots = r.json()
            return {"sequences": slot_sequences(slots), "slots": len(slots)}
        why = f"answered HTTP {r.status_code}" + (" (llama-server --no-slots?)" if r.status_code == 501 else "")
    except (httpx.HTTPError, ValueError, RecursionError, fetch.PageTooLarge, fetch.PageTooSlow) as exc:
        why = f"is not readable ({type(exc).__name__})"
    return {"unavailable": f"llama.cpp's /slots {why}: no per-sequence table"}


def add_slots(frame: dict, slots: dict) -> None:
    """Put what `read_slots` read into `frame`: the sequences and `scheduler.slots`, or the reason
    there are none in `unavailable` (the sequences then stay absent, never an empty table)."""
    if "sequences" in slots:
        frame["sequences"] = slots["sequences"]
        frame.setdefault("scheduler", {})["slots"] = slots["slots"]
    elif "unavailable" in slots:
        frame.setdefault("unavailable", []).append(slots["unavailable"])
