"""Structured output with xgrammar: a grammar matcher per request, its token mask applied to the
batch's logits on the device.

The matcher must have accepted every earlier token before it can fill the next mask, so a
request with a grammar skips a decode step while its previous token is still in flight (overlap
mode runs it every other step); the rest of the batch is not held back.
"""

from __future__ import annotations

import json

import torch

from minfer.core import InvalidRequestError, StructuredOutput


class GrammarBackend:
    """Compiles grammars for one tokenizer and masks logits with the requests' matchers."""

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar

        self.xgr = xgrammar
        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2)

    def matcher(self, spec: StructuredOutput, param: str = "response_format"):
        """A fresh matcher for the spec; InvalidRequestError if it does not compile."""
        try:
            if spec.kind == "json":
                compiled = self.compiler.compile_builtin_json_grammar()
            elif spec.kind == "json_schema":
                json.loads(spec.spec)
                # Compact JSON: free whitespace lets a weak model pad forever.
                compiled = self.compiler.compile_json_schema(spec.spec, any_whitespace=False)
            elif spec.kind == "regex":
                compiled = self.compiler.compile_regex(spec.spec)
            elif spec.kind == "ebnf":
                compiled = self.compiler.compile_grammar(spec.spec)
            else:
                raise InvalidRequestError(f"unknown structured output kind {spec.kind!r}", param)
        except InvalidRequestError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar: the parser's message
            raise InvalidRequestError(f"invalid {spec.kind}: {e}", param) from None
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, matchers: list) -> torch.Tensor:
        """The tokens each row's matcher allows next, as xgrammar's packed int32 bitmask [B,
        ceil(V / 32)] on the CPU (None: the row allows everything)."""
        bitmask = self.xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for i, matcher in enumerate(matchers):
            if matcher is not None:
                matcher.fill_next_token_bitmask(bitmask, i)
        return bitmask

    def allows_only(self, bitmask: torch.Tensor, row: int, tokens: set[int]) -> bool:
        """Whether `row` of `bitmask` allows no token outside `tokens`."""
        words = bitmask[row].to(torch.int64) & 0xFFFFFFFF
        for t in tokens:
            if 0 <= t < self.vocab_size:
                words[t // 32] &= ~(1 << (t % 32))
        if self.vocab_size % 32:  # the last word's bits past the vocabulary mean nothing
            words[-1] &= (1 << (self.vocab_size % 32)) - 1
        return not bool(words.any())

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Mask, in place, the tokens that `bitmask` (made by the method above) forbids."""
        self.xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device, non_blocking=True), vocab_size=self.vocab_size
        )
