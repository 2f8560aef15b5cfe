"""A CPU decode step's products with and without their output rows in groups (layers/linear.py:
torch_linear against F.linear), and whether the two give the same bits.

    python3 scripts/cpu_row_groups.py [--threads 2] [--rows 1,2,4,8]

The default model's products: 30 layers of qkv, o, gate_up and down, each with its own weights
(so they come from memory, as in a decode step), plus the 49,152 x 576 LM head; best of 7 passes,
ms per pass and the weights' GB/s. Then `torch.equal` of the two over shapes, rows 1-8 and
2-16 groups. For scale, a `sum` of 256 MB: what one pass over memory reads at this thread count.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from minfer.layers import linear

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M: (N, K)
HEAD_SHAPE = (49152, 576)


def best_ms(fn, passes: int = 7) -> float:
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,2,4,8")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    big = torch.randn(64 << 20)
    print(
        f"{args.threads} threads: sum of 256 MB reads {big.numel() * 4 / best_ms(big.sum, 5) / 1e6:.1f} GB/s"
    )
    weights = [torch.randn(n, k) for _ in range(30) for n, k in LAYER_SHAPES] + [torch.randn(*HEAD_SHAPE)]
    nbytes = sum(w.numel() * 4 for w in weights)
    for m in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(m, k) for k in (576, 1536)}
        cells = [f"F.linear {best_ms(lambda: [F.linear(inputs[w.shape[1]], w) for w in weights]):6.2f}"]
        cells.append(
            f"torch_linear {best_ms(lambda: [linear.torch_linear(inputs[w.shape[1]], w) for w in weights]):6.2f}"
        )
        for groups in (4, 8):
            run = lambda g=groups: [linear.grouped_linear(inputs[w.shape[1]], w, None, g) for w in weights]  # noqa: E731
            cells.append(f"{groups} groups {best_ms(run):6.2f}")
        print(f"rows {m}: " + " | ".join(cells) + f" ms for {nbytes / 1e6:.0f} MB", flush=True)
    torch.manual_seed(0)
    differ, total, rows_differing = 0, 0, set()
    for n, k in [*LAYER_SHAPES, HEAD_SHAPE, (4096, 1024), (1024, 3072)]:
        weight = torch.randn(n, k)
        for m in range(1, 9):
            x = torch.randn(m, k)
            ref = F.linear(x, weight)
            for groups in (2, 4, 8, 16):
                total += 1
                if not torch.equal(linear.grouped_linear(x, weight, None, groups), ref):
                    differ += 1
                    rows_differing.add(m)
    print(
        f"{differ} of {total} (shape, rows 1-8, groups) differ from F.linear in any bit"
        + (f", at rows {sorted(rows_differing)}" if differ else "")
    )


if __name__ == "__main__":
    main()
