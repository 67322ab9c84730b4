"""Record `snapshots/engines/vllm-under-load.kvsnap`: a real vLLM under more load than it runs at once.

vLLM's CPU build (`make vllm`) serves SmolLM2-135M with its KV cache cut to 24 blocks of 128 tokens
(`--num-gpu-blocks-override 24`: 3,072 tokens) and at most 8 sequences at once. Twelve clients send 3
requests each (a shared ~250-token prompt and their own question, 96 output tokens with `ignore_eos`),
while `kvctl record --url` writes a frame every 0.5 s; the recording is stopped with Ctrl-C (SIGINT)
once the load is over, as an operator would. Rerunnable (a few minutes on 2 cores):

    .venv/bin/python scripts/record_vllm_incident.py [--out PATH]

Replay it with `kvtop --replay snapshots/engines/vllm-under-load.kvsnap`.
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


def load(url: str, clients: int = 12, rounds: int = 3) -> int:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)

    def one(i: int) -> int:
        done = 0
        for r in range(rounds):
            out = client.completions.create(model="smollm2-135m", prompt=f"{SHARED}\n{QUESTIONS[i]} ({r})",
                                            max_tokens=96, temperature=0.0, extra_body={"ignore_eos": True})  # fmt: skip
            done += out.usage.completion_tokens
        return done

    with ThreadPoolExecutor(clients) as pool:
        return sum(pool.map(one, range(clients)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "snapshots" / "engines" / "vllm-under-load.kvsnap")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="vllm-rec"))
    extra = ("--num-gpu-blocks-override", "24", "--max-num-seqs", "8")
    with vllm_server(resolve_model_dir("smollm2-135m"), tmp / "vllm.log", *extra) as url:
        rec = subprocess.Popen([sys.executable, "-m", "kvtop.ctl.cli", "record", "--url", url, "-o", str(args.out),
                                "--force", "--duration", "0", "--interval", "0.5", "--reason", "under load"],
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
        print(rec.stderr.readline(), end="", file=sys.stderr)  # "recording …": its first frame is read
        threading.Thread(target=lambda: sys.stderr.writelines(rec.stderr), daemon=True).start()
        time.sleep(3)  # idle frames first: the incident starts from a quiet engine
        t0 = time.monotonic()
        tokens = load(url)
        print(f"load: {tokens} tokens generated in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        time.sleep(3)
        rec.send_signal(signal.SIGINT)
        rec.wait(60)
    print(f"{args.out}: {args.out.stat().st_size / 1024:.0f} KiB; vLLM's log in {tmp / 'vllm.log'}", file=sys.stderr)


if __name__ == "__main__":
    main()
