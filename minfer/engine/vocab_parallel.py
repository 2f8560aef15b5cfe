"""Vocabulary-parallel sampling: with tensor parallelism, each rank draws from its own slice
of the vocabulary and one all-reduce of 8 bytes per row tells every rank the winner.

Without it every rank all-gathers the full [B, vocab] logits each step (151,936 float32
entries per row for Qwen3) only to take one argmax. The draw is Gumbel-max with noise that is a
function of (seed, position, vocabulary index) (engine/sampler.py), so a rank can perturb its
slice exactly as the whole row would be perturbed, and the best value over the ranks is the
token the gathered path draws, bit for bit. Rows that need the whole row (top-k, top-p, min-p,
penalties, grammar masks, logprobs) take the gathered path instead (engine/sample_step.py).

The reduction packs (value, index) into one int64 whose order is lexicographic: the float's
bits made order-preserving as a signed int32 in the high half, the complement of the index in
the low half, so MAX picks the greatest value and, on a tie, the lowest index (torch.argmax's
rule). One MAX all-reduce then replaces a gather and an argmax.
"""

from __future__ import annotations

import torch

from minfer.distributed.parallel import TPGroup
from minfer.engine.sampler import SamplingTensors, best_of_shard, mark_undrawable

_LOW = (1 << 32) - 1


def pack(values: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """float32 [B] values and int64 [B] vocabulary indices -> int64 [B] keys ordered as (value, -index)."""
    bits = values.contiguous().view(torch.int32)
    # Negative floats order backwards as integers: flipping their 31 low bits fixes that.
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    return ordered * (1 << 32) + (_LOW - tokens)


def unpack_tokens(keys: torch.Tensor) -> torch.Tensor:
    return _LOW - (keys & _LOW)


def unpack_values(keys: torch.Tensor) -> torch.Tensor:
    """The float32 values of `pack`'s keys (the inverse of its order-preserving flip)."""
    ordered = (keys >> 32).to(torch.int32)
    return torch.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).view(torch.float32)


def sample_vocab_parallel(
    shard_logits: torch.Tensor, st: SamplingTensors, tp: TPGroup, vocab_start: int, vocab_size: int
) -> torch.Tensor:
    """Token ids [B] (the same on every rank) from this rank's logits [B, rows] of vocabulary
    entries vocab_start.. (columns past vocab_size are padding of the last shard)."""
    valid = max(0, min(shard_logits.shape[-1], vocab_size - vocab_start))
    tokens, values = best_of_shard(shard_logits[:, :valid], st, vocab_start)
    if valid == 0:  # a shard of padding only (tiny vocabularies): never the winner
        values = torch.full_like(values, float("-inf"))
    keys = tp.all_reduce_max(pack(values, tokens))
    return mark_undrawable(unpack_tokens(keys), unpack_values(keys))
