"""Logprobs reduced on the device: full vocabulary rows never leave it.

The distribution reported is the model's raw one: log-softmax of the logits before temperature,
penalties, logit_bias and the top-k / top-p / min-p filters (vLLM's default "raw_logprobs"). A
token's logprob then does not depend on how it was sampled, which is what scoring (echo
logprobs for loglikelihood evaluation) needs. Each row reduces to the target token's logprob
and the k most likely tokens, most likely first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minfer.core import Batch, LogprobRow

# Rows reduced at once: bounds the float32 [rows, vocab] temporaries of a long prompt.
ROWS_PER_CHUNK = 256


@dataclass
class LogprobTensors:
    """Reduced logprobs of R rows (device or host tensors)."""

    target: torch.Tensor  # [R] float32: logprob of the row's target token
    top_values: torch.Tensor  # [R, k] float32, descending
    top_ids: torch.Tensor  # [R, k] int64
    rank: torch.Tensor  # [R] int64: the target's rank in its row, 1 for the most likely (vLLM's)

    def tensors(self) -> list[torch.Tensor]:
        return [self.target, self.top_values, self.top_ids, self.rank]


def reduce_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> LogprobTensors:
    """logits [R, V], targets [R] int64 -> the targets' logprobs and ranks, and the top k of
    each row. A rank counts the row's tokens at least as likely as the target (so ties share
    the larger rank), as vLLM counts it."""
    targets_out, values_out, ids_out, ranks_out = [], [], [], []
    for start in range(0, logits.shape[0], ROWS_PER_CHUNK):
        logprobs = torch.log_softmax(logits[start : start + ROWS_PER_CHUNK].float(), dim=-1)
        target = logprobs.gather(1, targets[start : start + ROWS_PER_CHUNK, None])
        targets_out.append(target.squeeze(1))
        ranks_out.append((logprobs >= target).sum(dim=-1))
        values, ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
        values_out.append(values)
        ids_out.append(ids)
    if not targets_out:
        empty = logits.new_empty((0,))
        no_ids = torch.empty((0, k), dtype=torch.int64, device=logits.device)
        return LogprobTensors(empty, logits.new_empty((0, k)), no_ids, no_ids[:, 0])
    return LogprobTensors(
        torch.cat(targets_out), torch.cat(values_out), torch.cat(ids_out), torch.cat(ranks_out)
    )


def rows_of(result: LogprobTensors) -> list[LogprobRow]:
    """Host tensors -> one row per scored position."""
    return list(
        map(
            LogprobRow,
            result.target.tolist(),
            result.top_ids.tolist(),
            result.top_values.tolist(),
            result.rank.tolist(),
        )
    )


def prompt_logprob_spans(batch: Batch) -> list[tuple[int, int, int]]:
    """(req index, first position, count) of the prompt positions this pass scores: those of
    the chunk whose next token is a prompt token (position p scores token p + 1)."""
    spans = []
    for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
        if req.params.prompt_logprobs is None or req.output_len:
            continue
        end = min(req.cached_len + n, req.prompt_len - 1)
        if end > req.cached_len:
            spans.append((i, req.cached_len, end - req.cached_len))
    return spans
