"""--kv-cache-dtype fp8_e4m3 through the engine on CPU: the pool's format, its bytes in the
memory budget, and generation through KVPool.store / gather (tests/kernels/test_kernel_fp8_kv.py
covers the Triton side)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import save_tiny_model

from minfer import LLM, SamplingParams
from minfer.config import ConfigError


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-fp8")
    save_tiny_model("qwen3", path)
    return str(path)


def test_fp8_pool_quarters_float32_bytes_and_still_generates(model_path):
    prompts = [[5, 6, 7, 8], list(range(30))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    full = LLM(model_path, device="cpu", kv_cache_tokens=256)  # float32 on the CPU, on any machine
    fp8 = LLM(model_path, device="cpu", kv_cache_tokens=256, kv_cache_dtype="fp8_e4m3")
    pool = fp8.engine.kv_pool
    assert pool.k[0].dtype == torch.float8_e4m3fn and pool.quantized
    assert full.engine.kv_pool.k[0].dtype == torch.float32 and not full.engine.kv_pool.quantized
    # float32 compute on CPU: 4 bytes -> 1 (against bf16 on a GPU it halves)
    assert fp8.engine.memory.kv_bytes_per_token * 4 == full.engine.memory.kv_bytes_per_token
    line = fp8.engine.memory.describe(fp8.engine.max_model_len)
    assert f"x {fp8.engine.kv_bytes_per_token} B/token (fp8_e4m3)" in line
    assert "fp8" not in full.engine.memory.describe(full.engine.max_model_len)
    outs = fp8.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [8, 8]
    # The cache really holds what was written: some K bytes are non-zero after generation.
    assert pool.k[0].view(torch.uint8).any()


def test_an_unknown_kv_cache_dtype_is_refused_by_name():
    with pytest.raises(ConfigError, match="kv_cache_dtype='fp8'"):
        LLM(kv_cache_dtype="fp8")
