"""Logit adjustments before sampling, batched on the device: repetition, frequency and presence
penalties, logit_bias, min_tokens (no EOS or stop token before the minimum length), and the
tokens vLLM's allowed_token_ids and bad_words take out of the draw.

Definitions (those of OpenAI and vLLM):
  repetition_penalty r   tokens seen in the prompt or the output: logit / r if positive, else logit * r
  frequency_penalty f    logit -= f * (times the token occurs in the output so far)
  presence_penalty p     logit -= p * (1 if it occurs in the output so far)
  logit_bias b[token]    logit += b
  min_tokens             logit = -inf for EOS and stop_token_ids while the output is shorter
  allowed_token_ids      logit = -inf for every other token
  bad_words              logit = -inf for a word's last token where the output ends with the rest
                         of it (each spelling's token sequence: SamplingParams.bad_words_ids)

The token history comes from the device's token table (prompt and every sampled token, the
newest one included even when it has not reached the CPU yet in overlap mode), so building the
counts costs one gather and one scatter-add over the penalised rows, never a host copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minfer.core import Req
from minfer.device import to_device
from minfer.kvcache.page_table import PageTable


@dataclass
class LogitAdjustments:
    """The adjustments of one batch's sampled rows; each part is None when no row needs it."""

    # History penalties: rows (into the sampled logits) and their per-row parameters.
    penalty_rows: torch.Tensor | None = None  # [P] int64
    output_counts: torch.Tensor | None = None  # [P, V] float32: occurrences in the output
    seen: torch.Tensor | None = None  # [P, V] bool: occurs in the prompt or the output
    repetition: torch.Tensor | None = None  # [P, 1] float32
    frequency: torch.Tensor | None = None  # [P, 1] float32
    presence: torch.Tensor | None = None  # [P, 1] float32
    # (row, token, value) triples added to the logits, and (row, token) pairs banned.
    bias_index: torch.Tensor | None = None  # [2, N] int64
    bias_values: torch.Tensor | None = None  # [N] float32
    ban_index: torch.Tensor | None = None  # [2, M] int64
    # allowed_token_ids: rows whose every other token is -inf, and where they allow [A, V].
    allow_rows: torch.Tensor | None = None  # [A] int64
    allowed: torch.Tensor | None = None  # [A, V] bool
    # Bad words of several tokens: (row, last token) pairs, -inf where `word_bans` says (the
    # output ends with the rest of the word) and 0 elsewhere, added to the logits.
    word_index: torch.Tensor | None = None  # [2, W] int64
    word_bans: torch.Tensor | None = None  # [W] float32


def banned_tokens(r: Req) -> set[int]:
    """The tokens min_tokens bans from the token `r` samples now (it lands at device_len, output
    index device_len - prompt_len): EOS and the stop tokens while the output is shorter."""
    if r.device_len - r.prompt_len >= r.params.min_tokens:
        return set()
    banned = set(r.params.stop_token_ids)
    return banned if r.params.ignore_eos else banned | r.eos_token_ids


def build_adjustments(
    reqs: list[Req],
    page_table: PageTable,
    vocab_size: int,
    device: torch.device,
    grammar_ended: frozenset[int] = frozenset(),
) -> LogitAdjustments | None:
    """The adjustments for sampling one token of each request (rows in `reqs` order), or None.
    `grammar_ended`: rows whose grammar allows nothing but tokens that min_tokens bans; their
    bans are lifted, because the output must match the grammar (with both, every token would
    be -inf and the draw meaningless)."""
    penalised = [i for i, r in enumerate(reqs) if r.params.has_penalties]
    bias_rows, bias_tokens, bias_values = [], [], []
    ban_rows, ban_tokens = [], []
    words = []  # (row, request, token sequence) of the bad words longer than one token
    allowing = []  # rows with allowed_token_ids
    for i, r in enumerate(reqs):
        params = r.params
        for token, value in params.logit_bias.items():
            bias_rows.append(i)
            bias_tokens.append(token)
            bias_values.append(value)
        for token in () if i in grammar_ended else banned_tokens(r):
            ban_rows.append(i)
            ban_tokens.append(token)
        # params.limits_tokens, inline: the property call cost ~15 us a step at 256 plain rows
        if params.bad_words_ids or params.allowed_token_ids is not None:
            if params.allowed_token_ids is not None:
                allowing.append(i)
            for word in params.bad_words_ids:
                if len(word) == 1:
                    ban_rows.append(i)
                    ban_tokens.append(word[0])
                elif r.device_len - r.prompt_len >= len(word) - 1:  # the rest fits in the output so far
                    words.append((i, r, word))
    if not (penalised or bias_rows or ban_rows or words or allowing):
        return None
    adj = LogitAdjustments()
    if allowing:
        allowed = [reqs[i].params.allowed_token_ids for i in allowing]
        rows = [row for row, tokens in enumerate(allowed) for _ in tokens]
        where = to_device([rows, [token for tokens in allowed for token in tokens]], torch.int64, device)
        adj.allow_rows = to_device(allowing, torch.int64, device)
        adj.allowed = torch.zeros(len(allowing), vocab_size, dtype=torch.bool, device=device)
        adj.allowed[where[0], where[1]] = True
    if words:
        adj.word_index, adj.word_bans = _word_bans(words, page_table, device)
    if penalised:
        chosen = [reqs[i] for i in penalised]
        ints = to_device(
            [
                penalised,
                [r.table_idx for r in chosen],
                [r.device_len for r in chosen],
                [r.prompt_len for r in chosen],
            ],
            torch.int64,
            device,
        )
        rows, table_rows, lengths, prompt_lens = ints[0], ints[1], ints[2], ints[3]
        longest = max(r.device_len for r in chosen)
        history = page_table.tokens.index_select(0, table_rows)[:, :longest].long()  # [P, L]
        positions = torch.arange(longest, device=device)[None, :]
        known = positions < lengths[:, None]
        in_output = known & (positions >= prompt_lens[:, None])
        counts = torch.zeros(len(chosen), vocab_size, dtype=torch.float32, device=device)
        counts.scatter_add_(1, history, in_output.float())
        seen = torch.zeros(len(chosen), vocab_size, dtype=torch.float32, device=device)
        seen.scatter_add_(1, history, known.float())
        floats = to_device(
            [
                [r.params.repetition_penalty for r in chosen],
                [r.params.frequency_penalty for r in chosen],
                [r.params.presence_penalty for r in chosen],
            ],
            torch.float32,
            device,
        )
        adj.penalty_rows, adj.output_counts, adj.seen = rows, counts, seen > 0
        adj.repetition, adj.frequency, adj.presence = (
            floats[0, :, None],
            floats[1, :, None],
            floats[2, :, None],
        )
    if bias_rows:
        adj.bias_index = to_device([bias_rows, bias_tokens], torch.int64, device)
        adj.bias_values = to_device(bias_values, torch.float32, device)
    if ban_rows:
        adj.ban_index = to_device([ban_rows, ban_tokens], torch.int64, device)
    return adj


def _word_bans(words: list, page_table: PageTable, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(word_index, word_bans) of LogitAdjustments for `words`' (row, request, token sequence)
    entries. Whether the output ends with a word's first tokens is read from the device's token
    table (the newest token may not have reached the CPU yet, in overlap mode)."""
    entries, flat, expected = [], [], []
    for entry, (_, r, word) in enumerate(words):
        rest = word[:-1]
        start = r.device_len - len(rest)  # the sampled token lands at device_len
        for offset, token in enumerate(rest):
            entries.append(entry)
            flat.append(page_table.flat_index(r.table_idx, start + offset))
            expected.append(token)
    ints = to_device([entries, flat, expected], torch.int64, device)
    differs = (page_table.tokens.view(-1)[ints[1]].long() != ints[2]).float()
    mismatches = torch.zeros(len(words), device=device).index_add_(0, ints[0], differs)
    bans = torch.where(mismatches == 0, float("-inf"), 0.0)
    index = to_device([[row for row, _, _ in words], [word[-1] for _, _, word in words]], torch.int64, device)
    return index, bans


def apply_adjustments(logits: torch.Tensor, adj: LogitAdjustments) -> torch.Tensor:
    """Adjust logits [B, V] float32 in place (and return them)."""
    if adj.penalty_rows is not None:
        vocab = adj.output_counts.shape[1]
        sub = logits.index_select(0, adj.penalty_rows)[:, :vocab]
        repeated = torch.where(sub > 0, sub / adj.repetition, sub * adj.repetition)
        sub = torch.where(adj.seen, repeated, sub)
        sub = sub - adj.frequency * adj.output_counts - adj.presence * (adj.output_counts > 0).float()
        logits[:, :vocab].index_copy_(0, adj.penalty_rows, sub)
    if adj.bias_index is not None:
        logits.index_put_((adj.bias_index[0], adj.bias_index[1]), adj.bias_values, accumulate=True)
    if adj.ban_index is not None:
        logits.index_put_(
            (adj.ban_index[0], adj.ban_index[1]), torch.tensor(float("-inf"), device=logits.device)
        )
    if adj.word_index is not None:  # -inf + x is -inf, 0 + x is x: a word that matches wins
        logits.index_put_((adj.word_index[0], adj.word_index[1]), adj.word_bans, accumulate=True)
    if adj.allow_rows is not None:
        vocab = adj.allowed.shape[1]
        sub = logits.index_select(0, adj.allow_rows)
        sub[:, :vocab].masked_fill_(~adj.allowed, float("-inf"))
        sub[:, vocab:] = float("-inf")  # columns past the vocabulary, where logits are padded
        logits.index_copy_(0, adj.allow_rows, sub)
    return logits
