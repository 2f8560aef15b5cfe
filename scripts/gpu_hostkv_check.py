"""Check the host KV tier on CUDA: the paths the CPU tests cannot reach (pinned host pool, the
load stream and its events, requests waiting for a load while others run), then its speed.

    PYTHONPATH=$PWD python3 scripts/gpu_hostkv_check.py [--model qwen3-0.6b] [--dtype float32]

Needs minfer's run-time packages (msgspec, ...) as shared/gpu/README.md installs them. Dummy
weights of a shipped shape; multi-turn conversations whose histories are ~4x the device pool.
  1. one request at a time (identical batches in every run): with the host tier, every round
     after the first hits its whole history, and every output (greedy and seeded) equals the
     run with a device pool big enough for everything;
  2. all conversations at once (loads overlap other requests' passes): the page invariant is
     checked after every step, the trace check passes, and the loads actually waited (async);
  3. figures: load bandwidth (bytes over the loads' copy time on the load stream) against a
     pinned host->device copy measured here; TTFT of the last round with and without the tier.
Prints PASS/FAIL per check and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from minfer import LLM, SamplingParams  # noqa: E402
from minfer.bench.multiturn import copy_bandwidth, run_round  # noqa: E402
from minfer.kvcache.prefix_cache import KVInvariantError  # noqa: E402
from minfer.observability.trace_check import check_file, format_report  # noqa: E402

FAILED: list[str] = []
START = time.perf_counter()


def report(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def converse(args, params_of, pool_tokens: int, host_gb: float, max_running: int, trace=None, check=False):
    """All rounds of every conversation; returns outputs, per-round (hits, whole history, ttfts), llm."""
    llm = LLM(
        args.model,
        load_format="dummy",
        device=args.device,
        dtype=args.dtype,
        page_size=args.page_size,
        kv_cache_tokens=pool_tokens,
        host_kv_cache_gb=host_gb,
        max_running_requests=max_running,
        check_kv_invariants=check,
        trace_requests=trace,
        log_level="warning",
    )
    sched = llm.scheduler
    rng = random.Random(0)
    vocab = min(llm.engine.vocab_size, 20000)
    histories = [[rng.randrange(vocab) for _ in range(args.first_len)] for _ in range(args.conversations)]
    outputs, rounds = [], []
    counters = sched.kv.prefix_cache.counters
    for r in range(args.rounds):
        hit0 = counters.hit_tokens
        whole = (
            sum((len(h) - args.turn_len - 1) // args.page_size * args.page_size for h in histories)
            if r
            else 0
        )
        outs, ttfts = run_round(sched, histories, params_of(r))
        rounds.append((counters.hit_tokens - hit0, whole, ttfts))
        outputs += outs
        histories = [
            h + o + [rng.randrange(vocab) for _ in range(args.turn_len)] for h, o in zip(histories, outs)
        ]
    return outputs, rounds, llm


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument(
        "--dtype", default="float32", help="float32 keeps batched kernels' numerics out of the comparison"
    )
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--first-len", type=int, default=512)
    p.add_argument("--turn-len", type=int, default=256)
    p.add_argument("--answer-len", type=int, default=32)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--host-gb", type=float, default=4.0)
    p.add_argument("--device", default="cuda", help="cpu: a dry run of this script's logic only")
    args = p.parse_args()
    cuda = args.device == "cuda"
    assert not cuda or torch.cuda.is_available(), "this check needs CUDA"
    working = args.conversations * (
        args.first_len + (args.rounds - 1) * args.turn_len + args.rounds * args.answer_len
    )
    small = max(
        working // 4,
        args.first_len + (args.rounds - 1) * (args.turn_len + args.answer_len) + 2 * args.answer_len,
    )
    small = -(-small // args.page_size) * args.page_size
    print(
        f"{args.model} {args.dtype}: working set {working} tokens, device pool {small} ({working / small:.1f}x)"
    )

    def greedy(r):
        return SamplingParams(temperature=0, max_tokens=args.answer_len, ignore_eos=True)

    def seeded(r):
        return SamplingParams(
            temperature=0.8, top_p=0.95, seed=r, max_tokens=args.answer_len, ignore_eos=True
        )

    # 1. one request at a time: identical batches, so outputs must be bit-identical.
    for name, params_of in (("greedy", greedy), ("seeded", seeded)):
        want, _, big = converse(args, params_of, 2 * working, 0.0, 1)
        del big
        got, rounds, llm = converse(args, params_of, small, args.host_gb, 1)
        report(
            f"outputs equal the unconstrained pool ({name})",
            got == want,
            f"{sum(a == b for a, b in zip(got, want))}/{len(want)}",
        )
        short = [(r, hit, whole) for r, (hit, whole, _) in enumerate(rounds) if r and hit != whole]
        report(f"rounds >= 2 hit their whole history ({name})", not short, f"short rounds: {short[:3]}")
        c = llm.scheduler.kv.host_tier.counters
        if cuda:
            report(f"pinned host pool ({name})", llm.engine.host_kv_pool.k[0].is_pinned(), f"hits {c.hits}")
        del llm
        if cuda:
            torch.cuda.empty_cache()

    # 2. concurrent conversations: loads in flight while other requests run.
    trace = os.path.join(tempfile.mkdtemp(), "trace.jsonl")
    try:
        _, rounds, llm = converse(
            args, greedy, small, args.host_gb, args.conversations, trace=trace, check=True
        )
    except KVInvariantError as e:
        report("page invariant after every step (concurrent)", False, str(e))
        return 1
    c = llm.scheduler.kv.host_tier.counters
    report(
        "page invariant after every step (concurrent)",
        True,
        f"{c.hits} loads, {c.load_waits} polls found a load in flight",
    )
    if cuda:
        report("loads ran asynchronously (a request waited, others ran)", c.load_waits > 0)
    llm.scheduler.tracer.flush()
    rep = check_file(trace)
    report(
        "minfer trace check (loaded prefixes are the offloaded ones)",
        rep.ok,
        format_report(rep).splitlines()[-1],
    )
    pinned = copy_bandwidth(torch.device(args.device), 1 << 30)
    load_bw = c.bytes_loaded / max(c.load_seconds_sum, 1e-9)
    print(
        f"FIGURE load bandwidth {load_bw / 1e9:.1f} GB/s vs pinned H2D copy {pinned / 1e9:.1f} GB/s ({100 * load_bw / pinned:.0f}%)"
    )
    ttft_host = np.percentile(rounds[-1][2], 50)
    del llm
    if cuda:
        torch.cuda.empty_cache()
    _, rounds_plain, llm = converse(args, greedy, small, 0.0, args.conversations)
    ttft_plain = np.percentile(rounds_plain[-1][2], 50)
    hit_plain = rounds_plain[-1][0] / max(1, rounds_plain[-1][1])
    hit_host = rounds[-1][0] / max(1, rounds[-1][1])
    print(
        f"FIGURE last round: history hit {100 * hit_host:.0f}% with the host tier, {100 * hit_plain:.0f}% without; "
        f"TTFT p50 {1000 * ttft_host:.0f} ms vs {1000 * ttft_plain:.0f} ms"
    )
    print(
        f"{'FAIL' if FAILED else 'PASS'}: {len(FAILED)} check(s) failed {FAILED} ({time.perf_counter() - START:.0f} s)"
    )
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
