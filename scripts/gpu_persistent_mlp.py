"""Does a grid barrier cost less than a kernel boundary? A one-row MLP in one persistent launch.

The batch-1 decode step of Qwen3-0.6B spends ~21 us a layer over six launches against 6.5 us of
weight bytes (docs/PERFORMANCE.md, "Where the time goes now"): the boundaries, not the bytes.
What would close the 0.6 ms goal is a layer whose phases meet at barriers inside one launch,
each phase's weights asked for before its barrier as a chained gemv asks before its wait. Before
building that, this script measures the idea on the smallest piece that has a boundary in it:
the MLP, today two chained launches (gemv.gate_up_gemv: RMSNorm + residual prologue, SiLU
epilogue; then gemv.gemv for down), against one launch doing both with a grid barrier between.

1. The barrier alone: P programs (all resident) passing NB barriers in one launch, us a barrier,
   for polling by atomic and by volatile load.
2. A chain of `layers` MLPs at one row, each layer's weights its own (read from DRAM as in a
   decode step), replayed from a CUDA graph: us a layer for the engine's two launches and for the
   persistent launch at several grid sizes, and the largest difference between their outputs.

Run from the repository root on the GPU host:
    PYTHONPATH=$PWD python3 scripts/gpu_persistent_mlp.py [--models qwen3-0.6b llama-8b]
Under TRITON_INTERPRET=1 (CPU) `--check` runs the persistent kernel with one program on tiny
shapes against the engine's kernels (a barrier of one program), which checks its arithmetic.
"""

from __future__ import annotations

import argparse
import os

import torch
import triton
import triton.language as tl

# gpu_gemv (this directory) makes `minfer.kernels` importable without the server's dependencies
# and times CUDA graphs: graph_us(fn, calls) is us per fn(i) call, replayed.
from gpu_gemv import graph_us

from minfer.kernels import common, gemv, pdl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# A program that has polled this often without seeing every arrival gives up and raises the
# error flag: a grid that is not wholly resident would otherwise hang the GPU.
SPIN_LIMIT = tl.constexpr(1 << 16)


@triton.jit
def grid_barrier(counter_ptr, programs, VOLATILE_POLL: tl.constexpr):
    """Every program of the launch waits here until all `programs` have arrived; what each wrote
    before is visible to all after (release on arrival, acquire on leaving). counter_ptr holds
    [arrivals, departures, error flag]; the last program to leave zeroes the first two, so the
    counters are zero between launches (a CUDA graph replays them) without a memset."""
    tl.debug_barrier()  # every thread's stores of this program precede its arrival
    seen = tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu") + 1
    spins = 0
    while (seen < programs) & (spins < SPIN_LIMIT):
        if VOLATILE_POLL:
            seen = tl.load(counter_ptr, volatile=True)
        else:
            seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    if seen < programs:
        tl.atomic_xchg(counter_ptr + 2, 1, sem="relaxed", scope="gpu")
    tl.debug_barrier()  # no thread reads past the barrier before the acquire
    left = tl.atomic_add(counter_ptr + 1, 1, sem="relaxed", scope="gpu")
    if left == programs - 1:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(counter_ptr + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def _barriers_kernel(counter_ptr, BARRIERS: tl.constexpr, VOLATILE_POLL: tl.constexpr):
    programs = tl.num_programs(0)
    for i in tl.static_range(BARRIERS):
        grid_barrier(counter_ptr + 4 * i, programs, VOLATILE_POLL)


@triton.jit
def _gate_up_tile(w_ptr, t, tiles, I, H, BLOCK_G: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = t * BLOCK_G + tl.arange(0, BLOCK_G)
    cols = tl.arange(0, BLOCK_H)
    mask = ((rows < I) & (t < tiles))[:, None] & (cols < H)[None, :]
    ptrs = w_ptr + rows[:, None].to(tl.int64) * H + cols[None, :]
    gate = tl.load(ptrs, mask=mask, other=0.0)
    up = tl.load(ptrs + I * H, mask=mask, other=0.0)
    return gate, up


@triton.jit
def _down_tile(w_ptr, t, tiles, H, I, BLOCK_D: tl.constexpr, BLOCK_I: tl.constexpr):
    rows = t * BLOCK_D + tl.arange(0, BLOCK_D)
    cols = tl.arange(0, BLOCK_I)
    mask = ((rows < H) & (t < tiles))[:, None] & (cols < I)[None, :]
    return tl.load(w_ptr + rows[:, None].to(tl.int64) * I + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _persistent_mlp_kernel(
    x_ptr,
    res_ptr,
    res_out_ptr,
    norm_w_ptr,
    eps,
    gate_up_ptr,
    down_ptr,
    mid_ptr,
    out_ptr,
    counter_ptr,
    H,
    I,
    BLOCK_H: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    VOLATILE_POLL: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row: mid = silu(gate) * up of rmsnorm(x + res) * norm_w (phase 1, tiles of BLOCK_G
    outputs), a grid barrier, out = mid @ down.T (phase 2, tiles of BLOCK_D outputs). Each
    program walks tiles pid, pid + P, ...; its first tile of each phase is loaded before the
    phase's wait (the PDL wait, the barrier), as a chained gemv loads before its wait."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    g_tiles = tl.cdiv(I, BLOCK_G)
    d_tiles = tl.cdiv(H, BLOCK_D)
    gate, up = _gate_up_tile(gate_up_ptr, pid, g_tiles, I, H, BLOCK_G, BLOCK_H)
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    norm_w = tl.load(norm_w_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # The residual add and the norm, rounded where minfer.kernels.norm rounds (as gemv's prologue).
    x = tl.load(x_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + offs_h, mask=h_mask, other=0.0)
    summed = (x + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    if pid == 0:
        tl.store(res_out_ptr + offs_h, summed, mask=h_mask)
    x = summed.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / H + eps)
    x = ((x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * norm_w).to(x_ptr.dtype.element_ty)
    x = x.to(tl.float32)
    t = pid
    while t < g_tiles:
        g = tl.sum(gate.to(tl.float32) * x[None, :], axis=1).to(mid_ptr.dtype.element_ty).to(tl.float32)
        u = tl.sum(up.to(tl.float32) * x[None, :], axis=1).to(mid_ptr.dtype.element_ty).to(tl.float32)
        mid = (g / (1.0 + tl.exp(-g))).to(mid_ptr.dtype.element_ty).to(tl.float32) * u
        rows = t * BLOCK_G + tl.arange(0, BLOCK_G)
        tl.store(mid_ptr + rows, mid.to(mid_ptr.dtype.element_ty), mask=rows < I)
        t += programs
        gate, up = _gate_up_tile(gate_up_ptr, t, g_tiles, I, H, BLOCK_G, BLOCK_H)
    down = _down_tile(down_ptr, pid, d_tiles, H, I, BLOCK_D, BLOCK_I)  # in flight across the barrier
    grid_barrier(counter_ptr, programs, VOLATILE_POLL)
    offs_i = tl.arange(0, BLOCK_I)
    m = tl.load(mid_ptr + offs_i, mask=offs_i < I, other=0.0, cache_modifier=".cg").to(tl.float32)
    t = pid
    while t < d_tiles:
        acc = tl.sum(down.to(tl.float32) * m[None, :], axis=1)
        rows = t * BLOCK_D + tl.arange(0, BLOCK_D)
        tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=rows < H)
        t += programs
        down = _down_tile(down_ptr, t, d_tiles, H, I, BLOCK_D, BLOCK_I)


def counters(device, barriers: int = 1) -> torch.Tensor:
    return torch.zeros(4 * barriers, dtype=torch.int32, device=device)


def persistent_mlp(x, res, norm_w, eps, gate_up, down, counter, config):
    """(down(silu(gate) * up of rmsnorm(x + res) * norm_w), x + res) for one row, one launch.
    config: (programs, BLOCK_G, BLOCK_D, warps, volatile poll)."""
    programs, block_g, block_d, warps, volatile = config
    hidden, inter = down.shape
    mid = torch.empty(inter, dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    summed = torch.empty_like(x)
    chained = pdl.pdl_enabled(x.device)
    persistent_mlp.compiled = _persistent_mlp_kernel[(programs,)](
        x,
        res,
        summed,
        norm_w,
        eps,
        gate_up,
        down,
        mid,
        out,
        counter,
        hidden,
        inter,
        BLOCK_H=triton.next_power_of_2(hidden),
        BLOCK_I=triton.next_power_of_2(inter),
        BLOCK_G=block_g,
        BLOCK_D=block_d,
        VOLATILE_POLL=volatile,
        PDL=chained,
        num_warps=warps,
        **({"launch_pdl": True} if chained else {}),
    )
    return out, summed


def engine_mlp(x, res, norm_w, eps, gate_up, down):
    """The engine's batch-1 MLP today (layers/linear.py): two chained gemv launches."""
    mid, summed = gemv.gate_up_gemv(x, gate_up, norm_w, eps, res)
    return gemv.gemv(mid, down), summed


def check_interpreted() -> None:
    """One program (its barrier passes at once) on tiny shapes, against the engine's kernels."""
    gen = torch.Generator().manual_seed(0)
    for hidden, inter, block_g, block_d in ((64, 96, 16, 8), (48, 160, 32, 16)):
        x = torch.randn(1, hidden, generator=gen).to(torch.bfloat16)
        res = torch.randn(1, hidden, generator=gen).to(torch.bfloat16)
        norm_w = (torch.randn(hidden, generator=gen) * 0.1 + 1).to(torch.bfloat16)
        gate_up = (torch.randn(2 * inter, hidden, generator=gen) * hidden**-0.5).to(torch.bfloat16)
        down = (torch.randn(hidden, inter, generator=gen) * inter**-0.5).to(torch.bfloat16)
        counter = counters(x.device)
        out, summed = persistent_mlp(
            x, res, norm_w, 1e-6, gate_up, down, counter, (1, block_g, block_d, 4, 0)
        )
        ref, ref_summed = engine_mlp(x, res, norm_w, 1e-6, gate_up, down)
        assert torch.equal(summed, ref_summed)
        diff = (out.float() - ref.float()).abs().max().item()
        assert diff <= 2e-2 * ref.float().abs().max().item(), diff
        assert counter.tolist() == [0, 0, 0, 0], counter.tolist()
        print(f"H={hidden} I={inter}: max |diff| {diff:.2e}, counters zero after the launch")


def graph_replay_us(run) -> float:
    """us per replay of a graph of run()."""
    return graph_us(lambda i: run(), 1, replays=50)


def barrier_cost(sms: int) -> None:
    print(
        "\n== grid barriers alone: us per barrier (one launch of 32 barriers minus one of 1) ==", flush=True
    )
    for programs in (sms, 2 * sms):
        for volatile in (0, 1):
            times = {}
            for barriers in (1, 32):
                counter = counters(torch.device("cuda"), barriers)
                times[barriers] = graph_replay_us(
                    lambda: _barriers_kernel[(programs,)](
                        counter, BARRIERS=barriers, VOLATILE_POLL=volatile, num_warps=4
                    )
                )
                flags = counter.view(-1, 4)[:, :3]
                assert not flags.any(), f"barrier counters not reset or timed out: {flags.tolist()}"
            per = (times[32] - times[1]) / 31
            print(
                f"  {programs:4d} programs, poll by {'volatile load' if volatile else 'atomic':13s}: "
                f"{per:5.2f} us a barrier (launch of one: {times[1]:5.2f} us)",
                flush=True,
            )


MODELS = {"qwen3-0.6b": (1024, 3072, 28), "llama-8b": (4096, 14336, 8)}


def mlp_chain(model: str, sms: int, configs: list[tuple]) -> None:
    hidden, inter, layers = MODELS[model]
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)

    def weight(*shape):
        return (torch.randn(shape, generator=gen, device=device) * shape[-1] ** -0.5).to(torch.bfloat16)

    params = [
        dict(norm=weight(hidden) + 1, gate_up=weight(2 * inter, hidden), down=weight(hidden, inter))
        for _ in range(layers)
    ]
    x0 = torch.randn((1, hidden), generator=gen, device=device).to(torch.bfloat16)
    counter = counters(device)

    def chain(mlp):
        def run():
            h, res = x0, torch.zeros_like(x0)
            for p in params:
                h, res = mlp(h, res, p["norm"], 1e-6, p["gate_up"], p["down"])
            return h + res

        return run

    ref_run = chain(engine_mlp)
    ref = ref_run().float()
    weight_bytes = sum(p["gate_up"].numel() + p["down"].numel() for p in params) * 2 / layers
    print(
        f"\n== {model} MLP chain, one row, {layers} layers (floor {weight_bytes / 4.8e6:.2f} us a layer "
        f"at 4.8 TB/s) ==",
        flush=True,
    )
    print(
        f"  engine (gate_up_gemv + gemv, chained): {graph_replay_us(ref_run) / layers:6.2f} us a layer",
        flush=True,
    )
    for config in configs:
        programs, block_g, block_d, warps, volatile = config
        run = chain(lambda *a: persistent_mlp(*a, counter, config))
        try:
            # one program first (its barrier passes at once): the binary, to see if P fit at once
            p = params[0]
            persistent_mlp(x0, x0, p["norm"], 1e-6, p["gate_up"], p["down"], counter, (1, *config[1:]))
            compiled = persistent_mlp.compiled
            regs = -(-compiled.n_regs // 8) * 8 * 32 * warps
            resident = min(65536 // regs, (227 << 10) // max(1, compiled.metadata.shared), 64 // warps)
            if programs > resident * sms:
                print(
                    f"  persistent {config}: {compiled.n_regs} registers, {compiled.metadata.shared} B shared:"
                    f" {resident} a SM, not {programs} programs at once: skipped",
                    flush=True,
                )
                continue
            out = run().float()
            torch.cuda.synchronize()
        except Exception as e:  # out of registers or shared memory
            print(f"  persistent {config}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        if counter.any():
            print(
                f"  persistent {config}: counters {counter.tolist()} (timed out: not all resident)",
                flush=True,
            )
            counter.zero_()
            continue
        diff = (out - ref).abs().max().item() / ref.abs().max().item()
        us = graph_replay_us(run) / layers
        print(
            f"  persistent P={programs:3d} BLOCK_G={block_g:2d} BLOCK_D={block_d:2d} warps={warps} "
            f"poll={'volatile' if volatile else 'atomic  '}: {us:6.2f} us a layer (max rel diff {diff:.1e}; "
            f"{compiled.n_regs} registers, {compiled.n_spills} spills)",
            flush=True,
        )
    print(f"  engine again: {graph_replay_us(ref_run) / layers:6.2f} us a layer", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--check", action="store_true", help="the interpreter's arithmetic check (CPU)")
    parser.add_argument(
        "--configs",
        nargs="*",
        help="persistent launches to time instead of the default set: P,BLOCK_G,BLOCK_D,warps",
    )
    parser.add_argument("--no-barriers", action="store_true", help="skip the barrier-alone table")
    args = parser.parse_args()
    if args.check or INTERPRET:
        check_interpreted()
        return
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    sms = common.num_sms(torch.device("cuda"))
    if not args.no_barriers:
        barrier_cost(sms)
    for model in args.models:
        hidden, inter, _ = MODELS[model]
        configs = []
        if args.configs:
            for text in args.configs:
                configs.append((*map(int, text.split(",")), 0))
            mlp_chain(model, sms, configs)
            continue
        for programs, warps in ((sms, 8), (2 * sms, 8), (2 * sms, 4), (3 * sms, 4)):
            # the phase's whole work spread over the grid: one or two tiles a program
            block_g = max(1, min(32, triton.next_power_of_2(triton.cdiv(inter, programs))))
            block_d = max(1, min(16, triton.next_power_of_2(triton.cdiv(hidden, programs))))
            while block_g * triton.next_power_of_2(hidden) * 2 > 32768 and block_g > 1:
                block_g //= 2
            while block_d * triton.next_power_of_2(inter) > 32768 and block_d > 1:
                block_d //= 2
            for volatile in (0, 1):
                configs.append((programs, block_g, block_d, warps, volatile))
        mlp_chain(model, sms, configs)


if __name__ == "__main__":
    main()
