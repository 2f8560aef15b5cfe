"""A decoder layer run as four fused GEMMs (LlamaDecoderLayer._forward_fused, kernels/gemm.py)
gives the unfused layer's tokens and log-probabilities through the whole engine.

The fused form is taken on CUDA only; here it is forced on CPU tensors, with the GEMMs in
Triton's interpreter, which must be switched on before triton is imported: each comparison
runs in a fresh interpreter process. float32, where the two forms differ only by the order of
a sum of squares, so the log-probabilities agree to float32 rounding.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import sys
    from tiny_models import save_tiny_model
    from minfer import LLM, SamplingParams
    from minfer.kernels import gemm
    from minfer.models import llama

    arch, path = sys.argv[1], sys.argv[2]
    save_tiny_model(arch, path)
    # 70 tokens with an 80-token chunk budget: one prefill pass above gemm.MAX_ROWS runs unfused
    prompts = [[1, 2, 3, 4, 5], list(range(70)), [7] * 9, [200, 3]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    layer = llama.LlamaDecoderLayer
    unfused_suits, fused_forward = layer._fusion_suits, layer._forward_fused
    fused_passes = []

    def counted(self, *args):
        fused_passes.append(args[1].shape[0])
        return fused_forward(self, *args)

    layer._forward_fused = counted
    outs = {}
    for name, suits in (("unfused", unfused_suits), ("fused", lambda self, x: x.shape[0] <= gemm.MAX_ROWS and self.fusable())):
        layer._fusion_suits = suits
        llm = LLM(path, kv_cache_tokens=512, chunked_prefill_size=80)
        outs[name] = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(outs["unfused"], outs["fused"]):
        assert a.token_ids == b.token_ids, (a.token_ids, b.token_ids)
        diff = max(abs(x - y) for x, y in zip(a.logprobs.logprobs, b.logprobs.logprobs))
        assert diff < 1e-4, diff
    dense_layers = sum(isinstance(lyr.mlp, llama.LlamaMLP) for lyr in llm.engine.model.model.layers)
    assert dense_layers and fused_passes, "the fused form never ran"
    assert max(fused_passes) <= gemm.MAX_ROWS
    print("fused passes", len(fused_passes), "dense layers", dense_layers)
""")


# qwen2: the qkv bias; qwen3: q/k norms; qwen3_moe: a dense layer after a sparse one, whose
# per-expert terms the fused layer adds into the residual stream first
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_fused_layer_matches_unfused(tmp_path, arch):
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join(
            [os.path.dirname(os.path.dirname(__file__)), os.environ.get("PYTHONPATH", "")]
        ),
    )
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, arch, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "fused passes" in proc.stdout
