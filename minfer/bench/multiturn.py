"""`minfer bench multiturn`: conversations whose histories outgrow the device KV pool.

`--conversations` clients each hold a conversation of `--rounds` rounds. A round appends a new
`--turn-len`-token user turn (random ids, seeded) to the whole history and asks for
`--answer-len` tokens; every conversation's turn of a round is queued at once, so they
interleave in the scheduler, and the next round starts when all have answered. With a device
pool of a fraction of the working set (`--kv-cache-tokens`) the radix cache alone loses the
histories to eviction; `--host-kv-cache-gb` keeps them on the host tier.

Per round it prints the prefix-cache hit rate, the prefill tokens computed, TTFT p50/p99 (from
queueing to the first token, measured in the scheduler loop) and the host tier's traffic: bytes
loaded and offloaded and the load and offload bandwidth (bytes over the copies' own time), beside the
host->device copy bandwidth measured on the same device (pinned memory on CUDA).
"""

from __future__ import annotations

import argparse
import random
import time

from minfer.config import EngineConfig
from minfer.core import SamplingParams

WORKLOAD_ARGS = ("conversations", "rounds", "first_len", "turn_len", "answer_len", "bench_seed")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conversations", type=int, default=8, help="concurrent conversations")
    p.add_argument("--rounds", type=int, default=5, help="rounds of each conversation")
    p.add_argument("--first-len", type=int, default=512, help="tokens of each conversation's first turn")
    p.add_argument("--turn-len", type=int, default=256, help="tokens of each later user turn")
    p.add_argument("--answer-len", type=int, default=128, help="max_tokens of each answer")
    p.add_argument("--bench-seed", type=int, default=0, help="seed of the random turns")


def copy_bandwidth(device, num_bytes: int = 256 << 20) -> float:
    """Host -> device copy bandwidth, bytes/s: pinned memory to the GPU on CUDA, a host memcpy on CPU."""
    import torch  # here: the CLI's parser imports this module, and must not load torch

    cuda = device.type == "cuda"
    src = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=cuda)  # warm-up
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=cuda)
    if cuda:
        torch.cuda.synchronize(device)
    return 5 * num_bytes / (time.perf_counter() - start)


def run_round(sched, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], list[float]]:
    """Queue every prompt at once, step until all finish; returns outputs and TTFTs (seconds)."""
    queued = time.perf_counter()
    reqs = [sched.add_request(p, params) for p in prompts]
    first: dict[int, float] = {}
    while sched.has_work:
        for out in sched.step():
            first.setdefault(out.uid, time.perf_counter())
    return [r.output_ids for r in reqs], [first[r.uid] - queued for r in reqs]


def run_multiturn_bench(config: EngineConfig, args: argparse.Namespace) -> int:
    import numpy as np

    from minfer import LLM

    if (
        config.model
        and config.load_format == "auto"
        and "/" not in config.model
        and not config.model.endswith(".gguf")
    ):
        config.load_format = "dummy"
    llm = LLM(**vars(config))
    sched, kv = llm.scheduler, llm.scheduler.kv
    rng = random.Random(args.bench_seed)
    vocab = min(llm.engine.vocab_size, 10000)

    def turn(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    params = SamplingParams(temperature=0, max_tokens=args.answer_len, ignore_eos=True)
    run_round(sched, [turn(64), turn(64)], SamplingParams(max_tokens=2))  # warm-up, shares nothing
    histories = [turn(args.first_len) for _ in range(args.conversations)]
    working_set = args.conversations * (
        args.first_len + (args.rounds - 1) * args.turn_len + args.rounds * args.answer_len
    )
    host = kv.host_tier
    print(
        f"model {llm.engine.source.name} ({llm.engine.device}, {llm.engine.dtype}); {llm.engine.memory.describe(llm.engine.max_model_len)}"
    )
    print(
        f"{args.conversations} conversations x {args.rounds} rounds: first turn {args.first_len}, later turns "
        f"{args.turn_len}, answers {args.answer_len} tokens; working set {working_set} tokens = "
        f"{working_set / (kv.num_pages * kv.page_size):.1f}x the device pool"
    )
    if host is not None:
        print(
            f"host->device copy bandwidth measured here: {copy_bandwidth(llm.engine.device) / 1e9:.2f} GB/s"
        )
    print(
        "round  hit%   prefill_computed  ttft_p50_ms  ttft_p99_ms  loaded_MB  offloaded_MB  load_GB/s  offload_GB/s"
    )
    cache, c = kv.prefix_cache.counters, sched.counters
    for r in range(args.rounds):
        before = (cache.queried_tokens, cache.hit_tokens, c.prefill_tokens_computed)
        hc = host.counters if host else None
        hb = (
            (
                hc.bytes_loaded,
                hc.bytes_offloaded,
                hc.load_seconds_sum,
                hc.offload_bytes_timed,
                hc.offload_seconds_sum,
            )
            if host
            else (0, 0, 0.0, 0, 0.0)
        )
        outputs, ttfts = run_round(sched, histories, params)
        if host:
            host.synchronize()  # every copy of the round timed (offloads' D2H is read lazily)
        queried, hits = cache.queried_tokens - before[0], cache.hit_tokens - before[1]
        loaded = (hc.bytes_loaded - hb[0]) if host else 0
        offloaded = (hc.bytes_offloaded - hb[1]) if host else 0
        seconds = (hc.load_seconds_sum - hb[2]) if host else 0.0
        out_seconds = (hc.offload_seconds_sum - hb[4]) if host else 0.0
        out_bw = (hc.offload_bytes_timed - hb[3]) / out_seconds / 1e9 if out_seconds > 0 else None
        p50, p99 = np.percentile(ttfts, [50, 99]) * 1000
        print(
            f"{r + 1:5d}  {100 * hits / max(1, queried):5.1f}  {c.prefill_tokens_computed - before[2]:16d}  "
            f"{p50:11.1f}  {p99:11.1f}  {loaded / 1e6:9.1f}  {offloaded / 1e6:12.1f}  "
            + (f"{loaded / seconds / 1e9:9.2f}" if seconds > 0 else "        -")
            + (f"  {out_bw:12.2f}" if out_bw is not None else "             -")
        )
        histories = [h + out + turn(args.turn_len) for h, out in zip(histories, outputs)]
    print(f"decode {c.generation_tokens} tokens in {c.decode_seconds + c.prefill_seconds:.2f} s of steps")
    return 0
