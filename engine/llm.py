"""LLM: the offline front door — build an engine from keyword arguments, generate for a list."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling import SamplingParams
from kvtop.protocol.config import EngineConfig


def run_to_completion(
    engine: LLMEngine, request_ids: Sequence[str], on_output: Callable[[RequestOutput], None] | None = None
) -> list[RequestOutput]:
    """Step `engine` until every request of `request_ids` has finished; their final outputs, in that
    order. `on_output` sees each of their outputs as it comes (new tokens, then the finished one):
    the loop of `LLM.generate`, and of `kvctl run` with its progress bar."""
    waiting, finished = set(request_ids), {}
    while waiting:
        for out in engine.step():
            if out.request_id not in waiting:
                continue
            if on_output:
                on_output(out)
            if out.finished:
                finished[out.request_id] = out
                waiting.discard(out.request_id)
    return [finished[i] for i in request_ids]


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

        def finished_only(out: RequestOutput) -> None:
            if out.finished and on_output:
                on_output(out)

        return run_to_completion(self.engine, ids, finished_only)

    def stats(self) -> dict:
        return self.engine.stats()
