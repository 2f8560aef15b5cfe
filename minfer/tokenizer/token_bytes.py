"""The raw bytes a token stands for, for OpenAI's chat logprobs `bytes`.

A token's text decoded alone is not always its bytes: a character of several UTF-8 bytes (an
emoji, most CJK) is often split over tokens, and each part decodes to U+FFFD. OpenAI sends each
token's bytes so that a client can join them into the real text; `list(text.encode())` would give
the replacement character's three bytes instead. The bytes come from the token's vocabulary entry:
- byte-level BPE (GPT-2's scheme: Llama 3, Qwen, SmolLM2): each character of the entry stands
  for one byte (`BYTE_LEVEL_ALPHABET`);
- SentencePiece with byte fallback (Llama 2, Mistral): an entry `<0xNN>` is the byte NN, other
  entries are UTF-8 text with U+2581 for a space.
"""

from __future__ import annotations

import re

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SENTENCEPIECE_SPACE = "\u2581"


def _byte_level_alphabet() -> dict[str, int]:
    """Character -> byte of GPT-2's byte-level alphabet: the printable Latin-1 bytes ('!'..'~',
    U+00A1..U+00AC, U+00AE..U+00FF) are their own character; the other 68 bytes take U+0100,
    U+0101, ... in increasing byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in set(printable)]
    alphabet.update({chr(0x100 + i): b for i, b in enumerate(others)})
    return alphabet


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()


def is_byte_level(tokenizer) -> bool:
    """Whether the tokenizer's decoder is byte-level (its vocabulary spelled in the alphabet)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return "ByteLevel" in repr(decoder)


def token_bytes(tokenizer, token_id: int, byte_level: bool) -> list[int] | None:
    """The bytes of `token_id`'s vocabulary entry; None where the entry does not spell them in
    a scheme above (the caller keeps the decoded text's bytes)."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str):
        return None
    if byte_level:
        if all(c in BYTE_LEVEL_ALPHABET for c in piece):
            return [BYTE_LEVEL_ALPHABET[c] for c in piece]
        return None
    match = _BYTE_PIECE.fullmatch(piece)
    if match:
        return [int(match.group(1), 16)]
    return list(piece.replace(_SENTENCEPIECE_SPACE, " ").encode())
