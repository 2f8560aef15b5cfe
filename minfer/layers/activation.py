"""SiLU-and-multiply of the gated MLP: the input holds [gate | up]."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        from minfer.kernels.activation import silu_and_mul as fused

        return fused(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
