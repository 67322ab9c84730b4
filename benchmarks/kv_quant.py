"""KV quantization accuracy on SmolLM2-135M: greedy agreement with the 16/32-bit cache and the
mean log-prob difference of the reference tokens (teacher-forced), for int8 and fp8_e4m3.

    .venv/bin/python benchmarks/kv_quant.py --prompts 64 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import time

from engine import LLM, SamplingParams

TOPICS = ["the ocean", "a city at night", "memory in computers", "the history of tea", "a mountain village",
          "prime numbers", "how bread rises", "the moon landing", "learning a language", "rain in spring",
          "a chess opening", "the printing press", "volcanoes", "a lighthouse keeper", "coral reefs",
          "the speed of light"]  # fmt: skip
FORMS = ["Write two sentences about {}.", "Explain {} to a child.", "Give three facts about {}.",
         "Describe {} in one paragraph."]  # fmt: skip


def prompts(llm: LLM, n: int) -> list[list[int]]:
    tok = llm.tokenizer
    texts = [FORMS[i % len(FORMS)].format(TOPICS[(i // len(FORMS)) % len(TOPICS)]) for i in range(n)]
    rendered = [
        tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
        for t in texts
    ]
    return [tok.encode(r, add_special_tokens=False) for r in rendered]


def compare(base: LLM, ref: list, llm: LLM, kvd: str, ps: list[list[int]], greedy: SamplingParams) -> dict:
    """One quantized cache against the reference outputs: greedy agreement, and the log-prob gap."""
    t0 = time.time()
    got = llm.generate(ps, greedy)
    secs = time.time() - t0
    same_tokens = sum(a == b for r, g in zip(ref, got) for a, b in zip(r.token_ids, g.token_ids))
    identical = sum(r.token_ids == g.token_ids for r, g in zip(ref, got))
    first_div = [
        next((i for i, (a, b) in enumerate(zip(r.token_ids, g.token_ids)) if a != b), len(r.token_ids))
        for r, g in zip(ref, got)
    ]
    # log-prob of the reference's next token after a shared prefix: the first token and, teacher-
    # forced, the token after half of the reference continuation
    one = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
    diffs = []
    for r in ref[: min(len(ref), 32)]:
        half = len(r.token_ids) // 2
        prefix = r.prompt_token_ids + r.token_ids[:half]
        a = base.generate([prefix], one)[0]
        b = llm.generate([prefix], one)[0]
        if a.token_ids == b.token_ids:
            diffs.append(abs(a.logprobs[0] - b.logprobs[0]))
    return {
        "kv_cache_dtype": kvd,
        "bytes_per_token": llm.stats()["kv"]["bytes_per_token"],
        "seconds": secs,
        "token_agreement": same_tokens / sum(len(r.token_ids) for r in ref),
        "identical_sequences": identical / len(ref),
        "mean_tokens_before_divergence": sum(first_div) / len(first_div),
        "mean_abs_logprob_diff": sum(diffs) / len(diffs) if diffs else None,
    }


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"SmolLM2-135M, {args.prompts} chat prompts × {args.max_tokens} greedy tokens, model dtype {args.dtype}")
    print(
        f"{'KV dtype':10} {'B/token':>8} {'capacity':>9} {'tok agree':>10} {'identical':>10} {'tok to 1st diff':>16} {'|Δ logprob|':>12}"
    )
    auto_bpt = rows[0]["bytes_per_token"]
    for r in rows:
        agree = f"{r.get('token_agreement', 1.0) * 100:.1f} %"
        ident = f"{r.get('identical_sequences', 1.0) * 100:.1f} %"
        div = f"{r.get('mean_tokens_before_divergence', args.max_tokens):.1f}"
        lp = r.get("mean_abs_logprob_diff")
        print(f"{r['kv_cache_dtype']:10} {r['bytes_per_token']:>8} {auto_bpt / r['bytes_per_token']:>8.2f}x "
              f"{agree:>10} {ident:>10} {div:>16} {'-' if lp is None else f'{lp:.4f}':>12}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args()
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    base = LLM("smollm2-135m", dtype=args.dtype, kv_cache_memory="1GiB", quantization="none", quiet=True)
    ps = prompts(base, args.prompts)
    t0 = time.time()
    ref = base.generate(ps, greedy)
    ref_s = time.time() - t0
    rows = [{"kv_cache_dtype": "auto", "bytes_per_token": base.stats()["kv"]["bytes_per_token"], "seconds": ref_s}]
    # teacher forcing: score the reference continuation under each cache by feeding prompt + ref tokens
    for kvd in ("int8", "fp8_e4m3"):
        llm = LLM("smollm2-135m", dtype=args.dtype, kv_cache_memory="1GiB", kv_cache_dtype=kvd, quantization="none",
                  quiet=True)  # fmt: skip
        rows.append(compare(base, ref, llm, kvd, ps, greedy))
    print_table(rows, args)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
