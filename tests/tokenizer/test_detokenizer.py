"""Incremental detokenization: final pieces only, equal to a full decode, stop strings cut."""

from __future__ import annotations

import random

import pytest

from minfer.tokenizer.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! Plain ASCII.",
    "héllo wörld naïve café",
    "你好，世界。日本語のテキスト",
    "emoji 🎉🎉 and flags 🇫🇷 and family 👨‍👩‍👧",
    "tabs\tand\nnewlines  double  spaces",
]


class SlowOnly:
    """A tokenizer without a Rust backend: only `decode`, as slow tokenizers have."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


def pieces(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    out = [detok.add(t) for t in ids]
    out.append(detok.flush())
    return out


@pytest.mark.parametrize("slow", [False, True], ids=["DecodeStream", "slow-tokenizer"])
@pytest.mark.parametrize("text", TEXTS)
def test_pieces_join_to_the_full_decode(tokenizer, text, slow):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(SlowOnly(tokenizer) if slow else tokenizer)
    out = pieces(detok, ids)
    assert "".join(out) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in p for p in out)  # never half a character


def test_multibyte_characters_wait_for_their_last_byte(tokenizer):
    ids = tokenizer.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits the emoji's four bytes
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add(t) for t in ids] == [""] * (len(ids) - 1) + ["🎉"]


def test_random_ids_and_special_tokens(tokenizer):
    rng = random.Random(0)
    specials = tokenizer.all_special_ids
    for _ in range(50):
        ids = [rng.randrange(len(tokenizer)) for _ in range(30)] + [rng.choice(specials)]
        rng.shuffle(ids)
        out = pieces(IncrementalDetokenizer(tokenizer), ids)
        assert "".join(out) == tokenizer.decode(ids, skip_special_tokens=True)
        assert not any(tokenizer.decode([s]) in "".join(out) for s in specials if tokenizer.decode([s]))


def test_stop_string_is_cut_and_never_sent(tokenizer):
    ids = tokenizer.encode("The answer is 42. Done here, then more text.", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["Done"])
    sent = []
    for t in ids:
        sent.append(detok.add(t))
        if detok.matched_stop:
            break
    assert detok.matched_stop == "Done"
    assert "".join(sent) == "The answer is 42. "
    assert detok.add(ids[-1]) == "" and detok.flush() == ""  # nothing after the stop


def test_stop_string_across_tokens_and_earliest_wins(tokenizer):
    text = "alpha beta gamma delta"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["gamma delta", "ta ga"])
    out = "".join(detok.add(t) for t in ids)
    assert detok.matched_stop == "ta ga" and out == "alpha be"


def test_kept_stop_string_ends_the_text(tokenizer):
    """include_stop_str_in_output (keep_stop): the earliest match is kept, nothing after it."""
    text = "alpha beta gamma delta"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["gamma delta", "ta ga"], keep_stop=True)
    out = "".join(detok.add(t) for t in ids) + detok.flush()
    assert detok.matched_stop == "ta ga" and out == "alpha beta ga"


def test_possible_stop_prefix_is_held_back_then_released(tokenizer):
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["two threes", "thr"])
    sent = [detok.add(t) for t in ids]
    # " two" could start "two threes": held back until " three" rules that out... but "thr" matches.
    assert detok.matched_stop == "thr" and "".join(sent) == "one two "
    detok = IncrementalDetokenizer(tokenizer, stop=["two threes"])
    sent = [detok.add(t) for t in ids]
    assert "".join(sent) == "one " and detok.matched_stop is None
    assert detok.flush() == "two three"  # the request ended without the stop string completing


def test_no_tokenizer_gives_no_text():
    detok = IncrementalDetokenizer(None, stop=["x"])
    assert detok.add(5) == "" and detok.flush() == ""
