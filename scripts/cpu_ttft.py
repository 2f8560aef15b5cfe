"""Time to first token of long prompts on the CPU, through the offline LLM (one thread by default).

    OMP_NUM_THREADS=1 taskset -c 1 python3 scripts/cpu_ttft.py [--quantization gguf] [--tokens 2000 4000]
    python3 scripts/cpu_ttft.py --threads 2     # the engine's threads (unpinned)

Prompts of random token ids (no prefix in common, so nothing comes from the prefix cache),
max_tokens 1, after a short warm-up. Run it from another tree with PYTHONPATH=that tree to
compare two commits.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

import minfer
from minfer import LLM
from minfer.core import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2000, 4000])
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    ap.add_argument("--attention-backend", default="auto")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(
        cpu_threads=args.threads,
        attention_backend=args.attention_backend,
        **({"quantization": args.quantization} if args.quantization else {}),
    )
    rng = random.Random(0)
    greedy_one = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([[rng.randint(100, 20000) for _ in range(64)]], greedy_one)
    print(
        f"minfer from {minfer.__file__}, quantization {args.quantization}, {args.threads} threads, "
        f"attention {llm.engine.backend.name}"
    )
    for n in args.tokens:
        prompt = [rng.randint(100, 20000) for _ in range(n)]
        start = time.perf_counter()
        llm.generate([prompt], greedy_one)
        print(f"{n}-token prompt: first token in {time.perf_counter() - start:.2f} s")
    llm.shutdown()


if __name__ == "__main__":
    main()
