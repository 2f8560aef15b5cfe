"""The extend kernel's short configuration (packed prompts of a few hundred tokens, the offline
workload's prefill chunks) by tile shape, stages and register cap, over bf16 and fp8 pools (H200).

    PYTHONPATH=$PWD python3 scripts/gpu_extend_short.py

Why: compiled for sm_90 (scripts/kernel_registers.py), the default 64 x 64 tiles take 176-182
registers and fit two programs per SM, while 64 x 32 tiles fit three, or four with a cap of
128; which of these the kernel is bound by (programs, tile efficiency, spills) only timing
says. Every configuration's output is checked against the default's.
"""

from __future__ import annotations

import os
import random
import sys

import torch
import triton.testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__)), os.path.join(ROOT, "tests", "kernels")]

from gpu_decode_layout import both_pools  # noqa: E402
from kernel_cases import make_paged_batch  # noqa: E402

from minfer.kernels import attention_extend as ae  # noqa: E402

DEVICE, DTYPE = torch.device("cuda"), torch.bfloat16
CONFIGS = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 2), (64, 32, 4, 3), (64, 32, 4, 5), (32, 64, 4, 2)]
CAPS = (None, 168, 128)


def packed_prompts(total: int = 8192, seed: int = 0) -> list[int]:
    """Prompt lengths of the benchmark (100-1024 tokens) packed into one prefill chunk."""
    rng, lens = random.Random(seed), []
    while sum(lens) < total:
        lens.append(min(rng.randint(100, 1024), total - sum(lens)))
    return lens


def problems():
    """(label, q, {pool: (k, v, scale kwargs)}, index args, FLOPs) per shape."""
    for label, heads, kv_heads, prefix, extend in (
        ("qwen3-0.6b 8192 packed", 16, 8, None, packed_prompts()),
        ("llama-3.1-8b 4 x (1024 + 1024)", 32, 8, [1024] * 4, [1024] * 4),
    ):
        prefix = prefix or [0] * len(extend)
        batch = make_paged_batch(
            prefix, extend, kv_heads, 128, 1, DTYPE, DEVICE, torch.Generator().manual_seed(0)
        )
        q = torch.randn((sum(extend), heads, 128), device=DEVICE, dtype=DTYPE)
        pools = both_pools(batch)
        index = (batch.page_table, batch.table_idx, batch.prefix_lens, batch.seq_lens, batch.cu_extend_lens)
        flop = sum(4 * n * (p + (n + 1) / 2) * heads * 128 for p, n in zip(prefix, extend))
        yield label, q, pools, (*index, max(extend), 128**-0.5), flop


def main() -> None:
    default = dict(ae.SHORT_CONFIGS)
    for label, q, pools, args, flop in problems():
        for name, (k_pool, v_pool, scales) in pools.items():
            print(f"== {label}, {name} pool", flush=True)
            ae.SHORT_CONFIGS = dict(default)
            expected = ae.extend_attention(q, k_pool, v_pool, *args, **scales)
            for config in CONFIGS:
                for cap in CAPS:
                    ae.SHORT_CONFIGS[name] = (*config, cap)
                    run = lambda: ae.extend_attention(q, k_pool, v_pool, *args, **scales)  # noqa: E731
                    try:
                        err = (run().float() - expected.float()).abs().max().item()
                        us = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median") * 1e3
                    except Exception as exc:  # out of shared memory or registers
                        print(f"  {config} cap {cap}: {type(exc).__name__}", flush=True)
                        continue
                    mark = "  <- default" if (*config, cap) == default[name] else ""
                    bad = "  MISMATCH" if err > 2e-2 else ""
                    print(
                        f"  {config} cap {str(cap):4s}: {us:7.1f} us {flop / us / 1e6:6.1f} TFLOP/s "
                        f"(max diff {err:.1e}){bad}{mark}",
                        flush=True,
                    )
            ae.SHORT_CONFIGS = dict(default)
        del pools
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
