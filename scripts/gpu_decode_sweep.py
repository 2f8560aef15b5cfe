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

import torch
import triton.testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "kernels")]

from kernel_cases import make_paged_batch  # noqa: E402

from minfer.kernels import attention_decode as ad  # noqa: E402
from minfer.kvcache.pool import FP8_MAX, quantize_fp8  # noqa: E402

DEVICE, DTYPE = torch.device("cuda"), torch.bfloat16
HEADS = (16, 8, 128)  # qwen3-0.6b: q heads, kv heads, head dim
CASES = {
    "B=256 ctx~1024": (256, 512, 1536),
    "B=64 ctx~1024": (64, 512, 1536),
    "B=16 ctx~1024": (16, 512, 1536),
}


def main() -> None:
    rng = random.Random(0)
    num_heads, num_kv_heads, head_dim = HEADS
    for label, (batch_size, lo, hi) in CASES.items():
        seq_lens = [rng.randint(lo, hi) for _ in range(batch_size)]
        batch = make_paged_batch(
            [s - 1 for s in seq_lens],
            [1] * batch_size,
            num_kv_heads,
            head_dim,
            1,
            DTYPE,
            DEVICE,
            torch.Generator().manual_seed(1),
            4096,
        )
        q = torch.randn((batch_size, num_heads, head_dim), device=DEVICE, dtype=DTYPE)
        k_scale = batch.k_pool.float().abs().amax(dim=(0, 2)) / FP8_MAX
        v_scale = batch.v_pool.float().abs().amax(dim=(0, 2)) / FP8_MAX
        pools = {
            "bf16": (batch.k_pool, batch.v_pool, {}),
            "fp8": (
                quantize_fp8(batch.k_pool, k_scale),
                quantize_fp8(batch.v_pool, v_scale),
                {"k_scale": k_scale, "v_scale": v_scale},
            ),
        }
        common = (batch.page_table, batch.table_idx, batch.seq_lens, head_dim**-0.5)
        kv_bytes = sum(seq_lens) * num_kv_heads * head_dim * 2
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
                    f"({kv_bytes * width / t / 1e6:4.2f} TB/s)"
                )
            print(f"{label:16s} {name:5s} default {defaults}: {base[0]:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
