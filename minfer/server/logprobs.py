"""Logprobs in each API's shape: OpenAI completions, OpenAI chat, SGLang."""

from __future__ import annotations

from minfer.core import TokenLogprobs


def completion_logprobs(parts: list[TokenLogprobs], offset: int = 0) -> tuple[dict, int]:
    """OpenAI's completions `logprobs` object over consecutive tokens; text offsets start at
    `offset` (the characters before the first token). Returns it and the offset after it."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for part in parts:
        for i, text in enumerate(part.tokens):
            tokens.append(text)
            token_logprobs.append(part.logprobs[i])
            if part.logprobs[i] is None:  # the prompt's first token: nothing predicts it
                top_logprobs.append(None)
            else:  # the chosen token too, as vLLM does, so a sampled unlikely token is visible
                top = dict(zip(part.top_tokens[i], part.top_logprobs[i]))
                top.setdefault(text, part.logprobs[i])
                top_logprobs.append(top)
            text_offset.append(offset)
            offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }, offset


def chat_logprobs(lp: TokenLogprobs) -> dict:
    """OpenAI's chat `logprobs` object: token, logprob, UTF-8 bytes and the top alternatives."""

    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {**entry(token, logprob), "top_logprobs": [entry(t, v) for t, v in zip(top_tokens, top_values)]}
            for token, logprob, top_tokens, top_values in zip(
                lp.tokens, lp.logprobs, lp.top_tokens, lp.top_logprobs
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
