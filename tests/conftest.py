"""Shared fixtures: the real SmolLM2-135M, and tiny random-weight models of each supported family.

Models load once per session. Tiny models borrow SmolLM2's tokenizer so text prompts work.
"""

from __future__ import annotations

import os
import pty
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter; it must be set before triton imports.
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    initializer_range=0.1,  # peaky logits: greedy choices are not near-ties
    vocab_size=49152,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)

FAMILIES = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama3-rope": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "smollm-tied": ("LlamaConfig", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=32)),
}


# A test that loads a model, starts a server or drives a terminal goes through one of these fixtures
# (every server and terminal test needs a model to serve); `make test-fast` leaves them out.
MODEL_FIXTURES = frozenset({"smollm2_dir", "smollm2_llm", "smollm2_hf", "tiny_models", "tiny_dir", "tiny_llm"})
PEER_FIXTURES = frozenset({"prometheus"})  # a real Prometheus server (tests/prometheus_server.py)


def pytest_collection_modifyitems(config, items) -> None:
    """Mark `integration` what the fast lane leaves out: the model and peer fixtures' users, `slow`
    tests, and tests or modules that declare themselves so (`pytest.mark.integration`: a real
    terminal, a peer engine, a kvctl process)."""
    for item in items:
        if (MODEL_FIXTURES | PEER_FIXTURES).intersection(item.fixturenames) or item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True)
def fast_lane_stays_in_process(request, monkeypatch):
    """A test of the fast lane (not `integration`) runs in this process: it starts no process, opens
    no terminal and listens on no socket, which is what keeps `make test-fast` under two minutes.
    One that does fails here, naming what it started, until it is marked `integration`."""
    if request.node.get_closest_marker("integration"):
        yield
        return
    started: list[str] = []
    popen_init, fork, listen = subprocess.Popen.__init__, pty.fork, socket.socket.listen

    def popen(self, args, *rest, **kwargs):
        started.append(f"a process ({args if isinstance(args, str) else ' '.join(map(str, args))[:80]})")
        popen_init(self, args, *rest, **kwargs)

    def terminal():
        started.append("a terminal (pty.fork)")
        return fork()

    def listening(self, *backlog):
        started.append(f"a listening socket ({self.family.name})")
        return listen(self, *backlog)

    monkeypatch.setattr(subprocess.Popen, "__init__", popen)
    monkeypatch.setattr(pty, "fork", terminal)
    monkeypatch.setattr(socket.socket, "listen", listening)
    yield
    if started:
        pytest.fail(f"a fast-lane test started {', '.join(dict.fromkeys(started))}: mark it `pytest.mark.integration`")


@pytest.fixture(scope="session", autouse=True)
def cpu_attention_kernel() -> None:
    """Build the C++ CPU attention kernel before the first test (once per machine, tens of seconds
    on two cores), so no test's time limit or server start-up wait pays for it."""
    if not torch.cuda.is_available():
        from engine.kernels import cpu

        cpu.load()


@pytest.fixture
def anyio_backend() -> str:
    """Pilot tests run on asyncio."""
    return "asyncio"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from engine.model.loader import resolve_model_dir

    return resolve_model_dir("smollm2-135m")


def make_tiny_model(family: str, out_dir: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    import transformers

    cls_name, extra = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**TINY, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, smollm2_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {f: make_tiny_model(f, root / f, smollm2_dir) for f in FAMILIES}


@pytest.fixture(scope="session")
def tiny_dir(tiny_models) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def tiny_llm(tiny_dir):
    from engine import LLM

    return LLM(str(tiny_dir), dtype="float32", kv_cache_memory="8MiB", quiet=True)


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_dir):
    from engine import LLM

    return LLM("smollm2-135m", dtype="float32", kv_cache_memory="512MiB", quiet=True)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
