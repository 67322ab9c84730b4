"""Sequence: one request's tokens, KV block table and timings as it moves through the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine.sampling import SamplingParams


class SequenceState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Per-request timings in seconds (wall clock from time.time())."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    itls: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(eq=False)  # a sequence is itself: `in running` and remove() compare identity, not 25 fields
class Sequence:
    seq_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    prompt: str | None = None
    token_ids: list[int] = field(init=False)  # prompt then outputs, appended as they come
    output_logprobs: list[float] = field(default_factory=list)
    state: SequenceState = SequenceState.WAITING
    finish_reason: str | None = None
    finish_detail: str | None = None
    # KV cache bookkeeping (owned by BlockManager)
    block_table: list[int] = field(default_factory=list)
    host_table: list[int] = field(default_factory=list)  # CPU-tier blocks while swapped out
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_hashed_blocks: int = 0  # leading blocks registered in the prefix cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    prefix_counted: bool = False
    num_preemptions: int = 0
    lpm_skips: int = 0  # times passed over by the lpm policy (its fairness bound)
    stop_text_len: int | None = None  # text is cut here when a stop string matched
    generator: torch.Generator | None = None
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        self.token_ids = list(self.prompt_token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.state is SequenceState.FINISHED
