"""A/B of --quantization's CPU paths in process CPU time (robust to other jobs on the cores).

One thread, the default model, random 256-token prompts, no prefix cache: prefill = a 1-token
generation, decode step = (33-token generation - prefill) / 32; min and median of 5. Toggle the
paths with MINFER_LOW_BIT_DENSE=float32 (float32 dense matrices for many-row steps) and
MINFER_LOW_BIT_HEAD=float32 (the float32 LM head); run the variants back to back:
    PYTHONPATH=$PWD taskset -c 1 python3 scripts/cpu_quant_ab.py gguf [batch]
"""

from __future__ import annotations

import random
import sys
import time

import torch

from minfer import LLM, SamplingParams


def main() -> None:
    method = sys.argv[1] if len(sys.argv) > 1 else "gguf"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    torch.set_num_threads(1)
    llm = LLM(quantization=method, cpu_threads=1, kv_cache_tokens=32768, cache="naive")
    rng = random.Random(0)

    def prompts() -> list[list[int]]:
        return [[rng.randrange(100, 40000) for _ in range(256)] for _ in range(batch)]

    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    longer = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)
    llm.generate_ids(prompts(), longer, False)  # warm-up
    prefill, decode = [], []
    for _ in range(5):
        start = time.process_time()
        llm.generate_ids(prompts(), first, False)
        prefill.append(time.process_time() - start)
        start = time.process_time()
        llm.generate_ids(prompts(), longer, False)
        decode.append((time.process_time() - start - prefill[-1]) / 32)
    llm.shutdown()
    print(
        f"{method} batch {batch}: prefill 256x{batch} min {min(prefill) * 1e3:.0f} ms "
        f"(median {sorted(prefill)[2] * 1e3:.0f}); decode step min {min(decode) * 1e3:.1f} ms "
        f"(median {sorted(decode)[2] * 1e3:.1f}) [process CPU time]"
    )


if __name__ == "__main__":
    main()
