"""The decode graph's own draw (engine/cuda_graph.py): the tokens it draws and writes into the
token table are the sampler's, for greedy and seeded requests, in batches whose size changes as
requests finish; a batch with any request the plain draw cannot serve samples as before."""

from __future__ import annotations

import pytest
import torch
from tiny_models import save_tiny_model

from minfer.core import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _run(path, monkeypatch, graph_draw: str, prompts, params):
    from minfer import LLM

    monkeypatch.setenv("MINFER_GRAPH_DRAW", graph_draw)
    monkeypatch.setenv("MINFER_CHECK_KV_INVARIANTS", "1")
    llm = LLM(str(path), device="cuda", dtype="float32", kv_cache_tokens=4096, cuda_graph_max_bs=16)
    outs = llm.generate_ids(prompts, params, use_tqdm=False)
    runner = llm.engine.graphs
    drawn = runner.drawn_steps
    llm.shutdown()
    return [o.token_ids for o in outs], drawn


def _compare(tmp_path, monkeypatch, params):
    save_tiny_model("llama", tmp_path)
    prompts = [list(range(3 + i, 12 + 2 * i)) for i in range(len(params))]
    drawn_tokens, drawn_steps = _run(tmp_path, monkeypatch, "on", prompts, params)
    sampled_tokens, sampler_steps = _run(tmp_path, monkeypatch, "off", prompts, params)
    assert sampler_steps == 0
    assert drawn_tokens == sampled_tokens
    return drawn_steps


def test_the_graph_draws_the_samplers_tokens(tmp_path, monkeypatch):
    """Greedy and seeded rows of different lengths: every decode step is drawn by the graph,
    and the tokens (and so the token table the next steps read) equal the sampler's."""
    params = [
        SamplingParams(
            temperature=0 if i % 3 == 0 else 0.6 + 0.1 * i, seed=i, max_tokens=6 + 3 * i, ignore_eos=True
        )
        for i in range(7)
    ]
    assert _compare(tmp_path, monkeypatch, params) >= 6 + 3 * 6 - 1  # the longest one's steps


def test_a_batch_the_plain_draw_cannot_serve_samples_as_before(tmp_path, monkeypatch):
    """A top-p row, a penalised one and a min_tokens ban in the batch: those steps sample the
    graph's logits and overwrite the graph's tokens in the table; once only plain rows remain
    (the others finished, the ban lifted) the graph draws again."""
    params = [
        SamplingParams(temperature=0.8, seed=1, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=2, top_p=0.7, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=7, frequency_penalty=1.5, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=3, max_tokens=30, min_tokens=12),
    ]
    drawn_steps = _compare(tmp_path, monkeypatch, params)
    assert 0 < drawn_steps <= 29 - 11  # not while the ban holds (output tokens 1..11)
