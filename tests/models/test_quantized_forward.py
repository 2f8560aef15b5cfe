"""--quantization's lean decoder forward (models/quantized_forward.py) against the module path
it replaces, pass by pass inside the engine on the default model: prefill (chunked, with a
prefix-cache hit), a lone decode stream and batched decode; and on tiny models of the
variants it covers. Per pass rather than per answer,
as tests/engine/test_fast_attention_engine.py does: the bf16 kernels turn rounding-order
differences into near-tie flips of greedy tokens, which would say nothing about the code."""

from __future__ import annotations

import pytest
from default_model import needs_default_model

from minfer import LLM, SamplingParams
from minfer.models.quantized_forward import LeanDecoderForward


class CheckedForward:
    """Runs the module path, then the lean one on the same pass, and compares the hidden states
    (both write the same K/V slots; the lean path's nearly equal values stay)."""

    def __init__(self, decoder):
        self.decoder, self.lean = decoder, decoder.lean_forward
        self.passes = {"decode 1": 0, "decode many": 0, "prefill": 0}
        self.worst = 0.0

    def __call__(self, input_ids, positions, ctx):
        self.decoder.lean_forward = None
        try:
            want = self.decoder(input_ids, positions, ctx)
        finally:
            self.decoder.lean_forward = self
        got = self.lean(input_ids, positions, ctx)
        # Relative to each row's largest magnitude: the paths round in a different order, and
        # the bf16 kernel inputs make a last-bit difference one bf16 step (2^-8) of an element,
        # which 30 layers grow. Measured (the default model, 4 prefill passes of 38-48 rows):
        # worst row 0.0216, median row 0.002 on an AMD EPYC with avx512_bf16 and no AMX (below
        # 0.02 on the Intel AMX machines before it); exactly 0 with MINFER_LOW_BIT_DENSE=float32.
        # A wrong computation is off by the row's whole magnitude, in most rows.
        rows = (got - want).abs().amax(-1) / want.abs().amax(-1)
        error = rows.max().item()
        self.worst = max(self.worst, error)
        assert error < 4e-2, error
        assert rows.median().item() < 5e-3, rows.median().item()
        meta = ctx.attn
        kind = "prefill" if not meta.is_decode else "decode 1" if meta.batch_size == 1 else "decode many"
        self.passes[kind] += 1
        return got


def _check_passes(llm: LLM, vocab: int) -> CheckedForward:
    decoder = llm.engine.model.model
    assert isinstance(decoder.lean_forward, LeanDecoderForward)
    checked = decoder.lean_forward = CheckedForward(decoder)
    shared = [10 + i for i in range(30)]
    prompts = [shared + [(200 + 13 * i + j) % vocab for j in range(5 + 17 * i)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    try:
        llm.generate_ids(prompts, params, False)
        llm.generate_ids([prompts[0] + [7, 8, 9]], params, False)  # a lone stream, a cached prefix
    finally:
        llm.shutdown()
    assert all(checked.passes.values()), checked.passes
    return checked


@needs_default_model
def test_lean_forward_matches_the_module_path_pass_by_pass():
    llm = LLM(device="cpu", quantization="gguf", cpu_threads=1, kv_cache_tokens=2048, chunked_prefill_size=48)
    checked = _check_passes(llm, 49152)
    print(f"largest relative difference per pass: {checked.worst:.2e}")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3_moe"])
def test_lean_forward_variants(tmp_path, arch):
    """QKV biases (qwen2), per-head q/k norms (qwen3), a module MLP (experts) on tiny models."""
    from tiny_models import save_tiny_model

    save_tiny_model(arch, tmp_path)
    llm = LLM(
        str(tmp_path),
        device="cpu",
        quantization="int4",
        cpu_threads=1,
        kv_cache_tokens=2048,
        chunked_prefill_size=48,
    )
    _check_passes(llm, llm.engine.vocab_size)


@needs_default_model
def test_default_model_keeps_the_module_path():
    """The float32 default must stay bit-identical to transformers: no lean forward there."""
    llm = LLM(device="cpu", cpu_threads=1, kv_cache_tokens=512)
    try:
        assert llm.engine.model.model.lean_forward is None
    finally:
        llm.shutdown()
