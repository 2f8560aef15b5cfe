"""RMSNorm, SiLU-and-mul, RoPE and KV store kernels against torch references of the layers.

The layers themselves call these kernels on CUDA, so the kernels are compared with the
`*_reference` functions, and those with the layers on CPU, where the layers run plain torch.
"""

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


def test_references_match_the_layers_on_cpu():
    cpu = torch.device("cpu")
    for dtype in DTYPES:
        norm = RMSNorm(64, 1e-6).to(dtype=dtype)
        norm.weight.copy_(_randn((64,), dtype, cpu, 1))
        x, residual = _randn((7, 64), dtype, cpu, 2), _randn((7, 64), dtype, cpu, 3)
        torch.testing.assert_close(rmsnorm_reference(x, norm.weight, 1e-6), norm(x), atol=0, rtol=0)
        for got, want in zip(rmsnorm_reference(x, norm.weight, 1e-6, residual), norm(x, residual)):
            torch.testing.assert_close(got, want, atol=0, rtol=0)
        gate_up = _randn((3, 2 * 96), dtype, cpu, 4)
        want = layer_silu_and_mul(gate_up)
        torch.testing.assert_close(silu_and_mul_reference(gate_up), want, atol=0, rtol=0)
        rotary = RotaryEmbedding(64, 4096, {"rope_theta": 1_000_000.0, "rope_type": "default"})
        q, k, _ = _qkv_views(6, 4, 2, 64, dtype, cpu, 5)
        positions = torch.tensor([0, 1, 17, 900, 4095, 3])
        for got, want in zip(apply_rope_reference(q, k, positions, rotary.cos_sin), rotary(positions, q, k)):
            torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 200])
def test_rmsnorm_matches_reference(dtype, hidden, device):
    weight = _randn((hidden,), dtype, device, 1)
    x, residual = _randn((7, hidden), dtype, device, 2), _randn((7, hidden), dtype, device, 3)
    expected = rmsnorm_reference(x, weight, 1e-6)
    torch.testing.assert_close(rmsnorm(x, weight, 1e-6), expected, **tolerance(dtype))
    out, new_residual = rmsnorm(x, weight, 1e-6, residual)
    expected_out, expected_residual = rmsnorm_reference(x, weight, 1e-6, residual)
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
def test_silu_and_mul_matches_reference(dtype, width, device):
    x = _randn((2, 3, 2 * width), dtype, device, 6)
    out = silu_and_mul(x)
    assert out.shape == (2, 3, width)
    torch.testing.assert_close(out, silu_and_mul_reference(x), **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2)])
def test_rope_matches_reference(dtype, head_dim, num_heads, num_kv_heads, device):
    rotary = RotaryEmbedding(head_dim, 4096, {"rope_theta": 1_000_000.0, "rope_type": "default"}).to(device)
    q, k, _ = _qkv_views(6, num_heads, num_kv_heads, head_dim, dtype, device, 7)
    positions = torch.tensor([0, 1, 17, 900, 4095, 3], device=device)
    expected_q, expected_k = apply_rope_reference(q, k, positions, rotary.cos_sin)
    apply_rope_inplace(q, k, positions, rotary.cos_sin)
    # The kernel rounds where the torch ops round, yet on an H200 (triton 3.6) about a fifth of
    # bf16 results land one unit in the last place away from torch's, and fp32 ones differ by
    # fused multiply-adds: compare to within one unit.
    tol = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=5e-3, rtol=2 ** -10),
           torch.bfloat16: dict(atol=4e-2, rtol=2 ** -7)}[dtype]
    torch.testing.assert_close(q, expected_q, **tol)
    torch.testing.assert_close(k, expected_k, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_store_kv_writes_only_out_loc(dtype, head_dim, device):
    num_kv_heads, tokens, slots = 2, 9, 40
    _, k, v = _qkv_views(tokens, 4, num_kv_heads, head_dim, dtype, device, 8)
    k_pool = _randn((slots, num_kv_heads, head_dim), dtype, device, 9)
    v_pool = _randn((slots, num_kv_heads, head_dim), dtype, device, 10)
    expected_k, expected_v = k_pool.clone(), v_pool.clone()
    out_loc = torch.randperm(slots, generator=torch.Generator().manual_seed(11))[:tokens]
    out_loc = out_loc.to(torch.int32).to(device)
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
    torch.testing.assert_close(q, expected_q, atol=4e-2, rtol=2 ** -7)
    torch.testing.assert_close(k, expected_k, atol=4e-2, rtol=2 ** -7)
