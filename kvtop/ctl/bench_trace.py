"""`kvctl bench --trace FILE` and `--trace-out FILE`: a request trace (docs/whatif.md) as a bench
workload, and a bench run as a trace.

Replaying, each request's prompt is synthesized as token ids — the trace keeps no text: every
distinct prefix-block hash becomes one block of ids of its own (the same ids wherever the hash
repeats, so the server's prefix cache sees the recorded sharing), the rest of the prompt ids no
other request has; `max_tokens` is the recorded output length (sent with ignore_eos), and each
request goes out at its recorded arrival, open loop.
"""

from __future__ import annotations

import random
from pathlib import Path

from kvtop.ctl.bench import BenchRequest, RequestResult
from kvtop.protocol.trace import RequestRecord, block_hash_chain
from kvtop.protocol.trace_file import Trace, load_trace, write_jsonl

TOKEN_IDS = (1000, 30000)  # ordinary tokens in every vocabulary we serve (SmolLM2's is 49,152)
BLOCK_SIZE = 16  # a client does not know the server's: the engine's default


def _ids(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)  # a str seed is hashed with SHA-512: the same ids in every process
    return [rng.randrange(*TOKEN_IDS) for _ in range(n)]


def trace_requests(path: Path) -> list[BenchRequest]:
    """The requests of a trace file (a `.kvsnap` or a trace JSONL), as bench sends them."""
    trace = load_trace(path)
    bs = int((trace.config or {}).get("block_size") or BLOCK_SIZE)
    out = []
    for r in trace.requests:
        ids: list[int] = []
        for h in r.block_hashes[: r.prompt_len // bs]:
            ids += _ids(h, bs)
        ids += _ids(f"own:{r.id}", r.prompt_len - len(ids))
        out.append(BenchRequest(ids, max(1, r.output_len), at=r.arrival_time - trace.start))
    return out


def _pseudo_ids(prompt: str | list[int]) -> list[int]:
    """Token ids where bench sent them; for text, one id per word (a client has no tokenizer:
    repeats still line up, block boundaries only roughly)."""
    if isinstance(prompt, list):
        return prompt
    return [hash(w) for w in prompt.split()]  # equal within this process, all a trace needs


def write_trace(path: Path, requests: list[BenchRequest], results: list[RequestResult], ignore_eos: bool) -> None:
    """What this run sent and saw, as a trace JSONL (no engine configuration: a client's view)."""
    records = []
    for i, (req, res) in enumerate(zip(requests, results, strict=True)):
        ids = _pseudo_ids(req.prompt)
        sent = res.sent or 0.0
        records.append(RequestRecord(
            id=f"bench-{i}", arrival_time=sent, prompt_len=res.prompt_tokens or len(ids),
            block_hashes=block_hash_chain(ids, BLOCK_SIZE), max_tokens=req.max_tokens, ignore_eos=ignore_eos,
            output_len=res.output_tokens, finish_reason="length" if res.ok else "error",
            first_token_time=None if res.ttft is None else sent + res.ttft,
            finished_time=None if res.e2e is None else sent + res.e2e,
        ))  # fmt: skip
    write_jsonl(path, Trace(str(path), None, records), "kvctl bench")
