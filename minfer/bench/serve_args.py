"""The flags of `minfer bench serve` and their checks (kept apart so that building the CLI's
parser imports nothing else of the benchmark)."""

from __future__ import annotations

import argparse
import math

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# What the arguments default to per workload: the random draw follows vLLM's bench defaults, the
# nano-vllm draw its own (so the figure is comparable with `minfer bench offline`).
WORKLOAD_DEFAULTS = {
    "random": {"num_prompts": 1000, "input_len": 1024, "output_len": 128},
    "nano-vllm": {"num_prompts": 256, "input_len": 1024, "output_len": 1024},
    "dataset": {"num_prompts": None, "input_len": None, "output_len": 128},
}


class BenchError(Exception):
    """A problem with the flags, the workload or the server, reported as one line."""


def request_rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of requests per second or inf, got {text!r}"
        ) from None
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {text}")
    return rate


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    p.add_argument(
        "--endpoint", choices=sorted(ENDPOINT_PATHS), default="completions", help="the API to stream from"
    )
    p.add_argument(
        "--model", default=None, help="model name sent in requests (default: the first of /v1/models)"
    )
    p.add_argument(
        "--workload",
        choices=("random", "nano-vllm"),
        default=None,
        help="random-length prompts of random token ids, or nano-vllm's offline draw (default: random)",
    )
    p.add_argument(
        "--dataset",
        default=None,
        help="a JSONL file: one {prompt | messages, max_tokens?} per line (default: none, use --workload)",
    )
    p.add_argument(
        "--num-prompts",
        type=positive_int,
        default=None,
        help="requests to send (default: random 1000, nano-vllm 256, dataset: every line)",
    )
    p.add_argument(
        "--input-len",
        type=positive_int,
        default=None,
        help="prompt tokens (nano-vllm: upper end) (default: 1024)",
    )
    p.add_argument(
        "--output-len",
        type=positive_int,
        default=None,
        help="max_tokens (nano-vllm: upper end; dataset: for lines without max_tokens) (default: random 128, nano-vllm 1024, dataset 128)",
    )
    p.add_argument(
        "--range-ratio", type=float, default=0.0, help="random: lengths uniform in [L*(1-r), L*(1+r)]"
    )
    p.add_argument(
        "--request-rate",
        type=request_rate,
        default=math.inf,
        help="mean requests per second of the Poisson arrivals, or inf to send all at once",
    )
    p.add_argument(
        "--max-concurrency",
        type=positive_int,
        default=None,
        help="requests in flight at most (default: no limit)",
    )
    p.add_argument(
        "--num-warmups",
        type=int,
        default=0,
        help="untimed requests first (random, nano-vllm: drawn with --seed + 1; dataset: its first lines)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the workload draw and the arrival times")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature (nano-vllm: always 0.6, with ignore_eos)",
    )
    p.add_argument(
        "--ignore-eos", action="store_true", help="send ignore_eos so every output is max_tokens long"
    )
    p.add_argument(
        "--slo",
        default=None,
        help="goodput limits in ms, e.g. ttft:500,tpot:50 (also e2e) (default: none, no goodput line)",
    )
    p.add_argument(
        "--client-processes",
        type=positive_int,
        default=1,
        help="client processes to shard the requests over (one takes ~35,000 tok/s of CPU)",
    )
    p.add_argument(
        "--output-json",
        default=None,
        help="write every metric and per-request record here (default: not written)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
