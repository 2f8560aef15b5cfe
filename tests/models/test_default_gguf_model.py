"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers loading
the same file: next-token logits, greedy tokens, and the France question."""

from __future__ import annotations

import pytest
import torch
from default_model import needs_default_model
from greedy_parity import assert_greedy_parity, near_tie_gap

from minfer import LLM, SamplingParams
from minfer.attention.base import ForwardContext, build_metadata
from minfer.kvcache.pool import KVPool

pytestmark = needs_default_model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", disable_overlap_schedule=True)  # the float32 reference numerics


def _minfer_logits(llm, ids: list[int]) -> torch.Tensor:
    """Logits of every position from one prefill through a throwaway pool."""
    eng = llm.engine
    n = len(ids)
    pool = KVPool(
        eng.hf_config.num_hidden_layers, n, eng.num_kv_heads, eng.head_dim, 1, eng.dtype, eng.device
    )
    meta = build_metadata([0], [0], [n], torch.arange(n, dtype=torch.int32)[None, :], False, eng.device)
    ctx = ForwardContext(meta, pool, eng.backend, torch.arange(n))
    with torch.inference_mode():
        hidden = eng.model(torch.tensor(ids), torch.arange(n), ctx)
        return eng.model.compute_logits(hidden)


def test_logits_match_transformers(llm, default_reference):
    reference = default_reference  # tests/models/conftest.py
    ids = llm.apply_chat_template(QUESTION)
    ours = _minfer_logits(llm, ids)
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0].float()
    assert ours.shape == theirs.shape
    assert torch.allclose(ours, theirs, atol=2e-3, rtol=1e-3), (ours - theirs).abs().max()


def test_greedy_answer_is_paris_and_matches_transformers(llm, default_reference):
    reference = default_reference
    ids = llm.apply_chat_template(QUESTION)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert "Paris" in out.text
    with torch.no_grad():
        ref = reference.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=len(out.token_ids),
            do_sample=False,
        )
    expected = ref[0, len(ids) :].tolist()
    assert_greedy_parity(reference, ids, out.token_ids, expected, near_tie_gap(llm.engine.dtype))
    assert llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=16))[0].text == out.text
