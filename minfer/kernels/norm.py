"""RMSNorm in Triton, with the residual add fused in: one read of x (and residual), one write.

Rounding follows minfer/layers/norm.py step by step, so the outputs agree with it to the last
bit up to the order of the sum of squares: x + residual is rounded to x's dtype, the normalised
value is rounded to x's dtype before the weight multiplies it, and the result takes the dtype
torch's promotion gives `weight * x`.

x may also hold several terms per row that the add sums first ([..., terms, dim] beside a
[..., dim] residual): a mixture-of-experts layer's per-expert outputs (minfer/layers/moe.py),
so the reduction over a token's experts costs no launch of its own. The terms and the residual
are summed in float32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minfer.kernels.pdl import pdl_args, pdl_start


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    eps,
    inner_rows,
    stride_x0,
    stride_x1,
    stride_r0,
    stride_r1,
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    TERMS: tl.constexpr,
    PDL_RELEASE: tl.constexpr,
    PDL_WAIT: tl.constexpr,
):
    pdl_start(PDL_RELEASE, PDL_WAIT)  # a gemv after the norm may read its weights meanwhile
    # Rows of a [outer, inner, DIM] view; outputs are contiguous [rows, DIM].
    row = tl.program_id(0).to(tl.int64)
    outer = row // inner_rows
    inner = row % inner_rows
    offs = tl.arange(0, BLOCK)
    mask = offs < DIM
    x = tl.load(x_ptr + outer * stride_x0 + inner * stride_x1 + offs, mask=mask, other=0.0).to(tl.float32)
    for term in tl.static_range(1, TERMS):  # terms of one row are contiguous (see rmsnorm)
        x += tl.load(x_ptr + outer * stride_x0 + term * DIM + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + outer * stride_r0 + inner * stride_r1 + offs, mask=mask, other=0.0)
        summed = (x + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * DIM + offs, summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / DIM + eps)
    normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * DIM + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """A [outer, inner, dim] view of x without copying where the strides allow it."""
    if x.dim() == 3:
        return x
    if x.dim() == 2:
        return x.unsqueeze(1)
    return x.reshape(-1, 1, x.shape[-1])


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """What RMSNorm.forward returns: norm(x) * weight, or with `residual`
    (norm(x + residual) * weight, x + residual).

    x: [..., dim] with the last dim contiguous (any strides before it, e.g. a per-head view of
    a fused qkv output); residual: same shape and dtype as x; weight: [dim]. Outputs are new
    contiguous tensors.

    With x of shape [..., terms, dim] and residual [..., dim], each row's terms are summed
    into the residual add (the outputs have the residual's shape).
    """
    dim = x.shape[-1]
    terms = 1
    if residual is not None and x.dim() == residual.dim() + 1:
        if x.shape[:-2] != residual.shape[:-1] or x.dtype != residual.dtype:
            raise ValueError("terms x [..., terms, dim] must match residual [..., dim] and its dtype")
        terms = x.shape[-2]
        x = x.contiguous().view(-1, terms, dim)  # row r's terms at x3[r, 0..terms)
        x3 = x
        shape = residual.shape
    else:
        shape = x.shape
    if weight.shape != (dim,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match the last dim {dim} of x")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if terms == 1:
        x3 = _as_3d(x)
    num_rows = x3.shape[0] * (x3.shape[1] if terms == 1 else 1)
    residual_out = None
    if residual is not None:
        if residual.shape != shape or residual.dtype != x.dtype:
            raise ValueError("residual must have the shape and dtype of x")
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
        residual_out = torch.empty(shape, dtype=x.dtype, device=x.device)
        r3 = _as_3d(residual) if terms == 1 else residual.reshape(-1, 1, dim)
    else:
        r3 = x3
    if num_rows:
        _rmsnorm_kernel[(num_rows,)](
            x3,
            r3,
            weight,
            out,
            residual_out if residual_out is not None else out,
            eps,
            x3.shape[1] if terms == 1 else 1,
            x3.stride(0),
            x3.stride(1),
            r3.stride(0),
            r3.stride(1),
            DIM=dim,
            BLOCK=triton.next_power_of_2(dim),
            HAS_RESIDUAL=residual is not None,
            TERMS=terms,
            **pdl_args(x.device, x3.shape[0]),
            num_warps=_num_warps(dim),
        )
    return out if residual is None else (out, residual_out)


def _num_warps(dim: int) -> int:
    return 1 if dim <= 256 else 4 if dim <= 2048 else 8


def rmsnorm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
):
    """minfer/layers/norm.py RMSNorm.forward, as a function (terms x summed in float32 first)."""
    if residual is not None and x.dim() == residual.dim() + 1:
        x = (x.float().sum(-2) + residual.float()).to(x.dtype)
    elif residual is not None:
        x = x + residual
    dtype = x.dtype
    xf = x.float()
    normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return normed if residual is None else (normed, x)
