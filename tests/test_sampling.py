"""Sampling as a user sees it: seeds reproduce, stops stop, limits limit."""

from __future__ import annotations

import pytest
import torch

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


# ---- the sampler's edges: what a request can ask for without breaking its batch ----------------
EOS = 7


def _logits(rows: int = 1, vocab: int = 64, peak: int = EOS) -> torch.Tensor:
    g = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, vocab, generator=g)
    logits[:, peak] = 10.0  # the model's clear favourite
    return logits


def test_min_tokens_keeps_eos_out_until_enough_tokens(tiny_llm):
    from engine.sampling import sample

    params = [SamplingParams(temperature=0.0, min_tokens=3), SamplingParams(temperature=0.8, min_tokens=3, seed=1)]
    gens = [None, torch.Generator().manual_seed(1)]
    for done, banned in ((0, True), (2, True), (3, False)):
        tokens, _ = sample(
            _logits(2), params, gens, token_ids=[[1, 2]] * 2, num_outputs=[done] * 2, eos_token_ids={EOS}
        )
        assert (EOS not in tokens) if banned else tokens[0] == EOS
    stop = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[EOS])  # stop tokens too, EOS or not
    assert sample(_logits(), [stop], [None], token_ids=[[1]], num_outputs=[0])[0] != [EOS]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    from engine.sampling import apply_processors

    logits = torch.tensor([[4.0, -1.0, 3.0, 0.5]])
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    out = apply_processors(logits, [p], token_ids=[[0, 1]], num_outputs=[0], eos_token_ids=())
    assert out.tolist() == [[2.0, -2.0, 3.0, 0.5]]
    assert logits.tolist() == [[4.0, -1.0, 3.0, 0.5]]  # the model's logits (and log-probs) are left alone
    from engine.sampling import sample

    assert sample(logits, [p], [None], token_ids=[[0, 1]], num_outputs=[0])[0] == [2]  # greedy moves off token 0


def test_min_p_one_and_tiny_temperature_or_top_p_are_argmax():
    from engine.sampling import sample

    logits = torch.randn(32, 500, generator=torch.Generator().manual_seed(3)) * 3
    want = logits.argmax(dim=-1).tolist()
    gen = torch.Generator().manual_seed(0)
    for kw in ({"temperature": 1.5, "min_p": 1.0}, {"temperature": 1e-300}, {"temperature": 1e-40},
               {"temperature": 1.0, "top_p": 1e-300}, {"temperature": 2.0, "top_p": 1e-45, "top_k": 2**31 - 1}):  # fmt: skip
        tokens, _ = sample(logits, [SamplingParams(**kw)] * 32, [gen] * 32)
        assert tokens == want, kw


def test_plain_greedy_on_bf16_logits_picks_the_first_maximal_token_as_the_fp32_path():
    """All-greedy rows with nothing else asked take the argmax in the logits' own dtype (no fp32
    copy): the same tokens, ties to the first index, as with a row that sends the batch down the
    fp32 path (log-probs), and min_tokens still holds EOS back."""
    from engine.sampling import sample

    logits = (torch.randn(16, 300, generator=torch.Generator().manual_seed(4)) * 2).to(torch.bfloat16)
    logits[3, [7, 70, 200]] = 50.0  # a three-way tie: the first wins
    greedy = SamplingParams(temperature=0.0)
    fast, lp = sample(logits, [greedy] * 16, [None] * 16)
    assert lp is None and fast[3] == 7
    slow, lp = sample(logits, [greedy] * 15 + [SamplingParams(temperature=0.0, logprobs=1)], [None] * 16)
    assert fast == slow == logits.float().argmax(dim=-1).tolist() and lp is not None
    eos = fast[0]
    held = sample(logits, [SamplingParams(temperature=0.0, min_tokens=2)] * 16, [None] * 16,
                  num_outputs=[0] * 16, eos_token_ids=[eos])[0]  # fmt: skip
    assert eos not in held and all(h == f for h, f in zip(held, fast, strict=True) if f != eos)


def test_top_k_beyond_the_vocabulary_is_no_top_k():
    from engine.sampling import sample

    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(5))
    draw = [
        sample(logits, [SamplingParams(temperature=1.0, top_k=k, seed=9)] * 4, [torch.Generator().manual_seed(9)] * 4)
        for k in (-1, 100, 2**31 - 1)
    ]
    assert draw[0] == draw[1] == draw[2]


@pytest.mark.parametrize(
    "kw",
    [{"temperature": float("nan")}, {"temperature": float("inf")}, {"top_p": float("nan")}, {"top_k": 2**63},
     {"top_k": True}, {"min_p": 1.5}, {"min_tokens": -1}, {"repetition_penalty": 0.0},
     {"repetition_penalty": 1e-300}, {"max_tokens": 2**63}, {"seed": 2**64}, {"stop_token_ids": [-1]},
     {"logprobs": 21}],
)  # fmt: skip
def test_impossible_sampling_params_are_refused(kw):
    from engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError):
        SamplingParams(**kw)


def test_seeded_sampling_with_penalties_is_reproducible_whatever_the_batch(tiny_llm):
    target = random_prompts(1, (20, 20), seed=31)[0]
    params = SamplingParams(max_tokens=16, temperature=1.0, min_p=0.02, repetition_penalty=1.3, seed=77,
                            ignore_eos=True)  # fmt: skip
    alone = tiny_llm.generate([target], [params])[0].token_ids
    others = random_prompts(4, (5, 60), seed=32)
    crowd_params = [SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.1, ignore_eos=True)] * 4
    crowded = tiny_llm.generate([*others[:2], target, *others[2:]], [*crowd_params[:2], params, *crowd_params[2:]])
    assert crowded[2].token_ids == alone


def test_logprobs_carry_the_k_most_likely_tokens():
    """Each row's log-prob carries its own k most likely tokens of the model's distribution, most
    likely first (what `logprobs: k` / `top_logprobs: k` return)."""
    from engine.sampling import Logprob, sample

    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]] * 3)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0, logprobs=0),
              SamplingParams(temperature=1.0, seed=1)]  # fmt: skip
    tokens, lps = sample(logits, params, [None, None, torch.Generator().manual_seed(1)])
    full = torch.log_softmax(logits[0], dim=-1)
    assert tokens[:2] == [1, 1] and isinstance(lps[0], Logprob)
    assert [t for t, _ in lps[0].top] == [1, 3, 2]
    assert [v for _, v in lps[0].top] == pytest.approx(full[[1, 3, 2]].tolist())
    assert lps[0] == pytest.approx(full[1].item()) and lps[1].top == ()
