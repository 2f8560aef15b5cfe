"""Programmatic dependent launch (PDL): which launches of a step start early, and how a kernel
waits for the one before it. A chained kernel is launched while the kernel before it still runs,
reads what no earlier kernel of the step writes (its weights, the host's staged inputs), then
waits (`pdl_start`); every kernel that takes these arguments lets the next one start early.
Which row counts are chained, and the modes for A/B runs, are read from the environment once."""

from __future__ import annotations

import functools
import os
import types

import torch
import triton
import triton.language as tl

from minfer.kernels.common import INTERPRET

# MINFER_PDL: "1" (the default) chains the launches whose rows CHAIN_BANDS names and releases the
# rest, each kernel releasing the next before its own wait (see pdl_start); for A/B runs, "late" is
# "1" with the release after the wait (the twenty-third session's default), "chain" chains every
# launch, "release" none (the fifteenth session's), "0" turns programmatic dependent launch off.
_PDL_MODES = ("0", "release", "1", "late", "chain")
# Read at import, as a compile-time constant of every kernel that calls pdl_start. Releasing
# first let launches run several deep: H200, batch-1 decode graph 0.715 -> 0.681 ms for
# Qwen3-0.6B, 3.956 -> 3.917 ms for Llama-3.1-8B (docs/BENCHMARKS.md, twenty-fourth session).
EARLY_RELEASE = tl.constexpr(os.environ.get("MINFER_PDL", "1") != "late")
# Chained launches (started early, waiting at their first statement): one and two rows, where
# the gemv between kernels reads its weights early and a step is mostly kernel boundaries (H200,
# batch-1 graph 0.96 -> 0.83 ms for Qwen3-0.6B), and 33-64 rows, where the split-K GEMM asks L2
# for its weight slice before its wait (H100, 32-63 band 4.15 -> 4.07 ms, offline +0.24%). Not
# 3-32 rows (5-15% slower; batches of 17-31 replay the 32-row graph) nor cuBLAS's larger ones;
# chaining every launch cost ~1% (docs/BENCHMARKS.md, eighteenth, twenty-sixth, thirty-seventh).
CHAIN_ROWS = 2
DEFAULT_CHAIN_BANDS = f"1-{CHAIN_ROWS},33-64"


def parse_chain_bands(text: str) -> tuple[tuple[int, int], ...]:
    """MINFER_CHAIN_BANDS: comma-separated inclusive row ranges ("1-2,32-64") whose launches are
    chained, for A/B runs of where chaining pays (docs/BENCHMARKS.md, twenty-sixth session)."""
    bands = []
    for band in text.split(","):
        low, sep, high = band.strip().partition("-")
        if not (sep and low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high)):
            raise ValueError(f"MINFER_CHAIN_BANDS={text!r}: expected ranges of rows like 1-2,32-64")
        bands.append((int(low), int(high)))
    return tuple(bands)


# Read at import, like MINFER_PDL.
CHAIN_BANDS = parse_chain_bands(os.environ.get("MINFER_CHAIN_BANDS", DEFAULT_CHAIN_BANDS))


def chained_rows(rows: int) -> bool:
    """Whether launches over `rows` rows are chained (see CHAIN_ROWS and MINFER_CHAIN_BANDS)."""
    return any(low <= rows <= high for low, high in CHAIN_BANDS)


def _pdl_mode() -> str:
    mode = os.environ.get("MINFER_PDL", "1")
    if mode not in _PDL_MODES:
        raise ValueError(f"MINFER_PDL={mode!r}: expected one of {', '.join(_PDL_MODES)}")
    return mode


@functools.cache
def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` use programmatic dependent launch (minfer.kernels.gemv): compiled
    kernels (not the interpreter) on compute capability 9.0 or later, unless MINFER_PDL=0."""
    if INTERPRET or device.type != "cuda" or _pdl_mode() == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_args(device: torch.device, rows: int) -> types.MappingProxyType:
    """Launch arguments of a kernel over `rows` rows (tokens, or requests of a decode step) that
    starts with `pdl_start`: PDL_RELEASE (let the next kernel start early) wherever PDL is
    enabled; where the launch is chained (see CHAIN_BANDS) also PDL_WAIT and the launch
    attribute, so this kernel itself starts while the one before it finishes."""
    return _pdl_args(device, chained_rows(rows))


@functools.cache
def _pdl_args(device: torch.device, few_rows: bool) -> types.MappingProxyType:
    # cached and read-only: it is unpacked into every launch of those kernels
    release = pdl_enabled(device)
    mode = _pdl_mode()
    chained = release and (mode == "chain" or (mode in ("1", "late") and few_rows))
    return types.MappingProxyType(
        {"PDL_RELEASE": release, "PDL_WAIT": chained, **({"launch_pdl": True} if chained else {})}
    )


# MINFER_CHAIN_ATTENTION: "bands" chains decode attention where CHAIN_BANDS says, like every other
# kernel, and launches rope_store without PDL; "all" chains both at every batch size, so the
# attention launch reads its lengths, page-table rows and first key slots while rope_store runs,
# and rope_store its positions and cos/sin rows while the qkv product runs. "auto" is "all" over
# an fp8 pool and "bands" over the others: measured (H100, docs/PERFORMANCE.md section 43), "all"
# took the fp8 workload 1.1% faster in every batch band, and left bf16 where it was (2-31
# running faster, 32-127 slower). The default stays "bands" until the fp8 kernel tests have run
# on a GPU under "auto" (bf16's ran under "all": 67 passed).
_CHAIN_ATTENTION = os.environ.get("MINFER_CHAIN_ATTENTION", "bands")
if _CHAIN_ATTENTION not in ("auto", "bands", "all"):
    raise ValueError(f"MINFER_CHAIN_ATTENTION={_CHAIN_ATTENTION!r}: expected auto, bands or all")
_NO_PDL = types.MappingProxyType({"PDL_RELEASE": False, "PDL_WAIT": False})


def _chain_every_size(fp8_pool: bool) -> bool:
    return _CHAIN_ATTENTION == "all" or (_CHAIN_ATTENTION == "auto" and fp8_pool)


def attention_chained(rows: int, fp8_pool: bool) -> bool:
    """Whether decode attention over `rows` requests is a chained launch (fp8_pool: the K/V it
    reads are one byte a value)."""
    return _chain_every_size(fp8_pool) or chained_rows(rows)


def attention_pdl_args(device: torch.device, rows: int, fp8_pool: bool) -> types.MappingProxyType:
    """pdl_args for decode attention (see MINFER_CHAIN_ATTENTION)."""
    return _pdl_args(device, attention_chained(rows, fp8_pool))


def rope_store_pdl_args(device: torch.device, fp8_pool: bool) -> types.MappingProxyType:
    """rope_store's PDL arguments: chained where attention is chained at every size, else none."""
    return _pdl_args(device, True) if _chain_every_size(fp8_pool) else _NO_PDL


def reset_pdl_choice() -> None:
    """Read MINFER_PDL again (A/B scripts and tests that change it within one process)."""
    pdl_enabled.cache_clear()
    _pdl_args.cache_clear()


@triton.jit
def pdl_start(PDL_RELEASE: tl.constexpr, PDL_WAIT: tl.constexpr):
    """The first statement of a kernel that takes `pdl_args`, after whatever it reads that no
    earlier kernel of the step writes (a gemv's weights, the decode kernel's page-table row).
    PDL_WAIT: this kernel was launched early (programmatic dependent launch) and blocks here
    until the previous kernel has finished and its writes are visible, before it reads or
    writes anything the previous kernels touch. PDL_RELEASE: let the next kernel on the stream
    start if it was launched with the attribute (the gemv after an RMSNorm, a SiLU-and-multiply
    or attention reads its weights meanwhile and waits for this kernel's writes with its own
    `gdc_wait`). Kernels launched without the attribute still start only when this one has
    finished.

    The release comes first (EARLY_RELEASE), so the next kernel may start its own early reads
    while this one still waits, and a chain of launches fills the SMs as far as their registers
    allow; MINFER_PDL=late puts it after the wait, so at most two kernels run at once. Both
    orders are safe for what a kernel reads after its wait, for the same reason: a kernel's wait
    returns only when the kernel before it has finished, which is after that kernel's own wait
    returned. What a kernel reads before its wait must not be written by any kernel that can
    still be running, and with the release first that can be any earlier launch of the step:
    only what the host staged, or what the step's first launch (decode_step, which releases
    nothing) wrote. Nothing may be written before the wait. A chain cannot deadlock: a kernel is
    released only when all its programs have started (or ended), so the oldest kernel of a
    chain is always wholly resident and finishes."""
    if PDL_RELEASE and EARLY_RELEASE:
        tl.extra.cuda.gdc_launch_dependents()
    if PDL_WAIT:
        tl.extra.cuda.gdc_wait()
    if PDL_RELEASE and not EARLY_RELEASE:
        tl.extra.cuda.gdc_launch_dependents()
