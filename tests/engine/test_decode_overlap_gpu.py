"""Decode graphs whose model pass runs as two halves on two streams (MINFER_DECODE_OVERLAP,
engine/cuda_graph.py): the same tokens as one pass, for batches large enough to split, with the
KV invariants checked after every step, on Llama (cuBLAS GEMMs) and Qwen3 (q/k norms)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import save_tiny_model

from minfer.core import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# The largest graph. Steps of 33 or more running replay split graphs (48 and up), whose halves
# take the split-K GEMM (up to 64 rows) as well as cuBLAS.
BATCH = 160


def _generate(path, monkeypatch, overlap: str, prompts, params):
    from minfer import LLM

    monkeypatch.setenv("MINFER_DECODE_OVERLAP", overlap)
    monkeypatch.setenv("MINFER_CHECK_KV_INVARIANTS", "1")
    llm = LLM(str(path), device="cuda", dtype="float32", kv_cache_tokens=16384, cuda_graph_max_bs=BATCH)
    split = llm.engine.graphs.overlap_from
    outs = llm.generate_ids(prompts, params, use_tqdm=False)
    llm.shutdown()
    return split, [o.token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_two_halves_give_the_tokens_of_one_pass(arch, tmp_path, monkeypatch):
    save_tiny_model(arch, tmp_path)
    prompts = [[(7 * i + j) % 200 + 1 for j in range(3 + i % 29)] for i in range(BATCH)]
    # greedy and seeded rows; lengths differ so the batch shrinks through the split threshold
    params = [
        SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=4 + i % 13, ignore_eos=True)
        for i in range(BATCH)
    ]
    split, overlapped = _generate(tmp_path, monkeypatch, "48", prompts, params)
    assert split == 48
    none, single = _generate(tmp_path, monkeypatch, "0", prompts, params)
    assert none == 0
    assert overlapped == single
