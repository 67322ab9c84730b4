"""The figures of one column of a what-if: what the recording says happened, or what a
simulation says would have. Same names in both (`ttft_p50_s`, `preemptions`, …) so `--json`
columns compare key by key; a figure a source cannot know is None."""

from __future__ import annotations

import numpy as np

from engine.whatif.sim import SimResult
from kvtop.protocol.stats_math import percentiles
from kvtop.protocol.trace_file import Trace

PERCENTILES = (50, 95, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e", "queue")


def _pct(name: str, values) -> dict:
    """P50/P95/P99 of `values` as numpy's default computes them (np.sort: a simulation's ITLs are many)."""
    cuts = percentiles(np.sort(np.asarray(values, dtype=float).ravel()), PERCENTILES, presorted=True)
    return {f"{name}_p{p}_s": v for p, v in zip(PERCENTILES, cuts, strict=True)}


def _latencies(rows, itls) -> dict:
    """rows: (arrival, first_scheduled, first_token, finished, output_len, finish_reason, in_flight)."""
    ttft, tpot, e2e, queue = [], [], [], []
    for arrival, scheduled, first, finished, out, reason, in_flight in rows:
        if scheduled is not None:
            queue.append(scheduled - arrival)
        if first is not None:
            ttft.append(first - arrival)
        done = finished is not None and not in_flight and reason not in ("abort", "error", "rejected")
        if done:
            e2e.append(finished - arrival)
            if first is not None and out > 1:
                tpot.append((finished - first) / (out - 1))
    out = {}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itls), ("e2e", e2e), ("queue", queue)):
        out.update(_pct(name, [] if values is None else values))
    return out


def _common(n, completed, rejected, aborted, out_tokens, start, end) -> dict:
    span = max(end - start, 1e-9)
    return {
        "requests": n,
        "completed": completed,
        "rejected": rejected,
        "aborted": aborted,
        "duration_s": end - start,
        "output_tokens_per_s": out_tokens / span,
        "requests_per_s": completed / span,
    }


def recorded_figures(trace: Trace) -> dict:
    """What happened, from the trace's own records (ITL needs every token's time: not recorded)."""
    reqs, steps, cfg = trace.requests, trace.steps, trace.config or {}
    rows = [
        (
            r.arrival_time,
            r.first_scheduled_time,
            r.first_token_time,
            r.finished_time,
            r.output_len,
            r.finish_reason,
            r.finish_reason is None,
        )
        for r in reqs
    ]
    start = min(r.arrival_time for r in reqs)
    ends = [r.finished_time for r in reqs if r.finished_time is not None] + [s.end for s in steps]
    admitted = [r for r in reqs if r.first_scheduled_time is not None]
    queried = sum(r.prompt_len for r in admitted)
    peak = max((s.held_blocks for s in steps), default=None)
    blocks = cfg.get("num_blocks")
    return {
        **_common(
            len(reqs),
            sum(r.finish_reason in ("stop", "length") for r in reqs),
            0,
            sum(r.finish_reason in ("abort", "error") for r in reqs),
            sum(r.output_len for r in reqs),
            start,
            max(ends, default=start),
        ),
        **_latencies(rows, None),
        "preemptions": sum(r.preemptions for r in reqs),
        "peak_kv_blocks": peak,
        "peak_kv_usage": peak / blocks if peak is not None and blocks else None,
        "prefix_hit_rate": sum(r.cached_tokens for r in admitted) / queried
        if queried and cfg.get("enable_prefix_caching", True)
        else 0.0,
        "concurrency_mean": float(np.mean([s.num_seqs for s in steps])) if steps else None,
        "steps": len(steps) or None,
    }


def simulated_figures(res: SimResult) -> dict:
    os_ = res.outcomes
    rows = [
        (o.arrival, o.first_scheduled, o.first_token, o.finished, o.output_len, o.finish_reason, o.in_flight)
        for o in os_
    ]
    return {
        **_common(
            len(os_),
            sum(o.finish_reason == "length" and not o.in_flight for o in os_),
            sum(o.finish_reason == "rejected" for o in os_),
            sum(o.finish_reason == "abort" for o in os_),
            sum(o.output_len for o in os_),
            res.start,
            res.end,
        ),
        **_latencies(rows, res.itls),
        "preemptions": res.preemptions,
        "peak_kv_blocks": res.peak_blocks,
        "peak_kv_usage": res.peak_blocks / res.config.num_blocks,
        "prefix_hit_rate": res.prefix_hit_tokens / res.prefix_query_tokens if res.prefix_query_tokens else 0.0,
        "concurrency_mean": res.seq_steps / res.num_steps if res.num_steps else None,
        "steps": res.num_steps,
    }
