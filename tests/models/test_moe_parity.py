"""Mixture-of-experts models (Qwen3-MoE, Mixtral) generate transformers' greedy tokens exactly:
mixed-length prompts in one batch under chunked prefill, through the prefix cache, from a
checkpoint that stores experts stacked, and with the experts sharded over two TP ranks (gloo).
The comparisons with transformers run in float32 (on a GPU too, through the Triton MoE kernels): in
bf16 a rounding can flip a router's top-k choice, which moves the output far more than in a dense
model. The GPU's default bf16 is checked against itself (graphs against eager launches)."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import MOE_ARCHS, hf_greedy, save_tiny_model

from minfer import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PAIRS = ([[3, 1, 4, 1, 5, 9, 2, 6]], [[2, 7, 1, 8], [1, 6, 1, 8, 0, 3, 3]])  # one stream, then two


@pytest.fixture(scope="module", params=MOE_ARCHS)
def moe_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return request.param, str(path), save_tiny_model(request.param, path)


def _prompts(seed: int, lengths: list[int], prefix: list[int] = ()) -> list[list[int]]:
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(256) for _ in range(n)] for n in lengths]


def _generate(path: str, prompts: list[list[int]], **options) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, kv_cache_tokens=1024, dtype="float32", log_level="warning", **options)
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)], llm


def test_the_tiny_models_route_tokens_to_several_experts(moe_model):
    """Guards the other tests: a router that sent every token to the same experts would let a
    wrong expert layout or weight mix pass unnoticed."""
    _, _, hf = moe_model
    gate = next(p for n, p in hf.named_parameters() if n.endswith("layers.0.mlp.gate.weight"))
    hidden = hf.model.embed_tokens.weight[:64]
    chosen = torch.topk(hidden @ gate.T, 2, dim=-1).indices
    assert len(torch.unique(chosen)) == gate.shape[0]


@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_batch_under_chunked_prefill_matches_transformers(moe_model, page_size):
    _, path, hf = moe_model
    prompts = _prompts(1, [5, 70, 17, 1, 33])  # 70 tokens at a 24-token budget: three chunks
    got, _ = _generate(path, prompts, page_size=page_size, chunked_prefill_size=24)
    assert got == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_on_a_gpu_decodes_one_and_two_streams_alike_with_and_without_graphs(moe_model):
    """The GPU's default dtype. One- and two-row decode steps take the one-row gemv kernels, and
    on one GPU a MoE block hands the next layer its unreduced terms [tokens, top_k, hidden],
    which only the norm kernel sums: the gemv's norm prologue must not take them (it did, and
    the graph capture at batch 1 failed). bf16 may flip a router's choice against transformers
    (see the module docstring), so the reference is the same engine run eagerly: a replayed
    graph runs the same kernels, so the tokens are the same."""
    _, path, _ = moe_model
    outputs = []
    for graphs in (256, 0):
        llm = LLM(path, kv_cache_tokens=1024, dtype="bfloat16", cuda_graph_max_bs=graphs, log_level="warning")
        assert (llm.engine.graphs is not None) == (graphs > 0)
        outputs.append([[o.token_ids for o in llm.generate(p, GREEDY, use_tqdm=False)] for p in PAIRS])
        del llm
    assert outputs[0] == outputs[1]
    assert all(len(ids) == GREEDY.max_tokens for run in outputs[0] for ids in run)


def test_memory_line_and_bench_floor_count_the_experts(moe_model):
    from minfer.bench.offline import moe_weights_of

    arch, path, hf = moe_model
    _, llm = _generate(path, [[1, 2, 3]])
    cfg = hf.config
    num_experts = cfg.num_experts if arch == "qwen3_moe" else cfg.num_local_experts
    inter = cfg.moe_intermediate_size if arch == "qwen3_moe" else cfg.intermediate_size
    sparse_layers = 1 if arch == "qwen3_moe" else cfg.num_hidden_layers  # qwen3_moe: layer 1 dense
    per_expert = 3 * inter * cfg.hidden_size  # gate, up, down
    memory = llm.engine.memory
    assert memory.expert_weights_bytes == sparse_layers * num_experts * per_expert * 4  # float32
    assert f"(experts {memory.expert_weights_bytes / 2**30:.2f})" in memory.describe(512)
    moe = moe_weights_of(llm.engine.model, 1)
    assert (moe.layers, moe.num_experts, moe.top_k) == (sparse_layers, num_experts, 2)
    assert (moe.params_per_expert, moe.bytes_per_expert) == (per_expert, 4 * per_expert)


def test_prefix_cache_hits_and_matches_transformers(moe_model):
    _, path, hf = moe_model
    prompts = _prompts(2, [4, 9, 13], prefix=_prompts(3, [40])[0])
    expected = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    llm = LLM(path, kv_cache_tokens=1024, dtype="float32", log_level="warning")
    first = [o.token_ids for o in llm.generate(prompts[:1], GREEDY, use_tqdm=False)]
    rest = [o.token_ids for o in llm.generate(prompts[1:], GREEDY, use_tqdm=False)]
    assert llm.scheduler.kv.prefix_cache.counters.hit_tokens >= 2 * 40
    assert first + rest == expected


def test_stacked_expert_checkpoint_loads_alike(moe_model, tmp_path):
    """transformers keeps experts stacked in memory (`mlp.experts.gate_up_proj`); a checkpoint
    saved in that form loads to the same tokens as the per-expert one."""
    from safetensors.torch import save_file

    _, path, hf = moe_model
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    if not hf.config.tie_word_embeddings:
        state["lm_head.weight"] = hf.lm_head.weight.contiguous()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    hf.config.save_pretrained(tmp_path)
    prompts = _prompts(4, [6, 21])
    stacked, _ = _generate(str(tmp_path), prompts)
    assert stacked == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


def test_tp2_shards_expert_intermediate_and_matches_transformers(moe_model):
    _, path, hf = moe_model
    prompts = _prompts(5, [3, 30, 12])
    # on the CPU, so that a one-GPU host runs it too (two GPUs: tests/distributed/gpu_tp_check.py)
    got, llm = _generate(path, prompts, tp=2, chunked_prefill_size=16, device="cpu")
    experts = llm.engine.model.model.layers[0].mlp.experts
    assert experts.tp.size == 2
    assert experts.inter_per_rank * 2 == hf.model.layers[0].mlp.experts.down_proj.shape[2]
    assert got == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    llm.shutdown()


@pytest.mark.parametrize(
    "shape,total,active",
    [("qwen3-30b-a3b", 30_532_122_624, 3.35e9), ("mixtral-8x7b", 46_702_792_704, 12.9e9)],
)
def test_shipped_moe_shapes_have_the_published_sizes(shape, total, active):
    """Built on the meta device (no memory): 30.5B total / 3.3B active (Qwen3-30B-A3B), 46.7B /
    12.9B (Mixtral-8x7B), as their model cards say."""
    from minfer.bench.offline import moe_weights_of
    from minfer.models.loader import load_hf_config, resolve_model
    from minfer.models.registry import model_class_for

    config = load_hf_config(resolve_model(shape))
    with torch.device("meta"):
        model = model_class_for(config)(config, max_positions=128)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    moe = moe_weights_of(model, 1)
    assert params == total
    assert abs(params - moe.params + moe.layers * moe.top_k * moe.params_per_expert - active) < 0.05e9
