"""A thinking model's reasoning apart from its answer: `--reasoning-parser qwen3|deepseek_r1`
(vLLM's and SGLang's flag) moves what the model writes before `</think>` to the chat message's
`reasoning_content` (streamed as `delta.reasoning_content`, DeepSeek's and vLLM's field);
`content` keeps the rest, which is also all that tool-call parsing sees.

- qwen3: an answer that opens with `<think>` reasons up to `</think>`; one that does not (Qwen3
  with `enable_thinking: false`, or a template-opened thinking block) is all content.
- deepseek_r1: the chat template opens the thinking block in the prompt, so everything before
  `</think>` is reasoning (a leading `<think>` dropped), all of it when none comes (cut short).

The markers themselves are in neither field. One `ReasoningStream` does the splitting, fed the
whole text at once or piece by piece: a piece that may end in the start of a marker keeps that
part back until the next one, so a streamed answer splits exactly as the whole one does.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


def _marker_prefix_at_end(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """Feed the answer's text; get ("reasoning_content" | "content", text) pieces back."""

    def __init__(self, parser: str):
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r} (known: {', '.join(REASONING_PARSERS)})")
        self.parser = parser
        self.state = "start"  # nothing decided yet; then "reasoning", then "content"
        self.pending = ""
        self.reasoned = False  # a reasoning part exists (possibly empty: <think></think>)

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.pending += text
        out: list[tuple[str, str]] = []
        if self.state == "start":
            if len(self.pending) < len(START) and START.startswith(self.pending):  # may become <think>
                return out
            opened = self.pending.startswith(START)
            if opened:
                self.pending = self.pending[len(START) :]
            self.state = "reasoning" if opened or self.parser == "deepseek_r1" else "content"
            self.reasoned = self.state == "reasoning"
        if self.state == "reasoning":
            before, found, after = self.pending.partition(END)
            if not found:
                keep = _marker_prefix_at_end(self.pending, END)
                before, self.pending = (
                    self.pending[: len(self.pending) - keep],
                    self.pending[len(self.pending) - keep :],
                )
                return out + ([("reasoning_content", before)] if before else [])
            if before:
                out.append(("reasoning_content", before))
            self.state, self.pending = "content", after
        if self.pending:
            out.append(("content", self.pending))
            self.pending = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What was held back, once the answer is complete."""
        rest, self.pending = self.pending, ""
        if self.state == "start":  # all of it a proper prefix of <think>, or nothing at all
            self.state = "reasoning" if self.parser == "deepseek_r1" and rest else "content"
            self.reasoned = self.state == "reasoning"
        if not rest:
            return []
        return [("reasoning_content" if self.state == "reasoning" else "content", rest)]


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """(reasoning_content, content) of a whole answer; reasoning_content None when it has none."""
    stream = ReasoningStream(parser)
    pieces = stream.feed(text) + stream.finish()
    reasoning = "".join(t for kind, t in pieces if kind == "reasoning_content")
    return (reasoning if stream.reasoned else None), "".join(t for kind, t in pieces if kind == "content")


def reasoning_tokens(parser: str, text: str, token_ids: list[int], end_id: int | None) -> int | None:
    """How many of an answer's tokens are its reasoning (OpenAI's usage `reasoning_tokens`): up to
    and including the `</think>` token; all of them while it has not come (cut short, or still
    streaming); none without a reasoning part. None when `</think>` is in the text but is not
    one token of this tokenizer (`end_id` None), so where the reasoning ends among the tokens
    is not known."""
    reasoning, _ = split_reasoning(parser, text)
    if reasoning is None:
        return 0
    if end_id is not None and end_id in token_ids:
        return token_ids.index(end_id) + 1
    return len(token_ids) if END not in text else None
