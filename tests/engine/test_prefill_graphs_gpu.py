"""Prefill passes replayed from CUDA graphs (engine/prefill_graph.py) give transformers' tokens
and prompt logprobs, with prompts that share a prefix, span chunks, run beside decoding
requests and reuse buckets of earlier, larger passes; passes too long for a graph run eagerly
in the same engine, and an fp8 pool gives the eager passes' tokens."""

from __future__ import annotations

import pytest
import torch
from tiny_models import hf_greedy, save_tiny_model

from minfer.core import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    # 1700: a pass whose extend takes the long-prompt tiles, which runs eagerly; 700: two chunks
    lengths = [5, 40, 130, 300, 700, 1700, 17, 260, 90, 3]
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    prompts.append(prompts[3][:200] + prompts[1])  # a cached 200-token prefix, then 40 new
    return prompts


def _engine(path, max_running_requests=4, **kw):
    from minfer import LLM

    # Four running requests: later prompts prefill in passes beside decode steps.
    args = dict(device="cuda", dtype="float32", chunked_prefill_size=2048, kv_cache_tokens=16384)
    return LLM(str(path), max_running_requests=max_running_requests, check_kv_invariants=True, **args, **kw)


# MoE: graphed up to the rows the Triton align kernel sorts (4096 // top_k 2 = 2048 tokens)
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe", "mixtral"])
def test_prefill_graphs_match_transformers(tmp_path, arch):
    hf = save_tiny_model(arch, tmp_path, max_position_embeddings=4096).cuda()
    llm = _engine(tmp_path)
    runner = llm.engine.prefill_graphs
    assert runner is not None and runner.buckets[-1] == 2048
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate_ids(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf.cpu(), prompt, 12), len(prompt)
        with torch.no_grad():
            logits = hf.cuda()(torch.tensor([prompt], device="cuda")).logits[0].float()
        expected = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        got = torch.tensor(out.prompt_logprobs.logprobs[1:], device="cuda")
        torch.testing.assert_close(got, expected, atol=2e-3, rtol=0)
    assert runner.replays >= 3  # the passes that join requests as running ones finish


def test_prefill_graphs_over_fp8_pool_equal_eager_passes(tmp_path):
    save_tiny_model("qwen3", tmp_path, max_position_embeddings=4096)
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for max_tokens in (0, None):
        llm = _engine(tmp_path, kv_cache_dtype="fp8_e4m3", prefill_cuda_graph_max_tokens=max_tokens)
        assert (llm.engine.prefill_graphs is None) == (max_tokens == 0)
        tokens[max_tokens] = [o.token_ids for o in llm.generate_ids(prompts, params, use_tqdm=False)]
        del llm
    assert tokens[None] == tokens[0]


def test_many_short_prompts_in_one_graphed_pass(tmp_path):
    """100 prompts of 1-30 tokens: passes of up to 100 requests, each with its own tiles."""
    hf = save_tiny_model("qwen3", tmp_path, max_position_embeddings=4096)  # graphs up to 2048 tokens
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (int(n),), generator=gen).tolist() for n in torch.randint(1, 31, (100,))]
    llm = _engine(tmp_path, max_running_requests=100)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = llm.generate_ids(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 3), prompt
    assert llm.engine.prefill_graphs.replays >= 1
