"""Prometheus text, read: one scrape as plain numbers, and `histogram_quantile` as Prometheus computes it.

`parse` is where another engine's page becomes numbers, so it is where numbers no panel can use
stop: a sample that is NaN, ±Inf or past `MAX_VALUE` makes its series absent (never a partial sum
of the label sets that were fine), and so does a histogram bucket that is not a count (negative,
2.5) or has a bound below 0 or none, or a histogram without its +Inf bucket. Buckets that
decrease are made cumulative again, as Prometheus' `histogram_quantile` does. What the numbers
mean (a count is never negative, a fraction is at most 1) is `Scrape.first`'s, for the frame
fields the engine tables name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

MAX_BYTES = 8 * 1024**2  # a /metrics page bigger than this is not one we can use (a vLLM's is ~100 KiB)
MAX_VALUE = 2.0**53  # past it a float no longer counts by ones: no count, time or size we draw gets there


class NotMetrics(ValueError):
    """The text is not Prometheus exposition (an HTML page, garbage, a truncated body)."""

    state = "not metrics"  # how a fleet's row names the failure


def number(value: object) -> float | None:
    """`value` as a float where it is a number a panel can use (finite, below MAX_VALUE either
    way), else None: NaN, ±Inf, 1e308, an integer too large for a float, a bool, a string."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        f = float(value)
    except OverflowError:
        return None
    return f if math.isfinite(f) and abs(f) < MAX_VALUE else None


@dataclass
class Scrape:
    ts: float
    values: dict[str, float] = field(default_factory=dict)  # sample name -> sum over its label sets
    series: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)  # name -> (labels, value)
    buckets: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # histogram -> [(le, cumulative)]
    names: set[str] = field(default_factory=set)  # every sample name served, usable or not (what detection reads)
    unusable: set[str] = field(default_factory=set)  # names served with a value no panel can use

    def first(self, names: tuple[str, ...], most: float = MAX_VALUE) -> float | None:
        """The value of the first of `names` this scrape serves, as a frame field: None where it
        serves none of them, or where the first it serves is unusable or out of [0, `most`] (every
        field the tables fill is a count, a time, a size or a fraction, none negative)."""
        for name in names:
            if name in self.values:
                value = self.values[name]
                return value if 0 <= value <= most and value < MAX_VALUE else None
            if name in self.unusable:
                return None
        return None


def parse(text: str, ts: float) -> Scrape:
    """One scrape. Series of one name are added up over their labels (several models, ranks or
    engines behind one endpoint sum, as `sum by ()` would); a name with an unusable sample (NaN,
    ±Inf, past MAX_VALUE) is left out whole, and so is a histogram with a bucket that is not a
    count, or a bound below 0 (ours are all latencies)."""
    if len(text) > MAX_BYTES:
        raise NotMetrics(f"the page is {len(text) // 1024**2} MiB: not a /metrics page")
    scrape = Scrape(ts)
    by_le: dict[str, dict[float, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                _add(scrape, by_le, s.name, s.labels, s.value)
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise NotMetrics(f"not Prometheus text: {str(exc)[:120]}") from None
    if not scrape.names:
        raise NotMetrics("no metrics in the page")
    for name in scrape.unusable:
        scrape.values.pop(name, None)
        scrape.series.pop(name, None)
        by_le.pop(name.removesuffix("_bucket"), None)
    scrape.buckets = {name: _cumulative(les) for name, les in by_le.items() if math.inf in les}
    return scrape


def _add(scrape: Scrape, by_le: dict[str, dict[float, float]], name: str, labels: dict, raw: object) -> None:
    """One sample into `scrape` (a bucket into `by_le`), or its name marked unusable."""
    scrape.names.add(name)
    value = number(raw)
    if value is None:
        scrape.unusable.add(name)
        return
    if name.endswith("_bucket") and "le" in labels:
        try:
            le = float(labels["le"])
        except ValueError:
            le = math.nan
        if value < 0 or not value.is_integer() or not le >= 0:  # not a count, or a bound no latency has
            scrape.unusable.add(name)
            return
        hist = by_le.setdefault(name[: -len("_bucket")], {})
        hist[le] = hist.get(le, 0.0) + value
        return
    scrape.values[name] = scrape.values.get(name, 0.0) + value
    scrape.series.setdefault(name, []).append((dict(labels), value))


def _cumulative(les: dict[float, float]) -> list[tuple[float, float]]:
    """Buckets in order, each at least the one below it: Prometheus' fix for buckets that decrease
    (a scrape that caught a histogram mid-update, or a broken exporter)."""
    out, most = [], 0.0
    for le, count in sorted(les.items()):
        most = max(most, count)
        out.append((le, most))
    return out


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative `(le, count)` buckets (+Inf last): linear
    interpolation inside the bucket the rank falls in; the lowest bucket starts at 0; a rank in
    +Inf gives the highest finite bound. None when there are no observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for le, cum in buckets:
        if cum >= rank:
            if math.isinf(le):
                return lower
            if cum == below:
                return le
            return lower + (le - lower) * (rank - below) / (cum - below)
        lower, below = le, cum
    return lower


def delta(now: list[tuple[float, float]], then: list[tuple[float, float]] | None) -> list[tuple[float, float]]:
    """Buckets observed between two scrapes; a counter that went back (a restart) counts from 0."""
    if not then:
        return now
    old = dict(then)
    out = [(le, cum - old.get(le, 0.0)) for le, cum in now]
    return now if any(c < 0 for _, c in out) else out
