"""Request draws shared by the benchmarks: nano-vllm's offline draw, random-length prompts, a JSONL file.

Pure Python (no torch): `minfer bench serve` is a client and imports this.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass
class BenchRequest:
    """One request of a workload: a prompt (token ids, text or chat messages) and its output budget."""

    prompt: list[int] | str | None
    max_tokens: int
    messages: list[dict] | None = None  # a chat conversation instead of a prompt (JSONL only)


class WorkloadError(ValueError):
    """A workload that cannot be built from the given flags or file; the message names the cause."""


def nano_vllm_draw(
    num_requests: int = 256, input_len: int = 1024, output_len: int = 1024, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's / Mini-SGLang's offline workload: (prompts as token ids, max_tokens of each).

    random.seed(seed); for each request a prompt of randint(100, input_len) ids each randint(0, 10000),
    then max_tokens = randint(100, output_len) per request. The order of the draws is part of the
    workload: 256 x 1024/1024 with seed 0 is 133,966 output tokens.
    """
    rng = random.Random(seed)
    lo_in, lo_out = min(100, input_len), min(100, output_len)
    prompts = [
        [rng.randint(0, 10000) for _ in range(rng.randint(lo_in, input_len))] for _ in range(num_requests)
    ]
    max_tokens = [rng.randint(lo_out, output_len) for _ in range(num_requests)]
    return prompts, max_tokens


def check_range_ratio(range_ratio: float) -> None:
    if not 0 <= range_ratio < 1:
        raise WorkloadError(f"--range-ratio must be in [0, 1), got {range_ratio}")


def random_draw(
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_ids: list[int],
    seed: int = 0,
) -> list[BenchRequest]:
    """Prompts of random token ids: lengths uniform in [L(1-r), L(1+r)] for L = input_len, output_len."""
    check_range_ratio(range_ratio)
    if input_len < 1 or output_len < 1:
        raise WorkloadError(f"--input-len and --output-len must be >= 1, got {input_len} and {output_len}")
    rng = random.Random(seed)

    def length(center: int) -> int:
        return rng.randint(
            max(1, round(center * (1 - range_ratio))), max(1, round(center * (1 + range_ratio)))
        )

    out = []
    for _ in range(num_requests):
        prompt_len, max_tokens = length(input_len), length(output_len)
        out.append(BenchRequest([rng.choice(vocab_ids) for _ in range(prompt_len)], max_tokens))
    return out


def load_jsonl(path: str | Path, default_max_tokens: int, chat: bool) -> list[BenchRequest]:
    """One JSON object a line: `prompt` (text, or token ids for /v1/completions) or `messages` (chat),
    and an optional `max_tokens`. Blank lines are skipped; a bad line is an error naming its number."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise WorkloadError(f"cannot read --dataset {path}: {e.strerror}") from None
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--dataset {path} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise WorkloadError(f"{where}: expected a JSON object")
        prompt, messages = row.get("prompt"), row.get("messages")
        max_tokens = row.get("max_tokens", default_max_tokens)
        if (prompt is None) == (messages is None):
            raise WorkloadError(f"{where}: give exactly one of prompt and messages")
        if messages is not None and not chat:
            raise WorkloadError(f"{where}: messages need --endpoint chat")
        if prompt is not None and not (isinstance(prompt, str) and prompt or is_token_ids(prompt)):
            raise WorkloadError(f"{where}: prompt must be a non-empty string or list of token ids")
        if chat and isinstance(prompt, list):
            raise WorkloadError(f"{where}: token-id prompts need --endpoint completions")
        if messages is not None and not (isinstance(messages, list) and messages):
            raise WorkloadError(f"{where}: messages must be a non-empty list")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise WorkloadError(f"{where}: max_tokens must be a positive integer, got {max_tokens!r}")
        out.append(BenchRequest(prompt, max_tokens, messages))
    if not out:
        raise WorkloadError(f"--dataset {path} holds no requests")
    return out


def is_token_ids(value) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    )
