"""RMSNorm, SiLU-and-mul and the fused norm + RoPE + KV-store kernel against the torch layers.

The layers themselves call the RMSNorm and SiLU kernels on CUDA, so those kernels are compared
with the `*_reference` functions, and those with the layers on CPU, where the layers run plain
torch. The fused rope_store kernel replaces RMSNorm -> RotaryEmbedding -> KVPool.store on CUDA;
it is compared with those layers run on CPU copies of its inputs.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import tolerance

from minfer.kernels.activation import silu_and_mul, silu_and_mul_reference
from minfer.kernels.norm import rmsnorm, rmsnorm_reference
from minfer.kernels.rope_store import rope_store
from minfer.kvcache.pool import KVPool
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
    return dict(atol=atol, rtol=2**-7)


def _randn(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def _qkv_views(tokens, num_heads, num_kv_heads, head_dim, dtype, device, seed):
    """q, k, v as the attention layer sees them: strided views into one fused qkv output."""
    qkv = _randn((tokens, (num_heads + 2 * num_kv_heads) * head_dim), dtype, device, seed)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (
        q.view(tokens, num_heads, head_dim),
        k.view(tokens, num_kv_heads, head_dim),
        v.view(tokens, num_kv_heads, head_dim),
    )


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


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_sums_expert_terms_into_the_residual(dtype, device):
    """A mixture-of-experts layer's per-expert rows [T, top_k, H] beside the residual [T, H]:
    the kernel adds the terms and the residual in float32 and rounds once (and checks shapes)."""
    weight = _randn((96,), dtype, device, 1)
    terms, residual = _randn((5, 8, 96), dtype, device, 2), _randn((5, 96), dtype, device, 3)
    out, new_residual = rmsnorm(terms, weight, 1e-6, residual)
    expected_out, expected_residual = rmsnorm_reference(terms, weight, 1e-6, residual)
    assert out.shape == residual.shape == new_residual.shape
    torch.testing.assert_close(new_residual, expected_residual, **tolerance(dtype))
    torch.testing.assert_close(out, expected_out, **tolerance(dtype))
    summed = (terms.double().sum(1) + residual.double()).to(dtype)
    torch.testing.assert_close(new_residual, summed, **tolerance(dtype))
    with pytest.raises(ValueError, match="terms"):
        rmsnorm(terms, weight, 1e-6, residual[:4])


def test_rmsnorm_per_head_view_and_fp32_weight(device):
    """Qwen3's q/k norm runs on a strided [T, H, D] view; an fp32 weight promotes the output."""
    q, _, _ = _qkv_views(5, 4, 2, 64, torch.bfloat16, device, 4)
    weight = _randn((64,), torch.float32, device, 5)
    out = rmsnorm(q, weight, 1e-6)
    assert out.dtype == torch.float32 and out.shape == q.shape
    # the normalised value is rounded to bf16 before the weight: where the sum of squares (added
    # in another order) lands it on the other side of a rounding boundary, one bf16 unit apart
    torch.testing.assert_close(out, rmsnorm_reference(q, weight, 1e-6), atol=1e-5, rtol=2**-7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [96, 1500])
def test_silu_and_mul_matches_reference(dtype, width, device):
    x = _randn((2, 3, 2 * width), dtype, device, 6)
    out = silu_and_mul(x)
    assert out.shape == (2, 3, width)
    torch.testing.assert_close(out, silu_and_mul_reference(x), **tolerance(dtype))


# RoPE rounds where the torch ops round, yet on an H200 (triton 3.6) about a fifth of bf16
# results land one unit in the last place away from torch's, and fp32 ones differ by fused
# multiply-adds: compare to within one unit.
ONE_UNIT = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=5e-3, rtol=2**-10),
    torch.bfloat16: dict(atol=4e-2, rtol=2**-7),
}


def _check_rope_store(tokens, num_heads, num_kv_heads, head_dim, qk_norm, dtype, device, max_positions=4096):
    """rope_store on `device` against RMSNorm -> RotaryEmbedding -> KVPool.store on CPU copies."""
    cpu = torch.device("cpu")
    rotary = RotaryEmbedding(head_dim, max_positions, {"rope_theta": 1_000_000.0, "rope_type": "default"})
    q, k, v = _qkv_views(tokens, num_heads, num_kv_heads, head_dim, dtype, device, 7)
    gen = torch.Generator().manual_seed(11)
    positions = torch.randint(0, max_positions, (tokens,), generator=gen)
    slots = tokens + 9
    pool = KVPool(1, slots, num_kv_heads, head_dim, 1, dtype, cpu)
    pool.k[0].copy_(_randn(pool.k[0].shape, dtype, cpu, 9))
    pool.v[0].copy_(_randn(pool.v[0].shape, dtype, cpu, 10))
    out_loc = torch.randperm(slots, generator=gen)[:tokens]
    k_pool, v_pool = pool.k[0].to(device), pool.v[0].to(device)
    norms = ()
    q_ref, k_ref = q.cpu(), k.cpu()
    if qk_norm:
        q_norm, k_norm = RMSNorm(head_dim, 1e-6).to(dtype=dtype), RMSNorm(head_dim, 1e-6).to(dtype=dtype)
        # Trained norm weights sit near 1; unit-variance ones would make q/k values of ~10,
        # where one bf16 unit in the last place (0.06) exceeds the tolerance below.
        q_norm.weight.copy_(1 + _randn((head_dim,), dtype, cpu, 12) / 4)
        k_norm.weight.copy_(1 + _randn((head_dim,), dtype, cpu, 13) / 4)
        q_ref, k_ref = q_norm(q_ref), k_norm(k_ref)
        norms = (q_norm.weight.to(device), k_norm.weight.to(device), 1e-6)
    q_ref, k_ref = rotary(positions, q_ref, k_ref)
    pool.store(0, k_ref, v.cpu(), out_loc)

    rope_store(
        q,
        k,
        v,
        positions.to(device),
        rotary.cos_sin.to(device),
        k_pool,
        v_pool,
        out_loc.to(torch.int32).to(device),
        *norms,
    )
    tol = ONE_UNIT[dtype]
    if qk_norm and dtype == torch.bfloat16 and not torch.cuda.is_available():
        # Triton's interpreter truncates each of the five bf16 roundings on the way (norm,
        # weight, two products, sum) instead of rounding to nearest: up to four units apart.
        tol = dict(atol=8e-2, rtol=2**-5)
    torch.testing.assert_close(q.cpu(), q_ref, **tol)
    torch.testing.assert_close(k_pool.cpu(), pool.k[0], **tol)
    torch.testing.assert_close(v_pool.cpu(), pool.v[0], atol=0, rtol=0)  # a copy: exact


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 2)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_store_matches_the_layers(dtype, head_dim, num_heads, num_kv_heads, qk_norm, device):
    _check_rope_store(6, num_heads, num_kv_heads, head_dim, qk_norm, dtype, device)


def test_rope_store_rejects_mismatched_inputs(device):
    q, k, v = _qkv_views(2, 4, 2, 64, torch.float32, device, 1)
    pool = torch.zeros((4, 2, 64), device=device)
    cos_sin = torch.zeros((8, 64), device=device)
    positions = out_loc = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="pools"):
        rope_store(q, k, v, positions, cos_sin, pool[:, :1], pool, out_loc)
    with pytest.raises(ValueError, match="both q and k norm"):
        rope_store(q, k, v, positions, cos_sin, pool, pool, out_loc, torch.ones(64, device=device))


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
    _check_rope_store(256, 32, 8, 128, False, dtype, device, max_positions=40960)  # Llama-3.1-8B heads
    _check_rope_store(256, 16, 8, 128, True, dtype, device, max_positions=40960)  # Qwen3-0.6B heads
