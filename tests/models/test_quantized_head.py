"""--quantization's LM head: int4 / bfloat16 logits whose top candidates are float32-exact."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minfer.layers.quantized_head import HEAD_LOW_BIT_MAX_ROWS, REFINE_TOP
from minfer.layers.quantized_linear import dequantize_int4, quantize_int4
from minfer.models.quantize import _low_bit_head


def test_head_logits_are_float32_at_the_top_and_near_it_elsewhere():
    torch.manual_seed(0)
    weight = torch.randn(4096, 64) * 0.3
    head = _low_bit_head(weight)
    int4_weight = dequantize_int4(*quantize_int4(weight))
    for rows in (3, 20):
        hidden = torch.randn(rows, 64) * 4
        want = F.linear(hidden, weight)
        got = head.logits(hidden)
        assert got.dtype == torch.float32 and got.shape == want.shape
        top = want.topk(REFINE_TOP // 2, dim=-1).indices
        # the refined candidates hold the float32 head's logits, to float32 rounding
        torch.testing.assert_close(got.gather(-1, top), want.gather(-1, top), rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        # the tail: the int4 blocks (few rows) or the dense matrix (many), with bfloat16
        # activations and output, within 1% of the largest logit
        tail = F.linear(hidden, int4_weight if rows <= HEAD_LOW_BIT_MAX_ROWS else weight)
        refined = (got - want).abs() < 1e-4  # the REFINE_TOP entries a row recomputed
        assert (refined.sum(-1) >= REFINE_TOP).all()
        error = (got - tail).abs().masked_fill(refined, 0)
        assert (error.max() / tail.abs().max()).item() < 1e-2
        out = torch.empty_like(want)
        assert head.logits(hidden, out) is out and torch.equal(out, got)
