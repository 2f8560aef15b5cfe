"""The token embedding's row gather for a chained decode step (one or two rows; pdl.pdl_args).

torch's embedding kernel takes no part in programmatic dependent launch, so the first layer's
qkv gemv, launched early to read its weights before it waits (kernels/gemv.py), could start only
once the gather had ended: the one launch of a batch-1 step whose weights were not asked for
ahead. This gather lets its dependents start as it starts (they read only their weights before
their own wait), and reads its token ids only after its own wait, so it is safe after any launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minfer.kernels.pdl import pdl_args, pdl_start


@triton.jit
def _embedding_rows_kernel(
    ids_ptr,
    weight_ptr,
    out_ptr,
    hidden,
    stride_w,
    BLOCK: tl.constexpr,
    PDL_RELEASE: tl.constexpr,
    PDL_WAIT: tl.constexpr,
):
    pdl_start(PDL_RELEASE, PDL_WAIT)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden
    token = tl.load(ids_ptr + row).to(tl.int64)
    values = tl.load(weight_ptr + token * stride_w + offs, mask=mask)
    tl.store(out_ptr + row.to(tl.int64) * hidden + offs, values, mask=mask)


def embedding_rows(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """weight[ids] for int32 or int64 ids (each in range) -> [*ids.shape, hidden] in weight's dtype."""
    hidden = weight.shape[1]
    assert weight.stride(1) == 1
    flat = ids.reshape(-1)
    out = torch.empty((flat.numel(), hidden), dtype=weight.dtype, device=weight.device)
    if flat.numel():
        block = min(1024, triton.next_power_of_2(hidden))
        _embedding_rows_kernel[(flat.numel(), triton.cdiv(hidden, block))](
            flat,
            weight,
            out,
            hidden,
            weight.stride(0),
            BLOCK=block,
            num_warps=4,
            **pdl_args(weight.device, flat.numel()),
        )
    return out.reshape(*ids.shape, hidden)
