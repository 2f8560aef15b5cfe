"""Sweep the decode attention kernel's launch constants for a bf16 and an fp8 KV pool (H200).

Timed eagerly (do_bench): below ~60 us per call that measures the launch, not the kernel; the
CUDA-graph timings of scripts/gpu_decode_layout.py are the ones to trust at small batches.

    PYTHONPATH=$PWD python3 scripts/gpu_decode_sweep.py

The kernel gathers K/V row by row through the page table (page size 1: every key its own
row), so what bounds it is the number of row loads in flight, not only their bytes: an fp8 row
is half a bf16 row, and with the same BLOCK_N / stages the fp8 kernel keeps half the bytes in
flight. This times BLOCK_N x num_stages x num_warps at the benchmark's shapes for both dtypes
and prints each dtype's best, to choose the fp8 kernel's constants.
"""

from __future__ import annotations

import itertools
import os
import random
import sys

import triton.testing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_decode_layout import build  # noqa: E402  (the same cases, qwen3-0.6b heads)

from minfer.kernels import attention_decode as ad  # noqa: E402

CASES = {
    "B=256 ctx~1024": (256, 512, 1536),
    "B=64 ctx~1024": (64, 512, 1536),
    "B=16 ctx~1024": (16, 512, 1536),
}


def main() -> None:
    rng = random.Random(0)
    for label, (batch_size, lo, hi) in CASES.items():
        seq_lens = [rng.randint(lo, hi) for _ in range(batch_size)]
        q, pools, common, values = build("qwen3-0.6b", seq_lens, 1)
        defaults = (ad.BLOCK_N, ad.NUM_STAGES, ad.NUM_WARPS)
        for name, (k_pool, v_pool, scales) in pools.items():
            width = 2 if name == "bf16" else 1
            results = []
            for block_n, stages, warps in itertools.product((64, 128, 256), (2, 3, 4), (4, 8)):
                ad.BLOCK_N, ad.NUM_STAGES, ad.NUM_WARPS = block_n, stages, warps
                try:
                    t = triton.testing.do_bench(
                        lambda: ad.decode_attention(q, k_pool, v_pool, *common, **scales),
                        warmup=10,
                        rep=40,
                        return_mode="median",
                    )
                except Exception as exc:  # out of shared memory / registers for this config
                    print(
                        f"  {label} {name} BLOCK_N={block_n} stages={stages} warps={warps}: {type(exc).__name__}"
                    )
                    continue
                results.append((t * 1e3, block_n, stages, warps))
            ad.BLOCK_N, ad.NUM_STAGES, ad.NUM_WARPS = defaults
            results.sort()
            base = next(r for r in results if r[1:] == defaults)
            for t, block_n, stages, warps in results[:3]:
                print(
                    f"{label:16s} {name:5s} BLOCK_N={block_n:3d} stages={stages} warps={warps}: {t:7.1f} us "
                    f"({values * width / t / 1e6:4.2f} TB/s)"
                )
            print(f"{label:16s} {name:5s} default {defaults}: {base[0]:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
