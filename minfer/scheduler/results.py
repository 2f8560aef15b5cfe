"""Result processing: a finished pass's tokens reach the CPU; append them and decide who ends."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from minfer.core import NO_TOKEN, Batch, FinishReason, Req, TokenLogprobs
from minfer.engine.engine import ForwardResult
from minfer.observability.scheduler_trace import NullSchedulerTrace

logger = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """What one step produced for one request: a new token and/or the end of the request."""

    uid: int
    token_id: int | None
    finish_reason: FinishReason | None = None
    # The stop token id that ended it, when one did; with an abort, why (a sentence), when known.
    stop_reason: int | str | None = None
    logprobs: TokenLogprobs | None = None  # of token_id, when the request asked
    prompt_logprobs: TokenLogprobs | None = None  # with the first token, when the request asked
    cached_tokens: int | None = None  # with the first token: prompt tokens found in the prefix cache


def read_results(
    batch: Batch, result: ForwardResult, max_model_len: int, trace: NullSchedulerTrace
) -> tuple[list[StepOutput], list[tuple[Req, FinishReason]]]:
    """Append each sampled token to its request; returns the outputs and the requests that
    end with them (and why), for the scheduler to finish."""
    outputs, ending = [], []
    tokens = result.tokens()
    sampled_logprobs, prompt_logprobs = result.logprobs()
    for i, first, rows in prompt_logprobs:
        req = batch.reqs[i]
        if req.prompt_logprobs is None:
            req.prompt_logprobs = {}
        req.prompt_logprobs.update(zip(range(first, first + len(rows)), rows))
    trace.forward_done(batch)
    for i, token in zip(result.sampled_rows, tokens):
        req = batch.reqs[i]
        if req.finished:
            continue  # aborted, or ended by the previous pass while this one was in flight
        trace.token_sampled(req, token)
        req.token_ids.append(token)
        if token == NO_TOKEN:
            # The pass took the position, so the token list keeps its place (the request ends
            # now; the last position never enters the prefix cache), but nothing reaches the client.
            stop_reason = (
                "no finite logit to draw a token from (NaN model output, or masks that exclude "
                "every token: allowed_token_ids, bad_words, min_tokens and a grammar together)"
            )
            logger.error("request %d: %s; aborted", req.uid, stop_reason)
            ending.append((req, FinishReason.ABORT))
            outputs.append(StepOutput(req.uid, None, FinishReason.ABORT, stop_reason))
            continue
        reason, stop_reason = finish_reason(req, token, max_model_len)
        if req.grammar is not None and not req.grammar.accept_token(token):
            # The grammar's mask allows only tokens it accepts, so this is a defect (a row of NaN
            # logits, a mask applied to the wrong row): end the request loudly, saying why, rather
            # than let it go on producing text outside the format the client asked for.
            reason = FinishReason.ABORT
            stop_reason = f"internal error: sampled token {token} breaks the request's output grammar"
            logger.error("request %d: %s; aborted", req.uid, stop_reason)
        elif req.grammar is not None and req.grammar.is_terminated():
            reason = reason or FinishReason.STOP
        if reason:
            ending.append((req, reason))
        out = StepOutput(req.uid, token, reason, stop_reason)
        if i in sampled_logprobs:
            row, k = sampled_logprobs[i], req.params.logprobs
            out.logprobs = TokenLogprobs(
                [token], [row.logprob], [row.top_ids[:k]], [row.top_logprobs[:k]], ranks=[row.rank]
            )
        if req.output_len == 1:
            out.cached_tokens = req.prefix_hit
            if req.params.prompt_logprobs is not None:
                out.prompt_logprobs = prompt_logprobs_of(req)
        outputs.append(out)
    return outputs, ending


def finish_reason(req: Req, token: int, max_model_len: int) -> tuple[FinishReason | None, int | None]:
    """Why the request ends with `token` (just appended), and the stop token id if one did it."""
    p = req.params
    if req.output_len >= p.min_tokens:
        if token in p.stop_token_ids:
            return FinishReason.STOP, token
        if not p.ignore_eos and token in req.eos_token_ids:
            return FinishReason.STOP, None
    # The context is full when the known tokens fill it (device_len, under overlap, already counts
    # the tokens of passes in flight: it would end a request of prompt + max_tokens = the context
    # one token early).
    if req.output_len >= p.max_tokens or len(req.token_ids) >= max_model_len:
        return FinishReason.LENGTH, None
    return None, None


def prompt_logprobs_of(req: Req) -> TokenLogprobs:
    """The prompt's logprobs, gathered chunk by chunk during prefill; nothing scores the first token."""
    k = req.params.prompt_logprobs
    scored = req.prompt_logprobs or {}
    out = TokenLogprobs(list(req.token_ids[: req.prompt_len]), [None], [[]], [[]], ranks=[None])
    for position in range(req.prompt_len - 1):
        row = scored[position]
        out.logprobs.append(row.logprob)
        out.top_ids.append(row.top_ids[:k])
        out.top_logprobs.append(row.top_logprobs[:k])
        out.ranks.append(row.rank)
    req.prompt_logprobs = None
    return out
