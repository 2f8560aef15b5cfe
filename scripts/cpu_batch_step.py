"""Decode-step time of a --quantization model on CPU at one batch size, in process time.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD taskset -c 1 python3 scripts/cpu_batch_step.py 16

`batch` distinct 256-token prompts are prefilled once (the printed prefill time), so the timed
runs find them in the radix cache; then three runs of 33 new tokens each; the least ms per step
is printed. Process time, so another job on the other core moves it less than wall time.
"""

from __future__ import annotations

import random
import sys
import time

import torch

from minfer import LLM, SamplingParams


def main() -> None:
    torch.set_num_threads(1)
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    method = sys.argv[2] if len(sys.argv) > 2 else "gguf"
    llm = LLM(quantization=method, cpu_threads=1, kv_cache_tokens=32768)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(256)] for _ in range(batch)]
    start = time.process_time()
    llm.generate_ids(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), False)
    prefill = time.process_time() - start
    params = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)
    steps = []
    for _ in range(3):
        start = time.process_time()
        llm.generate_ids(prompts, params, False)
        steps.append((time.process_time() - start) / 33 * 1e3)
    llm.shutdown()
    print(
        f"batch {batch}: prefill {prefill * 1e3:.0f} ms; step (cached prompts, 33 tokens) min {min(steps):.1f} ms"
    )


if __name__ == "__main__":
    main()
