"""A synthetic trace: open-loop Poisson arrivals, mixed prompt and output lengths, a share of
requests behind a few shared system prompts — to measure the simulator, and to calibrate."""

from __future__ import annotations

import random

from kvtop.protocol.trace import RequestRecord
from kvtop.protocol.trace_file import Trace


def synthetic_trace(
    n: int,
    rate: float = 20.0,
    seed: int = 0,
    prompt_len: tuple[int, int] = (64, 1024),
    output_len: tuple[int, int] = (16, 256),
    shared_share: float = 0.5,
    systems: int = 4,
    system_len: int = 256,
    config: dict | None = None,
) -> Trace:
    """`n` requests at `rate` a second; `config`: the engine header to claim (trace_header's keys)."""
    rng = random.Random(seed)
    block = int((config or {}).get("block_size", 16))
    t = 0.0
    requests = []
    for i in range(n):
        t += rng.expovariate(rate)
        plen, olen = rng.randint(*prompt_len), rng.randint(*output_len)
        shared = rng.random() < shared_share
        plen = max(plen, system_len + 1) if shared else plen
        hashes = []
        for b in range((plen + olen) // block):
            own = not shared or b >= system_len // block
            hashes.append(f"r{i}-{b}" if own else f"s{i % systems}-{b}")
        requests.append(
            RequestRecord(f"req-{i}", t, plen, hashes, olen, ignore_eos=True, output_len=olen, finish_reason="length")
        )
    return Trace("synthetic", config, requests)
