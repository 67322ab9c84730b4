"""Sampling as a user sees it: seeds reproduce, stops stop, limits limit."""

from __future__ import annotations

from engine import SamplingParams
from tests.helpers import random_prompts


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_llm):
    target = random_prompts(1, (20, 20), seed=11)[0]
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = tiny_llm.generate([target], [params])[0].token_ids
    others = random_prompts(5, (5, 80), seed=12)
    other_params = [SamplingParams(max_tokens=30, temperature=0.8, ignore_eos=True) for _ in others]
    crowded = tiny_llm.generate([*others[:2], target, *others[2:]], [*other_params[:2], params, *other_params[2:]])
    assert crowded[2].token_ids == alone
    different_seed = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    assert tiny_llm.generate([target], [different_seed])[0].token_ids != alone


def test_top_k_one_is_greedy(tiny_llm):
    prompts = random_prompts(3, (10, 40), seed=5)
    greedy = tiny_llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    top1 = tiny_llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.7, top_k=1, ignore_eos=True))
    assert [o.token_ids for o in top1] == [o.token_ids for o in greedy]


def test_max_tokens_and_finish_reason_length(tiny_llm):
    out = tiny_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 7
    assert out.finish_reason == "length"


def test_eos_stops_unless_ignored(tiny_llm):
    # make the model's own greedy choice the stop token: it must stop right there with reason "stop"
    prompt = random_prompts(1, (12, 12), seed=21)[0]
    free = tiny_llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    stop_token = free.token_ids[3]
    first = free.token_ids.index(stop_token)
    stopped = tiny_llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop_token]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: first + 1]


def test_stop_string_cuts_the_text(tiny_llm):
    prompt = random_prompts(1, (12, 12), seed=22)[0]
    free = tiny_llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    text = free.text
    assert len(text) > 4
    stop = text[2:4]
    out = tiny_llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    assert stop not in out.text
