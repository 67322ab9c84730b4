"""Bad input raises a clear error that says what is wrong; nothing is queued forever."""

from __future__ import annotations

import json

import pytest

from engine import LLM, InvalidRequestError, ModelLoadError, SamplingParams, UnsupportedArchitectureError
from kvtop.protocol.config import EngineConfig, parse_size
from kvtop.protocol.errors import ConfigError


def test_empty_prompt(tiny_llm):
    with pytest.raises(InvalidRequestError, match="empty"):
        tiny_llm.engine.add_request("", SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        tiny_llm.engine.add_request([], SamplingParams())


def test_prompt_longer_than_model_or_cache(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_memory=8 * 16 * 512, max_model_len=100, quiet=True)
    with pytest.raises(InvalidRequestError, match=r"at most 99 fit \(max_model_len=100"):
        llm.engine.add_request(list(range(3, 103)), SamplingParams())
    small_cache = LLM(str(tiny_dir), dtype="float32", kv_cache_memory=4 * 16 * 512, quiet=True)
    with pytest.raises(InvalidRequestError, match="KV cache holds 64 tokens"):
        small_cache.engine.add_request(list(range(3, 83)), SamplingParams())
    assert not small_cache.engine.has_unfinished()


def test_generation_stops_when_the_cache_is_full(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_memory=4 * 16 * 512, quiet=True)
    out = llm.generate([list(range(3, 40))], SamplingParams(max_tokens=500, ignore_eos=True, temperature=0))[0]
    assert out.finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.token_ids) == 64
    assert llm.stats()["kv"]["used"] == 0


@pytest.mark.parametrize("bad", [0, -3, 1.5, True])
def test_max_tokens_must_be_positive(bad):
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=bad)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [("temperature", -1.0, "temperature"), ("top_p", 0.0, "top_p"), ("top_k", -5, "top_k")],
)
def test_bad_sampling_values(field, value, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**{field: value})


def test_unknown_model_names_what_is_accepted():
    with pytest.raises(ModelLoadError, match="unknown model 'no-such-model'.*smollm2-135m"):
        LLM("no-such-model", quiet=True)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="without config.json"):
        LLM(str(tmp_path), quiet=True)


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2, "n_embd": 64, "n_head": 2}
        )
    )
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel"):
        LLM(str(tmp_path), quiet=True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kv_cache_memory": "lots"}, "cannot read size"),
        ({"block_size": 12}, "power of two"),
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**kwargs)


def test_sizes_parse():
    assert parse_size("256MiB") == 256 * 1024**2
    assert parse_size("1.5GiB") == int(1.5 * 1024**3)
    assert parse_size("500MB") == 500 * 1000**2
    assert parse_size("4096") == 4096


def test_out_of_vocabulary_ids_are_refused_in_the_servers_words(tiny_llm):
    """engine.validation.PromptLimits is the one validator: the server's 400 carries this message too."""
    vocab = tiny_llm.engine.spec.vocab_size
    with pytest.raises(InvalidRequestError, match=rf"^token id {vocab} is outside the vocabulary \[0, {vocab}\)$"):
        tiny_llm.engine.add_request([1, vocab], SamplingParams())
    assert not tiny_llm.engine.has_unfinished()
