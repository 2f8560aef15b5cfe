"""The fused Gumbel-max kernel draws the torch sampler's tokens."""

from __future__ import annotations

import torch

from minfer.core import SamplingParams
from minfer.engine.sampler import SamplingTensors, sample
from minfer.kernels.sampling import gumbel_argmax


def test_gumbel_argmax_matches_torch_sampler():
    torch.manual_seed(0)
    batch, vocab = 6, 3000
    logits = torch.randn(batch, vocab) * 3
    params = [SamplingParams(temperature=t) for t in (0.0, 0.6, 1.0, 1.5, 0.0, 0.9)]
    for trial in range(3):
        st = SamplingTensors.build(params, [trial * 10 + i for i in range(batch)], [5 + trial] * batch, vocab,
                                   torch.device("cpu"))
        expected = sample(logits, st)
        got = gumbel_argmax(logits, st.temperature, st.seeds, st.positions)
        assert got.tolist() == expected.tolist()
