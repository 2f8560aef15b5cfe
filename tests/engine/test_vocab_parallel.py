"""Vocabulary-parallel sampling draws, shard by shard, the token the whole-row sampler draws."""

from __future__ import annotations

import torch

from minfer.core import NO_TOKEN, SamplingParams
from minfer.distributed.parallel import TPGroup
from minfer.engine.sampler import SamplingTensors, best_of_shard, mark_undrawable, sample
from minfer.engine.vocab_parallel import pack, sample_vocab_parallel, unpack_tokens, unpack_values


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


def _keys_over_shards(logits: torch.Tensor, st: SamplingTensors, num_shards: int) -> torch.Tensor:
    """What ranks of a TP group agree on: the MAX of each shard's packed (value, token)."""
    width = -(-logits.shape[1] // num_shards)
    keys = []
    for start in range(0, logits.shape[1], width):
        tokens, values = best_of_shard(logits[:, start : start + width], st, start)
        keys.append(pack(values, tokens))
    return torch.stack(keys).max(dim=0).values


def _draw_over_shards(logits: torch.Tensor, st: SamplingTensors, num_shards: int) -> list[int]:
    return unpack_tokens(_keys_over_shards(logits, st, num_shards)).tolist()


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


def test_values_unpack_from_the_keys():
    values = torch.tensor([-3.5, -0.0, 0.0, 2.25, float("-inf"), float("inf"), -1e-30, 7.0e30])
    keys = pack(values, torch.arange(8))
    assert torch.equal(unpack_values(keys), values)


def test_a_row_without_a_finite_logit_draws_no_token_over_shards():
    """A row with no finite logit in any shard is NO_TOKEN, as the whole-row draw says; a row
    whose finite logits all sit in one shard draws from that shard."""
    vocab = 200
    logits = torch.randn(3, vocab)
    logits[0] = float("-inf")
    logits[1, :100] = float("-inf")
    logits[2, 30] = float("nan")
    st = SamplingTensors.build(
        [SamplingParams(temperature=0.7)] * 3, [1, 2, 3], [4] * 3, vocab, torch.device("cpu")
    )
    expected = sample(logits, st).tolist()
    assert expected[0] == expected[2] == NO_TOKEN and expected[1] >= 100
    assert sample_vocab_parallel(logits, st, TPGroup(), 0, vocab).tolist() == expected  # one rank
    for shards in (1, 2, 4):
        keys = _keys_over_shards(logits, st, shards)
        assert mark_undrawable(unpack_tokens(keys), unpack_values(keys)).tolist() == expected
