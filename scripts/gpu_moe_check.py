"""Check the fused MoE Triton kernels on the GPU at real layer shapes, then time them.

One MoE layer of Qwen3-30B-A3B (hidden 2048, 128 experts of intermediate 768, top 8) with
dummy bf16 weights, at decode batches 1, 64, 256 and a 4096-token prefill (and Mixtral-8x7B's
layer, 8 experts of 14336, top 2, at batches 1 and 256). Each case:
  - compares minfer.kernels.moe.fused_moe with the torch path (minfer.layers.moe.moe_reference,
    run in float32 on the same bf16 weights): PASS when the relative error norm < 1e-2;
  - checks the align kernel against its torch ops (decode sizes);
  - times (triton.testing.do_bench, median) the align step (kernel and torch ops), the gate_up GEMM, the down GEMM,
    the per-token sum, the whole fused_moe and the torch path;
  - sets the layer against its floor: bytes of the experts the batch actually chose (and the
    activations) over the H200's 4.26 TB/s copy ceiling, and 2 x rows x 3 x I x H FLOPs over
    its 790 TFLOP/s bf16 GEMM rate; the larger of the two is the floor.
With --sweep it also times a grid of block configs per case and prints the best as JSON for
minfer/kernels/moe_configs.json.

Run from the repository root on the GPU host (< 3 min without --sweep):
    PYTHONPATH=$PWD python3 scripts/gpu_moe_check.py [--sweep]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import sys
import types

import torch
import triton
import triton.testing
from triton.runtime.errors import OutOfResources

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]
if importlib.util.find_spec("msgspec") is None:
    # minfer/__init__.py needs msgspec (absent on the GPU host); the kernels and layers used
    # here need only torch and triton, so bind the package name without running __init__.
    package = types.ModuleType("minfer")
    package.__path__ = [os.path.join(ROOT, "minfer")]
    sys.modules["minfer"] = package

from minfer.kernels import moe  # noqa: E402
from minfer.layers.moe import moe_reference, select_experts  # noqa: E402

BANDWIDTH = 4.26e12  # H200 device-to-device copy, bytes/s (shared/gpu/README.md)
MATMUL_RATE = 790e12  # H200 bf16 GEMM, FLOP/s
DTYPE = torch.bfloat16
QWEN3_30B = dict(name="qwen3-30b-a3b", hidden=2048, inter=768, experts=128, top_k=8)
MIXTRAL = dict(name="mixtral-8x7b", hidden=4096, inter=14336, experts=8, top_k=2)
CASES = [(QWEN3_30B, t) for t in (1, 64, 256, 4096)] + [(MIXTRAL, t) for t in (1, 256)]


def make_layer(shape: dict, tokens: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    h, i, e = shape["hidden"], shape["inter"], shape["experts"]

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=gen, device="cuda") * scale).to(DTYPE)

    x = randn(tokens, h)
    gate_up = randn(e, 2 * i, h, scale=h**-0.5)
    down = randn(e, h, i, scale=i**-0.5)
    logits = torch.randn(tokens, e, generator=gen, device="cuda")
    weights, ids = select_experts(logits, shape["top_k"], renormalize=True)
    return x, gate_up, down, weights, ids


def ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50)


def floor_ms(shape: dict, tokens: int, ids: torch.Tensor) -> tuple[float, float]:
    """(bytes floor, FLOPs floor) in ms for one layer: the chosen experts' weights plus x, out."""
    h, i = shape["hidden"], shape["inter"]
    chosen = len(torch.unique(ids))
    nbytes = chosen * 3 * i * h * 2 + 2 * tokens * h * 2
    flops = 2 * ids.numel() * 3 * i * h
    return 1e3 * nbytes / BANDWIDTH, 1e3 * flops / MATMUL_RATE


def check(shape: dict, tokens: int) -> bool:
    x, gate_up, down, weights, ids = make_layer(shape, tokens)
    got = moe.fused_moe(x, gate_up, down, weights, ids).float()
    ref = moe_reference(x.float(), gate_up.float(), down.float(), weights, ids)
    err = ((got - ref).norm() / ref.norm()).item()
    ok = err < 1e-2
    rows, e = ids.numel(), shape["experts"]
    config = moe.config_for(rows, e)
    aligned = moe.align_to_experts(ids, e, config["BLOCK_M"])
    timed_layout = moe.one_row_blocks(ids) if config.get("one_row_blocks") else aligned
    act = torch.empty(rows, shape["inter"], dtype=DTYPE, device="cuda")
    out_rows = torch.empty(rows, shape["hidden"], dtype=DTYPE, device="cuda")
    flat_w = weights.reshape(-1).float()
    t_align = ms(lambda: moe.align_to_experts(ids, e, config["BLOCK_M"]))
    t_align_torch = ms(lambda: moe.align_to_experts_torch(ids, e, config["BLOCK_M"]))
    if rows <= moe.ALIGN_KERNEL_MAX_ROWS:  # the align kernel against its torch oracle
        want = moe.align_to_experts_torch(ids, e, config["BLOCK_M"])
        end = int(want[2])
        same = int(aligned[2]) == end and torch.equal(aligned[0][:end], want[0][:end])
        same = same and torch.equal(
            aligned[1][: end // config["BLOCK_M"]], want[1][: end // config["BLOCK_M"]]
        )
        ok = ok and same
        print(
            f"{'PASS' if same else 'FAIL'} {shape['name']} tokens={tokens}: align kernel equals the torch ops"
        )
    t_gate_up = ms(lambda: moe.grouped_gemm(x, gate_up, act, timed_layout, config, shape["top_k"], True))
    t_down = ms(lambda: moe.grouped_gemm(act, down, out_rows, timed_layout, config, 1, False, flat_w))
    t_sum = ms(lambda: out_rows.view(tokens, shape["top_k"], -1).sum(dim=1))
    t_fused = ms(lambda: moe.fused_moe(x, gate_up, down, weights, ids))
    t_torch = ms(lambda: moe_reference(x, gate_up, down, weights, ids))
    bytes_ms, flops_ms = floor_ms(shape, tokens, ids)
    floor = max(bytes_ms, flops_ms)
    phase = "decode" if rows / e <= moe.block_configs()["decode_max_rows_per_expert"] else "prefill"
    print(
        f"{'PASS' if ok else 'FAIL'} {shape['name']} tokens={tokens} ({phase} config {config}) "
        f"rel err {err:.2e}, experts hit {len(torch.unique(ids))}/{e}"
    )
    print(
        f"    align {1e3 * t_align:.1f} us (torch ops {1e3 * t_align_torch:.1f} us) | gate_up {1e3 * t_gate_up:.1f} us | down {1e3 * t_down:.1f} us "
        f"| sum {1e3 * t_sum:.1f} us | fused_moe {1e3 * t_fused:.1f} us | torch path {1e3 * t_torch:.1f} us"
    )
    print(
        f"    floor {1e3 * floor:.1f} us (bytes {1e3 * bytes_ms:.1f} us, FLOPs {1e3 * flops_ms:.1f} us): "
        f"fused_moe at {100 * floor / t_fused:.0f}% of it"
    )
    return ok


# 42 configs (narrow N tiles for decode: more programs reading the few chosen experts):
# about 2-3 minutes more for all cases (each compiles two kernel variants)
SWEEP = [
    dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
    for m, n, k, w, s in itertools.product((16, 32, 64), (64, 128), (64, 128), (4, 8), (3,))
] + [
    dict(BLOCK_M=16, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=4)
    for n, k, w in itertools.product((16, 32, 64, 128), (64, 128, 256), (4, 8))
]


def sweep(shape: dict, tokens: int) -> dict:
    x, gate_up, down, weights, ids = make_layer(shape, tokens)
    results = []
    for config in SWEEP:
        if config["BLOCK_M"] > 16 and tokens * shape["top_k"] / shape["experts"] <= 2:
            continue  # decode: one row per expert, bigger blocks are only padding
        try:
            results.append((ms(lambda c=config: moe.fused_moe(x, gate_up, down, weights, ids, c)), config))
        except OutOfResources:  # shared memory of the H200 exceeded: not a candidate
            continue
    best_ms, best = min(results, key=lambda r: r[0])
    print(f"sweep {shape['name']} tokens={tokens}: best {1e3 * best_ms:.1f} us {json.dumps(best)}")
    return best


def graph_us(shape: dict, tokens: int, config: dict, layers: int = 8, reps: int = 20) -> float:
    """us per layer of fused_moe(config) replayed in one CUDA graph over `layers` distinct
    layers (distinct weights and routing, as in a decode step: nothing stays in L2)."""
    made = [make_layer(shape, tokens, seed) for seed in range(layers)]
    outs = []

    def step():
        outs.clear()
        for x, gate_up, down, weights, ids in made:
            outs.append(moe.fused_moe(x, gate_up, down, weights, ids, config))

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return 1e3 * start.elapsed_time(end) / reps / layers


def sweep_one_row(shape: dict, tokens: int) -> dict:
    """The one-row-per-block layout's configs (BLOCK_M 16 rows of SWEEP), timed in a graph."""
    grid = [dict(c, one_row_blocks=True) for c in SWEEP if c["BLOCK_M"] == 16]
    timed = [(graph_us(shape, tokens, c, layers=4, reps=10), c) for c in grid]
    best_us, best = min(timed, key=lambda t: t[0])
    print(
        f"one-row sweep {shape['name']} tokens={tokens}: best {best_us:.1f} us {json.dumps(best)}", flush=True
    )
    return best


def graph_compare(shape: dict, tokens: int, sweep: bool) -> None:
    """Per layer inside a CUDA graph (launch gaps as in the engine): the aligned path, the
    table's choice, and with --sweep the best one-row-per-block config."""
    rows, e = tokens * shape["top_k"], shape["experts"]
    table = moe.block_configs()
    grouped = table["decode"] if rows / e <= table["decode_max_rows_per_expert"] else table["prefill"]
    chosen = moe.config_for(rows, e)
    x, gate_up, down, weights, ids = make_layer(shape, tokens)
    floor = floor_ms(shape, tokens, ids)[0] * 1e3
    line = f"graph {shape['name']} tokens={tokens}: floor {floor:.1f} us | aligned {graph_us(shape, tokens, grouped):.1f} us"
    line += f" | table ({'one row' if chosen.get('one_row_blocks') else 'aligned'}) {graph_us(shape, tokens, chosen):.1f} us"
    print(line, flush=True)
    if sweep:
        sweep_one_row(shape, tokens)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="time a grid of block configs per case")
    ap.add_argument("--graph-only", action="store_true", help="only the in-graph comparison (and its sweep)")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for shape, tokens in [(QWEN3_30B, 1), (QWEN3_30B, 4), (QWEN3_30B, 8), (MIXTRAL, 1)]:
        graph_compare(shape, tokens, args.sweep and tokens <= 4)
    if args.graph_only:
        return 0
    results = [check(shape, tokens) for shape, tokens in CASES]  # every case, even after a FAIL
    ok = all(results)
    if args.sweep:
        for shape, tokens in CASES:
            sweep(shape, tokens)
    print("ALL PASS" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
