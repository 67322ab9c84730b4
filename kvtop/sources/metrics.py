"""`MetricsSource`: any engine's Prometheus `/metrics` (vLLM, SGLang, llama.cpp, ours) as stats frames.

Each scrape becomes a partial frame (DESIGN §6): what the engine's table (`mappings/`) names is
filled, everything else is absent, never 0, and `unavailable` lists what the panels cannot show.
Rates and last-minute percentiles come from the difference between scrapes, as Prometheus'
`rate()` and `histogram_quantile()` would compute them (a counter that went back was reset).

A page is read within limits (`kvtop/sources/fetch.py`: MAX_BYTES, DEADLINE_S for the whole page)
and its numbers are checked where they become numbers (`prometheus.parse`, `Scrape.first`): a
value no panel can use (NaN, ±Inf, a negative count, a count of 2.5, a fraction above 1, 1e308)
is absent from the frame, drawn as `–`, never a crash.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import httpx

from kvtop.derived import derive
from kvtop.protocol.frame import FRAME_EVENTS
from kvtop.rates import RATE_WINDOW_S, SAME_RUN_S, increase
from kvtop.sources import fetch
from kvtop.sources.base import EVENTS_KEPT, HISTORY_S, FrameSource, SourceUnavailable, last_seconds
from kvtop.sources.mappings import Mapping, by_kind, detect
from kvtop.sources.mappings.llamacpp import add_slots, read_slots
from kvtop.sources.prometheus import MAX_BYTES, MAX_VALUE, NotMetrics, Scrape, delta, histogram_quantile, parse

WINDOW_S = 60.0  # latency percentiles over the last minute
MIN_WINDOW_S = 20.0  # …once the scrapes span this much of it
QUANTILES = (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))
DEADLINE_S = 10.0  # for a whole page, whatever the per-read timeout: a byte a second never trips that
WINDOW_LOOKUPS = 64  # tokens looked up in the prefix cache within the rate window: fewer give no rate for it
FRACTIONS = ("kv.usage", "kv.peak_usage", "prefix.hit_rate")  # frame fields that are at most 1
SECONDS = ("engine.uptime_s", "prefix.saved_prefill_s")  # and these any amount: every other field is a count


class Unreachable(NotMetrics):
    """No answer: the connection was refused or dropped."""

    state = "unreachable"


class Slow(NotMetrics):
    """The engine took longer than the timeout to answer."""

    state = "slow"


def metrics_url(url: str) -> str:
    """`http://host:8000` means its `/metrics`; a URL with a path is used as given."""
    u = httpx.URL(url if "://" in url else f"http://{url}")
    if u.scheme not in ("http", "https") or not u.host:
        raise ValueError(f"{url!r} is not an http(s) URL")
    return str(u.copy_with(path="/metrics")) if u.path in ("", "/") else str(u)


def _set(frame: dict, path: str, value) -> None:
    section, _, key = path.partition(".")
    frame.setdefault(section, {})[key] = value


def _histograms(m: Mapping, named: dict[str, str], scrape: Scrape, earlier: list[Scrape]) -> dict:
    """The histograms `named` (frame key -> series name) as frame histograms: quantiles since
    start and, where the scrapes span enough of it, over the last minute."""
    out = {}
    for key, name in named.items():
        buckets = scrape.buckets.get(name)
        if not buckets:
            continue
        h = {"count": int(buckets[-1][1]), "sum": scrape.first((name + "_sum",))}
        h.update({p: histogram_quantile(q, buckets) for p, q in QUANTILES})
        h["buckets"] = [le for le, _ in buckets[:-1]]
        h["counts"] = [int(c - b) for (_, c), (_, b) in zip(buckets, [(0, 0.0), *buckets[:-1]], strict=True)]
        if window := _window(m, name, scrape, earlier):
            win, seconds = window
            h["window"] = {"seconds": seconds, "count": int(win[-1][1])}
            h["window"].update({p: histogram_quantile(q, win) for p, q in QUANTILES})
        out[key] = h
    return out


def _window(m: Mapping, name: str, scrape: Scrape, earlier: list[Scrape]) -> tuple[list, float] | None:
    """The histogram's buckets over the last minute, and the seconds they span: the difference
    from the oldest scrape in the minute, once that is MIN_WINDOW_S back (over fewer seconds a P99
    jumps from round to round: none is given rather than one that will not hold); or everything
    since the engine started, where it started within the minute (then that is the window)."""
    buckets = scrape.buckets[name]
    start = _start(m, scrape)
    if start is not None and scrape.ts - WINDOW_S <= start <= scrape.ts:
        return buckets, scrape.ts - start
    then = next((s for s in earlier if s.ts >= scrape.ts - WINDOW_S and name in s.buckets), None)
    if then is None or scrape.ts - then.ts < MIN_WINDOW_S:
        return None
    return delta(buckets, then.buckets[name]), scrape.ts - then.ts


def _run_window(m: Mapping, scrape: Scrape, earlier: list[Scrape]) -> list[Scrape]:
    """The scrapes of the engine's run in the last RATE_WINDOW_S seconds up to `scrape`, oldest first."""
    start = _start(m, scrape)
    window = [scrape]
    for s in reversed(earlier):  # newest first
        if s.ts < scrape.ts - RATE_WINDOW_S or s.ts >= window[-1].ts:
            break
        if start is not None and (then := _start(m, s)) is not None and abs(then - start) >= SAME_RUN_S:
            break  # an earlier run: its counters are not this one's
        window.append(s)
    return window[::-1]


def _rates(m: Mapping, window: list[Scrape]) -> dict:
    """Throughput over the run's window of scrapes, as Prometheus' `rate()` (kvtop/rates.py):
    `window_s` says over how long."""
    seconds = window[-1].ts - window[0].ts
    if seconds <= 0:
        return {}
    out: dict = {}
    for key, names in m.rates.items():
        values = [s.first(names) for s in window]
        if all(v is not None for v in values):
            out[key] = increase(values) / seconds  # type: ignore[arg-type]
    if out:
        out["window_s"] = seconds
    return out


def _window_hit_rate(m: Mapping, window: list[Scrape]) -> float | None:
    """The prefix cache's token hit rate over the window's scrapes (its counters' increases), where
    at least WINDOW_LOOKUPS tokens were looked up in it: the rate now, beside the run's since start."""
    hits = [s.first(m.counters.get("prefix.hit_tokens", ())) for s in window]
    asked = [s.first(m.counters.get("prefix.query_tokens", ())) for s in window]
    if len(window) < 2 or None in hits or None in asked:
        return None
    looked_up = increase(asked)  # type: ignore[arg-type]
    return min(1.0, increase(hits) / looked_up) if looked_up >= WINDOW_LOOKUPS else None  # type: ignore[arg-type]


def _start(m: Mapping, scrape: Scrape) -> float | None:
    """When the engine's process started, where its page says (the same value: the same run)."""
    return scrape.first((m.start_time,)) if m.start_time else None


def _unusable_histograms(m: Mapping, scrape: Scrape) -> list[str]:
    """The latency histograms the page serves but kvtop cannot use (a bucket that is not a count, no +Inf)."""
    return [key for key, name in m.histograms.items()
            if name + "_bucket" in scrape.names and name not in scrape.buckets]  # fmt: skip


def _cache_config(m: Mapping, scrape: Scrape, frame: dict) -> None:
    """vLLM's `cache_config_info` labels: block size, blocks, KV dtype (a count that is not one is absent)."""
    labels = (scrape.series.get(m.info) or [({}, 0.0)])[0][0] if m.info else {}
    for label, key, least, less in (
        ("block_size", "block_size", 1, 0),
        ("num_gpu_blocks", "num_blocks", 0, m.reserved_blocks),
    ):
        count = _label_count(labels.get(label))
        if count is not None and count >= least + less and key not in frame["kv"]:
            frame["kv"][key] = count - less  # the blocks requests get: the usage is a share of these
    if labels.get("cache_dtype") not in (None, "", "None") and "dtype" not in frame["kv"]:
        frame["kv"]["dtype"] = labels["cache_dtype"]


def _label_count(text: str | None) -> int | None:
    """A label's count ("16", "16.0"), or None for anything else ("inf", "nan", "-5", "1e308", "x")."""
    try:
        value = float(text or "")
    except ValueError:
        return None
    return int(value) if 0 <= value < MAX_VALUE else None


def _model(scrape: Scrape) -> str | None:
    for series in scrape.series.values():
        for labels, _ in series:
            if labels.get("model_name"):
                return labels["model_name"]
    return None


def build_frame(m: Mapping, scrape: Scrape, earlier: list[Scrape], url: str) -> dict:
    """The partial stats frame of one scrape; `earlier` scrapes (oldest first) give rates and windows."""
    frame: dict = {"schema": 1, "ts": scrape.ts, "source": {"kind": "metrics", "url": url},
                   "engine": {"kind": m.kind, "model": _model(scrape)},
                   "kv": {}, "scheduler": {}, "prefix": {}, "events": []}  # fmt: skip
    for path, names in (*m.gauges.items(), *m.counters.items()):
        value = scrape.first(names, most=1.0 if path in FRACTIONS else MAX_VALUE)
        if value is not None and (path in FRACTIONS or path in SECONDS):
            _set(frame, path, value)
        elif value is not None and value.is_integer():  # a count of 2.5 requests is not one
            _set(frame, path, int(value))
    if (start := _start(m, scrape)) is not None:
        frame["engine"]["start_time"] = start
    for path, (name, label, wanted) in m.selected.items():
        _set_selected(frame, path, scrape, name, label, wanted)
    _cache_config(m, scrape, frame)
    if m.kind == "kvtop":
        _kvtop_extras(scrape, frame)
    prefix = frame["prefix"]
    hits, asked = prefix.get("hit_tokens"), prefix.get("query_tokens")
    if asked == 0:  # nothing looked up yet: no hit rate (ours serves its gauge as 0), never 0 %
        prefix.pop("hit_rate", None)
    elif "hit_rate" not in prefix and hits is not None and asked and hits <= asked:  # hits unknown: no rate, not 0 %
        prefix["hit_rate"] = hits / asked
    frame["latency"] = _histograms(m, m.histograms, scrape, earlier)
    if requests := _histograms(m, m.request_histograms, scrape, earlier):
        frame["requests"] = requests
    window = _run_window(m, scrape, earlier)
    frame["throughput"] = _rates(m, window)
    if (recent := _window_hit_rate(m, window)) is not None:
        prefix["window_hit_rate"] = recent
    frame["engine"].setdefault("state", "running")
    if frame["engine"]["model"] is None:  # llama-server names no model: absent, not None on screen
        del frame["engine"]["model"]
    frame["unavailable"] = list(m.cannot_show)
    if bad := _unusable_histograms(m, scrape):  # the latency panel's note, when none is left to draw
        frame["unavailable"].append(
            f"{m.label}'s latency histograms {', '.join(bad)} hold values kvtop cannot use (NaN, ±Inf, not a count)"
        )
    return frame


def _set_selected(frame: dict, path: str, scrape: Scrape, name: str, label: str, wanted: str) -> None:
    """The count of `name`'s series whose `label` is `wanted` (summed over the other labels), where served."""
    found = [v for labels, v in scrape.series.get(name, []) if labels.get(label) == wanted]
    total = sum(found)
    if found and 0 <= total < MAX_VALUE and total.is_integer():
        _set(frame, path, int(total))


def _kvtop_extras(scrape: Scrape, frame: dict) -> None:
    """Ours serves block counts by state, and its state, as labels: the frame's own fields."""
    for labels, value in scrape.series.get("kvtop_kv_cache_blocks", []):
        if labels.get("state") in ("free", "cached", "used", "shared", "offloaded") and value >= 0:
            frame["kv"][labels["state"]] = int(value)
    for labels, value in scrape.series.get("kvtop_engine_state", []):
        if value == 1.0 and labels.get("state"):
            frame["engine"]["state"] = labels["state"]


class MetricsSource(FrameSource):
    """Frames scraped from an engine's `/metrics`, every `interval` seconds."""

    kind = "metrics"  # no controls: no engine but ours has one kvtop can call, and ours is reached by socket
    can_record = True  # kvtop/sources/recorder.py writes what was scraped as a .kvsnap

    def __init__(
        self,
        url: str,
        interval: float = 1.0,
        engine: str | None = None,
        timeout: float = 3.0,
        clock: Callable[[], float] = time.time,
        deadline: float | None = None,
    ) -> None:
        """`timeout` bounds each connect and read; `deadline` the whole page (default DEADLINE_S,
        or `timeout` where that is longer: a page may always take as long as one read)."""
        super().__init__()
        self.url = metrics_url(url)
        self.path = self.url  # what the header names
        self.interval = interval
        self.mapping: Mapping | None = by_kind(engine) if engine else None
        self.timeout, self.deadline = timeout, max(DEADLINE_S, timeout) if deadline is None else deadline
        self._clock = clock
        self._scrapes: deque[Scrape] = deque()
        self._frames: deque[dict] = deque()
        self._events: list[dict] = []  # derived from the frames, oldest first
        self.failure: str | None = None  # the last poll's: "unreachable", "not metrics" or "slow"
        self._client = fetch.client(timeout)
        self._lock = threading.Lock()

    def scrape(self) -> Scrape:
        """One page, read within MAX_BYTES and `deadline`, parsed."""
        try:
            page = fetch.fetch(self._client, self.url, max_bytes=MAX_BYTES, deadline_s=self.deadline,
                               what="the /metrics page")  # fmt: skip
        except fetch.PageTooSlow as exc:
            raise Slow(str(exc)) from None
        except fetch.PageTooLarge as exc:
            raise NotMetrics(str(exc)) from None
        except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout) as exc:
            raise Slow(f"{type(exc).__name__}: no answer in {self.timeout:g} s") from exc
        except httpx.HTTPError as exc:
            raise Unreachable(f"{type(exc).__name__}: {exc}".rstrip(": ")) from None
        if page.status_code != 200:
            raise NotMetrics(f"it answered HTTP {page.status_code}")
        return parse(page.text, self._clock())

    def poll(self) -> dict | None:
        try:
            scrape = self.scrape()
            mapping = self.mapping or detect(scrape.names)
            if mapping is None:
                raise NotMetrics("it serves no vLLM, SGLang, llama.cpp or kvtop metrics")
        except NotMetrics as exc:
            if self.disconnected_since is None:
                self.disconnected_since = self._clock()
            self.last_error, self.failure = str(exc), exc.state
            raise SourceUnavailable(self.last_error) from None
        self.disconnected_since, self.last_error, self.failure = None, None, None
        slots = read_slots(self._client, self.url, self.deadline) if mapping.kind == "llamacpp" else {}  # per sequence
        with self._lock:
            frame = build_frame(mapping, scrape, list(self._scrapes), self.url)
            add_slots(frame, slots)
            if self._frames:  # the engine logs nothing kvtop can read: its counters' jumps, as events
                self._events.extend(derive(self._frames[-1], frame))
                del self._events[:-EVENTS_KEPT]
            frame["events"] = self._events[-FRAME_EVENTS:]
            self._scrapes.append(scrape)
            while self._scrapes and self._scrapes[0].ts < scrape.ts - max(WINDOW_S, RATE_WINDOW_S) - 5:
                self._scrapes.popleft()
            self._frames.append(frame)
            while self._frames and self._frames[0]["ts"] < scrape.ts - HISTORY_S:
                self._frames.popleft()
            self.current = frame
        return frame

    def history(self, seconds: float = HISTORY_S) -> list[dict]:
        with self._lock:
            return last_seconds(self._frames, seconds)

    def events(self) -> list[dict]:
        """Prometheus carries counts, not events: those derived from them (kvtop/derived.py)."""
        with self._lock:
            return list(self._events)

    def next_delay(self) -> float:
        return min(2.0, self.interval) if self.disconnected_since is not None else self.interval

    def close(self) -> None:
        self._client.close()
