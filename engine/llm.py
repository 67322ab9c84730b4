"""LLM: the offline front door — build an engine from keyword arguments, generate for a list."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling import SamplingParams


class LLM:
    def __init__(self, model: str = "smollm2-135m", quiet: bool = False, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs), quiet=quiet)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    if on_output:
                        on_output(out)
        return [finished[i] for i in ids]

    def stats(self) -> dict:
        return self.engine.stats()
