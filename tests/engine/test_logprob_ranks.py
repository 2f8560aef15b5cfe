"""The rank reduce_logprobs reports with each target (vLLM's `rank`): how many tokens of the row
are at least as likely as the target, so 1 is the most likely and ties share the larger rank."""

from __future__ import annotations

import torch

from minfer.engine.logprobs import reduce_logprobs, rows_of


def test_ranks_count_the_tokens_at_least_as_likely():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0, 5.0]])
    result = reduce_logprobs(logits, torch.tensor([2, 4]), k=2)
    assert result.rank.tolist() == [3, 1]  # row 0: tokens 0, 2 and 3 are at least as likely as 2
    assert reduce_logprobs(logits, torch.tensor([0, 1]), k=0).rank.tolist() == [1, 5]
    row = rows_of(result)[0]
    assert row.rank == 3 and row.top_ids in ([0, 2], [0, 3])  # a tie: either order
    # more rows than one reduction chunk: each chunk's ranks in order
    many = torch.randn(600, 50)
    targets = torch.randint(0, 50, (600,))
    expected = (many.log_softmax(-1) >= many.log_softmax(-1).gather(1, targets[:, None])).sum(-1)
    assert torch.equal(reduce_logprobs(many, targets, k=1).rank, expected)
