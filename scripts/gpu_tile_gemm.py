"""Decode GEMMs at 48-256 rows chained with programmatic dependent launch, against cuBLAS (GPU).

At 48-256 running requests a Qwen3-0.6B decode step spends ~0.8 ms in its 112 GEMMs against
~0.3 ms of FLOPs and bytes (docs/PERFORMANCE.md): each pays ~4 us of fixed cost, and cuBLAS
cannot join the step's PDL chain (start early, ask L2 for its weights, wait for x). This script
measures whether Triton GEMMs that do join it win there, in two ways, both replayed from CUDA
graphs:
1. One shape at a time: 64 calls per graph, each on its own copy of the weights (as in a decode
   step, they come from DRAM), chained call after call; cuBLAS unchained. Tiles of two kinds:
   minfer.kernels.gemm's pointer loads, and a kernel of this script whose tiles arrive by TMA
   (tensor descriptors). Both split K with the same last-arrival sum.
2. Qwen3-0.6B's layer chain without attention (28 layers: RMSNorm + residual, qkv, o_proj,
   RMSNorm + residual, gate_up, SiLU-and-multiply, down) with cuBLAS (the engine today: norms
   release, cuBLAS launches unchained) against every launch chained with each shape's best tile.

Run from the repository root on the GPU host:
    PYTHONPATH=$PWD python3 scripts/gpu_tile_gemm.py [--rows 64,128,256] [--quick]
Locally (tiny shapes under the interpreter, outputs against torch only):
    TRITON_INTERPRET=1 python3 scripts/gpu_tile_gemm.py --check
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_gemv import graph_us, set_pdl  # noqa: E402  (also makes minfer's kernels importable)

from minfer.kernels import common, gemm, pdl  # noqa: E402
from minfer.kernels.activation import silu_and_mul  # noqa: E402
from minfer.kernels.gemm import prefetch_weight_slice, store_tile  # noqa: E402
from minfer.kernels.norm import rmsnorm  # noqa: E402
from minfer.kernels.pdl import pdl_start  # noqa: E402

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None

SHAPES = {  # (N, K) of y = x @ w.T, Qwen3-0.6B
    "qkv": (4096, 1024),
    "o_proj": (1024, 2048),
    "gate_up": (6144, 1024),
    "down": (1024, 3072),
}
L2_BYTES = 60 << 20


@triton.jit
def _tma_gemm_kernel(
    x_desc,
    w_desc,
    w_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    M,
    N,
    K,
    stride_wn,
    stride_om,
    k_per_split,
    num_splits,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL_RELEASE: tl.constexpr,
    PDL_WAIT: tl.constexpr,
    SLICE_LINES: tl.constexpr,
    LINE_ELEMENTS: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if PDL_WAIT:  # launched early: ask L2 for this program's weight slice while the kernel before runs
        prefetch_weight_slice(w_ptr, stride_wn, offs_n, n_mask, k_start, k_end, SLICE_LINES, LINE_ELEMENTS)
    pdl_start(PDL_RELEASE, PDL_WAIT)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in tl.range(k_start, k_end, BLOCK_K):
        x = x_desc.load([off_m, k])  # rows past M and columns past K arrive as zeros
        w = w_desc.load([off_n, k])
        acc = tl.dot(x, w.T, acc)
    # no bias: the engine's decode GEMMs here have none
    store_tile(
        acc,
        out_ptr,
        out_ptr,
        partial_ptr,
        counter_ptr,
        offs_m,
        offs_n,
        M,
        N,
        stride_om,
        split,
        num_splits,
        SPLIT,
        False,
    )


_DESCRIPTORS: dict = {}


def tma_linear(
    x: torch.Tensor, weight: torch.Tensor, config: tuple[int, int, int, int, int, int]
) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T through _tma_gemm_kernel with config (BM, BN, BK, splits, warps, stages)."""
    block_m, block_n, block_k, split_k, warps, stages = config
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    k_per_split, split_k, partials, counters, prefetch = gemm.split_workspace(out, weight, block_k, split_k)
    # descriptors are cached per (tensor, block): a graph replays the parameters it captured
    key = (x.data_ptr(), x.shape, x.stride(), weight.data_ptr(), block_m, block_n, block_k)
    if key not in _DESCRIPTORS:
        _DESCRIPTORS[key] = (
            TensorDescriptor(x, list(x.shape), list(x.stride()), [block_m, block_k]),
            TensorDescriptor(weight, list(weight.shape), list(weight.stride()), [block_n, block_k]),
        )
    x_desc, w_desc = _DESCRIPTORS[key]
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split_k)
    _tma_gemm_kernel[grid](
        x_desc,
        w_desc,
        weight,
        out,
        partials,
        counters,
        m,
        n,
        k,
        weight.stride(0),
        out.stride(0),
        k_per_split,
        split_k,
        SPLIT=split_k > 1,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        **prefetch,
        num_warps=warps,
        num_stages=stages,
        **pdl.pdl_args(x.device, m),
    )
    return out


def configs_for(m: int, n: int, k: int, quick: bool) -> list[tuple[int, int, int, int, int, int]]:
    """Tensor-core tiles (BM, BN, BK, splits, warps, stages) for an [m, k] x [k, n] product: the
    split count fills about one or two programs per SM over the output tiles."""
    sms = common.num_sms(torch.device("cuda"))
    out = []
    for bm in (64, 128):
        if bm > 64 and m <= 64:
            continue
        for bn in (64, 128):
            tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
            for bk in (64, 128):
                splits = {
                    1,
                    max(1, min(sms // tiles, k // (2 * bk))),
                    max(1, min(2 * sms // tiles, k // (2 * bk))),
                }
                for s in sorted(splits):
                    for warps in (4, 8):
                        if bm == 128 and warps == 4 and bn == 128:
                            continue
                        for stages in (3, 4) if not quick else (3,):
                            if (bm + bn) * bk * 2 * stages > 200_000:
                                continue
                            out.append((bm, bn, bk, s, warps, stages))
    return out


def shape_table(rows: list[int], quick: bool) -> dict:
    """Per shape and row count: us per call of cuBLAS and the best chained tiles of each kind."""
    best = {}
    device = torch.device("cuda")
    for name, (n, k) in SHAPES.items():
        copies = max(1, min(64, -(-2 * L2_BYTES // (n * k * 2))))
        weights = [torch.randn((n, k), device=device, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        for m in rows:
            x = torch.randn((m, k), device=device, dtype=torch.bfloat16)
            ref = F.linear(x.float(), weights[0].float())
            set_pdl("1")
            cublas = graph_us(lambda i: F.linear(x, weights[i % copies]), 64)
            results = []
            set_pdl("chain")
            for kind, fn in (
                ("ptr", lambda c: lambda i: gemm.linear(x, weights[i % copies], config=c)),
                ("tma", lambda c: lambda i: tma_linear(x, weights[i % copies], c)),
            ):
                for config in configs_for(m, n, k, quick):
                    call = fn(config)
                    try:
                        err = (call(0).float() - ref).abs().max().item()
                        us = graph_us(call, 64)
                    except Exception as exc:  # a config that does not compile (shared memory)
                        print(f"  {name} M={m} {kind} {config}: {type(exc).__name__}", flush=True)
                        continue
                    if err > 0.05:
                        raise AssertionError(f"{name} M={m} {kind} {config}: max error {err}")
                    results.append((us, kind, config))
            set_pdl("1")
            results.sort()
            for kind in ("ptr", "tma"):
                best[(name, m, kind)] = next(r for r in results if r[1] == kind)
            top = " | ".join(f"{kind} {c} {us:.2f}" for us, kind, c in results[:4])
            print(f"{name:8s} M={m:3d}: cuBLAS {cublas:6.2f} us | best chained: {top}", flush=True)
    return best


def layer_chain(m: int, best: dict, kind: str, layers: int = 28) -> None:
    hidden, inter, qkv_width, attn_width = 1024, 3072, 4096, 2048
    gen = torch.Generator(device="cuda").manual_seed(0)

    def weight(*shape):
        return (torch.randn(shape, generator=gen, device="cuda") * shape[-1] ** -0.5).to(torch.bfloat16)

    params = [
        dict(
            n1=weight(hidden) + 1,
            qkv=weight(qkv_width, hidden),
            o_proj=weight(hidden, attn_width),
            n2=weight(hidden) + 1,
            gate_up=weight(2 * inter, hidden),
            down=weight(hidden, inter),
        )
        for _ in range(layers)
    ]
    x0 = torch.randn((m, hidden), generator=gen, device="cuda").to(torch.bfloat16)

    def tiled(x, p, name):
        config = best[(name, m, kind)][2]
        x = x.contiguous() if kind == "tma" else x
        return tma_linear(x, p[name], config) if kind == "tma" else gemm.linear(x, p[name], config=config)

    def run(lin):
        h, res = x0, torch.zeros_like(x0)
        for p in params:
            h, res = rmsnorm(h, p["n1"], 1e-6, res)
            qkv = lin(h, p, "qkv")
            h = lin(qkv[:, :attn_width], p, "o_proj")
            h, res = rmsnorm(h, p["n2"], 1e-6, res)
            h = lin(silu_and_mul(lin(h, p, "gate_up")), p, "down")
        return h + res

    set_pdl("1")
    ref = run(lambda x, p, name: F.linear(x, p[name])).float()
    cublas = graph_us(lambda i: run(lambda x, p, name: F.linear(x, p[name])), 1, replays=50) / layers
    set_pdl("chain")
    out = run(tiled).float()
    chained = graph_us(lambda i: run(tiled), 1, replays=50) / layers
    set_pdl("1")
    diff = (out - ref).abs().max().item() / ref.abs().max().item()
    print(
        f"layer chain M={m}: cuBLAS {cublas:.2f} us/layer, {kind} tiles chained {chained:.2f} "
        f"(max rel diff {diff:.1e})",
        flush=True,
    )


def check() -> None:
    """Interpreter check of the TMA kernel's arithmetic and split sums on tiny shapes."""
    torch.manual_seed(0)
    for m, n, k, config in ((5, 48, 64, (16, 16, 16, 1, 4, 1)), (20, 32, 96, (16, 16, 16, 3, 4, 1))):
        x = torch.randn(m, k, dtype=torch.float32)
        w = torch.randn(n, k, dtype=torch.float32)
        out = tma_linear(x, w, config)
        torch.testing.assert_close(out, x @ w.T, atol=1e-3, rtol=1e-3)
    print("tma_linear matches torch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="64,128,256")
    parser.add_argument("--quick", action="store_true", help="three stages only")
    parser.add_argument("--check", action="store_true", help="interpreter check of the TMA kernel")
    args = parser.parse_args()
    if args.check:
        check()
        return
    rows = [int(r) for r in args.rows.split(",")]
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    best = shape_table(rows, args.quick)
    for m in rows:
        for kind in ("ptr", "tma"):
            layer_chain(m, best, kind)


if __name__ == "__main__":
    main()
