"""Logprobs in each API's shape: OpenAI completions, OpenAI chat, SGLang."""

from __future__ import annotations

import codecs

from minfer.core import TokenLogprobs


class TextCursor:
    """Where the next token's text starts in an answer, in characters, for `text_offset`: each
    token's bytes go through an incremental UTF-8 decoder, so a character split over tokens
    counts once, and a token that continues one starts where that character does."""

    def __init__(self):
        self.chars = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, raw: bytes) -> None:
        self.chars += len(self._utf8.decode(raw))


def completion_logprobs(parts: list[TokenLogprobs], k: int, cursor: TextCursor | None = None) -> dict:
    """OpenAI's completions `logprobs` object over consecutive tokens with k alternatives each
    (the prompt's may hold more, for prompt_logprobs); text offsets continue from `cursor` (the
    answer's text before the first token), which moves past the tokens."""
    cursor = cursor or TextCursor()
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for part in parts:
        for i, text in enumerate(part.tokens):
            tokens.append(text)
            token_logprobs.append(part.logprobs[i])
            if part.logprobs[i] is None:  # the prompt's first token: nothing predicts it
                top_logprobs.append(None)
            else:  # the chosen token too, as vLLM does, so a sampled unlikely token is visible
                top = dict(zip(part.top_tokens[i][:k], part.top_logprobs[i][:k]))
                top.setdefault(text, part.logprobs[i])
                top_logprobs.append(top)
            text_offset.append(cursor.chars)
            raw = part.raw_bytes.get(part.token_ids[i])
            cursor.advance(bytes(raw) if raw is not None else text.encode())
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def chat_logprobs(lp: TokenLogprobs) -> dict:
    """OpenAI's chat `logprobs` object: token, logprob, bytes and the top alternatives. `bytes`
    are the token's own (joined, the tokens' bytes are the text), also where its text alone is
    U+FFFD, part of a character of several bytes."""

    def entry(token_id: int, token: str, logprob: float) -> dict:
        raw = lp.raw_bytes.get(token_id)
        return {"token": token, "logprob": logprob, "bytes": raw if raw is not None else list(token.encode())}

    return {
        "content": [
            {
                **entry(token_id, token, logprob),
                "top_logprobs": [entry(*top) for top in zip(top_ids, top_tokens, top_values)],
            }
            for token_id, token, logprob, top_ids, top_tokens, top_values in zip(
                lp.token_ids, lp.tokens, lp.logprobs, lp.top_ids, lp.top_tokens, lp.top_logprobs
            )
        ]
    }


def sglang_logprobs(lp: TokenLogprobs, start: int, with_text: bool) -> tuple[list, list]:
    """SGLang's (token logprobs, top logprobs) lists of [logprob, token id, text or None] from
    position `start` on."""

    def item(logprob, token_id, text):
        return [logprob, token_id, text if with_text else None]

    tokens, tops = [], []
    for i in range(start, len(lp.token_ids)):
        tokens.append(item(lp.logprobs[i], lp.token_ids[i], lp.tokens[i] if lp.tokens else None))
        tops.append(
            None
            if lp.logprobs[i] is None
            else [
                item(v, t, s)
                for v, t, s in zip(
                    lp.top_logprobs[i], lp.top_ids[i], lp.top_tokens[i] or [None] * len(lp.top_ids[i])
                )
            ]
        )
    return tokens, tops


def vllm_prompt_logprobs(lp: TokenLogprobs, k: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token None for the first (nothing predicts it), else
    {token id: {logprob, rank, decoded_token}} for the prompt's token (its rank in the whole
    vocabulary) and then the k most likely tokens (ranks 1 to k) where they are other tokens."""
    out: list[dict | None] = [None]
    for i in range(1, len(lp.token_ids)):
        entry = {
            str(lp.token_ids[i]): {
                "logprob": lp.logprobs[i],
                "rank": lp.ranks[i],
                "decoded_token": lp.tokens[i],
            }
        }
        alternatives = zip(lp.top_ids[i][:k], lp.top_logprobs[i][:k], lp.top_tokens[i][:k])
        for rank, (token_id, logprob, text) in enumerate(alternatives, 1):
            entry.setdefault(str(token_id), {"logprob": logprob, "rank": rank, "decoded_token": text})
        out.append(entry)
    return out
