"""What a short prefill pass costs the CPU to launch, against its whole time: the shape of a
multi-turn round (a few hundred new tokens over a cached history), on dummy weights.

    PYTHONPATH=$PWD python3 scripts/gpu_prefill_launch.py --model llama-3.1-8b

Each timed pass (replayed from a CUDA graph unless --prefill-cuda-graph-max-tokens 0) starts with the GPU idle (synchronized), so `launch` is pure CPU time (model
forward issued, nothing waited for) and `total` adds the GPU's tail. If launch is close to
total, the pass is CPU-bound: its kernels run faster than Python issues them. Then one pass
under cProfile, by own time, says which calls the CPU time goes to.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from minfer import LLM, SamplingParams  # noqa: E402
from minfer.bench.multiturn import run_round  # noqa: E402
from minfer.core import Phase  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--history", type=int, default=2304, help="cached tokens before the new turn")
    p.add_argument("--new", type=int, default=320, help="new tokens per request")
    p.add_argument("--requests", default="1,2", help="requests per pass, comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--prefill-cuda-graph-max-tokens", type=int, default=None, help="0: launch every pass from Python"
    )
    args = p.parse_args()
    llm = LLM(
        args.model,
        load_format="dummy",
        dtype=args.dtype,
        kv_cache_tokens=65536,
        log_level="warning",
        prefill_cuda_graph_max_tokens=args.prefill_cuda_graph_max_tokens,
    )
    sched, engine = llm.scheduler, llm.scheduler.engine
    rng = random.Random(0)
    vocab = min(engine.vocab_size, 20000)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    records: list[tuple[int, float, float]] = []
    profile = [False]
    forward = engine.forward_batch
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # CPU: a dry run

    def timed(batch):
        sync()
        start = time.perf_counter()
        profiler = cProfile.Profile() if profile[0] and batch.phase == Phase.PREFILL else None
        if profiler:
            profiler.enable()
        result = forward(batch)
        launched = time.perf_counter()
        if profiler:
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
            profile[0] = False
        sync()
        if batch.phase == Phase.PREFILL:
            records.append((sum(batch.extend_lens), launched - start, time.perf_counter() - start))
        return result

    engine.forward_batch = timed
    for n in [int(x) for x in args.requests.split(",")]:
        histories = [[rng.randrange(vocab) for _ in range(args.history)] for _ in range(n)]
        run_round(sched, histories, one)  # cache the histories (and compile for these shapes)
        for r in range(args.repeats + 1):
            records.clear()
            turns = [h + [rng.randrange(vocab) for _ in range(args.new)] for h in histories]
            run_round(sched, turns, one)
            if r == 0:
                continue  # warm-up of this shape
            for tokens, launch, total in records:
                print(
                    f"{n} request(s), {tokens} new tokens over {args.history} cached: "
                    f"launch {1000 * launch:.2f} ms, total {1000 * total:.2f} ms"
                )
    profile[0] = True
    run_round(sched, [histories[0] + [rng.randrange(vocab) for _ in range(args.new)]], one)
    return 0


if __name__ == "__main__":
    sys.exit(main())
