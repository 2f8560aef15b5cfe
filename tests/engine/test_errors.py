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
