"""RMSNorm, SiLU-and-mul, RoPE and KV store kernels against the torch layers they replace."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import tolerance

from minfer.kernels.activation import silu_and_mul, silu_and_mul_reference
from minfer.kernels.kv_store import store_kv
from minfer.kernels.norm import rmsnorm, rmsnorm_reference
from minfer.kernels.rope import apply_rope_inplace, apply_rope_reference
from minfer.layers.activation import silu_and_mul as layer_silu_and_mul
from minfer.layers.norm import RMSNorm
from minfer.layers.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _bitwise_or_interpreter(dtype: torch.dtype, atol: float = 0.0) -> dict:
    """Exact on the GPU, where the kernels round exactly where the torch ops do. Triton's
    interpreter (3.9) truncates fp32 -> bf16 instead of rounding to nearest even, so there each
    bf16 rounding may be one unit in the last place off (`atol` covers sums that cancel).
    In fp32 nothing rounds between a product and a sum, so the compiler may fuse them (FMA)."""
    if dtype == torch.float32:
        return dict(atol=1e-5, rtol=1e-5)
    if torch.cuda.is_available() or dtype != torch.bfloat16:
        return dict(atol=0, rtol=0)
    return dict(atol=atol, rtol=2 ** -7)


def _randn(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def _qkv_views(tokens, num_heads, num_kv_heads, head_dim, dtype, device, seed):
    """q, k, v as the attention layer sees them: strided views into one fused qkv output."""
    qkv = _randn((tokens, (num_heads + 2 * num_kv_heads) * head_dim), dtype, device, seed)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (q.view(tokens, num_heads, head_dim), k.view(tokens, num_kv_heads, head_dim),
            v.view(tokens, num_kv_heads, head_dim))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 200])
def test_rmsnorm_matches_layer(dtype, hidden, device):
    norm = RMSNorm(hidden, 1e-6).to(device=device, dtype=dtype)
    norm.weight.copy_(_randn((hidden,), dtype, device, 1))
    x, residual = _randn((7, hidden), dtype, device, 2), _randn((7, hidden), dtype, device, 3)
    torch.testing.assert_close(rmsnorm(x, norm.weight, 1e-6), norm(x), **tolerance(dtype))
    out, new_residual = rmsnorm(x, norm.weight, 1e-6, residual)
    expected_out, expected_residual = norm(x, residual)
    torch.testing.assert_close(out, expected_out, **tolerance(dtype))
    torch.testing.assert_close(new_residual, expected_residual, **_bitwise_or_interpreter(dtype))


def test_rmsnorm_per_head_view_and_fp32_weight(device):
    """Qwen3's q/k norm runs on a strided [T, H, D] view; an fp32 weight promotes the output."""
    q, _, _ = _qkv_views(5, 4, 2, 64, torch.bfloat16, device, 4)
    weight = _randn((64,), torch.float32, device, 5)
    out = rmsnorm(q, weight, 1e-6)
    assert out.dtype == torch.float32 and out.shape == q.shape
    # the normalised value is rounded to bf16 before the weight: where the sum of squares (added
    # in another order) lands it on the other side of a rounding boundary, one bf16 unit apart
    torch.testing.assert_close(out, rmsnorm_reference(q, weight, 1e-6), atol=1e-5, rtol=2 ** -7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [96, 1500])
def test_silu_and_mul_matches_layer(dtype, width, device):
    x = _randn((2, 3, 2 * width), dtype, device, 6)
    out = silu_and_mul(x)
    assert out.shape == (2, 3, width)
    torch.testing.assert_close(out, layer_silu_and_mul(x), **tolerance(dtype))
    torch.testing.assert_close(out, silu_and_mul_reference(x), **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2)])
def test_rope_matches_layer(dtype, head_dim, num_heads, num_kv_heads, device):
    params = {"rope_theta": 1_000_000.0, "rope_type": "default"}
    rotary = RotaryEmbedding(head_dim, 4096, params).to(device)
    q, k, _ = _qkv_views(6, num_heads, num_kv_heads, head_dim, dtype, device, 7)
    positions = torch.tensor([0, 1, 17, 900, 4095, 3], device=device)
    expected_q, expected_k = rotary(positions, q.clone(), k.clone())
    apply_rope_inplace(q, k, positions, rotary.cos_sin)
    tol = _bitwise_or_interpreter(dtype, atol=4e-2)
    torch.testing.assert_close(q, expected_q, **tol)
    torch.testing.assert_close(k, expected_k, **tol)
    ref_q, ref_k = apply_rope_reference(q.clone(), k.clone(), positions, rotary.cos_sin)  # runs on its output
    assert ref_q.shape == q.shape and ref_k.shape == k.shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_store_kv_writes_only_out_loc(dtype, head_dim, device):
    num_kv_heads, tokens, slots = 2, 9, 40
    _, k, v = _qkv_views(tokens, 4, num_kv_heads, head_dim, dtype, device, 8)
    k_pool = _randn((slots, num_kv_heads, head_dim), dtype, device, 9)
    v_pool = _randn((slots, num_kv_heads, head_dim), dtype, device, 10)
    expected_k, expected_v = k_pool.clone(), v_pool.clone()
    out_loc = torch.randperm(slots, generator=torch.Generator().manual_seed(11))[:tokens].to(torch.int32).to(device)
    expected_k[out_loc.long()] = k
    expected_v[out_loc.long()] = v
    store_kv(k_pool, v_pool, k, v, out_loc)
    torch.testing.assert_close(k_pool, expected_k, atol=0, rtol=0)
    torch.testing.assert_close(v_pool, expected_v, atol=0, rtol=0)


@pytest.mark.gpu
def test_fused_kernels_real_shapes_gpu():
    device, dtype = torch.device("cuda"), torch.bfloat16
    x, residual = _randn((256, 4096), dtype, device, 12), _randn((256, 4096), dtype, device, 13)
    weight = _randn((4096,), dtype, device, 14)
    out, new_residual = rmsnorm(x, weight, 1e-5, residual)
    expected_out, expected_residual = rmsnorm_reference(x, weight, 1e-5, residual)
    torch.testing.assert_close(out, expected_out, **tolerance(dtype))
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)
    gate_up = _randn((256, 2 * 14336), dtype, device, 15)
    torch.testing.assert_close(silu_and_mul(gate_up), silu_and_mul_reference(gate_up), **tolerance(dtype))
    rotary = RotaryEmbedding(128, 40960, {"rope_theta": 500000.0, "rope_type": "default"}).to(device)
    q, k, v = _qkv_views(256, 32, 8, 128, dtype, device, 16)
    positions = torch.randint(0, 40960, (256,), device=device)
    expected_q, expected_k = apply_rope_reference(q, k, positions, rotary.cos_sin)
    apply_rope_inplace(q, k, positions, rotary.cos_sin)
    torch.testing.assert_close(q, expected_q, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(k, expected_k, atol=1e-2, rtol=1e-2)
