"""Where the paged decode kernel's time goes: slot layout, split count, fp8 launch (H200).

    PYTHONPATH=$PWD python3 scripts/gpu_decode_layout.py            # the timing table
    PYTHONPATH=$PWD python3 scripts/gpu_decode_layout.py --splits    # split counts at 16-96 running, sorted
    PYTHONPATH=$PWD python3 scripts/gpu_decode_layout.py --registers # fp8 launch constants, register cap
    PYTHONPATH=$PWD python3 scripts/gpu_decode_layout.py --pipeline  # stage counts that buffer 2-4 deep
    PYTHONPATH=$PWD python3 scripts/gpu_decode_layout.py --order     # requests longest first (--batches 128 64)
    PYTHONPATH=$PWD python3 scripts/gpu_decode_layout.py --widen     # fp8: V widened at load or not
    PYTHONPATH=$PWD python3 scripts/gpu_decode_layout.py --once fp8  # a few launches, for ncu

The engine's pool has page size 1, and decode appends one slot per request per step, so a
request's keys end up scattered one row at a time. This times the decode kernel on the
benchmark's shapes with two slot layouts: scattered single rows (what the engine has) and one
contiguous run per request. (A first version also timed the grid's two orders; kv head fastest
won and is the kernel's order: docs/BENCHMARKS.md, eighth session.) All times are CUDA-graph
replays, as the engine runs decode: timed eagerly, a launch under ~60 us measures the CPU's
launch cost (up to two Triton launches of ~40 arguments each) instead of the kernel. If
contiguous runs are much faster, DRAM access granularity bounds the kernel; if not, the work
per row does.
"""

from __future__ import annotations

import argparse
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
MODELS = {"qwen3-0.6b": (16, 8, 128), "llama-3.1-8b": (32, 8, 128)}  # q heads, kv heads, head dim
BATCHES = (256, 128, 64, 32, 16)
DEFAULTS = (ad.FP8_BLOCK_N, ad.NUM_WARPS, ad.NUM_STAGES, ad.FP8_MAX_REGISTERS)
LAYOUTS = {"rows": 1, "contiguous": 2048}  # page size of the random layout


def draw(batch_size: int, seed: int = 0) -> list[int]:
    """Context lengths of the benchmark's busy band (~1024 on average)."""
    rng = random.Random(seed)
    return [rng.randint(512, 1536) for _ in range(batch_size)]


def both_pools(batch) -> dict:
    """{"bf16" | "fp8": (k pool, v pool, scale kwargs)} of a bf16 PagedBatch: its own pools, and
    those quantized with per-head scales (amax / 448, the format KVPool stores)."""
    k_scale = batch.k_pool.float().abs().amax(dim=(0, 2)) / FP8_MAX
    v_scale = batch.v_pool.float().abs().amax(dim=(0, 2)) / FP8_MAX
    return {
        "bf16": (batch.k_pool, batch.v_pool, {}),
        "fp8": (
            quantize_fp8(batch.k_pool, k_scale),
            quantize_fp8(batch.v_pool, v_scale),
            {"k_scale": k_scale, "v_scale": v_scale},
        ),
    }


def build(model: str, seq_lens: list[int], page_size: int):
    """q, {"bf16" | "fp8": (k pool, v pool, scale kwargs)}, the kernel's other arguments and the
    K/V values read, for one decode step over `seq_lens` with the layout of `page_size`."""
    num_heads, num_kv_heads, head_dim = MODELS[model]
    batch_size = len(seq_lens)
    batch = make_paged_batch(
        [s - 1 for s in seq_lens],
        [1] * batch_size,
        num_kv_heads,
        head_dim,
        page_size,
        DTYPE,
        DEVICE,
        torch.Generator().manual_seed(1),
        4096,
    )
    q = torch.randn((batch_size, num_heads, head_dim), device=DEVICE, dtype=DTYPE)
    pools = both_pools(batch)
    common = (batch.page_table, batch.table_idx, batch.seq_lens, head_dim**-0.5)
    values = sum(seq_lens) * num_kv_heads * head_dim * 2  # K and V
    return q, pools, common, values


def timed(fn, calls: int = 20) -> float:
    """Microseconds per call, from replays of a CUDA graph of `calls` calls: the engine replays
    decode in graphs, and timed eagerly a small launch measures the CPU's launch cost instead."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=60, return_mode="median") * 1e3 / calls


def table() -> None:
    print(f"{'model':13s} {'B':>4s} {'layout':10s} {'dtype':5s} {'us':>7s}")
    for model in MODELS:
        for batch_size in BATCHES:
            for layout, page_size in LAYOUTS.items():
                q, pools, common, values = build(model, draw(batch_size), page_size)
                for name, (k_pool, v_pool, scales) in pools.items():
                    width = 2 if name == "bf16" else 1
                    t = timed(lambda: ad.decode_attention(q, k_pool, v_pool, *common, **scales))
                    print(
                        f"{model:13s} {batch_size:4d} {layout:10s} {name:5s} {t:7.1f}   {values * width / t / 1e6:4.2f} TB/s",
                        flush=True,
                    )
                del pools
                torch.cuda.empty_cache()


def order_study(batches=BATCHES) -> None:
    """The same requests in the drawn order, longest first and shortest first. The grid runs
    the programs of the requests in batch order, and with one split per request (from 64
    running) the last wave holds whatever requests come last: if the long ones end up there the
    SMs idle while they finish. Longest first, the fix for that tail, is what the scheduler does
    (scheduler/decode.py); the split columns ask whether a sorted batch wants more splits than
    choose_num_splits gives."""
    for batch_size in batches:
        for spread, (lo, hi) in {"512-1536": (512, 1536), "100-2048": (100, 2048)}.items():
            rng = random.Random(batch_size)
            lens = [rng.randint(lo, hi) for _ in range(batch_size)]
            q, pools, common, values = build("qwen3-0.6b", lens, 1)
            page_table, table_idx, seq_lens, scale = common
            for name, (k_pool, v_pool, scales) in pools.items():
                width = 2 if name == "bf16" else 1
                cells = []
                for label, descending, splits in (
                    ("drawn", None, None),
                    ("longest first", True, None),
                    ("shortest first", False, None),
                    ("longest first, 2 splits", True, 2),
                    ("longest first, 4 splits", True, 4),
                ):
                    order = torch.arange(batch_size, device=DEVICE)
                    if descending is not None:
                        order = torch.argsort(seq_lens, descending=descending)
                    args = (
                        q[order].contiguous(),
                        k_pool,
                        v_pool,
                        page_table,
                        table_idx[order],
                        seq_lens[order],
                        scale,
                    )
                    t = timed(lambda: ad.decode_attention(*args, num_splits=splits, **scales))
                    cells.append(f"{label} {t:6.1f} us ({values * width / t / 1e6:4.2f} TB/s)")
                print(f"B={batch_size:3d} ctx {spread} {name:5s} | " + " | ".join(cells), flush=True)
            del pools
            torch.cuda.empty_cache()


SPLITS_BATCHES = (16, 24, 32, 40, 48, 56, 64, 80, 96)  # around where the default turns to one split


def splits_study(batches=SPLITS_BATCHES) -> None:
    """Decode time by explicit split count, the batch longest first as the scheduler orders it
    (contexts 100-2048, the spread the offline workload's tail has), at the batch sizes where
    the default turns to one split. Each cell also gives the launch's programs per SM: with one
    split a batch under one wave of programs (bf16 fits 4 an SM, fp8 3) leaves SMs idle, and two
    splits of a batch just over a wave make a second, short one (docs/PERFORMANCE.md section 26:
    two splits at 33-66 running paid for a batch of 64 alone and cost fp8 3.11 -> 3.25 ms a step
    in the engine). A rule that counts waves per pool would be chosen from this table."""
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    for batch_size in batches:
        rng = random.Random(batch_size)
        lens = sorted((rng.randint(100, 2048) for _ in range(batch_size)), reverse=True)
        q, pools, common, values = build("qwen3-0.6b", lens, 1)
        for name, (k_pool, v_pool, scales) in pools.items():
            width = 2 if name == "bf16" else 1
            block_n = ad.FP8_BLOCK_N if scales else ad.BLOCK_N
            num_kv_heads = k_pool.shape[1]
            default = ad.choose_num_splits(batch_size, num_kv_heads, common[0].shape[1], DEVICE, block_n)
            cells = []
            for splits in (1, 2, 3, 4):
                t = timed(
                    lambda: ad.decode_attention(q, k_pool, v_pool, *common, num_splits=splits, **scales)
                )
                cells.append(f"{splits}: {t:6.1f} us ({batch_size * num_kv_heads * splits / sms:4.1f}/SM)")
            t = timed(lambda: ad.decode_attention(q, k_pool, v_pool, *common, **scales))
            print(
                f"B={batch_size:3d} {name:5s} default {default} split(s) {t:6.1f} us "
                f"({values * width / t / 1e6:4.2f} TB/s) | " + " | ".join(cells),
                flush=True,
            )
        del pools
        torch.cuda.empty_cache()


def register_sweep() -> None:
    """The fp8 pool's launch constants with a register cap: uncapped the kernel takes 200
    registers per thread (two programs of 4 warps per SM); a cap trades spills for programs."""
    caps = {4: (None, 168, 128, 96), 8: (None, 128, 96)}
    ad.FP8_PTX_WIDEN = False  # the launch these constants belong to (--widen times the other)
    for batch_size in (256, 64, 16):
        q, pools, common, values = build("qwen3-0.6b", draw(batch_size), 1)
        k_pool, v_pool, scales = pools["fp8"]
        results = []
        for block_n, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3, 4)):
            for cap in caps[warps]:
                ad.FP8_BLOCK_N, ad.NUM_WARPS, ad.NUM_STAGES, ad.FP8_MAX_REGISTERS = (
                    block_n,
                    warps,
                    stages,
                    cap,
                )
                try:
                    t = timed(lambda: ad.decode_attention(q, k_pool, v_pool, *common, **scales))
                except Exception as exc:  # out of shared memory for this configuration
                    print(f"  B={batch_size} {block_n}/{warps}/{stages}/{cap}: {type(exc).__name__}")
                    continue
                results.append((t, block_n, warps, stages, cap))
        ad.FP8_BLOCK_N, ad.NUM_WARPS, ad.NUM_STAGES, ad.FP8_MAX_REGISTERS = DEFAULTS
        results.sort(key=lambda r: r[0])
        default = next(r for r in results if r[1:] == DEFAULTS)
        for t, block_n, warps, stages, cap in results[:4] + [default]:
            print(
                f"B={batch_size:3d} fp8 BLOCK_N={block_n:3d} warps={warps} stages={stages} cap={cap}: "
                f"{t:6.1f} us ({values / t / 1e6:4.2f} TB/s){'  <- default' if (block_n, warps, stages, cap) == DEFAULTS else ''}",
                flush=True,
            )
        del pools
        torch.cuda.empty_cache()


# (BLOCK_N, warps, stages, register cap) per pool for --pipeline. With Triton 3.6 the K/V loads
# (gathered through the page table, one stage behind the slot load) get one shared-memory buffer
# for 2-4 stages: the next block's copy is issued only after this block's products, so a
# program never computes while its loads are in flight. 5-6 stages give two buffers, 7 three,
# 9 four (scripts/kernel_registers.py shows the shared memory; the first row is the default).
PIPELINES = {
    "bf16": [
        (64, 4, 3, None),
        (64, 4, 5, None),
        (32, 4, 5, None),
        (32, 4, 7, None),
        (64, 8, 5, None),
        (32, 4, 3, None),
    ],
    "fp8": [
        (128, 4, 3, 168),
        (128, 4, 5, 168),
        (64, 4, 5, None),
        (64, 4, 5, 128),
        (64, 4, 7, None),
        (64, 4, 3, 128),
        (32, 4, 5, None),
        (32, 4, 7, None),
        (32, 4, 9, None),
        (64, 8, 5, 128),
        (32, 4, 3, 96),  # 96 registers, no spill: 5 programs per SM (untimed before)
        (32, 4, 5, 96),
    ],
}


def set_launch(name: str, config) -> None:
    block_n, ad.NUM_WARPS, ad.NUM_STAGES, cap = config
    if name == "fp8":
        ad.FP8_BLOCK_N, ad.FP8_MAX_REGISTERS = block_n, cap
    else:
        ad.BLOCK_N = block_n


def compare_launches(configs, apply, call, nbytes: float) -> list[str]:
    """One table cell per launch configuration: `apply(config)`, then `call` graph-timed (read
    bandwidth over nbytes) and its output against the first configuration's (the default
    launch: the others must agree with it)."""
    cells, first = [], None
    for config in configs:
        apply(config)
        try:
            t = timed(call)
            out = call().float()
        except Exception as exc:  # out of shared memory for this configuration
            cells.append(f"{config}: {type(exc).__name__}")
            continue
        first = out if first is None else first
        diff = (out - first).abs().max().item()
        cells.append(f"{config}: {t:6.1f} us {nbytes / t / 1e6:4.2f} TB/s  max |diff| {diff:.1e}")
    return cells


def pipeline_sweep() -> None:
    """Each pool's launch with deeper load pipelines (PIPELINES), graph-timed at 16-256 running;
    each launch's output against the first (default) launch's."""
    saved = (ad.BLOCK_N, ad.FP8_BLOCK_N, ad.NUM_WARPS, ad.NUM_STAGES, ad.FP8_MAX_REGISTERS)
    ad.FP8_PTX_WIDEN = False  # the fp8 rows are the launch without V widened at load (see --widen)
    for batch_size in BATCHES:
        q, pools, common, values = build("qwen3-0.6b", draw(batch_size), 1)
        for name, (k_pool, v_pool, scales) in pools.items():
            width = 2 if name == "bf16" else 1
            cells = compare_launches(
                PIPELINES[name],
                lambda config: set_launch(name, config),
                lambda: ad.decode_attention(q, k_pool, v_pool, *common, **scales),
                values * width,
            )
            ad.BLOCK_N, ad.FP8_BLOCK_N, ad.NUM_WARPS, ad.NUM_STAGES, ad.FP8_MAX_REGISTERS = saved
            print(f"B={batch_size:3d} {name}\n    " + "\n    ".join(cells), flush=True)
        del pools
        torch.cuda.empty_cache()


# (V widened in PTX at load, BLOCK_N, warps, stages, register cap) for --widen; the first row is
# the launch without the widening, the second the default. Widened, the launch needs 138-148
# registers, so no cap, and V's fp16 tile takes 32 KB of shared memory beside the fp8 buffers:
# 3 stages (one buffer) fit three programs an SM, 5 (two buffers) two, 7 one.
WIDEN_LAUNCHES = [
    (False, 128, 4, 3, 168),
    (True, 128, 4, 5, None),
    (True, 128, 4, 3, None),
    (True, 128, 4, 7, None),
    (True, 64, 4, 5, None),
    (True, 64, 4, 7, None),
    (True, 128, 8, 5, None),
]


# The attention_decode constants set_fp8_launch changes, which widen_study puts back.
FP8_LAUNCH_CONSTANTS = (
    "FP8_PTX_WIDEN",
    "FP8_BLOCK_N",
    "NUM_WARPS",
    "NUM_STAGES",
    "FP8_MAX_REGISTERS",
    "FP8_WIDENED_STAGES",
)


def set_fp8_launch(widen: bool, block_n: int, warps: int, stages: int, cap: int | None) -> None:
    ad.FP8_PTX_WIDEN, ad.FP8_BLOCK_N, ad.NUM_WARPS = widen, block_n, warps
    if widen:
        ad.FP8_WIDENED_STAGES = stages
    else:
        ad.NUM_STAGES, ad.FP8_MAX_REGISTERS = stages, cap


def widen_study(batches=BATCHES) -> None:
    """The fp8 launch with V widened where it is loaded (common.widen_e4m3_rows) against without,
    and widened launches with other constants, graph-timed at 16-256 running; each output
    against the first launch's (the widening is exact, so they should agree to rounding)."""
    saved = {name: getattr(ad, name) for name in FP8_LAUNCH_CONSTANTS}
    for batch_size in batches:
        q, pools, common, values = build("qwen3-0.6b", draw(batch_size), 1)
        k_pool, v_pool, scales = pools["fp8"]
        cells = compare_launches(
            WIDEN_LAUNCHES,
            lambda config: set_fp8_launch(*config),
            lambda: ad.decode_attention(q, k_pool, v_pool, *common, **scales),
            values,
        )
        for name, value in saved.items():
            setattr(ad, name, value)
        print(f"B={batch_size:3d} fp8\n    " + "\n    ".join(cells), flush=True)
        del pools
        torch.cuda.empty_cache()


def once(dtype: str, batch_size: int) -> None:
    q, pools, common, _ = build("qwen3-0.6b", draw(batch_size), 1)
    k_pool, v_pool, scales = pools[dtype]
    for _ in range(3):
        ad.decode_attention(q, k_pool, v_pool, *common, **scales)
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--once", choices=["bf16", "fp8"], help="run a few launches only (for ncu)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--splits", action="store_true", help="time split counts at 16-96 running")
    parser.add_argument("--registers", action="store_true", help="sweep the fp8 launch and its register cap")
    parser.add_argument("--pipeline", action="store_true", help="time deeper load pipelines for both pools")
    parser.add_argument("--widen", action="store_true", help="fp8: V widened at load against not")
    parser.add_argument(
        "--order", action="store_true", help="time the batch longest first and shortest first"
    )
    parser.add_argument(
        "--batches", nargs="*", type=int, help="batch sizes of --order or --splits (default: each one's own)"
    )
    args = parser.parse_args()
    if args.order:
        order_study(args.batches or BATCHES)
    elif args.pipeline:
        pipeline_sweep()
    elif args.widen:
        widen_study(args.batches or BATCHES)
    elif args.registers:
        register_sweep()
    elif args.splits:
        splits_study(args.batches or SPLITS_BATCHES)
    elif args.once:
        once(args.once, args.batch)
    else:
        table()


if __name__ == "__main__":
    main()
