"""One long-prompt chunk through the extend kernels, a few launches each, for a profiler:

    ncu --kernel-name regex:_extend_wgmma_kernel --launch-skip 2 --launch-count 1 \\
        --section WarpStateStats python3 scripts/gpu_extend_one.py

Llama-8B heads (32 q, 8 kv, 128 dims), an 8,192-token chunk over a 16,384-token prefix (pages of
16 by default, shuffled), as chunked prefill runs the third chunk of a 32k prompt. The Triton
kernel runs first (`_extend_kernel`), then the Gluon one (`_extend_wgmma_kernel`), `--launches`
times each.

`--variants` times diagnostic builds of the Gluon kernel, made by patching its source (each
patch must match the source exactly once, so a stale patch fails loudly): `no-copies` (the
producer fills the ring once and then only signals, so the consumers compute on real data with no
K/V traffic: the consumers' ceiling), `zero-fill` (cp.async only, and every copy after the first
fill reads nothing and writes zeros: shared-memory writes without L2 reads) and `cp-async` (every
block gathered row by row with cp.async, none by TMA: the kernel as before TMA).

`--page-size` sets the pool's pages (shuffled): with pages of 128 or more every full key block is
one TMA box, with fewer none is.

Clocks: the default three launches run at the card's boost clock; the Gluon kernel takes an
H100 to its power cap within a second, after which it runs ~13% slower (docs/BENCHMARKS.md,
thirty-second session). `--launches 200` gives the sustained figure, which is what a prefill
sees. `--host` also prints the host's time to enqueue one launch of each kernel.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
import tempfile
from pathlib import Path

import torch
import triton
from gpu_check import extend_problem

from minfer.kernels import attention_extend, attention_extend_wgmma
from minfer.kernels.attention_extend import extend_attention

# Diagnostic builds of attention_extend_wgmma: (text, replacement) pairs applied to its source.
_FIRST_FILL = f"first < {attention_extend_wgmma.CONFIG[1] * attention_extend_wgmma.CONFIG[2]}"  # i < STAGES
_TMA = "    if start >= 0:\n"
VARIANTS = {
    "no-copies": [(_TMA, f"    if not ({_FIRST_FILL}):\n        mbarrier.arrive(bar, count=gl.num_warps() * 32)\n    elif start >= 0:\n")],
    "zero-fill": [("mask=(first + rows < end)[:, None])", f"mask=((first + rows < end) & ({_FIRST_FILL}))[:, None])"),
                  (_TMA, "    if False:\n")],
    "cp-async": [(_TMA, "    if False:\n")],
}  # fmt: skip


def load_variant(name: str):
    """attention_extend_wgmma with VARIANTS[name] applied, imported from a temporary file (Gluon
    reads a kernel's source from its file)."""
    source = inspect.getsource(attention_extend_wgmma)
    for text, replacement in VARIANTS[name]:
        if source.count(text) != 1:
            sys.exit(f"variant {name}: the kernel's source no longer has {text!r} exactly once")
        source = source.replace(text, replacement)
    path = Path(tempfile.mkdtemp()) / f"extend_{name.replace('-', '_')}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def host_time(args: tuple, launches: int = 50) -> None:
    """What the host spends to enqueue one launch (the GPU runs behind, so this is Python and
    the launcher alone): per-launch timers such as triton.testing.do_bench count whatever of it
    is not hidden behind their L2 flush, and an engine's eager prefill pays it per layer."""
    import cProfile
    import pstats
    import time

    for wgmma in (False, True):
        attention_extend.WGMMA_LONG = wgmma
        extend_attention(*args)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(launches):
            extend_attention(*args)
        host = (time.perf_counter() - start) / launches * 1e6
        torch.cuda.synchronize()
        print(f"{'gluon' if wgmma else 'triton'}: host {host:7.1f} us per launch enqueued")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(launches):
        extend_attention(*args)
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=int, default=16384)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument(
        "--configs",
        nargs="*",
        default=[],
        help="also time the Gluon kernel in these CONFIGs, e.g. 128,64,5 (checked against Triton)",
    )
    parser.add_argument("--variants", nargs="*", default=[], choices=sorted(VARIANTS))
    parser.add_argument(
        "--host", action="store_true", help="also the host's time to enqueue a launch, and its profile"
    )
    opts = parser.parse_args()
    args, flop = extend_problem("llama-8b", [opts.prefix], [opts.chunk], 0, page_size=opts.page_size)
    if opts.host:
        host_time(args)
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

    def timed(label: str) -> None:
        err = (extend_attention(*args).float() - expected.float()).abs().max().item()
        us = triton.testing.do_bench(lambda: extend_attention(*args), warmup=25, rep=100) * 1e3
        print(f"gluon {label}: {us:8.1f} us per launch, {flop / us / 1e6:6.1f} TFLOP/s, max |diff| {err:.2g}")

    default = attention_extend_wgmma.CONFIG
    for text in opts.configs:
        attention_extend_wgmma.CONFIG = tuple(int(x) for x in text.split(","))
        timed(text)
    attention_extend_wgmma.CONFIG = default
    launch = attention_extend_wgmma.extend_attention_wgmma
    for name in opts.variants:  # (their outputs are wrong by design: the K/V they use are stale)
        attention_extend_wgmma.extend_attention_wgmma = load_variant(name).extend_attention_wgmma
        timed(name)
    attention_extend_wgmma.extend_attention_wgmma = launch


if __name__ == "__main__":
    main()
