"""Time minfer.kernels.gemv against the split-K GEMM and cuBLAS at decode shapes, on the GPU.

Two measurements, both replayed from CUDA graphs (what the engine's decode steps are):
1. One GEMM shape at a time: 64 calls in a graph, each on its own copy of the weights when one
   copy would fit the 60 MB L2 (a decode step reads every weight once, from DRAM). Prints
   us per call and the weight bytes over that time. `--sweep` adds gemv's BLOCK_N and warps.
2. A Qwen3-0.6B- and a Llama-3.1-8B-shaped layer chain without attention (28 and 8 layers in
   one graph): RMSNorm + residual, qkv, o_proj (on the qkv output's first features), RMSNorm +
   residual, gate_up, SiLU-and-multiply, down. Small GEMMs through gemm.linear, through gemv without
   programmatic dependent launch, with PDL releasing the gemv early, with every launch chained
   (MINFER_PDL's default at <= 2 rows), and with each of the two norms and the SiLU folded into
   gemv's prologues, one at a time, both norms, and all three, and with the SiLU as gate_up's
   epilogue instead (gemv.gate_up_gemv); the variant the engine picks is marked.
   Prints us per layer and checks every variant's output against the first.

Run from the repository root on the GPU host:
    PYTHONPATH=$PWD python3 scripts/gpu_gemv.py [--sweep] [--rows 1,2,4] [--chains-only]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import types

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]
if importlib.util.find_spec("msgspec") is None:  # as scripts/gpu_check.py: kernels need torch only
    package = types.ModuleType("minfer")
    package.__path__ = [os.path.join(ROOT, "minfer")]
    sys.modules["minfer"] = package

from minfer.kernels import common, gemm, gemv, pdl  # noqa: E402
from minfer.kernels.activation import silu_and_mul  # noqa: E402
from minfer.kernels.norm import rmsnorm  # noqa: E402

DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16
COPY_CEILING = 4.26e12
L2_BYTES = 60 << 20
SHAPES = {  # (N, K) of y = x @ w.T
    "qwen3-0.6b qkv": (4096, 1024),
    "qwen3-0.6b o_proj": (1024, 2048),
    "qwen3-0.6b gate_up": (6144, 1024),
    "qwen3-0.6b down": (1024, 3072),
    "llama-8b qkv": (6144, 4096),
    "llama-8b o_proj": (4096, 4096),
    "llama-8b gate_up": (28672, 4096),
    "llama-8b down": (4096, 14336),
}


def set_pdl(mode: str) -> None:
    """MINFER_PDL's mode (minfer.kernels.common): "0", "release", "1" (chains <= 2 rows), "chain"."""
    os.environ["MINFER_PDL"] = mode
    pdl.reset_pdl_choice()


def graph_us(fn, calls: int, replays: int = 20) -> float:
    """Microseconds per call of fn(i) for i < calls, replayed from one CUDA graph."""
    for i in range(calls):  # compile outside the capture
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (replays * calls))
    return best


def shape_table(rows_list: list[int], sweep: bool) -> None:
    print("\n== one GEMM shape, 64 calls per graph (us per call, weight TB/s) ==", flush=True)
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(1, min(64, -(-2 * L2_BYTES // nbytes)))
        weights = [torch.randn((n, k), device=DEVICE, dtype=DTYPE) for _ in range(copies)]
        for m in rows_list:
            x = torch.randn((m, k), device=DEVICE, dtype=DTYPE)
            ref = F.linear(x.float(), weights[0].float())
            variants = {
                "cublas": lambda i: F.linear(x, weights[i % copies]),
                "splitk": lambda i: gemm.linear(x, weights[i % copies]),
            }

            def gemv_with_pdl(on: bool):
                def call(i):
                    set_pdl(
                        "1" if on else "0"
                    )  # also while the graph is captured: the launch takes the attribute or not
                    return gemv.gemv(x, weights[i % copies])

                return call

            variants["gemv pdl=0"], variants["gemv pdl=1"] = gemv_with_pdl(False), gemv_with_pdl(True)
            configs = [gemv.choose_config(n, k, common.num_sms(DEVICE))]
            if sweep:
                bn, bk, _ = configs[0]
                configs += [
                    (b, bk, w) for b in (bn // 2, bn, bn * 2) for w in (4, 8) if b >= 1 and b * bk <= 32768
                ]
            for config in configs[1:]:
                variants[f"gemv {config}"] = (
                    lambda c: lambda i: gemv.gemv(x, weights[i % copies], config=c)
                )(config)
            cells = []
            for label, fn in variants.items():
                set_pdl("1")
                out = fn(0)
                err = (out.float() - ref).abs().max().item() / max(1.0, ref.abs().max().item())
                us = graph_us(fn, 64)
                cells.append(f"{label} {us:6.2f} us {nbytes / us / 1e6:5.2f} TB/s (err {err:.1e})")
            set_pdl("1")
            print(f"{name:20s} M={m}: " + " | ".join(cells), flush=True)


# (hidden, intermediate, qkv width, attention output width, layers in the graph): every layer's
# weights are its own, so they come from DRAM as in a decode step (8 of Llama's 32 layers: 3.5 GB)
CHAINS = {
    "qwen3-0.6b": (1024, 3072, 4096, 2048, 28),
    "qwen3-1.7b": (2048, 6144, 4096, 2048, 28),
    "llama-8b": (4096, 14336, 6144, 4096, 8),
}
# Which of a layer's three prologues fold (qkv's norm, gate_up's norm, down's SiLU) and whether
# the SiLU is gate_up's epilogue instead (gemv.gate_up_gemv), by name.
FOLDS = {
    "chain": (False, False, False, False),
    "chain, qkv norm folded": (True, False, False, False),
    "chain, gate_up norm folded": (False, True, False, False),
    "chain, silu folded": (False, False, True, False),
    "chain, both norms folded": (True, True, False, False),
    "chain, all folded": (True, True, True, False),
    "chain, silu epilogue": (False, False, False, True),
    "chain, both norms folded, silu epilogue": (True, True, False, True),
}


def layer_chain(model: str, m: int) -> None:
    hidden, inter, qkv_width, attn_width, layers = CHAINS[model]
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def weight(*shape):
        return (torch.randn(shape, generator=gen, device=DEVICE) * shape[-1] ** -0.5).to(DTYPE)

    params = [
        dict(
            n1=weight(hidden) + 1,
            qkv=weight(qkv_width, hidden),
            o=weight(hidden, attn_width),
            n2=weight(hidden) + 1,
            gate_up=weight(2 * inter, hidden),
            down=weight(hidden, inter),
        )
        for _ in range(layers)
    ]
    x0 = torch.randn((m, hidden), generator=gen, device=DEVICE).to(DTYPE)

    def auto(x, w):  # the engine's choice (minfer.layers.linear.linear)
        return gemv.gemv(x, w) if gemv.suits(x.shape[0], w) else gemm.linear(x, w)

    def separate(lin):
        def run():
            h, res = x0, torch.zeros_like(x0)
            for p in params:
                h, res = rmsnorm(h, p["n1"], 1e-6, res)
                qkv = lin(h, p["qkv"])
                h = lin(qkv[:, :attn_width], p["o"])
                h, res = rmsnorm(h, p["n2"], 1e-6, res)
                h = lin(silu_and_mul(lin(h, p["gate_up"])), p["down"])
            return h + res

        return run

    def folded(fold_qkv: bool, fold_gate_up: bool, fold_silu: bool, epilogue: bool):
        """Each chosen norm or SiLU in the gemv prologue after it (MINFER_GEMV_PROLOGUE), or the
        SiLU in gate_up's epilogue (MINFER_GEMV_EPILOGUE)."""

        def normed(h, res, w, norm_w, fold):
            if fold:
                return gemv.normed_gemv(h, w, norm_w, 1e-6, res)
            h, res = rmsnorm(h, norm_w, 1e-6, res)
            return auto(h, w), res

        def run():
            h, res = x0, torch.zeros_like(x0)
            for p in params:
                qkv, res = normed(h, res, p["qkv"], p["n1"], fold_qkv)
                h = auto(qkv[:, :attn_width], p["o"])
                if epilogue:
                    if not fold_gate_up:
                        h, res = rmsnorm(h, p["n2"], 1e-6, res)
                        h = gemv.gate_up_gemv(h, p["gate_up"])[0]
                    else:
                        h, res = gemv.gate_up_gemv(h, p["gate_up"], p["n2"], 1e-6, res)
                    h = auto(h, p["down"])
                    continue
                gate_up, res = normed(h, res, p["gate_up"], p["n2"], fold_gate_up)
                h = (
                    gemv.gated_gemv(gate_up, p["down"])
                    if fold_silu
                    else auto(silu_and_mul(gate_up), p["down"])
                )
            return h + res

        return run

    p0 = params[0]
    # The engine's choice (minfer.layers.linear): the norms where gemv.prologue_pays, the SiLU as
    # gate_up's epilogue where gemv takes gate_up, else in down's prologue where that pays.
    epilogue = gemv.suits(m, p0["gate_up"])
    rule = (
        gemv.prologue_pays(m, p0["qkv"], False),
        gemv.prologue_pays(m, p0["gate_up"], False),
        not epilogue and gemv.prologue_pays(m, p0["down"], True),
        epilogue,
    )
    variants = [("splitk", "0", separate(gemm.linear))]
    if m <= gemv.MAX_ROWS:
        variants += [("gemv", "0", separate(auto)), ("gemv+release", "release", separate(auto))]
        for label, (fq, fg, fs, fe) in FOLDS.items():
            fold = (
                fq and gemv.suits(m, p0["qkv"]),
                fg and gemv.suits(m, p0["gate_up"]),
                fs and gemv.suits(m, p0["down"]),
                fe and epilogue,
            )
            if label == "chain" or any(fold) and (fold[3] or not fe):
                variants.append((label + (" [the engine]" if fold == rule else ""), "1", folded(*fold)))
    outputs, cells = [], []
    for label, mode, run in variants:
        set_pdl(mode)
        outputs.append(run().float())
        us = graph_us(lambda i: run(), 1, replays=50) / layers
        diff = (outputs[-1] - outputs[0]).abs().max().item() / outputs[0].abs().max().item()
        cells.append(f"{label} {us:6.2f} us/layer (max rel diff {diff:.1e})")
    set_pdl("1")
    print(f"{model} layer chain M={m}, engine folds (qkv, gate_up, silu, epilogue) = {rule}:", flush=True)
    for cell in cells:
        print("    " + cell, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time gemv's BLOCK_N and warps")
    parser.add_argument("--rows", default="1,2,4", help="row counts (comma-separated, <= gemv.MAX_ROWS)")
    parser.add_argument("--chains-only", action="store_true", help="only the layer chains (measurement 2)")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    for model in CHAINS:
        for m in rows_list:
            layer_chain(model, m)
    if not args.chains_only:
        shape_table(rows_list, args.sweep)


if __name__ == "__main__":
    main()
