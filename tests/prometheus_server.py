"""A real Prometheus (Debian's `prometheus`; .ci/run installs it) scraping given targets every
second, for tests that check what Prometheus makes of a real server's /metrics."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.vllm_server import free_port

PROMETHEUS = shutil.which("prometheus")
READY_TIMEOUT_S = 120  # a busy 2-core box
MISSING = "no prometheus binary (Debian: apt-get install prometheus; .ci/run installs it)"


def require_prometheus() -> None:
    """Skip where Prometheus is not installed; fail in CI (CI=true), whose .ci/run installs it."""
    if PROMETHEUS is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{MISSING}; in CI (CI=true) these tests must run")
        pytest.skip(MISSING)


@contextlib.contextmanager
def prometheus(targets: dict[str, str], tmp: Path) -> Iterator[str]:
    """Prometheus scraping each job's URL (`{job: "http://host:port/metrics"}`) every second;
    yields its base URL once ready, stops it after."""
    if PROMETHEUS is None:
        raise RuntimeError(MISSING)
    jobs = ""
    for job, url in targets.items():
        u = httpx.URL(url)
        jobs += (
            f"  - {{job_name: {job}, metrics_path: '{u.path}', static_configs: [{{targets: ['{u.host}:{u.port}']}}]}}\n"
        )
    (tmp / "prometheus.yml").write_text("global: {scrape_interval: 1s, scrape_timeout: 1s}\nscrape_configs:\n" + jobs)
    port = free_port()
    with open(tmp / "prometheus.log", "w") as log:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _ready(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Prometheus did not start:\n{(tmp / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(20)


def _ready(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/-/ready", timeout=1).status_code == 200
    return False


def query(url: str, promql: str) -> list[dict]:
    """The instant query's result vector (Prometheus' HTTP API)."""
    r = httpx.get(f"{url}/api/v1/query", params={"query": promql}, timeout=10)
    body = r.json()
    assert body.get("status") == "success", (promql, body)
    return body["data"]["result"]
