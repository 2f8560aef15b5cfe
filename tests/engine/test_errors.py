"""Bad input raises clear exceptions that name the problem."""

from __future__ import annotations

import json

import pytest

from minfer import LLM, SamplingParams
from minfer.core import InvalidRequestError
from minfer.models.registry import UnsupportedModelError


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from tiny_models import save_tiny_model

    path = tmp_path_factory.mktemp("tiny-errors")
    save_tiny_model("llama", path)
    return path


def test_unknown_architecture(tiny_path, tmp_path):
    cfg = json.loads((tiny_path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        LLM(str(tmp_path), load_format="dummy")


def test_missing_model_file():
    with pytest.raises(FileNotFoundError, match="no/such/model"):
        LLM("no/such/model")


def test_missing_weights(tiny_path, tmp_path):
    (tmp_path / "config.json").write_text((tiny_path / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(tmp_path))


def test_unknown_option(tiny_path):
    with pytest.raises(TypeError, match="page_sise"):
        LLM(str(tiny_path), page_sise=4)


def test_request_limits(tiny_path):
    llm = LLM(str(tiny_path), max_model_len=64, kv_cache_tokens=256)
    with pytest.raises(InvalidRequestError, match="64"):
        llm.generate([[1] * 60], SamplingParams(max_tokens=10))
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=0))
    with pytest.raises(InvalidRequestError, match="temperature"):
        llm.generate([[1, 2]], SamplingParams(temperature=-1))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        llm.generate([[1, 999999]], SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], SamplingParams())
    # Still serves afterwards.
    assert len(llm.generate([[1, 2]], SamplingParams(max_tokens=3), use_tqdm=False)[0].token_ids) <= 3


@pytest.mark.parametrize("overlap", [True, False])
def test_a_request_that_fills_the_context_gets_every_token(tiny_path, overlap):
    """prompt + max_tokens == max_model_len is allowed, so all max_tokens come: under overlap
    scheduling the context check once counted the pass already in flight and ended such a
    request one token early ("length" at 5 of 6)."""
    llm = LLM(str(tiny_path), max_model_len=64, kv_cache_tokens=256, disable_overlap_schedule=not overlap)
    for prompt_len in (58, 63):  # decode steps up to the last position; only the prefill's token
        max_tokens = 64 - prompt_len
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        out = llm.generate([[5] * prompt_len], params, use_tqdm=False)[0]
        assert len(out.token_ids) == max_tokens and out.finish_reason == "length"
