"""Check the Triton kernels on the GPU at real model shapes, then time them.

Every case is first compared with its torch reference (bf16 inputs), then timed with
triton.testing.do_bench (median of repeated runs, L2 flushed between runs). Bandwidth is the
bytes a kernel must move (for attention: the K/V it reads plus q and o) over its time, set
against the H200's measured device-to-device copy ceiling of 4.26 TB/s (shared/gpu/README.md).

Run from the repository root on the GPU host:
    PYTHONPATH=$PWD python3 scripts/gpu_check.py [--sweep] [--quick]
It imports only torch, triton and minfer.kernels, skipping minfer/__init__.py where msgspec is
missing (the GPU host has no msgspec/pyzmq/...).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import random
import sys
import time
import types

import torch
import triton
import triton.testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "kernels")]
if importlib.util.find_spec("msgspec") is None:
    # minfer/__init__.py imports minfer.core, which needs msgspec (absent on the GPU host); the
    # kernels need only torch and triton, so bind the package name to its folder without
    # running the package's __init__.
    package = types.ModuleType("minfer")
    package.__path__ = [os.path.join(ROOT, "minfer")]
    sys.modules["minfer"] = package

from kernel_cases import make_paged_batch

from minfer.kernels import attention_decode, attention_extend, attention_extend_wgmma, gemm
from minfer.kernels.activation import silu_and_mul, silu_and_mul_reference
from minfer.kernels.attention_decode import decode_attention
from minfer.kernels.attention_extend import extend_attention
from minfer.kernels.attention_reference import decode_attention_reference, extend_attention_reference
from minfer.kernels.norm import rmsnorm, rmsnorm_reference
from minfer.kernels.rope_store import rope_store
from minfer.layers.rotary import RotaryEmbedding

COPY_CEILING_BYTES_PER_S = 4.26e12  # H200 device-to-device copy, measured (shared/gpu/README.md)
DTYPE = torch.bfloat16
DEVICE = torch.device("cuda")
TABLE_WIDTH = 40960  # the engine's page table is as wide as the longest context (Qwen3: 40960)
PAGE_SIZE = 16

MODELS = {  # name: (q heads, kv heads, head dim, hidden, intermediate)
    "qwen3-0.6b": (16, 8, 128, 1024, 3072),
    "llama-8b": (32, 8, 128, 4096, 14336),
}

rows: list[dict] = []
failures: list[str] = []


_EXTEND_DEFAULTS = (
    dict(attention_extend.SHORT_CONFIGS),
    attention_extend.LONG_CONFIG,
    attention_extend.HEAVY_FIRST,
)


def force_extend_config(config: tuple | None) -> None:
    """Make every extend launch take `config` ((BLOCK_M, BLOCK_N, warps, stages[, heavy first]),
    uncapped) whatever its length and pool; None restores the module's choice."""
    short, long, heavy = _EXTEND_DEFAULTS
    short = dict(short)
    if config is not None:
        long = (*config[:4], None)
        short = dict.fromkeys(short, long)
        heavy = config[4] if len(config) > 4 else heavy
    attention_extend.SHORT_CONFIGS, attention_extend.LONG_CONFIG, attention_extend.HEAVY_FIRST = (
        short,
        long,
        heavy,
    )


def bench_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def graph_us(fn) -> float:
    """Median time per call replayed from a CUDA graph, as the engine runs decode steps: no
    Python launch cost, but also no L2 flush between calls (inputs under 60 MB stay cached)."""
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3


def check(name: str, out: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> float:
    err = (out.float() - expected.float()).abs().max().item()
    try:
        torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)
    except AssertionError as e:
        failures.append(f"{name}: {str(e).splitlines()[0:4]}")
        print(f"  FAIL {name}: max abs err {err:.3g}", flush=True)
    return err


def record(kernel: str, model: str, shape: str, fn, nbytes: float, err: float, extra="") -> None:
    """Time fn both ways; bandwidth is computed from the do_bench (L2-flushed) median.
    `extra` is a note, or a function of the median in us that returns one."""
    us = bench_us(fn)
    extra = extra(us) if callable(extra) else extra
    replay_us = graph_us(fn)
    gbs = nbytes / (us * 1e-6) / 1e9
    row = dict(
        kernel=kernel,
        model=model,
        shape=shape,
        us=us,
        graph_us=replay_us,
        gbs=gbs,
        pct=100 * gbs * 1e9 / COPY_CEILING_BYTES_PER_S,
        mb=nbytes / 1e6,
        err=err,
        extra=extra,
    )
    rows.append(row)
    print(
        f"  {kernel:14s} {model:11s} {shape:34s} {us:9.1f} us (graph {replay_us:8.1f} us) {gbs:8.0f} GB/s "
        f"{row['pct']:5.1f}%  err {err:.2e} {extra}",
        flush=True,
    )


def decode_case(model: str, batch_size: int, seq_lens: list[int], label: str) -> None:
    num_heads, num_kv_heads, head_dim = MODELS[model][:3]
    gen = torch.Generator().manual_seed(batch_size)
    batch = make_paged_batch(
        [s - 1 for s in seq_lens],
        [1] * batch_size,
        num_kv_heads,
        head_dim,
        PAGE_SIZE,
        DTYPE,
        DEVICE,
        gen,
        table_width=TABLE_WIDTH,
    )
    q = torch.randn((batch_size, num_heads, head_dim), device=DEVICE, dtype=DTYPE)
    args = (q, batch.k_pool, batch.v_pool, batch.page_table, batch.table_idx, batch.seq_lens, head_dim**-0.5)
    err = check(
        f"decode {model} {label}", decode_attention(*args), decode_attention_reference(*args), 1e-2, 1e-2
    )
    kv_bytes = sum(seq_lens) * num_kv_heads * head_dim * 2 * DTYPE.itemsize
    qo_bytes = 2 * q.numel() * DTYPE.itemsize
    splits = attention_decode.choose_num_splits(batch_size, num_kv_heads, TABLE_WIDTH, DEVICE)
    record(
        "decode_attn",
        model,
        f"B={batch_size} {label}",
        lambda: decode_attention(*args),
        kv_bytes + qo_bytes,
        err,
        f"splits={splits}",
    )
    del batch


def extend_problem(
    model: str,
    prefix_lens: list[int],
    extend_lens: list[int],
    seed: int,
    table_width: int | None = None,
    page_size: int = PAGE_SIZE,
) -> tuple[tuple, int]:
    """One extend launch with `model`'s heads (pages shuffled): extend_attention's
    arguments and the launch's causal FLOPs (query j of a request sees prefix + j + 1 keys; two
    products of 2 FLOPs per multiply-add)."""
    num_heads, num_kv_heads, head_dim = MODELS[model][:3]
    batch = make_paged_batch(
        prefix_lens,
        extend_lens,
        num_kv_heads,
        head_dim,
        page_size,
        DTYPE,
        DEVICE,
        torch.Generator().manual_seed(seed),
        table_width=table_width,
    )
    q = torch.randn((sum(extend_lens), num_heads, head_dim), device=DEVICE, dtype=DTYPE)
    args = (q, batch.k_pool, batch.v_pool, batch.page_table, batch.table_idx, batch.prefix_lens)
    args += (batch.seq_lens, batch.cu_extend_lens, max(extend_lens), head_dim**-0.5)
    pairs = sum(e * p + e * (e + 1) // 2 for p, e in zip(prefix_lens, extend_lens))
    return args, 4 * head_dim * num_heads * pairs


def extend_reference(args: tuple) -> torch.Tensor:
    """extend_attention_reference on extend_problem's arguments."""
    q, k_pool, v_pool, page_table, table_idx, prefix_lens, seq_lens, _, _, scale = args
    return extend_attention_reference(q, k_pool, v_pool, page_table, table_idx, prefix_lens, seq_lens, scale)


def extend_case(model: str, prefix_lens: list[int], extend_lens: list[int], label: str) -> None:
    num_heads, num_kv_heads, head_dim = MODELS[model][:3]
    args, flop = extend_problem(model, prefix_lens, extend_lens, len(prefix_lens), TABLE_WIDTH)

    def run():
        return extend_attention(*args)

    expected = extend_reference(args)
    err = check(f"extend {model} {label}", run(), expected, 1e-2, 1e-2)
    del expected
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    kv_bytes = sum(seq_lens) * num_kv_heads * head_dim * 2 * DTYPE.itemsize
    qo_bytes = 2 * args[0].numel() * DTYPE.itemsize
    record(
        "extend_attn",
        model,
        label,
        run,
        kv_bytes + qo_bytes,
        err,
        lambda us: f"{flop / us / 1e6:.0f} TFLOP/s",
    )


def fused_cases(model: str, tokens: int) -> None:
    num_heads, num_kv_heads, head_dim, hidden, inter = MODELS[model]
    item = DTYPE.itemsize
    x = torch.randn((tokens, hidden), device=DEVICE, dtype=DTYPE)
    residual = torch.randn_like(x)
    weight = torch.randn((hidden,), device=DEVICE, dtype=DTYPE)
    out, new_res = rmsnorm(x, weight, 1e-6, residual)
    ref_out, ref_res = rmsnorm_reference(x, weight, 1e-6, residual)
    err = max(
        check(f"rmsnorm {model} T={tokens}", out, ref_out, 2e-2, 2e-2),
        check(f"rmsnorm residual {model} T={tokens}", new_res, ref_res, 0, 0),
    )
    torch_us = bench_us(lambda: rmsnorm_reference(x, weight, 1e-6, residual))
    record(
        "rmsnorm+add",
        model,
        f"T={tokens} H={hidden}",
        lambda: rmsnorm(x, weight, 1e-6, residual),
        4 * x.numel() * item,
        err,
        f"torch {torch_us:.1f} us",
    )

    gate_up = torch.randn((tokens, 2 * inter), device=DEVICE, dtype=DTYPE)
    err = check(
        f"silu_and_mul {model} T={tokens}", silu_and_mul(gate_up), silu_and_mul_reference(gate_up), 2e-2, 2e-2
    )
    torch_us = bench_us(lambda: silu_and_mul_reference(gate_up))
    record(
        "silu_and_mul",
        model,
        f"T={tokens} I={inter}",
        lambda: silu_and_mul(gate_up),
        1.5 * gate_up.numel() * item,
        err,
        f"torch {torch_us:.1f} us",
    )

    qkv = torch.randn((tokens, (num_heads + 2 * num_kv_heads) * head_dim), device=DEVICE, dtype=DTYPE)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.view(tokens, num_heads, head_dim)
    k = k.view(tokens, num_kv_heads, head_dim)
    v = v.view(tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, TABLE_WIDTH, (tokens,), device=DEVICE)
    rotary = RotaryEmbedding(head_dim, TABLE_WIDTH, {"rope_theta": 1e6, "rope_type": "default"}).to(DEVICE)
    q_weight, k_weight = (1 + torch.randn((2, head_dim), device=DEVICE) / 4).to(DTYPE)
    slots = 4 * tokens + 64
    k_pool = torch.zeros((slots, num_kv_heads, head_dim), device=DEVICE, dtype=DTYPE)
    v_pool = torch.zeros_like(k_pool)
    out_loc = torch.randperm(slots, device=DEVICE)[:tokens]

    def unfused():  # what the layers do without the kernel (torch ops; Triton RMSNorm on CUDA)
        q_ref, k_ref = rotary(
            positions, rmsnorm_reference(q, q_weight, 1e-6), rmsnorm_reference(k, k_weight, 1e-6)
        )
        ref_k_pool, ref_v_pool = k_pool.clone(), v_pool.clone()
        ref_k_pool[out_loc], ref_v_pool[out_loc] = k_ref, v
        return q_ref, ref_k_pool, ref_v_pool

    ref_q, ref_k_pool, ref_v_pool = unfused()
    q2 = q.clone()
    rope_store(q2, k, v, positions, rotary.cos_sin, k_pool, v_pool, out_loc, q_weight, k_weight, 1e-6)
    # one bf16 unit: see tests/kernels/test_kernel_fused.py for why the GPU may round differently
    err = max(
        check(f"rope_store q {model} T={tokens}", q2, ref_q, 4e-2, 2**-7),
        check(f"rope_store k {model} T={tokens}", k_pool, ref_k_pool, 4e-2, 2**-7),
        check(f"rope_store v {model} T={tokens}", v_pool, ref_v_pool, 0, 0),
    )
    torch_us = bench_us(unfused)
    nbytes = (
        2 * (q.numel() + 2 * k.numel()) * item + tokens * head_dim * 4
    )  # q in+out, k and v in+out, cos/sin
    record(
        "rope_store",
        model,
        f"T={tokens} {num_heads}/{num_kv_heads}x{head_dim} +qk-norm",
        lambda: rope_store(
            q2, k, v, positions, rotary.cos_sin, k_pool, v_pool, out_loc, q_weight, k_weight, 1e-6
        ),
        nbytes,
        err,
        f"torch {torch_us:.1f} us",
    )


def sampling_case(batch: int, vocab: int = 151936) -> None:
    """Gumbel-max sampling of a [batch, vocab] fp32 logits block (Qwen3's vocabulary)."""
    from minfer.kernels.sampling import gumbel_argmax

    logits = torch.randn((batch, vocab), device=DEVICE) * 3
    temperature = torch.full((batch,), 0.6, device=DEVICE)
    temperature[::4] = 0.0  # some greedy rows
    seeds = torch.arange(batch, device=DEVICE)
    positions = torch.full((batch,), 100, device=DEVICE)
    got = gumbel_argmax(logits, temperature, seeds, positions)
    greedy = temperature == 0
    mismatched = (got[greedy] != logits[greedy].argmax(-1)).sum().item()
    if mismatched:
        failures.append(f"gumbel_argmax B={batch}: {mismatched} greedy rows differ from argmax")
    record(
        "gumbel_argmax",
        "vocab 151936",
        f"B={batch} T=0.6 (1 in 4 rows greedy)",
        lambda: gumbel_argmax(logits, temperature, seeds, positions),
        logits.numel() * 4,
        float(mismatched),
    )


def cuda_graph_case() -> None:
    """Capture a decode step once; replays must follow lengths and page table changed in place."""
    num_heads, num_kv_heads, head_dim = MODELS["llama-8b"][:3]
    gen = torch.Generator().manual_seed(7)
    batch = make_paged_batch(
        [2000] * 64, [1] * 64, num_kv_heads, head_dim, PAGE_SIZE, DTYPE, DEVICE, gen, table_width=TABLE_WIDTH
    )
    q = torch.randn((64, num_heads, head_dim), device=DEVICE, dtype=DTYPE)
    args = (q, batch.k_pool, batch.v_pool, batch.page_table, batch.table_idx, batch.seq_lens, head_dim**-0.5)
    decode_attention(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(*args)
    for trial in range(3):
        batch.seq_lens.copy_(torch.randint(1, 2002, (64,), generator=gen, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=gen))
        graph.replay()
        check(f"decode cuda-graph replay {trial}", out, decode_attention_reference(*args), 1e-2, 1e-2)
    seq_lens = batch.seq_lens.tolist()
    nbytes = sum(seq_lens) * num_kv_heads * head_dim * 2 * DTYPE.itemsize + 2 * q.numel() * DTYPE.itemsize
    record(
        "decode_attn",
        "llama-8b",
        "B=64 ctx 1..2001 (graph-replay check)",
        lambda: decode_attention(*args),
        nbytes,
        0.0,
    )


def sweep() -> None:
    """Time launch configurations of both attention kernels; the defaults are not changed."""
    print("\n== decode launch sweep (BLOCK_N, num_warps, num_stages) ==", flush=True)
    defaults = (attention_decode.BLOCK_N, attention_decode.NUM_WARPS, attention_decode.NUM_STAGES)
    rng = random.Random(1)
    shapes = [
        ("llama-8b", 64, [rng.randint(100, 2048) for _ in range(64)]),
        ("qwen3-0.6b", 256, [rng.randint(100, 2048) for _ in range(256)]),
        ("llama-8b", 1, [32768]),
    ]
    cases = []
    for model, batch_size, seq_lens in shapes:
        num_heads, num_kv_heads, head_dim = MODELS[model][:3]
        batch = make_paged_batch(
            [s - 1 for s in seq_lens],
            [1] * batch_size,
            num_kv_heads,
            head_dim,
            PAGE_SIZE,
            DTYPE,
            DEVICE,
            torch.Generator().manual_seed(0),
            table_width=TABLE_WIDTH,
        )
        q = torch.randn((batch_size, num_heads, head_dim), device=DEVICE, dtype=DTYPE)
        nbytes = sum(seq_lens) * num_kv_heads * head_dim * 2 * DTYPE.itemsize
        cases.append(
            (
                f"{model} B={batch_size}",
                nbytes,
                (q, batch.k_pool, batch.v_pool, batch.page_table, batch.table_idx, batch.seq_lens, 0.088),
            )
        )
    for config in [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 2), (128, 8, 3)]:
        attention_decode.BLOCK_N, attention_decode.NUM_WARPS, attention_decode.NUM_STAGES = config
        line = []
        for name, nbytes, args in cases:
            us = bench_us(lambda: decode_attention(*args))
            line.append(f"{name}: {us:7.1f} us {nbytes / us / 1e3:6.0f} GB/s")
        print(f"  {config}: " + " | ".join(line), flush=True)
    attention_decode.BLOCK_N, attention_decode.NUM_WARPS, attention_decode.NUM_STAGES = defaults
    print("\n== decode split counts (default launch configuration) ==", flush=True)
    for name, nbytes, args in cases:
        line = []
        for num_splits in (1, 2, 3, 4, 6, 8, 16, 32, 64):
            us = bench_us(lambda: decode_attention(*args, num_splits=num_splits))
            line.append(f"{num_splits}: {us:6.1f}")
        print(f"  {name} ({nbytes / 1e6:.0f} MB) us by splits: " + "  ".join(line), flush=True)
    del cases

    print("\n== extend launch sweep (BLOCK_M, BLOCK_N, num_warps, num_stages) ==", flush=True)
    num_heads, num_kv_heads, head_dim = MODELS["llama-8b"][:3]
    batch = make_paged_batch(
        [0, 1024],
        [2048, 1024],
        num_kv_heads,
        head_dim,
        PAGE_SIZE,
        DTYPE,
        DEVICE,
        torch.Generator().manual_seed(0),
        table_width=TABLE_WIDTH,
    )
    q = torch.randn((3072, num_heads, head_dim), device=DEVICE, dtype=DTYPE)
    flop = 4 * (2048 * 2049 // 2 + 1024 * 1024 + 1024 * 1025 // 2) * num_heads * head_dim
    for config in [
        (64, 64, 4, 2),
        (64, 64, 8, 2),
        (128, 64, 8, 2),
        (128, 64, 8, 3),
        (128, 32, 4, 3),
        (128, 128, 8, 2),
        (64, 32, 4, 3),
    ]:
        force_extend_config(config)
        us = bench_us(
            lambda: extend_attention(
                q,
                batch.k_pool,
                batch.v_pool,
                batch.page_table,
                batch.table_idx,
                batch.prefix_lens,
                batch.seq_lens,
                batch.cu_extend_lens,
                2048,
                0.088,
            )
        )
        print(
            f"  {config}: llama-8b prefill 2048 + (1024 cached, 1024 new): {us:8.1f} us "
            f"{flop / us / 1e6:6.1f} TFLOP/s",
            flush=True,
        )
    force_extend_config(None)


def split_table() -> None:
    """Decode attention time by split count for the qwen3 shape at the batch sizes where the
    offline benchmark's batch drains (context 600..1400, as late in that run)."""
    print("\n== decode split counts, qwen3-0.6b heads, context 600..1400 ==", flush=True)
    num_heads, num_kv_heads, head_dim = MODELS["qwen3-0.6b"][:3]
    rng = random.Random(2)
    for batch_size in (8, 16, 32, 48, 64, 96, 128, 192):
        seq_lens = [rng.randint(600, 1400) for _ in range(batch_size)]
        batch = make_paged_batch(
            [s - 1 for s in seq_lens],
            [1] * batch_size,
            num_kv_heads,
            head_dim,
            1,
            DTYPE,
            DEVICE,
            torch.Generator().manual_seed(0),
            table_width=TABLE_WIDTH,
        )
        q = torch.randn((batch_size, num_heads, head_dim), device=DEVICE, dtype=DTYPE)
        args = (q, batch.k_pool, batch.v_pool, batch.page_table, batch.table_idx, batch.seq_lens, 0.088)
        nbytes = sum(seq_lens) * num_kv_heads * head_dim * 2 * DTYPE.itemsize
        default = attention_decode.choose_num_splits(batch_size, num_kv_heads, TABLE_WIDTH, DEVICE)
        line = []
        for num_splits in (1, 2, 3, 4, 6, 8, 12, 16):
            us = graph_us(lambda: decode_attention(*args, num_splits=num_splits))
            line.append(f"{num_splits}: {us:6.1f}")
        print(
            f"  B={batch_size:3d} ({nbytes / 1e6:5.0f} MB, floor {nbytes / COPY_CEILING_BYTES_PER_S * 1e6:5.1f} us, "
            f"default {default} splits) graph-replay us by splits: " + "  ".join(line),
            flush=True,
        )


def qwen3_sweep() -> None:
    """Launch configurations of both attention kernels on the shapes of the offline benchmark
    with the qwen3-0.6b heads: decode at three batch sizes (page size 1, context 600..1400)
    and one prefill chunk of 8192 tokens made of prompts of 100..1024."""
    num_heads, num_kv_heads, head_dim = MODELS["qwen3-0.6b"][:3]
    rng = random.Random(3)
    cases = []
    for batch_size in (32, 128, 256):
        seq_lens = [rng.randint(600, 1400) for _ in range(batch_size)]
        batch = make_paged_batch(
            [s - 1 for s in seq_lens],
            [1] * batch_size,
            num_kv_heads,
            head_dim,
            1,
            DTYPE,
            DEVICE,
            torch.Generator().manual_seed(0),
            table_width=TABLE_WIDTH,
        )
        q = torch.randn((batch_size, num_heads, head_dim), device=DEVICE, dtype=DTYPE)
        cases.append(
            (
                batch_size,
                (q, batch.k_pool, batch.v_pool, batch.page_table, batch.table_idx, batch.seq_lens, 0.088),
            )
        )
    print(
        "\n== qwen3 decode launch sweep (BLOCK_N, num_warps, num_stages): graph-replay us at B=32/128/256 =="
    )
    defaults = (attention_decode.BLOCK_N, attention_decode.NUM_WARPS, attention_decode.NUM_STAGES)
    for config in [
        (64, 4, 3),
        (64, 4, 2),
        (64, 4, 4),
        (32, 4, 3),
        (32, 2, 3),
        (64, 2, 3),
        (128, 4, 3),
        (128, 8, 3),
        (64, 8, 3),
    ]:
        attention_decode.BLOCK_N, attention_decode.NUM_WARPS, attention_decode.NUM_STAGES = config
        times = [graph_us(lambda: decode_attention(*args)) for _, args in cases]
        print(
            f"  {config}: " + "  ".join(f"{t:7.1f}" for t in times) + f"   sum {sum(times):7.1f}", flush=True
        )
    attention_decode.BLOCK_N, attention_decode.NUM_WARPS, attention_decode.NUM_STAGES = defaults
    del cases

    extend = []
    while sum(extend) < 8192:
        extend.append(min(rng.randint(100, 1024), 8192 - sum(extend)))
    batch = make_paged_batch(
        [0] * len(extend),
        extend,
        num_kv_heads,
        head_dim,
        1,
        DTYPE,
        DEVICE,
        torch.Generator().manual_seed(0),
        table_width=TABLE_WIDTH,
    )
    q = torch.randn((8192, num_heads, head_dim), device=DEVICE, dtype=DTYPE)
    flop = sum(4 * n * (n + 1) // 2 * num_heads * head_dim for n in extend)
    print(
        f"\n== qwen3 extend launch sweep (BLOCK_M, BLOCK_N, num_warps, num_stages): 8192 tokens in "
        f"{len(extend)} prompts =="
    )
    for config in [
        (64, 64, 4, 2),
        (64, 64, 4, 3),
        (128, 64, 8, 2),
        (128, 64, 8, 3),
        (128, 32, 4, 3),
        (64, 32, 4, 3),
        (128, 128, 8, 2),
        (64, 128, 4, 2),
        (64, 64, 4, 5),  # 5 stages: one more K/V buffer in shared memory (scripts/kernel_registers.py)
        (64, 32, 4, 5),
    ]:
        force_extend_config(config)
        us = bench_us(
            lambda: extend_attention(
                q,
                batch.k_pool,
                batch.v_pool,
                batch.page_table,
                batch.table_idx,
                batch.prefix_lens,
                batch.seq_lens,
                batch.cu_extend_lens,
                max(extend),
                0.088,
            )
        )
        print(f"  {config}: {us:8.1f} us {flop / us / 1e6:6.1f} TFLOP/s", flush=True)
    force_extend_config(None)


def extend_long_sweep(
    prompt_len: int = 32768, chunk: int = 8192, quick: bool = False, page_size: int = PAGE_SIZE
) -> None:
    """Extend attention over one long prompt in prefill chunks (Llama-8B heads), as chunked
    prefill runs it: the chunk at prefix P computes `chunk` queries over P + its own keys.
    Launch configurations and the heavy-first block order are timed against the causal FLOPs
    of all chunks; each is checked against the default's output, and the default against the
    torch reference on the first chunk. `quick`: the default configuration alone (for A/B
    runs of a kernel change), without the crossover table. `page_size`: the pool's pages,
    shuffled; with 128 or more every full key block's slots are consecutive, as the engine's
    allocator gives a prompt's (pages of 1 handed out in ascending runs), which the Gluon
    kernel copies by TMA."""
    chunks = [
        (prefix, *extend_problem("llama-8b", [prefix], [chunk], prefix, page_size=page_size))
        for prefix in range(0, prompt_len, chunk)
    ]
    reference = extend_reference(chunks[0][1])
    check("extend long, first chunk", extend_attention(*chunks[0][1]), reference, atol=2e-2, rtol=2e-2)
    attention_extend.WGMMA_LONG = False  # the Triton kernel's rows, then the Gluon kernel's
    check("extend long, first chunk, Triton", extend_attention(*chunks[0][1]), reference, 2e-2, 2e-2)
    del reference
    expected = [extend_attention(*args) for _, args, _ in chunks]
    total_flop = sum(flop for _, _, flop in chunks)
    print(
        f"\n== extend attention, one {prompt_len}-token prompt in {chunk}-token chunks (llama-8b heads, "
        f"pages of {page_size}): us per chunk, TFLOP/s of all chunks (floor 790) ==",
        flush=True,
    )
    long = attention_extend.LONG_CONFIG[:4]
    configs = [long + (True,), long + (False,)] + [
        (bm, bn, w, st, True)
        for bm, bn, w, st in [
            (64, 64, 4, 2),
            (64, 64, 4, 3),
            (128, 64, 8, 2),
            (128, 64, 8, 3),
            (128, 64, 4, 2),
            (128, 128, 8, 2),
            (128, 128, 4, 3),
            (64, 128, 4, 3),
            (128, 64, 4, 3),
            (128, 32, 8, 3),
        ]
    ]

    def time_chunks(label: str) -> None:
        """One row: every chunk through extend_attention as configured now, checked against the
        default's output."""
        try:
            times = []
            for (prefix, args, _), want in zip(chunks, expected):
                err = (extend_attention(*args).float() - want.float()).abs().max().item()
                if err > 2e-2:
                    failures.append(f"extend long {label} prefix {prefix}: max abs err {err:.3g}")
                times.append(bench_us(lambda: extend_attention(*args)))
            print(
                f"  {label}: "
                + "  ".join(f"{t:8.1f}" for t in times)
                + f"   {total_flop / sum(times) / 1e6:6.1f} TFLOP/s",
                flush=True,
            )
        except Exception as e:  # e.g. out of shared memory
            print(f"  {label}: {type(e).__name__}: {e}", flush=True)

    for config in configs[:1] if quick else configs:
        force_extend_config(config)
        time_chunks(str(config))
    force_extend_config(None)
    attention_extend.WGMMA_LONG = True
    if attention_extend_wgmma.applies(chunks[0][1][0], chunks[0][1][1], None):
        wgmma_default = attention_extend_wgmma.CONFIG
        others = [(128, 64, 3), (128, 64, 5)]  # (BLOCK_M, BLOCK_N, STAGES)
        for config in [wgmma_default] + ([] if quick else others):
            attention_extend_wgmma.CONFIG = config
            time_chunks(f"wgmma {config}")
        attention_extend_wgmma.CONFIG = wgmma_default
    if quick:
        return

    print("\n== where the long configuration starts: 8192 tokens of prompts of E tokens each ==", flush=True)
    long_from, wgmma_default = attention_extend.LONG_EXTEND, attention_extend_wgmma.CONFIG
    for extend in (512, 1024, 1536, 2048, 4096):
        count = chunk // extend
        args, flop = extend_problem("llama-8b", [0] * count, [extend] * count, extend, page_size=page_size)
        line = []
        for name, config, gluon in (
            ("short", attention_extend.SHORT_CONFIGS["bf16"], None),
            ("long", attention_extend.LONG_CONFIG, None),
            # at every E, for the crossover; and 64-key blocks, which lose less on diagonal blocks
            ("long, Gluon", attention_extend.LONG_CONFIG, wgmma_default),
            ("long, Gluon 64-key", attention_extend.LONG_CONFIG, (128, 64, 5)),
        ):
            if gluon and not attention_extend_wgmma.applies(args[0], args[1], None):
                continue
            force_extend_config(config[:4])
            attention_extend.WGMMA_LONG, attention_extend.LONG_EXTEND = bool(gluon), 0 if gluon else long_from
            attention_extend_wgmma.CONFIG = gluon or wgmma_default
            us = bench_us(lambda: extend_attention(*args))
            line.append(f"{name} {gluon or config}: {us:7.1f} us {flop / us / 1e6:6.1f} TFLOP/s")
        force_extend_config(None)
        attention_extend_wgmma.CONFIG = wgmma_default
        attention_extend.WGMMA_LONG, attention_extend.LONG_EXTEND = True, long_from
        print(f"  E={extend:5d} x {count:2d}: " + "   ".join(line), flush=True)


def rotated_graph_us(make_call, weights: list[torch.Tensor], reps: int = 10) -> float:
    """Median us per call of `make_call(w)`, replayed from one CUDA graph that cycles through
    `weights` (together larger than the 60 MB L2), so each call reads its weights from HBM as
    in a decode step, where a layer's weights were last touched a whole model ago."""

    def calls():
        for _ in range(reps):
            for w in weights:
                make_call(w)

    calls()  # compile / warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (reps * len(weights)))
    del graph
    return sorted(times)[len(times) // 2]


def gemm_configs_us(x: torch.Tensor, weights: list[torch.Tensor]) -> list[tuple[float, tuple]]:
    """(us, config) of the split-K GEMM for tiles 16-64 x 32-128, BK 64-256, 1-16 K splits,
    3-4 stages, 4 warps (8 for 128-wide tiles); from 128 rows, tiles 64-128 x 64-256, BK 64-128,
    1-8 splits, 4 or 8 warps. Tiles taller than the batch and more splits than K blocks are
    skipped."""
    m, k = x.shape
    results = []
    if m >= 128:  # compute-bound rows: tensor-core-sized tiles (two warpgroups at 128 rows)
        space = ((64, 128), (64, 128, 256), (64, 128), (1, 2, 4, 8), (3, 4), (4, 8))
    else:
        space = ((16, 32, 64), (32, 64, 128), (64, 128, 256), (1, 2, 3, 4, 6, 8, 16), (3, 4), (4, 8))
    for bm, bn, bk, split, stages, warps in itertools.product(*space):
        if bm > max(16, triton.next_power_of_2(m)) or k // bk < split:
            continue
        if m < 128 and warps == 8 and bn < 128:
            continue
        cfg = (bm, bn, bk, split, warps, stages)
        try:
            results.append((rotated_graph_us(lambda w: gemm.linear(x, w, config=cfg), weights, reps=4), cfg))
        except Exception as e:  # e.g. out of shared memory
            print(f"    {cfg}: {type(e).__name__}", flush=True)
    return results


def gemm_sweep(
    full: bool, models: list[str] | None = None, sweep_rows: tuple[int, ...] | None = None
) -> None:
    """Decode-shaped GEMMs: cuBLAS (F.linear) against minfer.kernels.gemm with its default
    configuration and, with `full`, a sweep of tile sizes and K splits. Weights from HBM."""
    import torch.nn.functional as F

    shapes = {  # name: (N, K) of y[M, N] = x[M, K] @ w[N, K].T
        "qwen3-0.6b": {
            "qkv": (4096, 1024),
            "o_proj": (1024, 2048),
            "gate_up": (6144, 1024),
            "down": (1024, 3072),
        },
        "qwen3-30b-a3b": {
            "qkv": (5120, 2048),
            "o_proj": (2048, 4096),
            "router": (128, 2048),
        },
        "llama-8b": {
            "qkv": (6144, 4096),
            "o_proj": (4096, 4096),
            "gate_up": (28672, 4096),
            "down": (4096, 14336),
        },
    }
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(
        "\n== decode GEMMs: us per call, weights from HBM (floor = max(weight bytes / 4.26 TB/s, "
        "FLOPs / 790 TF)) ==",
        flush=True,
    )
    for model, layer in shapes.items():
        if models and model not in models:
            continue
        totals = {"cublas": {}, "triton": {}}
        for name, (n, k) in layer.items():
            copies = max(2, triton.cdiv(256 << 20, n * k * 2))
            weights = [torch.randn((n, k), device=DEVICE, dtype=DTYPE) * 0.02 for _ in range(copies)]
            for m in (1, 16, 64, 128, 256):
                x = torch.randn((m, k), device=DEVICE, dtype=DTYPE)
                check(
                    f"gemm {model} {name} M={m}",
                    gemm.linear(x, weights[0]),
                    F.linear(x, weights[0]),
                    atol=2e-2,
                    rtol=2e-2,
                )
                floor = max(n * k * 2 / COPY_CEILING_BYTES_PER_S, 2 * m * n * k / 790e12) * 1e6
                cublas = rotated_graph_us(lambda w: F.linear(x, w), weights)
                default = gemm.choose_config(m, n, k, sms)
                ours = rotated_graph_us(lambda w: gemm.linear(x, w), weights)
                totals["cublas"][m] = totals["cublas"].get(m, 0) + cublas
                totals["triton"][m] = totals["triton"].get(m, 0) + ours
                line = (
                    f"  {model:10s} {name:7s} M={m:3d} N={n:5d} K={k:5d} floor {floor:6.1f}  cublas {cublas:6.1f}  "
                    f"triton {ours:6.1f} {default}"
                )
                swept = (
                    m in sweep_rows
                    if sweep_rows
                    else (model == "qwen3-0.6b" and m in (16, 64, 256) or model == "llama-8b" and m == 1)
                )
                if full and swept:
                    results = sorted(gemm_configs_us(x, weights))
                    line += "  best " + "  ".join(f"{us:5.1f} {cfg}" for us, cfg in results[:4])
                print(line, flush=True)
            del weights
        for m in (1, 16, 64, 128, 256):
            print(
                f"  {model} per layer M={m}: cublas {totals['cublas'][m]:6.1f} us, triton "
                f"{totals['triton'][m]:6.1f} us",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time attention launch configurations")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--splits", action="store_true", help="only the decode split-count table")
    parser.add_argument("--qwen3-sweep", action="store_true", help="only the launch sweep on qwen3 shapes")
    parser.add_argument(
        "--gemm", action="store_true", help="only the decode GEMMs: cuBLAS vs the Triton kernel"
    )
    parser.add_argument("--gemm-sweep", action="store_true", help="--gemm plus a sweep of its launch configs")
    parser.add_argument(
        "--extend-long", action="store_true", help="only extend attention over one long prompt"
    )
    parser.add_argument(
        "--page-size",
        type=int,
        default=PAGE_SIZE,
        help="--extend-long: the pool's page size (pages shuffled)",
    )
    parser.add_argument("--gemm-models", nargs="*", help="only these models' GEMMs (default: all)")
    parser.add_argument("--gemm-sweep-rows", nargs="*", type=int, help="sweep at these row counts")
    opts = parser.parse_args()
    print(
        f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}", flush=True
    )
    start = time.time()
    if opts.extend_long:
        extend_long_sweep(quick=opts.quick, page_size=opts.page_size)
        if failures:
            print("FAILURES:", *failures, sep="\n  ")
            sys.exit(1)
        return
    if opts.gemm or opts.gemm_sweep:
        rows = tuple(opts.gemm_sweep_rows) if opts.gemm_sweep_rows else None
        gemm_sweep(full=opts.gemm_sweep, models=opts.gemm_models, sweep_rows=rows)
        if failures:
            print("FAILURES:", *failures, sep="\n  ")
            sys.exit(1)
        return
    if opts.splits or opts.qwen3_sweep:
        split_table() if opts.splits else qwen3_sweep()
        return
    rng = random.Random(0)
    batches = (1, 64) if opts.quick else (1, 64, 256)

    print("\n== decode attention (page size 16, context uniform in 100..2048) ==", flush=True)
    for model in MODELS:
        for batch_size in batches:
            seq_lens = [rng.randint(100, 2048) for _ in range(batch_size)]
            decode_case(model, batch_size, seq_lens, f"ctx 100..2048 (mean {sum(seq_lens) // batch_size})")
        decode_case(model, 64, [2048] * 64, "ctx 2048")
        decode_case(model, 1, [40000], "ctx 40000")
    cuda_graph_case()

    print("\n== extend attention (page size 16) ==", flush=True)
    for model in MODELS:
        extend_case(model, [0], [2048], "B=1 prefill 2048")
        extend_case(model, [1536], [512], "B=1 cached 1536 + new 512")
        prefix = [rng.randint(0, 1024) for _ in range(8)]
        extend = [rng.randint(100, 1024) for _ in range(8)]
        extend_case(model, prefix, extend, f"B=8 cached 0..1024 + new 100..1024 ({sum(extend)} tok)")

    print("\n== fused kernels ==", flush=True)
    for model in MODELS:
        for tokens in (1, 64, 256, 4096):
            fused_cases(model, tokens)
    for batch in (1, 64, 256):
        sampling_case(batch)

    if opts.sweep:
        sweep()

    print(
        f"\n== summary ({time.time() - start:.0f} s; bytes = data each kernel must move; "
        f"ceiling 4.26 TB/s) =="
    )
    print(
        f"{'kernel':14s} {'model':11s} {'shape':46s} {'MB':>8s} {'time us':>9s} {'graph us':>9s} "
        f"{'GB/s':>7s} {'% ceil':>7s}  notes"
    )
    for r in rows:
        print(
            f"{r['kernel']:14s} {r['model']:11s} {r['shape']:46s} {r['mb']:8.2f} {r['us']:9.1f} "
            f"{r['graph_us']:9.1f} {r['gbs']:7.0f} {r['pct']:6.1f}%  {r['extra']}"
        )
    if failures:
        print(f"\n{len(failures)} correctness FAILURES:")
        for f in failures:
            print("  " + f)
        sys.exit(1)
    print("\nall correctness checks passed")


if __name__ == "__main__":
    main()
