"""One request's decode attention on a CPU at a long context, in every torch formulation tried.

    OMP_NUM_THREADS=1 taskset -c 1 python3 scripts/cpu_decode_attention_forms.py [--keys 1400]

The default model's shapes (9 query heads over 3 KV heads of 64, 30 layers), the keys a run of
a pool laid out [slots, KV heads, head dim] (the GPU's layout) or, for the form minfer's CPU
backends use, [KV heads, slots, head dim]; float32, one thread. Prints us per
layer and the K+V bytes over that time; compare with `sum read`, the same bytes only summed.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

KV_HEADS, GROUP, HEAD_DIM, LAYERS = 3, 3, 64, 30
SCALE = HEAD_DIM**-0.5


def per_head_bmm(q, k, v):  # what the torch backends did over a slot-major pool (until 2026-12-07)
    grouped = q.view(KV_HEADS, GROUP, HEAD_DIM)
    scores = torch.bmm(grouped, k.permute(1, 2, 0)).mul_(SCALE)
    return torch.bmm(scores.softmax(dim=-1), v.transpose(0, 1))


def head_major_bmm(q, k, v):  # the same over a head-major pool's run: what the CPU backends do now
    grouped = q.view(KV_HEADS, GROUP, HEAD_DIM)
    kh, vh = k.transpose(0, 1), v.transpose(0, 1)  # [KV heads, keys, dim], each head contiguous
    scores = torch.bmm(grouped, kh.transpose(1, 2)).mul_(SCALE)
    return torch.bmm(scores.softmax(dim=-1), vh)


def keys_major_bmm(q, k, v):  # scores as [KV heads, keys, group]: the keys are the GEMM's long side
    grouped = q.view(KV_HEADS, GROUP, HEAD_DIM)
    scores = torch.bmm(k.transpose(0, 1), grouped.transpose(1, 2)).mul_(SCALE)
    return torch.bmm(scores.softmax(dim=1).transpose(1, 2), v.transpose(0, 1))


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(
        q.view(1, -1, 1, HEAD_DIM),
        k.permute(1, 0, 2).unsqueeze(0),
        v.permute(1, 0, 2).unsqueeze(0),
        scale=SCALE,
        enable_gqa=True,
    )


def einsum(q, k, v):
    grouped = q.view(KV_HEADS, GROUP, HEAD_DIM)
    scores = torch.einsum("hgd,shd->hgs", grouped, k).mul_(SCALE)
    return torch.einsum("hgs,shd->hgd", scores.softmax(-1), v)


def block_diagonal(q, k, v):  # one contiguous [keys, 192] GEMM per side, 3x the FLOPs
    keys = k.shape[0]
    grouped = q.view(KV_HEADS, GROUP, HEAD_DIM)
    qbd = torch.block_diag(*[grouped[h].t() for h in range(KV_HEADS)])
    scores = torch.mm(k.reshape(keys, -1), qbd).mul_(SCALE)
    out = torch.mm(scores.softmax(dim=0).t(), v.reshape(keys, -1)).view(KV_HEADS, GROUP, KV_HEADS, HEAD_DIM)
    return torch.diagonal(out, dim1=0, dim2=2).permute(2, 0, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", type=int, default=1400)
    keys = ap.parse_args().keys
    torch.set_num_threads(1)
    # A K and a V tensor per layer: 30 layers' worth does not fit a cache, as in a real step.
    pool = [
        (torch.randn(keys + 200, KV_HEADS, HEAD_DIM), torch.randn(keys + 200, KV_HEADS, HEAD_DIM))
        for _ in range(LAYERS)
    ]
    # The same values laid out head-major (minfer's CPU pool), seen [slot, KV head, dim] as well.
    head_major = [tuple(t.transpose(0, 1).contiguous().transpose(0, 1) for t in kv) for kv in pool]
    q = torch.randn(KV_HEADS * GROUP, HEAD_DIM)
    kv_bytes = 2 * keys * KV_HEADS * HEAD_DIM * 4
    reference = None
    forms = {"per-head bmm": per_head_bmm, "head-major pool, per-head bmm (minfer)": head_major_bmm}
    forms |= {"keys-major bmm": keys_major_bmm, "SDPA": sdpa}
    forms |= {"einsum": einsum, "block-diagonal mm": block_diagonal}
    forms["sum read"] = lambda q, k, v: (k.sum(), v.sum())
    for name, form in forms.items():
        layers = head_major if form is head_major_bmm else pool
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for k, v in layers:
                form(q, k[100 : 100 + keys], v[100 : 100 + keys])
            best = min(best, time.perf_counter() - start)
        out = form(q, layers[0][0][100 : 100 + keys], layers[0][1][100 : 100 + keys])
        if name != "sum read":
            out = out.reshape(-1, HEAD_DIM)
            reference = out if reference is None else reference
            err = f", max |diff| {(out - reference).abs().max().item():.0e}"
        else:
            err = ""
        per_layer = best / LAYERS
        print(f"{name}: {per_layer * 1e6:.0f} us/layer, {kv_bytes / per_layer / 1e9:.1f} GB/s{err}")


if __name__ == "__main__":
    main()
