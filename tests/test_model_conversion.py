"""The HF directory kvtop converts a GGUF into is a plain transformers checkpoint: any loader
(transformers, vLLM) takes it, tied embeddings included, and it gives our engine's tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.model.gguf import FORMAT, convert_gguf, ready
from tests.conftest import make_tiny_model
from tests.helpers import hf_greedy, random_prompts


def tensor_names(model_dir) -> set[str]:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return set(f.keys())


def transformers_load(model_dir):
    from transformers import AutoModelForCausalLM

    hf, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    return hf.eval(), info


def assert_plain_checkpoint(model_dir) -> None:
    names = tensor_names(model_dir)
    assert "model.embed_tokens.weight" in names
    assert "lm_head.weight" not in names  # tied: stored once, under transformers' name
    _, info = transformers_load(model_dir)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


@pytest.mark.slow
def test_the_smollm2_dir_loads_in_transformers_with_no_missing_key(smollm2_dir, smollm2_llm):
    assert_plain_checkpoint(smollm2_dir)
    assert json.loads((smollm2_dir / ".complete").read_text())["format"] == FORMAT
    hf, _ = transformers_load(smollm2_dir)
    tok = smollm2_llm.tokenizer
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    out = smollm2_llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf, prompt, 12, eos=None)
    assert "Paris" in out.text


@pytest.mark.slow
def test_a_fresh_gguf_conversion_writes_the_embedding_under_transformers_name(smollm2_dir, tmp_path):
    source = json.loads((smollm2_dir / ".complete").read_text())["source"]
    out = convert_gguf(Path(source), tmp_path / "smollm2")
    assert_plain_checkpoint(out)
    assert json.loads((out / ".complete").read_text())["format"] == FORMAT
    reference = load_file(str(smollm2_dir / "model.safetensors"))
    fresh = load_file(str(out / "model.safetensors"))
    assert fresh.keys() == reference.keys()
    assert torch.equal(fresh["model.embed_tokens.weight"], reference["model.embed_tokens.weight"])


def old_format_copy(src, dst):
    """What kvtop wrote before format 2: a tied embedding stored only as lm_head.weight, no format."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    if "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / ".complete").write_text(json.dumps({"source": "old.gguf", "converted": 0}))
    return dst


@pytest.mark.parametrize("family", ["smollm-tied", "llama"])
def test_an_old_cached_conversion_is_repaired_on_first_use(family, smollm2_dir, tmp_path):
    fresh = make_tiny_model(family, tmp_path / "fresh", smollm2_dir)
    old = old_format_copy(fresh, tmp_path / "old")
    tied = family == "smollm-tied"
    assert ("model.embed_tokens.weight" in tensor_names(old)) is not tied

    assert ready(old)
    assert json.loads((old / ".complete").read_text()) == {"source": "old.gguf", "converted": 0, "format": FORMAT}
    assert tensor_names(old) == tensor_names(fresh)
    _, info = transformers_load(old)
    assert not info["missing_keys"] and not info["unexpected_keys"], info

    prompts = random_prompts(3, (4, 40), seed=5)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [
        o.token_ids
        for o in LLM(str(fresh), dtype="float32", kv_cache_memory="4MiB", quiet=True).generate(prompts, params)
    ]
    got = [
        o.token_ids
        for o in LLM(str(old), dtype="float32", kv_cache_memory="4MiB", quiet=True).generate(prompts, params)
    ]
    assert got == expected
    assert ready(old) and tensor_names(old) == tensor_names(fresh)  # a second look changes nothing


def test_a_dir_without_a_finished_conversion_is_not_ready(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert not ready(tmp_path)
