"""Record the incident snapshots in `snapshots/` from real engine runs.

Each scenario drives an in-process LLMEngine step by step, records a stats frame into a
FlightRecorder every ~0.1 s (and after the last step), thins the frames so the file stays small,
and writes a `.kvsnap` with `kvtop.protocol.snapshot.write_snapshot`. Rerunnable:

    .venv/bin/python scripts/record_incidents.py                 # both, on SmolLM2-135M
    .venv/bin/python scripts/record_incidents.py --only thrash   # one of them
    .venv/bin/python scripts/record_incidents.py --model PATH    # another model directory

Replay one with `kvtop --replay snapshots/preemption-storm.kvsnap`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine import LLMEngine, SamplingParams  # noqa: E402
from engine.telemetry.flight_recorder import FlightRecorder  # noqa: E402
from kvtop.protocol.config import EngineConfig  # noqa: E402
from kvtop.protocol.sizing import bytes_per_token  # noqa: E402
from kvtop.protocol.snapshot import write_snapshot  # noqa: E402

RECORD_EVERY_S = 0.1
MAX_FRAMES = 150  # ~10 KiB a frame: keeps each file well under 2 MB

TOPICS = [
    "a lighthouse keeper who finds a map",
    "the history of paper money",
    "how bees choose a new home",
    "a robot learning to paint",
    "why the sky is blue",
    "a city built on stilts",
    "the first winter on Mars",
    "a library that never closes",
    "the migration of eels",
    "a clock that runs backwards",
    "how glass is made",
    "a letter from a tree",
]

# Distinct system prompts, each ~5 KV blocks long, for the prefix-cache thrash.
PERSONAS = [
    "a patient customer-support agent for a bank",
    "a terse senior Linux administrator",
    "a cheerful museum guide for children",
    "a careful pharmacist who double-checks everything",
    "a travel agent specialised in rail journeys",
    "a chess coach who explains every move",
    "a sommelier at a small French restaurant",
    "a park ranger in a mountain reserve",
]


def system_prompt(persona: str) -> str:
    return (
        f"You are {persona}. Answer in plain English, in at most three sentences, and never invent "
        "facts. If a question is outside your field, say so politely and suggest who could help. "
        "Keep a friendly tone, avoid jargon, and end every answer with a short follow-up question "
        "that helps the user go further. Policy version 7, reviewed quarterly by the support team."
    )


class Triggered(Exception):
    """The scenario's trigger fired: take the snapshot now, mid-incident, as an operator would."""


@dataclasses.dataclass
class Scenario:
    name: str
    reason: str
    config: dict
    drive: Callable[[LLMEngine, Callable[[], None]], None]
    trigger: Callable[[dict], bool]  # on each frame: is this the moment to snapshot?


def drive_storm(engine: LLMEngine, tick: Callable[[], None]) -> None:
    """Twelve long generations arrive together into a KV cache that holds about a third of them."""
    params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    for i, topic in enumerate(TOPICS):
        engine.add_request(f"Write a long, detailed story about {topic}.", params, request_id=f"story-{i:02d}")
    run_until_idle(engine, tick)


def drive_thrash(engine: LLMEngine, tick: Callable[[], None]) -> None:
    """Phase 1: two system prompts take turns (they fit: hits). Phase 2: eight take turns, more
    than the cache holds, round robin — least-recently-used eviction then drops each prefix just
    before it is needed again, and the hit rate collapses."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    n = 0
    for phase, personas, waves in (("warm", PERSONAS[:2], 3), ("thrash", PERSONAS, 2)):
        for wave in range(waves):
            for p, persona in enumerate(personas):
                question = f"Question {wave}: what should I know about {TOPICS[(n + p) % len(TOPICS)]}?"
                engine.add_request(
                    f"{system_prompt(persona)}\n\nUser: {question}\nAssistant:",
                    params,
                    request_id=f"{phase}-{persona.split()[1]}-{wave}",
                )
                n += 1
                run_until_idle(engine, tick)  # one at a time: the order of prefixes decides hits


def run_until_idle(engine: LLMEngine, tick: Callable[[], None]) -> None:
    while engine.has_pending():
        engine.step()
        tick()


SCENARIOS = {
    "storm": Scenario(
        name="preemption-storm",
        reason="preemption storm: 12 requests × 96 tokens arrive at once into a 32-block KV cache",
        config=dict(num_blocks=32, max_num_seqs=12, block_size=16),
        drive=drive_storm,
        # three requests still running: the storm has played out, the snapshot still shows who is left
        trigger=lambda f: f["counters"]["requests_finished"] >= 9 and bool(f["sequences"]),
    ),
    "thrash": Scenario(
        name="prefix-thrash",
        reason="prefix-cache thrash: 8 distinct system prompts take turns in a cache that holds ~3",
        config=dict(num_blocks=20, max_num_seqs=4, block_size=16),
        drive=drive_thrash,
        # the last request of the thrash phase is running
        trigger=lambda f: f["prefix"]["queries"] >= 2 * 3 + 8 * 2 and bool(f["sequences"]),
    ),
}


def build_engine(model: str, num_blocks: int, block_size: int, max_num_seqs: int) -> LLMEngine:
    """An engine whose KV cache holds exactly `num_blocks` blocks."""
    from engine.model.loader import resolve_model_dir
    from engine.model.spec import read_spec

    spec, _ = read_spec(resolve_model_dir(model))
    per_block = bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, "auto", "float32") * block_size
    cfg = EngineConfig(
        model=model,
        dtype="float32",
        device="cpu",
        kv_cache_memory=per_block * num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        seed=0,
    )
    return LLMEngine(cfg, quiet=True)


def thin(frames: list[dict], limit: int) -> list[dict]:
    """At most `limit` frames, evenly spread in time, always keeping the first and the last."""
    if len(frames) <= limit:
        return frames
    step = (len(frames) - 1) / (limit - 1)
    return [frames[round(i * step)] for i in range(limit)]


def record(scenario: Scenario, model: str, out_dir: Path) -> Path:
    engine = build_engine(model, **scenario.config)
    recorder = FlightRecorder(history_s=3600, interval_s=RECORD_EVERY_S)
    last = 0.0

    def tick() -> None:
        nonlocal last
        now = time.time()
        frame = engine.stats()
        if scenario.trigger(frame):
            recorder.record(frame)
            raise Triggered
        if now - last >= RECORD_EVERY_S:
            recorder.record(frame)
            last = now

    t0 = time.time()
    recorder.record(engine.stats())
    try:
        scenario.drive(engine, tick)
        raise SystemExit(f"{scenario.name}: the trigger never fired; nothing written")
    except Triggered:
        pass
    frames = thin(recorder.snapshot_frames(), MAX_FRAMES)
    path = write_snapshot(
        out_dir / f"{scenario.name}.kvsnap",
        model=engine.config.model if "/" not in engine.config.model else Path(engine.config.model).name,
        config=dataclasses.asdict(engine.config),
        reason=scenario.reason,
        frames=frames,
        events=list(engine.metrics.events),
        block_refs=[b.ref_count for b in engine.block_manager.blocks],
    )
    last_frame = frames[-1]
    print(
        f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: {len(frames)} frames over "
        f"{time.time() - t0:.1f} s, {last_frame['scheduler']['preemptions_total']} preemptions, "
        f"prefix hit rate {last_frame['prefix']['hit_rate']:.0%}, {last_frame['prefix']['evictions']} evictions, "
        f"{path.stat().st_size / 1024:.0f} KiB",
        flush=True,
    )
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="model name or directory (default smollm2-135m)")
    parser.add_argument("--only", choices=sorted(SCENARIOS), help="record one scenario")
    parser.add_argument("--out", type=Path, default=ROOT / "snapshots", help="output directory")
    args = parser.parse_args(argv)
    for key, scenario in SCENARIOS.items():
        if args.only in (None, key):
            record(scenario, args.model, args.out)


if __name__ == "__main__":
    main()
