"""kvctl whatif's simulator (engine/whatif/): a real recording from the tiny model, replayed
through the real Scheduler and BlockManager. The recorded step times reproduce the recorded
schedule exactly; other configurations change what they should."""

from __future__ import annotations

import pytest

from engine.whatif.config import recorded_config, whatif_config
from engine.whatif.figures import recorded_figures, simulated_figures
from engine.whatif.sim import simulate
from engine.whatif.sweep import sweep
from engine.whatif.timing import RecordedTiming, TimingError, fit
from kvtop.protocol.errors import ConfigError
from kvtop.protocol.snapshot import write_snapshot
from kvtop.protocol.trace_file import load_trace
from tests.test_trace import record

SCHEDULE = (
    "step",
    "num_seqs",
    "prefill_tokens",
    "decode_seqs",
    "context_tokens",
    "held_blocks",
    "admitted",
    "preempted",
)


SMOLLM2_BLOCK_BYTES = 16 * 30 * 2 * 3 * 64 * 4  # float32: 30 layers × K,V × 3 KV heads × 64 dims × 4 B a token


def recorded_trace(engine, directory):
    """The engine's recording, through a snapshot file and back."""
    path = write_snapshot(directory / "r.kvsnap", model="test", config={}, reason="test", frames=[engine.stats()],
                          events=[], trace=engine.trace_tables())  # fmt: skip
    return load_trace(path)


@pytest.fixture(scope="module")
def trace(tiny_dir, tmp_path_factory):
    """A recording of the tiny model that preempts and shares prefixes."""
    return recorded_trace(record(tiny_dir), tmp_path_factory.mktemp("whatif"))


@pytest.fixture(scope="module")
def smollm2_trace(smollm2_dir, tmp_path_factory):
    """The same workload recorded on SmolLM2-135M, in as few blocks (its real tokens hash its outputs)."""
    engine = record(smollm2_dir, block_bytes=SMOLLM2_BLOCK_BYTES)
    assert engine.kv.num_blocks == 20, "SMOLLM2_BLOCK_BYTES must be SmolLM2's block"
    return recorded_trace(engine, tmp_path_factory.mktemp("whatif-smollm2"))


@pytest.mark.slow  # records real engines (its fixtures come by name)
@pytest.mark.parametrize("recording", ["trace", "smollm2_trace"])
def test_recorded_step_times_reproduce_the_recorded_schedule_step_by_step(recording, request):
    trace = request.getfixturevalue(recording)
    res = simulate(trace, recorded_config(trace.config), RecordedTiming(trace.steps), keep_steps=True)
    assert sum(len(s.preempted) for s in trace.steps) > 0, "the recording must preempt"
    assert sum(h for s in trace.steps for _, h in s.admitted) > 0, "and hit the prefix cache"
    assert len(res.steps) == len(trace.steps)
    for sim, rec in zip(res.steps, trace.steps, strict=True):
        assert [getattr(sim, k) for k in SCHEDULE] == [getattr(rec, k) for k in SCHEDULE], f"step {rec.step}"
        assert sim.start == pytest.approx(rec.start, abs=1e-6) and sim.end == pytest.approx(rec.end, abs=1e-6)
    by_id = {o.id: o for o in res.outcomes}
    for r in trace.requests:
        o = by_id[r.id]
        assert (o.output_len, o.preemptions, o.cached_tokens) == (r.output_len, r.preemptions, r.cached_tokens)
        assert o.first_token == pytest.approx(r.first_token_time, abs=1e-6)
    rec, sim = recorded_figures(trace), simulated_figures(res)
    for key in (
        "preemptions",
        "peak_kv_blocks",
        "prefix_hit_rate",
        "ttft_p50_s",
        "ttft_p99_s",
        "e2e_p50_s",
        "completed",
    ):
        assert sim[key] == pytest.approx(rec[key], rel=1e-6, abs=1e-3), key
    # the engine stamps a request scheduled after schedule() returns; the simulation at the step's start
    assert sim["queue_p95_s"] == pytest.approx(rec["queue_p95_s"], abs=5e-3)


def test_more_kv_memory_ends_the_preemptions(trace):
    cfg = whatif_config(trace.config, kv_cache_memory=4 * trace.config["kv_cache_memory"])
    assert cfg.num_blocks == 80
    res = simulate(trace, cfg, fit(trace.steps))
    assert res.preemptions == 0 and simulated_figures(res)["completed"] == len(trace.requests)


def test_no_prefix_caching_hits_nothing(trace):
    res = simulate(trace, whatif_config(trace.config, enable_prefix_caching=False), fit(trace.steps))
    assert res.prefix_hit_tokens == 0 and simulated_figures(res)["prefix_hit_rate"] == 0.0


def test_an_int8_cache_holds_more_blocks_in_the_same_memory(trace):
    assert whatif_config(trace.config, kv_cache_dtype="int8").num_blocks > trace.config["num_blocks"] * 3


def test_higher_load_compresses_arrivals(trace):
    model = fit(trace.steps)
    base = simulate(trace, recorded_config(trace.config), model)
    loaded = simulate(trace, recorded_config(trace.config), model, load=3.0)

    def span(res) -> float:
        return max(o.arrival for o in res.outcomes) - min(o.arrival for o in res.outcomes)

    assert span(loaded) == pytest.approx(span(base) / 3, abs=1e-6)  # arrivals are epoch seconds: ~2e-7 s apart
    # a recording bound by its steps rather than its arrivals ends about when its work does: the
    # same work, batched a little differently (a step's time depends on its batch), not more of it
    assert simulated_figures(loaded)["duration_s"] <= 1.05 * simulated_figures(base)["duration_s"]


def test_a_sweep_in_parallel_gives_the_figures_of_one_run_per_point(trace):
    """A large trace's sweep runs its points in worker processes: the same rows, in the same order,
    as simulating each point here, a point too small to hold a request included."""
    model = fit(trace.steps)
    memory = trace.config["kv_cache_memory"]
    values = [1024, memory // 2, memory, 4 * memory]  # 1 KiB holds no block
    here = sweep(trace, "kv-cache-memory", values[1:], {}, model, workers=1)
    parallel = sweep(trace, "kv-cache-memory", values[1:], {}, model, workers=2)
    assert parallel == here
    assert [row["preemptions"] for row in here][-1] == 0
    with pytest.raises(ConfigError, match="holds no block"):
        sweep(trace, "kv-cache-memory", values, {}, model, workers=2)


def test_a_configuration_that_holds_no_request_says_so(trace):
    with pytest.raises(ConfigError, match="cannot hold even one request"):
        simulate(trace, whatif_config(trace.config, max_model_len=8), fit(trace.steps))
    with pytest.raises(ConfigError, match="holds no block"):
        whatif_config(trace.config, kv_cache_memory="1KiB")
    with pytest.raises(ConfigError, match="--kv-cache-dtype 'fp4'"):
        whatif_config(trace.config, kv_cache_dtype="fp4")


def test_the_step_time_model_reports_its_error_and_needs_enough_steps(trace):
    model = fit(trace.steps)
    assert model.steps == len(trace.steps) and model.mape is not None and min(model.coef) >= 0
    assert "fitted on" in model.describe()
    with pytest.raises(TimingError, match="too few to fit"):
        fit(trace.steps[:5])
