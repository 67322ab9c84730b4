"""Record `snapshots/engines/vllm-under-pressure.kvsnap`: a real vLLM short of KV, queue and prefix cache.

vLLM's CPU build (`make vllm`) serves SmolLM2-135M with its KV cache cut to 24 blocks of 128 tokens
(`--num-gpu-blocks-override 24`: 3,072 tokens), up to 12 sequences at once and at most 14 requests
in it (`--max-num-queued-reqs 14`). Sixteen clients send 5 requests each, 96 output tokens with
`ignore_eos`: in the first three rounds a shared ~250-token prompt and their own question (the
prefix cache hits), in the last two a prompt of their own (it stops hitting). Twelve sequences of
~350 tokens want more blocks than there are, so vLLM preempts; the two clients beyond the limit
are turned away (an HTTP error, counted) and try again a second later. `kvctl record --url` writes a frame
every 0.5 s; the recording is stopped with Ctrl-C (SIGINT) once the load is over, as an operator
would. Rerunnable (a few minutes on 2 cores):

    .venv/bin/python scripts/record_vllm_incident.py [--out PATH]

Replay it with `kvtop --replay snapshots/engines/vllm-under-pressure.kvsnap`.
(`snapshots/engines/vllm-under-load.kvsnap` came from an earlier version: 12 clients, 8 sequences.)
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.model.loader import resolve_model_dir  # noqa: E402
from tests.vllm_server import vllm_server  # noqa: E402

SHARED = "You are a careful assistant who answers questions about history, science and cooking. " * 14
QUESTIONS = ["Why is the sky blue?", "Who built the pyramids?", "How does bread rise?", "What is a comet?",
             "Why do leaves fall?", "How do bees dance?", "What is rust?", "Why is the sea salty?",
             "How do magnets work?", "What is a volcano?", "Why do cats purr?", "How is glass made?"]  # fmt: skip


def prompt(client: int, round_: int, rounds: int) -> str:
    """The shared prompt and the client's question, but in the last round a prompt of its own."""
    question = QUESTIONS[client % len(QUESTIONS)]
    if round_ < rounds - 2:
        return f"{SHARED}\n{question} ({round_})"
    own = " ".join(f"{w}{client}" for w in SHARED.split()[:60])  # as long, shared with no one
    return f"{own}\n{question}"


def load(url: str, clients: int = 16, rounds: int = 5) -> tuple[int, int]:
    """(tokens generated, requests turned away)."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)

    def one(i: int) -> tuple[int, int]:
        done = refused = 0
        for r in range(rounds):
            for _ in range(30):
                try:
                    out = client.completions.create(model="smollm2-135m", prompt=prompt(i, r, rounds), max_tokens=96,
                                                    temperature=0.0, extra_body={"ignore_eos": True})  # fmt: skip
                except openai.APIStatusError:  # the queue limit, counted by vLLM: again in a second
                    refused += 1
                    time.sleep(1.0)
                    continue
                done += out.usage.completion_tokens
                break
        return done, refused

    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one, range(clients)))
    return sum(d for d, _ in results), sum(r for _, r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "snapshots" / "engines" / "vllm-under-pressure.kvsnap")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="vllm-rec"))
    extra = ("--num-gpu-blocks-override", "24", "--max-num-seqs", "12", "--max-num-queued-reqs", "14")
    with vllm_server(resolve_model_dir("smollm2-135m"), tmp / "vllm.log", *extra) as url:
        rec = subprocess.Popen([sys.executable, "-m", "kvtop.ctl.cli", "record", "--url", url, "-o", str(args.out),
                                "--force", "--duration", "0", "--interval", "0.5", "--reason", "under pressure"],
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
        print(rec.stderr.readline(), end="", file=sys.stderr)  # "recording …": its first frame is read
        threading.Thread(target=lambda: sys.stderr.writelines(rec.stderr), daemon=True).start()
        time.sleep(3)  # idle frames first: the incident starts from a quiet engine
        t0 = time.monotonic()
        tokens, refused = load(url)
        print(f"load: {tokens} tokens generated, {refused} requests turned away, in {time.monotonic() - t0:.0f} s",
              file=sys.stderr)  # fmt: skip
        time.sleep(3)
        rec.send_signal(signal.SIGINT)
        rec.wait(60)
    print(f"{args.out}: {args.out.stat().st_size / 1024:.0f} KiB; vLLM's log in {tmp / 'vllm.log'}", file=sys.stderr)


if __name__ == "__main__":
    main()
