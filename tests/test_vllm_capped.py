"""kvtop against a real vLLM held by a sequence cap (`--max-num-seqs 4`, twelve clients, the
default KV cache): requests wait for capacity while the KV cache is mostly free. The dashboard's
header and `kvctl status --url` must say it is a sequence cap, not KV: never "KV-bound", never a
free-block count vLLM does not serve.

Where vLLM is not installed these are skipped, saying so — except in CI (`CI=true`), where its
absence is a failure (tests/test_vllm_live.py says how it is installed).
"""

from __future__ import annotations

import pytest

from kvtop.sources.metrics import MetricsSource
from tests.helpers import until
from tests.helpers import widget_text as text
from tests.server_harness import kvctl, short_tmpdir
from tests.vllm_server import Load, require_vllm, samples, vllm_server

MAX_NUM_SEQS = 4
CLIENTS = 12


@pytest.fixture(scope="module", autouse=True)
def vllm_installed() -> None:
    require_vllm()


@pytest.fixture(scope="module")
def capped_url(smollm2_dir):
    tmp = short_tmpdir("vllmcap")
    try:
        with vllm_server(smollm2_dir, tmp / "vllm.log", "--max-num-seqs", str(MAX_NUM_SEQS)) as url:
            yield url
    except RuntimeError as exc:
        pytest.fail(str(exc))


def glance(app) -> str:
    from kvtop.dashboard.widgets.header import EngineHeader

    lines = text(app.query_one(EngineHeader)).splitlines()
    return lines[2] if len(lines) > 2 else ""


@pytest.mark.anyio
async def test_a_capped_vllm_is_a_sequence_cap_not_kv_on_the_dashboard_and_in_kvctl_status(capped_url):
    from kvtop.dashboard.app import KvtopApp

    load = Load(capped_url, clients=CLIENTS)
    app = KvtopApp(MetricsSource(capped_url, interval=1.0, timeout=10))
    seen: list[str] = []
    try:
        async with app.run_test(size=(160, 48)) as pilot:

            def cap_found() -> bool:
                seen.append(glance(app))
                return "a sequence cap, not KV" in seen[-1]

            await until(pilot, cap_found, "the sequence-cap finding in the header", 300)
            truth = samples(capped_url)
            assert truth["vllm:num_requests_running"] <= MAX_NUM_SEQS and truth["vllm:kv_cache_usage_perc"] < 0.5
            assert f"{MAX_NUM_SEQS} running" in seen[-1] and "--max-num-seqs" in seen[-1], seen[-1]
            # vLLM lists no sequences: the panel shows its running and waiting, by reason, as the frame has them
            from kvtop.dashboard.widgets.sequences import SequencesPanel

            def counted() -> str:
                s = app.dashboard.source.current["scheduler"]
                return f"{s['running']} running · {s['waiting']} waiting ({s['waiting_for_capacity']} for capacity"

            shown = lambda: " ".join(text(n) for n in app.query_one(SequencesPanel).query(".absent-note"))  # noqa: E731
            await until(pilot, lambda: shown().startswith(counted()), "the sequences panel's counts", 60)
            assert "derived: vLLM serves no per-sequence table" in shown()
        assert not [line for line in seen if "KV-bound" in line or "free blocks" in line], seen

        for _ in range(5):  # 10 s of scrapes; one caught as a request ended and the next was not yet in says less
            r = kvctl("status", "--url", capped_url, timeout=120)
            assert r.returncode == 0, r.stderr
            said = " ".join(r.stdout.split())  # as read: the table wraps a finding at the terminal's width
            if "a sequence cap, not KV" in said:
                break
        assert "a sequence cap, not KV" in said and "--max-num-seqs" in said, r.stdout
        assert "KV-bound" not in said and "free blocks" not in said, r.stdout
    finally:
        load.close()
