"""Registers, spills and shared memory of the attention kernels (and of gemv, with its
prologues), compiled for an H200 (sm_90) on a machine without a GPU, and how many programs of
each then fit on one SM. The Gluon long-extend kernel is compiled the same way (its registers
are the launch's limit; setmaxnreg moves them between its partitions at run time).

    python3 scripts/kernel_registers.py                 # decode and extend, uncapped
    python3 scripts/kernel_registers.py --caps 168 128  # also with those register caps (maxnreg)
    python3 scripts/kernel_registers.py --gemv          # gemv at the decode shapes instead
    python3 scripts/kernel_registers.py --sampler --ops sampler  # the sampler's logarithms
    python3 scripts/kernel_registers.py --ops "long"    # and the SASS instruction mix of those

Why: on the GPU, whether a launch fits 2 or 3 programs per SM decided the fp8 decode kernel's
speed (docs/BENCHMARKS.md, eighth session), and that is fixed at compile time. ptxas ships with
Triton, so the count can be read here, for free, before spending device time on a candidate.

The figures depend on the Triton version: run this with the GPU host's Triton (3.6 on the
H200 host, ../shared/gpu/README.md), e.g. in a venv with `pip install triton==3.6.0
torch==2.13.0 numpy msgspec`. With 3.6 it reproduced what the device reported for the decode
kernel (bf16 128 registers / 39,168 B shared, fp8 200 / 41,472; ncu and Triton's n_regs).
Triton 3.9 compiles the same source to other counts (fp8 255 registers with spills).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import itertools
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from minfer.kernels import (  # noqa: E402
    attention_decode,
    attention_extend,
    attention_extend_wgmma,
    decode_split_kernel,
    gemv,
    sampling,
)

H200 = GPUTarget("cuda", 90, 32)
REGISTERS_PER_SM = 65536
SHARED_PER_SM = 233472  # 228 KiB; each program also takes 1 KiB of it for the driver
INDEX_ARGS = (
    "page_table_ptr",
    "table_idx_ptr",
    "seq_lens_ptr",
    "prefix_lens_ptr",
    "cu_extend_lens_ptr",
    "positions_ptr",
    "out_loc_ptr",
    "tiles_ptr",
)


# The sampler's arguments that the attention kernels' naming would get wrong
SAMPLER_ARGS = {
    "logits_ptr": "*fp32",
    "temperature_ptr": "*fp32",
    "seeds_ptr": "*i64",
    "positions_ptr": "*i64",
    "best_val_ptr": "*fp32",
    "best_idx_ptr": "*i32",
}


def arg_type(name: str, pool: str) -> str:
    """Triton's type string for a kernel argument, from the naming the attention kernels use."""
    if pool == "fp32" and name in SAMPLER_ARGS:
        return SAMPLER_ARGS[name]
    if name in ("k_ptr", "v_ptr"):
        return "*" + pool
    if name in ("k_desc", "v_desc"):  # the Gluon kernel's TMA descriptors over the pools
        box = attention_extend_wgmma.CONFIG[1], 128
        return f"tensordesc<{pool}[{box[0]}, {box[1]}],{attention_extend_wgmma.TILE.value!r}>"
    if name.endswith("scale_ptr") or name in ("part_out_ptr", "part_lse_ptr"):
        return "*fp32"
    if name in INDEX_ARGS:
        return "*i32"
    if name.endswith("_ptr"):
        return "*bf16"  # the model's dtype
    if name in ("eps", "sm_scale_log2"):  # (gemv's pointers are all the model's dtype too)
        return "fp32"
    return "i32"


def compile_for_h200(kernel, pool: str, constexprs: dict, num_warps: int, num_stages: int, cap: int | None):
    """(registers, spill stack bytes, shared bytes, the SASS, warps a program runs: a Gluon
    kernel's worker partitions add theirs to num_warps). Pointers and strides are marked
    divisible by 16, as Triton's launcher specializes them on the device (pool strides are
    multiples of the head dim); without that the loads are not pipelined and the counts are
    another kernel's."""
    names = list(inspect.signature(kernel.fn).parameters)
    signature = {n: "constexpr" if n in constexprs else arg_type(n, pool) for n in names}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if n not in constexprs
        and (signature[n].startswith("*") or (n.startswith("stride") and n != "stride_page_row"))
    }
    source = (GluonASTSource if isinstance(kernel, GluonJITFunction) else ASTSource)(
        kernel, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs
    )
    options = dict(num_warps=num_warps, num_stages=num_stages, **({"maxnreg": cap} if cap else {}))
    compiled = triton.compile(source, target=H200, options=options)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run(
            [tool, "--dump-resource-usage", cubin.name], capture_output=True, text=True
        ).stdout
        sass = subprocess.run([tool, "-sass", cubin.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+)\s+STACK:(\d+)", usage)
    return (
        int(found.group(1)),
        int(found.group(2)),
        compiled.metadata.shared,
        sass,
        compiled.metadata.num_warps,
    )


# Instruction classes worth counting in an attention or GEMM kernel: tensor-core products, the
# fp32 arithmetic of the softmax, exp2 (MUFU), the loads, and the shared-memory traffic and
# register shuffling (LDS, LDSM, STS, IMAD, PRMT, SEL) that operand layout changes cost.
OP_CLASSES = (
    "HGMMA", "HMMA", "UTMALDG", "FFMA", "FMUL", "FADD", "FMNMX", "MUFU", "F2FP", "LDGSTS", "LDG", "STG", "BAR",
    "LDS", "LDSM", "STS", "IMAD", "PRMT", "SEL", "CCTL",
)  # fmt: skip


def op_counts(sass: str) -> str:
    """Static counts of OP_CLASSES in a SASS listing (instructions in the code, not executed)."""
    ops = collections.Counter(
        m.group(1).split(".")[0]
        for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass)
    )
    return " ".join(f"{name} {ops[name]}" for name in OP_CLASSES if ops[name]) + f", all {sum(ops.values())}"


def programs_per_sm(registers: int, num_warps: int, shared: int) -> int:
    per_warp = -(-registers * 32 // 256) * 256  # registers are allocated per warp in units of 256
    return min(REGISTERS_PER_SM // (per_warp * num_warps), SHARED_PER_SM // (shared + 1024), 32)


def cases():
    """(name, kernel, pool dtype, constexprs, num_warps, num_stages, the engine's register cap)
    for the engine's launches."""
    ad, ae = attention_decode, attention_extend
    for pool, scaled in (("bf16", False), ("fp8e4nv", True)):
        block_n = ad.FP8_BLOCK_N if scaled else ad.BLOCK_N
        for splits, new_kv, window in ((1, False, 0), (4, False, 0), (4, True, 0), (4, True, 4096)):
            constexprs = dict(
                GROUP=2,
                HEAD_DIM=128,
                DIRECT_OUT=splits == 1,
                PDL_RELEASE=True,
                PDL_WAIT=new_kv,
                PREFETCH=new_kv,
                LINES=1 if scaled else 2,  # 128-byte lines of a 128-dim row
                LINE_ELEMENTS=128 if scaled else 64,
                V_PTX_WIDEN=scaled,
                KV_SCALED=scaled,
                NEW_KV=new_kv,
                HAS_NORM=new_kv,
                BLOCK_H=16,
                BLOCK_D=128,
                BLOCK_N=block_n,
                WINDOW=window,
            )
            if splits == 1:
                constexprs["num_splits"] = 1  # Triton specializes an int argument equal to 1
            label = (
                f"decode {pool:7s} {'1 split' if splits == 1 else 'splits'}{' +prologue' if new_kv else ''}"
                f"{' window' if window else ''}"
            )
            # the engine's launch on an H200: an fp8 pool's V widened at load, no register cap
            yield (
                label,
                decode_split_kernel.decode_split_kernel,
                pool,
                constexprs,
                ad.NUM_WARPS,
                ad.FP8_WIDENED_STAGES if scaled else ad.NUM_STAGES,
                None,
            )
    for pool, scaled in (("bf16", False), ("fp8e4nv", True)):
        for config_name, config in (
            ("short", ae.SHORT_CONFIGS["fp8" if scaled else "bf16"]),
            ("long", ae.LONG_CONFIG),
        ):
            block_m, block_n, warps, stages, cap = config
            constexprs = dict(
                GROUP=4,
                HEAD_DIM=128,
                KV_SCALED=scaled,
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                BLOCK_D=128,
                HEAVY_FIRST=ae.HEAVY_FIRST,
            )
            # eager passes, prefill graphs' fixed tile maps, and a sliding window's (Mistral's)
            for tiled, window in ((False, 0), (True, 0), (True, 4096)):
                label = f"extend {pool:7s} {config_name} {block_m}x{block_n}{' tiled' if tiled else ''}"
                label += " window" if window else ""
                yield (
                    label,
                    ae._extend_kernel,
                    pool,
                    {**constexprs, "TILED": tiled, "WINDOW": window},
                    warps,
                    stages,
                    cap,
                )


def gluon_cases():
    """The Gluon long-extend kernel (attention_extend_wgmma) as the engine launches it: its cap is
    the launch's register limit, which setmaxnreg then moves between the partitions."""
    aw = attention_extend_wgmma
    block_m, block_n, stages = aw.CONFIG
    constexprs = dict(
        GROUP=4,
        HEAD_DIM=128,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        STAGES=stages,
        HEAVY_FIRST=attention_extend.HEAVY_FIRST,
        TILED=True,
        PRODUCER_THREADS=aw.PRODUCER_THREADS,
        CONSUMER_REGS=aw.CONSUMER_REGS,
        PRODUCER_REGS=aw.PRODUCER_REGS,
    )
    yield "extend bf16    long Gluon tiled", aw._extend_wgmma_kernel, "bf16", constexprs, 4, 1, aw.MAXNREG


def sampler_cases():
    """The fused sampler's first pass (kernels/sampling.py): both logarithms libdevice's, the
    outer one MUFU, and also the inner one MUFU with the series near u = 1 (SERIES_LOG)."""
    variants = {
        "libdevice logs": (False, False),
        "outer MUFU": (True, False),
        "outer MUFU + series": (True, True),
    }
    for label, (fast, series) in variants.items():
        constexprs = dict(CHUNK=sampling.CHUNK, BLOCK=sampling.BLOCK, FAST=fast, SERIES=series)
        yield f"sampler {label}", sampling._gumbel_argmax_chunk_kernel, "fp32", constexprs, 4, 3, None


def gemv_cases():
    """gemv's launches at the one-row (and two-row) decode shapes, plain and with the prologue
    the engine would give it (MINFER_GEMV_PROLOGUE=on), and gate_up with the SiLU as its
    epilogue (gemv.gate_up_gemv, after the norm), in the same tuple form as `cases`."""
    shapes = {  # name: (N, K, prologue)
        "qwen3-0.6b qkv": (4096, 1024, gemv._NORM),
        "qwen3-0.6b gate_up": (6144, 1024, gemv._NORM),
        "qwen3-0.6b down": (1024, 3072, gemv._SILU),
        "llama-8b qkv": (6144, 4096, gemv._NORM),
        "llama-8b gate_up": (28672, 4096, gemv._NORM),
        "llama-8b down": (4096, 14336, gemv._SILU),
    }
    for name, (n, k, prologue) in shapes.items():
        for rows in (1, 2):
            if rows == 2 and k > gemv.MAX_K_TWO_ROWS:
                continue
            variants = [(gemv._PLAIN, False), (prologue, False)]
            if name.endswith("gate_up"):
                variants.append((gemv._NORM, True))
            for folded, gated in variants:
                choose = gemv.gated_config if gated else gemv.choose_config
                block_n, block_k, warps = choose(n // 2 if gated else n, k, 132, rows)
                constexprs = dict(
                    ROWS=rows,
                    HAS_BIAS=False,
                    PROLOGUE=folded.value,
                    HAS_RESIDUAL=folded == gemv._NORM,
                    GATED=gated,
                    BLOCK_N=block_n,
                    BLOCK_K=block_k,
                    PDL=True,
                )
                kind = {0: "plain", 1: "+norm", 2: "+silu"}[folded.value] + (
                    " +silu epilogue" if gated else ""
                )
                label = f"gemv {name} M={rows} {kind}"
                yield label, gemv._gemv_kernel, "bf16", constexprs, warps, 1, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--caps", type=int, nargs="*", default=[], help="register caps to compile with too")
    parser.add_argument(
        "--gemv", action="store_true", help="gemv's launches instead of the attention kernels"
    )
    parser.add_argument("--sampler", action="store_true", help="the sampler's first pass instead")
    parser.add_argument(
        "--ops", metavar="TEXT", help="also print the SASS instruction mix of launches whose name has TEXT"
    )
    parser.add_argument("--only", metavar="TEXT", help="compile only the launches whose name has TEXT")
    args = parser.parse_args()
    print(f"triton {triton.__version__}, target sm_90 (the device's Triton is 3.6: see the docstring)")
    print("(* the cap the engine launches with)")
    print(
        f"{'launch':32s} {'cap':>5s} {'registers':>9s} {'spill B':>7s} {'shared B':>8s} {'programs/SM':>11s}"
    )
    if args.sampler:
        launches = sampler_cases()
    else:
        launches = gemv_cases() if args.gemv else itertools.chain(cases(), gluon_cases())
    for label, kernel, pool, constexprs, warps, stages, engine_cap in launches:
        if args.only and args.only not in label:
            continue
        for cap in dict.fromkeys([None, engine_cap, *args.caps]):
            registers, spill, shared, sass, all_warps = compile_for_h200(
                kernel, pool, constexprs, warps, stages, cap
            )
            mark = "*" if cap == engine_cap else " "
            print(
                f"{label:32s} {str(cap or '-') + mark:>5s} {registers:9d} {spill:7d} {shared:8d} "
                f"{programs_per_sm(registers, all_warps, shared):11d}",
                flush=True,
            )
            if args.ops and args.ops in label:
                print(f"    {op_counts(sass)}", flush=True)


if __name__ == "__main__":
    main()
