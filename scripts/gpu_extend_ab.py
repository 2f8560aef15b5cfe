"""Builds of the Gluon extend kernel against each other, in one process, on the chunks of a long
prompt (Llama-8B heads, 8,192-token chunks of a 32k prompt by default).

Here (the builds are git refs, as for any A/B; `.ab/` is carried to the device):

    python3 scripts/ab_variants.py prepare main=HEAD sums=extend-sums-mma

On the device, from the repository root:

    python3 scripts/gpu_extend_ab.py --rounds 3 --page-size 128

Why in one process: the card's speed drifts by several percent between calls and even between
seconds of one call (docs/BENCHMARKS.md, thirtieth session), so builds are timed in interleaved
rounds on the same tensors and compared by their medians. Each build's kernel module and its
consumer module are loaded from `.ab/<name>/minfer/kernels/` under names of their own (Gluon
reads a kernel's source from its file, so the kernel's copy, whose import of the consumer is
renamed, is written beside the others in a temporary directory); its launch function replaces
the engine's for the timed calls. Every output is checked against the Triton kernel's.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = Path("minfer") / "kernels"
CONSUMER_IMPORT = "from minfer.kernels.attention_extend_wgmma_consumer import"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (the kernel module imports its consumer by this name)
    spec.loader.exec_module(module)
    return module


def load_build(name: str, variant_dir: Path, scratch: Path):
    """The extend_attention_wgmma function of the build in variant_dir/minfer."""
    kernels = variant_dir / KERNELS
    consumer = f"extend_consumer_{name}"
    _load(consumer, kernels / "attention_extend_wgmma_consumer.py")
    source = (kernels / "attention_extend_wgmma.py").read_text()
    if source.count(CONSUMER_IMPORT) != 1:
        sys.exit(f"{name}: its kernel module no longer imports the consumer as `{CONSUMER_IMPORT}`")
    kernel_path = scratch / f"extend_kernel_{name}.py"
    kernel_path.write_text(source.replace(CONSUMER_IMPORT, f"from {consumer} import"))
    module = _load(kernel_path.stem, kernel_path)

    def launch(*args, **kwargs) -> bool:
        # (a failed launch returns False and the engine would time its Triton kernel instead)
        if not module.extend_attention_wgmma(*args, **kwargs):
            sys.exit(f"{name}: the Gluon kernel failed: {module._disabled}")
        return True

    return launch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("builds", nargs="*", help="names under .ab/ (default: all of them)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--page-size", type=int, default=128, help="the pool's pages (shuffled)")
    parser.add_argument("--prompt", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=8192)
    opts = parser.parse_args()
    variants = ROOT / ".ab"
    names = opts.builds or sorted(p.name for p in variants.iterdir() if (p / KERNELS).is_dir())
    if not names:
        sys.exit("no builds: run `python3 scripts/ab_variants.py prepare NAME=REF ...` first")

    sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
    import torch
    import triton
    from gpu_check import extend_problem

    from minfer.kernels import attention_extend, attention_extend_wgmma
    from minfer.kernels.attention_extend import extend_attention

    scratch = Path(tempfile.mkdtemp())
    builds = {name: load_build(name, variants / name, scratch) for name in names}
    engine_launch = attention_extend_wgmma.extend_attention_wgmma
    print(f"{torch.cuda.get_device_name()}, pages of {opts.page_size}, builds {', '.join(names)}")
    totals = {name: [0.0, 0] for name in names}  # us, FLOPs
    for prefix in range(0, opts.prompt, opts.chunk):
        args, flop = extend_problem("llama-8b", [prefix], [opts.chunk], 0, page_size=opts.page_size)
        attention_extend.WGMMA_LONG = False
        expected = extend_attention(*args).float()
        attention_extend.WGMMA_LONG = True
        times: dict[str, list[float]] = {name: [] for name in names}
        for round_ in range(opts.rounds):
            order = names if round_ % 2 == 0 else names[::-1]
            for name in order:
                attention_extend_wgmma.extend_attention_wgmma = builds[name]
                if round_ == 0:
                    err = (extend_attention(*args).float() - expected).abs().max().item()
                    print(f"  prefix {prefix:6d} {name}: max |diff| against Triton {err:.2g}")
                times[name].append(triton.testing.do_bench(lambda: extend_attention(*args)) * 1e3)
        for name in names:
            us = statistics.median(times[name])
            totals[name][0] += us
            totals[name][1] += flop
            spread = ", ".join(f"{flop / t / 1e6:.1f}" for t in times[name])
            print(
                f"prefix {prefix:6d} {name:>10s}: {us:8.1f} us {flop / us / 1e6:6.1f} TFLOP/s (rounds {spread})"
            )
    attention_extend_wgmma.extend_attention_wgmma = engine_launch
    for name, (us, flop) in totals.items():
        print(f"prompt {opts.prompt} {name:>10s}: {us:8.1f} us {flop / us / 1e6:6.1f} TFLOP/s")


if __name__ == "__main__":
    main()
