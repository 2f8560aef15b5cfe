"""Incremental detokenization of one request, with stop strings.

Text leaves this module only when it is final: a token that ends in the middle of a UTF-8
character (byte-level BPE, byte-fallback pieces) yields nothing until the character completes,
and text that might be the start of a stop string is held back until it either completes the
stop string (then it is cut, never sent) or cannot anymore (then it is sent).

The decoding itself is tokenizers' `DecodeStream`, which keeps a small window of recent tokens
rather than decoding the whole sequence every step.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class _SlowTokenizerStream:
    """`DecodeStream`'s contract for tokenizers without a Rust backend: decode a short window
    of recent tokens and hand out what it adds, holding back an unfinished character."""

    def __init__(self, tokenizer, skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] decode to text already handed out
        self.read = 0

    def step(self, _backend, token_id: int) -> str | None:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        done = decode(self.ids[self.prefix : self.read], skip_special_tokens=self.skip)
        now = decode(self.ids[self.prefix :], skip_special_tokens=self.skip)
        if len(now) <= len(done) or now.endswith("\ufffd"):
            return None
        self.prefix, self.read = self.read, len(self.ids)
        return now[len(done) :]


def make_stream(tokenizer, skip_special_tokens: bool = True):
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return DecodeStream(skip_special_tokens=skip_special_tokens), backend
    return _SlowTokenizerStream(tokenizer, skip_special_tokens), None


class IncrementalDetokenizer:
    """Turns one request's tokens into final text pieces and finds its stop strings.

    `tokenizer` is a transformers tokenizer, or None for models without one (then text is empty).
    """

    def __init__(
        self,
        tokenizer,
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
        keep_stop: bool = False,
    ):
        self.stream, self.backend = make_stream(tokenizer, skip_special_tokens) if tokenizer else (None, None)
        # The special tokens add_final keeps out, wherever the text shows special tokens.
        self.special_ids = (
            frozenset() if skip_special_tokens else frozenset(getattr(tokenizer, "all_special_ids", ()))
        )
        self.stop = [s for s in (stop or []) if s]
        self.keep_stop = keep_stop  # the matched stop string stays at the end of the text
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.text = ""  # everything decoded so far (cut at the stop string once one matched)
        self.sent = 0  # characters of `text` handed out
        self.matched_stop: str | None = None

    def add_final(self, token_id: int, ends_as_stop_token: bool) -> str:
        """`add` for a request's token, unless it is a special token that ended the request (EOS,
        a special stop token) and the text shows special tokens: that one stays out of the text,
        as a skipped special token would, unless the request keeps its stop (vLLM's rule)."""
        if ends_as_stop_token and not self.keep_stop and token_id in self.special_ids:
            return ""
        return self.add(token_id)

    def add(self, token_id: int) -> str:
        """Feed the next token; return the text that became final (often '', never revised).

        After a stop string matched, `matched_stop` names it and the text ends before it (or
        with it, with keep_stop).
        """
        if self.stream is None or self.matched_stop is not None:
            return ""
        piece = self.stream.step(self.backend, token_id)
        if not piece:
            return ""
        old_len = len(self.text)
        self.text += piece
        if not self.stop:
            return self._hand_out(len(self.text))
        # A new match ends inside `piece`; it cannot start in text already sent (that was held back).
        search_from = max(self.sent, old_len - self.max_stop_len + 1)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            cut, self.matched_stop = min(hits)
            if self.keep_stop:
                cut += len(self.matched_stop)
            self.text = self.text[:cut]
            return self._hand_out(cut)
        return self._hand_out(len(self.text) - self._stop_prefix_len())

    def flush(self) -> str:
        """The request ended: hand out what was held back as a possible stop-string start."""
        return self._hand_out(len(self.text))

    def _hand_out(self, end: int) -> str:
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the unsent text that a stop string starts with."""
        unsent = len(self.text) - self.sent
        for k in range(min(self.max_stop_len - 1, unsent), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
