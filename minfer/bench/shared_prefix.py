"""`minfer bench shared-prefix`: many requests sharing one long system prompt.

Each request is the same `--system-len`-token system prompt followed by its own
`--question-len`-token question (random ids, seeded). The radix cache should compute the
system prompt once; `--cache naive` computes it for every request. Prints the prefill tokens
actually computed, the prefix-cache hit rate and the throughput of one generate call.
"""

from __future__ import annotations

import argparse
import random
import time

from minfer.config import EngineConfig
from minfer.core import SamplingParams

WORKLOAD_ARGS = ("num_requests", "system_len", "question_len", "output_len", "bench_seed")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=64, help="requests, all sharing one system prompt")
    p.add_argument("--system-len", type=int, default=1000, help="tokens of the shared system prompt")
    p.add_argument("--question-len", type=int, default=50, help="tokens of each request's own question")
    p.add_argument("--output-len", type=int, default=32, help="max_tokens of each request")
    p.add_argument("--bench-seed", type=int, default=0, help="seed of the random prompts")


def make_workload(num_requests: int, system_len: int, question_len: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(system_len)]
    return [system + [rng.randrange(vocab) for _ in range(question_len)] for _ in range(num_requests)]


def run_shared_prefix_bench(config: EngineConfig, args: argparse.Namespace) -> int:
    from minfer import LLM

    if (
        config.model
        and config.load_format == "auto"
        and "/" not in config.model
        and not config.model.endswith(".gguf")
    ):
        config.load_format = "dummy"
    llm = LLM(**vars(config))
    vocab = min(llm.engine.vocab_size, 10000)
    prompts = make_workload(args.num_requests, args.system_len, args.question_len, vocab, args.bench_seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    # Warm-up on other ids (no shared prefix with the workload).
    warm = make_workload(2, 64, 8, vocab, args.bench_seed + 1)
    llm.generate(warm, SamplingParams(max_tokens=2), use_tqdm=False)
    sched = llm.scheduler
    sched.counters.__init__()
    cache = sched.kv.prefix_cache.counters
    queried0, hit0 = cache.queried_tokens, cache.hit_tokens
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    c = sched.counters
    prompt_tokens = sum(map(len, prompts))
    queried, hits = cache.queried_tokens - queried0, cache.hit_tokens - hit0
    print(f"model {llm.engine.source.name} ({llm.engine.device}, {llm.engine.dtype}), cache {config.cache}")
    print(
        f"requests {len(prompts)}: system prompt {args.system_len} + question {args.question_len} tokens, "
        f"{args.output_len} output tokens each"
    )
    print(
        f"prefill tokens computed {c.prefill_tokens_computed} of {prompt_tokens} prompt tokens "
        f"({100 * c.prefill_tokens_computed / prompt_tokens:.1f}%); prefix hits {hits}/{queried} queried"
    )
    print(
        f"wall {wall:.2f} s; {prompt_tokens / wall:,.0f} prompt tok/s, "
        f"{len(prompts) * args.output_len / wall:,.0f} output tok/s"
    )
    return 0
