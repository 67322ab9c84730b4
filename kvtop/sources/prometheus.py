"""Prometheus text, read: one scrape as plain numbers, and `histogram_quantile` as Prometheus computes it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

MAX_BYTES = 8 * 1024**2  # a /metrics page bigger than this is not one we can use


class NotMetrics(ValueError):
    """The text is not Prometheus exposition (an HTML page, garbage, a truncated body)."""

    state = "not metrics"  # how a fleet's row names the failure


@dataclass
class Scrape:
    ts: float
    values: dict[str, float] = field(default_factory=dict)  # sample name -> sum over its label sets
    series: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)  # name -> (labels, value)
    buckets: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # histogram -> [(le, cumulative)]

    def first(self, names: tuple[str, ...]) -> float | None:
        """The value of the first of `names` this scrape carries."""
        for name in names:
            if name in self.values:
                return self.values[name]
        return None


def parse(text: str, ts: float) -> Scrape:
    """One scrape. Series of one name are added up over their labels (several models, ranks or
    engines behind one endpoint sum, as `sum by ()` would); NaN samples are dropped."""
    if len(text) > MAX_BYTES:
        raise NotMetrics(f"the page is {len(text) // 1024**2} MiB: not a /metrics page")
    scrape = Scrape(ts)
    by_le: dict[str, dict[float, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.value is None or math.isnan(s.value):
                    continue
                if s.name.endswith("_bucket") and "le" in s.labels:
                    le = float(s.labels["le"])
                    hist = by_le.setdefault(s.name[: -len("_bucket")], {})
                    hist[le] = hist.get(le, 0.0) + s.value
                    continue
                scrape.values[s.name] = scrape.values.get(s.name, 0.0) + s.value
                scrape.series.setdefault(s.name, []).append((dict(s.labels), s.value))
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise NotMetrics(f"not Prometheus text: {str(exc)[:120]}") from None
    if not scrape.values and not by_le:
        raise NotMetrics("no metrics in the page")
    scrape.buckets = {name: sorted(les.items()) for name, les in by_le.items()}
    return scrape


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
