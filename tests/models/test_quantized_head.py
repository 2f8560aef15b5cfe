"""--quantization's LM head: int8 / bfloat16 logits whose top candidates are float32-exact."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minfer.layers.quantized_head import REFINE_TOP
from minfer.models.quantize import _low_bit_head


def test_head_logits_are_float32_at_the_top_and_near_it_elsewhere():
    torch.manual_seed(0)
    weight = torch.randn(4096, 64) * 0.3
    head = _low_bit_head(weight)
    # 3 rows take the int8 kernel, 20 the dense (bfloat16 or float32) matrix
    for rows in (3, 20):
        hidden = torch.randn(rows, 64) * 4
        want = F.linear(hidden, weight)
        got = head.logits(hidden)
        assert got.dtype == torch.float32 and got.shape == want.shape
        top = want.topk(REFINE_TOP // 2, dim=-1).indices
        # the refined candidates hold the float32 head's logits, to float32 rounding
        torch.testing.assert_close(got.gather(-1, top), want.gather(-1, top), rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        # the tail: bfloat16 activations and int8 / bfloat16 weights, within 2% of the largest logit
        assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2
        out = torch.empty_like(want)
        assert head.logits(hidden, out) is out and torch.equal(out, got)
