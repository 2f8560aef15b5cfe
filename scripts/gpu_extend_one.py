"""One long-prompt chunk through the extend kernels, a few launches each, for a profiler:

    ncu --kernel-name regex:_extend_wgmma_kernel --launch-skip 2 --launch-count 1 \\
        --section WarpStateStats python3 scripts/gpu_extend_one.py

Llama-8B heads (32 q, 8 kv, 128 dims), an 8,192-token chunk over a 16,384-token prefix (pages of
16, shuffled), as chunked prefill runs the third chunk of a 32k prompt. The Triton kernel runs
first (`_extend_kernel`), then the Gluon one (`_extend_wgmma_kernel`), `--launches` times each.
"""

from __future__ import annotations

import argparse

import torch
import triton
from gpu_check import extend_problem

from minfer.kernels import attention_extend, attention_extend_wgmma
from minfer.kernels.attention_extend import extend_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=int, default=16384)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument(
        "--configs",
        nargs="*",
        default=[],
        help="also time the Gluon kernel in these CONFIGs, e.g. 128,64,5 (checked against Triton)",
    )
    opts = parser.parse_args()
    args, flop = extend_problem("llama-8b", [opts.prefix], [opts.chunk], 0)
    for wgmma in (False, True):
        attention_extend.WGMMA_LONG = wgmma
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        extend_attention(*args)
        start.record()
        for _ in range(opts.launches):
            extend_attention(*args)
        stop.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(stop) * 1e3 / opts.launches
        print(f"{'gluon' if wgmma else 'triton'}: {us:8.1f} us per launch, {flop / us / 1e6:6.1f} TFLOP/s")
        if not wgmma:
            expected = extend_attention(*args)
    default = attention_extend_wgmma.CONFIG
    for text in opts.configs:
        attention_extend_wgmma.CONFIG = tuple(int(x) for x in text.split(","))
        err = (extend_attention(*args).float() - expected.float()).abs().max().item()
        us = triton.testing.do_bench(lambda: extend_attention(*args), warmup=25, rep=100) * 1e3
        print(f"gluon {text}: {us:8.1f} us per launch, {flop / us / 1e6:6.1f} TFLOP/s, max |diff| {err:.2g}")
    attention_extend_wgmma.CONFIG = default


if __name__ == "__main__":
    main()
