"""--quantization's LM head: int4 / bfloat16 logits whose top candidates are float32-exact."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minfer.layers.quantized_head import HEAD_LOW_BIT_MAX_ROWS, REFINE_TOP, top_indices
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


def test_top_indices_are_topk_as_a_set():
    """The chunked search finds what topk finds: random rows, and rows whose largest values all
    sit in one chunk or spread one per chunk; a vocabulary it does not tile falls back to topk."""
    torch.manual_seed(0)
    logits = torch.randn(6, 49152) * 3
    logits[1, 640:656] += 50  # the 16 largest in one chunk
    logits[2, torch.arange(16) * 3000] += 50  # one per chunk
    logits[3] = logits[3].round()  # many ties below the top
    logits[3, 7] = 99
    for rows in (logits, logits[:1], torch.randn(2, 49153)):
        got = top_indices(rows, REFINE_TOP).sort(-1).values
        want = rows.topk(REFINE_TOP, dim=-1).indices.sort(-1).values
        assert got.shape == want.shape
        # as values: tied entries may be either of their copies
        assert torch.equal(rows.gather(-1, got).sort(-1).values, rows.gather(-1, want).sort(-1).values)
    assert torch.equal(
        top_indices(logits[:3], REFINE_TOP).sort(-1).values[:3],
        logits[:3].topk(REFINE_TOP).indices.sort(-1).values,
    )
