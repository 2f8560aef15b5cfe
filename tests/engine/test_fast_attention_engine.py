"""The --quantization CPU attention path (attention/torch_fast.py) inside the engine, on the
default model: every attention call of a served batch (chunked prefill whose later chunks
attend to the cached ones, prefix-cache hits, batched decode) matches the
reference torch backend on the same pool. Per call rather than per answer: the low-bit
kernels round activations to bfloat16, which turns attention's 1e-6 rounding differences
into ~0.01-nat log-prob differences and, at near-ties, different greedy tokens."""

from __future__ import annotations

import torch
from default_model import needs_default_model

from minfer import LLM, SamplingParams
from minfer.attention.torch_backend import TorchAttentionBackend
from minfer.attention.torch_fast import FastTorchAttentionBackend

pytestmark = needs_default_model


class CheckedBackend(FastTorchAttentionBackend):
    """The fast path, each call checked against the reference backend."""

    def __init__(self):
        super().__init__()
        self.reference = TorchAttentionBackend()
        self.calls = {"decode": 0, "prefill with a prefix": 0}

    def forward(self, q, layer, ctx, scale, new_kv=None, window=None):  # new_kv: None on the CPU
        got = super().forward(q, layer, ctx, scale, new_kv, window)
        expected = self.reference.forward(q, layer, ctx, scale, window=window)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        meta = ctx.attn
        if meta.is_decode:
            self.calls["decode"] += 1
        elif any(p > 0 and e > 1 for p, e in zip(meta.prefix_lens_cpu, meta.extend_lens_cpu)):
            self.calls["prefill with a prefix"] += 1
        return got


def test_every_attention_call_matches_the_reference_backend():
    llm = LLM(device="cpu", quantization="gguf", cpu_threads=1, kv_cache_tokens=2048, chunked_prefill_size=48)
    assert isinstance(llm.engine.backend, FastTorchAttentionBackend)
    backend = llm.engine.backend = CheckedBackend()
    shared = [100 + i for i in range(30)]
    prompts = [shared + [2000 + 13 * i + j for j in range(5 + 17 * i)] for i in range(5)]  # 35..103 tokens
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    try:
        llm.generate_ids(prompts, params, False)
        # Prefix-cache hits on the page-table rows of finished requests, longer than those were.
        llm.generate_ids([p + list(range(7, 19)) for p in prompts[:3]], params, False)
    finally:
        llm.shutdown()
    assert backend.calls["prefill with a prefix"] > 0
    assert backend.calls["decode"] > 0
