"""A request trace's records (docs/whatif.md): what an engine saw of its workload, never its text.

`RequestRecord`: one request's arrival, prompt length, sampling limits, output length, finish
reason, first-token and finish times, preemptions, and the chain of prefix-block hashes the prefix
cache keys on — salted per engine, so equal blocks within one recording stay equal (shared
prefixes survive) but nobody can confirm a guessed prompt by hashing it. `StepRecord`: one step's
shape (prefill tokens, decode sequences, context tokens attended), its wall times, and what the
scheduler decided (admissions with their prefix hits, preemptions, the peak blocks held).

The engine records them (engine/telemetry/trace.py), snapshots and trace files carry them
(`kvtop.protocol.trace_file`), `kvctl bench` replays and writes them, `engine.whatif` simulates
them. `chain_hash` is the prefix cache's own block hash (engine/kv/block_manager.py uses it), so a
client that synthesizes prompts from a trace shares blocks where the recording did.
"""

from __future__ import annotations

from array import array
from dataclasses import asdict, dataclass, field, fields

_MASK = (1 << 64) - 1


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """The prefix cache's key of a full block: its tokens, chained to the block before it."""
    return hash((parent, tokens))


@dataclass(slots=True)
class RequestRecord:
    id: str
    arrival_time: float  # seconds (wall clock); only differences between records matter
    prompt_len: int
    block_hashes: list[str]  # hex, one per full block of prompt + output, in order (packed in the ring)
    max_tokens: int
    ignore_eos: bool = False
    min_tokens: int = 0
    has_stop: bool = False  # stop strings or stop token ids were given (their values never are)
    output_len: int = 0
    finish_reason: str | None = None  # stop | length | abort | error; None: still in flight
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache served at first admission

    @classmethod
    def from_dict(cls, d: dict) -> RequestRecord:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(slots=True)
class StepRecord:
    step: int
    start: float  # wall clock when the step took its inbox
    end: float  # when its tokens were out
    num_seqs: int
    prefill_tokens: int  # tokens of prompt chunks (every row that is not a one-token decode)
    decode_seqs: int
    context_tokens: int  # keys attended: each sequence's computed tokens after the step, summed
    held_blocks: int  # the most device blocks held while scheduling
    admitted: list[list] = field(default_factory=list)  # [request id, prefix-hit tokens]
    preempted: list[str] = field(default_factory=list)

    @property
    def duration(self) -> float:
        return self.end - self.start

    @classmethod
    def from_dict(cls, d: dict) -> StepRecord:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def block_hash_chain(token_ids: list[int], block_size: int, salt: int = 0) -> list[str]:
    """The prefix cache's chained hash of every full block (`chain_hash`), salted, in hex."""
    return [f"{h:016x}" for h in packed_hash_chain(token_ids, block_size, salt)]


def packed_hash_chain(token_ids: list[int], block_size: int, salt: int) -> array:
    """`block_hash_chain` as 64-bit integers, packed (how the engine's trace ring holds them)."""
    out, parent = array("Q"), None
    for i in range(len(token_ids) // block_size):
        parent = chain_hash(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]))
        out.append(hash((salt, parent)) & _MASK)
    return out


def rows(requests: list[RequestRecord], steps: list[StepRecord]) -> tuple[list[dict], list[dict]]:
    """Snapshot rows of captured records, the hashes in hex."""
    out = []
    for r in requests:
        row = asdict(r)
        row["block_hashes"] = [f"{h:016x}" for h in r.block_hashes]
        out.append(row)
    return out, [asdict(s) for s in steps]
