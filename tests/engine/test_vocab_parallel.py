"""Vocabulary-parallel sampling draws, shard by shard, the token the whole-row sampler draws."""

from __future__ import annotations

import torch

from minfer.core import SamplingParams
from minfer.engine.sampler import SamplingTensors, best_of_shard, sample
from minfer.engine.vocab_parallel import pack, unpack_tokens


def test_pack_orders_by_value_then_lowest_index():
    values = torch.tensor([-3.5, -0.0, 0.0, 2.25, 2.25, float("-inf"), -1e-30, 7.0e30])
    tokens = torch.tensor([10, 3, 4, 9, 2, 0, 5, 1])
    keys = pack(values, tokens)
    expected = sorted(range(8), key=lambda i: (values[i].item(), -tokens[i].item()))
    # -0.0 and 0.0 are equal floats but distinct keys; that only decides between two shards'
    # exact zeros, which the whole-row argmax sees as a tie: check the rest of the order.
    got = sorted(range(8), key=lambda i: keys[i].item())
    assert [i for i in got if i not in (1, 2)] == [i for i in expected if i not in (1, 2)]
    assert unpack_tokens(keys).tolist() == tokens.tolist()


def _draw_over_shards(logits: torch.Tensor, st: SamplingTensors, num_shards: int) -> list[int]:
    """What ranks of a TP group agree on: the MAX of each shard's packed (value, token)."""
    width = -(-logits.shape[1] // num_shards)
    keys = []
    for start in range(0, logits.shape[1], width):
        tokens, values = best_of_shard(logits[:, start : start + width], st, start)
        keys.append(pack(values, tokens))
    return unpack_tokens(torch.stack(keys).max(dim=0).values).tolist()


def test_shards_draw_the_whole_row_token():
    torch.manual_seed(0)
    batch, vocab = 6, 1001
    logits = torch.randn(batch, vocab) * 3
    logits[0, [100, 700]] = 40.0  # a greedy tie across shards: the lower index wins
    params = [SamplingParams(temperature=t) for t in (0.0, 0.7, 1.0, 1.3, 0.0, 0.4)]
    for trial in range(4):
        st = SamplingTensors.build(
            params, [trial * 31 + i for i in range(batch)], [3 + trial] * batch, vocab, torch.device("cpu")
        )
        expected = sample(logits, st).tolist()
        assert expected[0] == 100
        for shards in (1, 2, 3, 4):
            assert _draw_over_shards(logits, st, shards) == expected


def test_greedy_only_batch_over_shards():
    torch.manual_seed(1)
    logits = torch.randn(3, 257)
    st = SamplingTensors.build(
        [SamplingParams(temperature=0)] * 3, [0, 0, 0], [1, 1, 1], 257, torch.device("cpu")
    )
    assert _draw_over_shards(logits, st, 2) == logits.argmax(dim=-1).tolist()
