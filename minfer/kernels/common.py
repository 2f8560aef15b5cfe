"""Helpers shared by the Triton kernels."""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Triton's CPU interpreter (TRITON_INTERPRET=1, used by the tests without a GPU) keeps bf16 as
# raw uint16 bits and its tl.dot multiplies those bits as integers (seen in triton 3.9), so
# under the interpreter dot operands are widened to fp32 first. Read once, at import: the
# interpreter itself is chosen when the kernels are defined.
INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def dot(a, b):
    """a @ b accumulated in fp32. fp32 operands get a true fp32 product (the default would be
    tf32 on tensor cores) so the fp32 path matches the torch reference to fp32 rounding."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)
