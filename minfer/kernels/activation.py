"""SiLU-and-multiply of the gated MLP in Triton: x holds [gate | up] along the last dim.

Rounding follows minfer/layers/activation.py: silu(gate) is rounded to x's dtype before it
multiplies `up`, as the two separate torch ops do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minfer.kernels.pdl import pdl_args, pdl_start


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, width, BLOCK: tl.constexpr, PDL_RELEASE: tl.constexpr, PDL_WAIT: tl.constexpr
):
    pdl_start(PDL_RELEASE, PDL_WAIT)  # the down projection's gemv may read its weights meanwhile
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * width + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * width] -> silu(x[..., :width]) * x[..., width:], a new contiguous tensor."""
    if x.shape[-1] % 2:
        raise ValueError(f"last dim {x.shape[-1]} of x is not even: it must hold [gate | up]")
    width = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*x.shape[:-1], width), dtype=x.dtype, device=x.device)
    if x2.shape[0] and width:
        block = min(1024, triton.next_power_of_2(width))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(width, block))](
            x2, out, x2.stride(0), width, BLOCK=block, num_warps=4, **pdl_args(x.device, x2.shape[0])
        )
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
