"""How long a prompt may be, checked before the whole text is tokenized.

Tokenizing takes time in proportion to the text (the default model's tokenizer: ~0.4 s per MB on
one core), so a prompt is measured in three steps, each cheaper than the next:

1. its byte length: no token is longer than the vocabulary's longest one, so a text of more than
   `max_prompt_tokens x longest token` bytes cannot fit and is refused without tokenizing;
2. a text long enough to be suspicious (more bytes than `SUSPICIOUS_BYTES_PER_TOKEN` per allowed
   token) is counted in pieces, stopping as soon as the count is over the limit by more than the
   pieces could have added (a token never spans the cut in a whitespace-splitting tokenizer, and
   a margin per cut covers the others);
3. everything else is tokenized whole, and the exact count is left to the scheduler's check.

A tokenizer whose normalizer drops text (BERT's discards whitespace) can fit more bytes per token
than its longest token; minfer serves decoder models whose tokenizers keep every byte.
"""

from __future__ import annotations

from minfer.core import InvalidRequestError

# Most text is 3-5 bytes per token; a prompt with fewer per allowed token fits without a count.
SUSPICIOUS_BYTES_PER_TOKEN = 2
PIECE_CHARS = 16384  # characters tokenized at a time by the early count
# Tokens a cut can change the count by (a word split in two, a byte-level merge undone).
MARGIN_TOKENS_PER_CUT = 4


def longest_token_bytes(tokenizer) -> int:
    """The UTF-8 length of the longest token string: an upper bound on the text one token covers
    (byte-level BPE maps a byte to 1-2 UTF-8 bytes, SentencePiece writes a space as 3)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max(len(t.encode("utf-8", "surrogatepass")) for t in tokens if t is not None)


def text_bytes(value) -> int:
    """UTF-8 bytes of every string inside `value` (a prompt, or chat messages)."""
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, dict):
        return sum(text_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(text_bytes(v) for v in value)
    return 0


def _too_long(max_tokens: int, found: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"this model's maximum context length is {max_tokens + 1} tokens (prompt at most "
        f"{max_tokens}, leaving one for the answer), but the prompt {found}",
        param,
        "context_length_exceeded",
    )


class PromptMeter:
    """Refuses prompts that cannot fit, as early as possible; `max_prompt_tokens` None: no limit."""

    def __init__(self, tokenizer, max_prompt_tokens: int | None = None):
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.token_bytes = longest_token_bytes(tokenizer) if tokenizer is not None else 0

    @property
    def max_prompt_bytes(self) -> int | None:
        if self.max_prompt_tokens is None or not self.token_bytes:
            return None
        return self.max_prompt_tokens * self.token_bytes

    def check_bytes(self, nbytes: int, param: str) -> None:
        limit = self.max_prompt_bytes
        if limit is not None and nbytes > limit:
            raise _too_long(
                self.max_prompt_tokens,
                f"is {nbytes} bytes, more than that many tokens can hold ({limit} bytes: the longest "
                f"token is {self.token_bytes} bytes)",
                param,
            )

    def encode(
        self, text: str, add_special_tokens: bool, param: str = "prompt", truncating: bool = False
    ) -> list[int]:
        """`truncating`: the caller keeps only the last tokens, so a text over the limit in tokens
        is tokenized whole (only the byte bound of step 1 refuses it, which bounds the work)."""
        nbytes = text_bytes(text)
        self.check_bytes(nbytes, param)
        if (
            not truncating
            and self.max_prompt_tokens is not None
            and nbytes > SUSPICIOUS_BYTES_PER_TOKEN * self.max_prompt_tokens
        ):
            self.count_until_over(text, param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def count_until_over(self, text: str, param: str) -> None:
        """Tokenize `text` piece by piece; raise as soon as it is certainly too long."""
        limit, count, cuts, start = self.max_prompt_tokens, 0, 0, 0
        while start < len(text):
            end = _cut(text, start + PIECE_CHARS)
            count += len(self.tokenizer.encode(text[start:end], add_special_tokens=False))
            if count > limit + MARGIN_TOKENS_PER_CUT * cuts:
                raise _too_long(
                    limit,
                    f"has more than {count - MARGIN_TOKENS_PER_CUT * cuts} tokens in its first "
                    f"{end} characters (of {len(text)})",
                    param,
                )
            start, cuts = end, cuts + 1


def _cut(text: str, at: int) -> int:
    """A position near `at` just before whitespace that follows a non-space (where a
    whitespace-splitting tokenizer starts a new word anyway); `at` itself if there is none."""
    if at >= len(text):
        return len(text)
    for pos in range(at, max(at - 1024, 1), -1):
        if text[pos].isspace() and not text[pos - 1].isspace():
            return pos
    return at
