"""One pass's sampling: from the logits of the rows that sample to token ids and the logprobs
asked for, on the device.

Order matters and is the same for every row: logprobs read the raw logits, then penalties,
logit bias and min-tokens bans adjust them (engine/penalties.py), then grammar masks, then the
draw (engine/sampler.py). With tensor parallelism the logits arrive as this rank's vocabulary
shard; a batch that needs none of those steps is drawn shard by shard
(engine/vocab_parallel.py), any other batch gathers the whole rows first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minfer.core import Req
from minfer.device import to_device
from minfer.engine.decode_inputs import DecodeInputs
from minfer.engine.logprobs import LogprobTensors, reduce_logprobs
from minfer.engine.penalties import apply_adjustments, banned_tokens, build_adjustments
from minfer.engine.sampler import filters_apply, sample, table_token
from minfer.engine.vocab_parallel import sample_vocab_parallel

if TYPE_CHECKING:
    from minfer.engine.engine import Engine


def draws_plainly(r: Req) -> bool:
    """Whether `r`'s tokens are the plain draw, the Gumbel-max of its raw logits at its
    temperature (the argmax at 0), at every position where min_tokens bans nothing
    (penalties.banned_tokens): no logprobs, penalties, logit bias, allowed or bad tokens,
    grammar, top-k, top-p or min-p. Fixed for the request's life. A decode graph draws such
    tokens itself (engine/cuda_graph.py)."""
    p = r.params
    plain = p.logprobs is None and not p.has_penalties and not p.logit_bias and not filters_apply(p)
    return plain and not p.limits_tokens and r.grammar is None


def _grammar_masks(engine: Engine, chosen: list[Req]) -> tuple[torch.Tensor | None, frozenset[int]]:
    """The grammar rows' bitmask (None without grammar rows; they need tp = 1, see
    Scheduler.add_request), and the rows whose grammar allows nothing but tokens that min_tokens
    bans (penalties.build_adjustments lifts those bans)."""
    if all(r.grammar is None for r in chosen):
        return None, frozenset()
    grammar = engine.grammar_backend()
    mask = grammar.bitmask([r.grammar for r in chosen])
    ended = frozenset(
        i
        for i, r in enumerate(chosen)
        if r.grammar is not None and (bans := banned_tokens(r)) and grammar.allows_only(mask, i, bans)
    )
    return mask, ended


def sample_step(
    engine: Engine, chosen: list[Req], logits: torch.Tensor, sampled_at: torch.Tensor | None = None
) -> tuple[torch.Tensor, LogprobTensors | None, list[int]]:
    """(next tokens [B] (NO_TOKEN where a row had nothing to draw), logprobs of the sampled
    tokens or None, the rows of `chosen` those logprobs belong to). `logits` is float32
    [B, vocab], or [B, shard] when TP splits the vocabulary. `sampled_at`: the requests'
    device_len already on the device (a decode step's, engine/decode_inputs.py), else staged
    here."""
    logprob_rows = [j for j, r in enumerate(chosen) if r.params.logprobs is not None]
    grammar_mask, grammar_ended = _grammar_masks(engine, chosen)
    adjustments = build_adjustments(
        chosen, engine.page_table, engine.vocab_size, engine.device, grammar_ended
    )
    st = engine.sampling_tensors.get(chosen, engine.vocab_size, engine.device, sampled_at)
    if engine.tp.size > 1:
        whole_row_needed = (
            logprob_rows
            or adjustments is not None
            or grammar_mask is not None
            or any(filters_apply(r.params) for r in chosen)
        )
        lm_head = engine.model.lm_head
        if not whole_row_needed:
            engine.vocab_parallel_draws += 1
            return sample_vocab_parallel(logits, st, engine.tp, lm_head.start, engine.vocab_size), None, []
        logits = lm_head.gather_logits(logits)
    # Logprobs are of the raw logits: read them before any adjustment (see logprobs.py).
    raw_logits = logits
    if logprob_rows:
        raw_logits = logits[to_device(logprob_rows, torch.int64, engine.device)]
    if adjustments is not None:
        logits = apply_adjustments(logits, adjustments)  # raw_logits is a copy when needed
    if grammar_mask is not None:
        engine.grammar_backend().apply(logits, grammar_mask)
    next_tokens = sample(logits, st)
    sampled_logprobs = None
    if logprob_rows:
        targets = table_token(next_tokens[to_device(logprob_rows, torch.int64, engine.device)])
        k = max(chosen[j].params.logprobs for j in logprob_rows)
        sampled_logprobs = reduce_logprobs(raw_logits, targets, k)
    return next_tokens, sampled_logprobs, logprob_rows


def sample_into_table(
    engine: Engine, chosen: list[Req], logits: torch.Tensor, step: DecodeInputs | None
) -> tuple[torch.Tensor, LogprobTensors | None, list[int]]:
    """sample_step, and each token written into the token table at its position (the request's
    device_len), where the next decode step's input gather finds it without a trip through the
    CPU. `step`: a decode step's staged inputs (it samples every row), else None."""
    if step is not None and len(chosen) == step.n:
        sampled_at, flat = step.sampled_at, step.sampled_to
    else:
        sampled_at = None
        flat = [engine.page_table.flat_index(r.table_idx, r.device_len) for r in chosen]
        flat = to_device(flat, torch.int64, engine.device)
    next_tokens, sampled_logprobs, logprob_rows = sample_step(engine, chosen, logits, sampled_at)
    engine.page_table.scatter_tokens_at(flat, table_token(next_tokens))
    return next_tokens, sampled_logprobs, logprob_rows
