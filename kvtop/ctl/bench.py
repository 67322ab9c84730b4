"""`kvctl bench`: a load generator for any OpenAI-compatible server, measured at the client.

Every request streams (`/v1/completions`, `stream_options.include_usage`), so TTFT and each
inter-token gap are seen as a user sees them. Arrivals are Poisson (or gamma with a burstiness
factor, as vLLM's benchmark) at `request_rate`, or as fast as `max_concurrency` allows. When the
server is ours, its own view (prefix hit rate, preemptions, peak KV usage) comes from `/metrics`:
the peak from the server's own `kvtop_kv_cache_peak_usage_perc` (it sees every step), not only
from what the client's scrapes happened to catch.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvtop.ctl.openai_client import stream
from kvtop.protocol import metric_names  # the one place every kvtop_ metric is named
from kvtop.protocol.stats_math import percentiles

_WORDS_TEXT = """
    the of and to in is that for it as was with be by on not he this are or his from at which but
    have an they you were her all she there would their we him been has when who will more no if out
    so said what up its about into than them can only other new some could time these two may then
    do first any my now such like our over man me even most made after also did many before must
    through back years where much your way well down should because each just those people how too
    little state good very make world still own see men work long get here between both life being
    under never day same another know while last might us great old year off come since against go
    came right used take three cache memory block token request latency
"""
WORDS = _WORDS_TEXT.split()  # prompt vocabulary: common English words and a few of ours


@dataclass
class BenchRequest:
    prompt: str | list[int]  # text, or token ids (a replayed trace)
    max_tokens: int
    at: float | None = None  # seconds after the run starts (a trace's arrival), instead of --request-rate


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    error: str | None = None
    sent: float | None = None  # wall clock when the request went out

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# ---- datasets -------------------------------------------------------------------------------
def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n)))


def random_dataset(n: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int) -> list[BenchRequest]:
    """Prompts of about `input_len` words (≈ tokens for these common words)."""
    rng = random.Random(seed)
    return [BenchRequest(_words(rng, rng.randint(*input_len)), rng.randint(*output_len)) for _ in range(n)]


def shared_prefix_dataset(
    n: int, groups: int, system_len: int, question_len: int, output_len: tuple[int, int], seed: int
) -> list[BenchRequest]:
    """`groups` system prompts, each shared by n / groups requests with distinct questions."""
    rng = random.Random(seed)
    systems = [_words(rng, system_len) for _ in range(groups)]
    out = [
        BenchRequest(f"{systems[i % groups]}\nQuestion: {_words(rng, question_len)}", rng.randint(*output_len))
        for i in range(n)
    ]
    rng.shuffle(out)
    return out


def long_context_dataset(
    n: int, input_len: tuple[int, int], output_len: tuple[int, int], long_share: float, long_factor: int, seed: int
) -> list[BenchRequest]:
    """Mostly ordinary prompts, a `long_share` of them `long_factor` times longer."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        length = rng.randint(*input_len)
        if rng.random() < long_share:
            length *= long_factor
        reqs.append(BenchRequest(_words(rng, length), rng.randint(*output_len)))
    return reqs


def jsonl_dataset(path: Path, n: int | None, output_len: tuple[int, int], seed: int) -> list[BenchRequest]:
    """A file of `{"prompt": ..., "max_tokens"?: ...}` lines."""
    rng = random.Random(seed)
    reqs = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            prompt = obj["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{path}:{i}: expected a JSON object with a 'prompt'") from None
        reqs.append(BenchRequest(str(prompt), int(obj.get("max_tokens") or rng.randint(*output_len))))
    if not reqs:
        raise ValueError(f"{path} holds no prompts")
    if n:
        reqs = (reqs * (n // len(reqs) + 1))[:n]
    return reqs


# ---- arrivals and requests ------------------------------------------------------------------
def arrival_gaps(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before each request: Poisson at burstiness 1, gamma otherwise; 0 at inf rate."""
    if request_rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(n)]


async def _one(
    client: httpx.AsyncClient, url: str, model: str, req: BenchRequest, ignore_eos: bool, headers: dict
) -> RequestResult:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0}
    if ignore_eos:
        body["ignore_eos"] = True
    sent = time.time()
    answer = await stream(client, url, body, headers)
    usage = answer.usage or {}
    res = RequestResult(ok=answer.error is None and answer.ttft is not None, ttft=answer.ttft, e2e=answer.e2e,
                        itls=answer.itls, error=answer.error, prompt_tokens=usage.get("prompt_tokens", 0),
                        output_tokens=usage.get("completion_tokens", 0) or answer.chunks, sent=sent)  # fmt: skip
    if answer.error is None and answer.ttft is None:
        res.error = "no tokens received"
    return res


# ---- the server's own view ------------------------------------------------------------------
KV_USAGE = metric_names.KV_CACHE_USAGE
KV_PEAK = metric_names.KV_CACHE_PEAK_USAGE  # since the server started
PREFIX_QUERIES = metric_names.PREFIX_CACHE_QUERIES + "_total"  # counters are exposed with `_total`
PREFIX_HITS = metric_names.PREFIX_CACHE_HITS + "_total"
PREEMPTIONS = metric_names.NUM_PREEMPTIONS + "_total"


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name -> value of the series labelled with no more than `model_name` and `engine` (every
    series carries these two, as vLLM's), as kvtop.sources.prometheus reads the page (the one reader
    of Prometheus text): a value no panel can use is absent; a page that is not Prometheus text
    raises NotMetrics, a ValueError."""
    from kvtop.sources.prometheus import parse  # not at import: every kvctl command loads this module

    return {
        name: value
        for name, rows in parse(text, 0.0).series.items()
        for labels, value in rows
        if not set(labels) - {"model_name", "engine"}
    }


SCRAPE_TIMEOUT = 5.0  # seconds for one /metrics scrape while the load runs
# A scrape costs a kvtop server ~4-8 ms of CPU under the GIL its engine thread needs: at 10 a
# second the load tool itself cost the server ~10 % of its throughput and TTFT (benchmarks/HISTORY.md).
SCRAPE_INTERVAL = 1.0


async def _poll_server(
    client: httpx.AsyncClient, base: str, stop: asyncio.Event, peak: dict, interval: float = SCRAPE_INTERVAL
) -> None:
    """Sample KV usage every `interval` seconds while the run lasts. A failed scrape (a busy
    server, a timeout) is counted and the next one tried: one bad answer must not end the
    sampling for the rest of the run."""
    while not stop.is_set():
        try:
            r = await client.get(f"{base}/metrics", timeout=SCRAPE_TIMEOUT)
            m = parse_metrics(r.text) if r.status_code == 200 else {}
            if KV_USAGE in m:
                peak["kv"] = max(peak.get("kv", 0.0), m[KV_USAGE])
            else:
                peak["failed_scrapes"] = peak.get("failed_scrapes", 0) + 1
        except (httpx.HTTPError, ValueError):
            peak["failed_scrapes"] = peak.get("failed_scrapes", 0) + 1
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval)
        except asyncio.TimeoutError:
            pass


async def _server_counters(client: httpx.AsyncClient, base: str) -> dict[str, float] | None:
    try:
        r = await client.get(f"{base}/metrics")
        m = parse_metrics(r.text) if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return None
    return m if any(k.startswith(metric_names.P) for k in m) else None


def peak_kv_usage(before: dict, after: dict, sampled: float) -> float:
    """The run's peak KV usage. The server's own peak (since it started) is exact, but it only
    belongs to this run when the run raised it; otherwise the client's samples are what we have."""
    if after.get(KV_PEAK, 0.0) > before.get(KV_PEAK, 0.0):
        return max(after[KV_PEAK], sampled)
    return max(sampled, after.get(KV_USAGE, 0.0))


def api_base(base_url: str) -> str:
    """The server root from what a user may paste: `http://h:8000`, `http://h:8000/` or the
    `http://h:8000/v1` that `kvctl serve` prints and the openai client takes."""
    base = base_url.strip().rstrip("/")
    return base.removesuffix("/v1")


# ---- the run ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Load:
    """How `run_bench` sends its requests (`kvctl bench`'s flags of the same names): arrivals at
    `request_rate` (inf: all at once) with `burstiness`, at most `max_concurrency` in flight, each
    asking for exactly max_tokens where `ignore_eos`; the server's /metrics every `scrape_interval`
    seconds (0: only before and after)."""

    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0  # arrivals' (the prompts' is the dataset's)
    ignore_eos: bool = True
    api_key: str | None = None
    timeout: float = 600.0  # seconds, per request
    scrape_interval: float = SCRAPE_INTERVAL


async def run_bench(
    base_url: str,
    model: str,
    requests: list[BenchRequest],
    load: Load = Load(),
    on_done: Callable[[RequestResult], None] | None = None,
) -> tuple[list[RequestResult], float, dict]:
    base = api_base(base_url)
    url = f"{base}/v1/completions"
    headers = {"Authorization": f"Bearer {load.api_key}"} if load.api_key else {}
    limits = httpx.Limits(max_connections=load.max_concurrency or 1000, max_keepalive_connections=100)
    # the server's view through a client of its own: in the load's pool, with every connection held
    # by a streaming request, a scrape waited for a free one and failed (two per run, typically)
    async with (
        httpx.AsyncClient(timeout=load.timeout, limits=limits) as client,
        httpx.AsyncClient(timeout=load.timeout) as scraper,
    ):
        before = await _server_counters(scraper, base)
        stop = asyncio.Event()
        peak: dict = {}
        poller = None
        if before is not None and load.scrape_interval > 0:
            poller = asyncio.create_task(_poll_server(scraper, base, stop, peak, load.scrape_interval))
        sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None

        async def fire(req: BenchRequest) -> RequestResult:
            if sem is None:
                res = await _one(client, url, model, req, load.ignore_eos, headers)
            else:
                async with sem:
                    res = await _one(client, url, model, req, load.ignore_eos, headers)
            if on_done:
                on_done(res)
            return res

        start = time.perf_counter()
        tasks = []
        gaps = arrival_gaps(len(requests), load.request_rate, load.burstiness, load.seed)
        for req, gap in zip(requests, gaps, strict=True):
            if req.at is not None:  # open loop at the trace's own times
                gap = max(0.0, start + req.at - time.perf_counter())
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(fire(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        server: dict = {}
        if before is not None:
            stop.set()
            if poller is not None:
                await poller
            server = _server_view(before, await _server_counters(scraper, base) or {}, peak)
    return list(results), duration, server


def _server_view(before: dict[str, float], after: dict[str, float], peak: dict) -> dict:
    """What the server saw of the run: its counters' change, the peak KV usage, the failed scrapes."""

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    queries = delta(PREFIX_QUERIES)
    return {
        "prefix_hit_rate": delta(PREFIX_HITS) / queries if queries else 0.0,
        "preemptions": delta(PREEMPTIONS),
        "peak_kv_usage": peak_kv_usage(before, after, peak.get("kv", 0.0)),
        "failed_scrapes": peak.get("failed_scrapes", 0),
    }


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p95": None, "p99": None}
    p50, p95, p99 = percentiles(values, (50, 95, 99))
    return {"mean": statistics.fmean(values), "p50": p50, "p95": p95, "p99": p99}


def parse_slo(spec: str | None) -> dict[str, float]:
    """`ttft=500,tpot=50` (milliseconds) -> seconds per metric."""
    if not spec:
        return {}
    out = {}
    for part in spec.split(","):
        key, _, value = part.partition("=")
        if key.strip() not in ("ttft", "tpot", "e2e") or not value:
            raise ValueError(f"bad --slo part {part!r}: use ttft=MS,tpot=MS,e2e=MS")
        out[key.strip()] = float(value) / 1000.0
    return out


def report(results: list[RequestResult], duration: float, server: dict, slo: dict[str, float], meta: dict) -> dict:
    ok = [r for r in results if r.ok]
    good = [
        r
        for r in ok
        if all(
            (getattr(r, k) if k != "tpot" else r.tpot) is not None
            and (getattr(r, k) if k != "tpot" else r.tpot) <= limit
            for k, limit in slo.items()
        )
    ]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "?"] = errors.get(r.error or "?", 0) + 1
    return {
        **meta,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "input_token_throughput": in_tokens / duration if duration else 0.0,
        "output_token_throughput": out_tokens / duration if duration else 0.0,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "ttft_s": _stats([r.ttft for r in ok]),
        "tpot_s": _stats([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": _stats([x for r in ok for x in r.itls]),
        "e2e_s": _stats([r.e2e for r in ok]),
        "slo": {k: v * 1000 for k, v in slo.items()},
        "goodput_requests_per_s": len(good) / duration if slo and duration else None,
        "server": server or None,
    }
