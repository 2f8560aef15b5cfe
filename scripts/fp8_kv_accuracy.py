"""How much an fp8 KV cache moves the default model (issue 18, "Accuracy"), on CPU, real weights.

    PYTHONPATH=$PWD python3 scripts/fp8_kv_accuracy.py [--prompts 50] [--scales unit,head,tensor]

Prompts: 50 windows of 100-500 tokens cut from this repository's docs/*.md (real English text,
deterministic offsets). For each, the float32 cache (--kv-cache-dtype auto) gives the reference
per-token prompt log-probabilities and a greedy 32-token continuation; each fp8 configuration
is compared with it: mean and max |delta log-prob| over all prompt tokens (nats), and the share
of prompts whose greedy continuation is identical. Bounds (issue 18): mean |delta| <= 0.02 nats,
identical continuations on >= 90% of prompts. Prints PASS/FAIL per configuration.

fp8 scale configurations (KVPool's scales are static, [layers, kv heads]):
  unit    1.0 everywhere (what --kv-cache-dtype fp8_e4m3 does; vLLM's default without scales)
  head    amax / 448 per layer and kv head, calibrated on 8 other windows of the docs
  tensor  amax / 448 per layer (the largest over its heads), same calibration
  token   simulated, not a pool format: a scale per token and kv head (its amax / 448), K/V
          rounded through fp8 and back in a float32 pool; what dynamic per-token scales would give
  k-only  simulated: only K goes through fp8 (scale 1), V stays float32 -- which of the two costs
  v-only  simulated: only V goes through fp8 (scale 1)
  bf16    simulated: K/V rounded to bfloat16 (for scale: what a bf16 cache costs on its own)
"""

from __future__ import annotations

import argparse
import pathlib
import random
import time

import torch

from minfer import LLM, SamplingParams
from minfer.kvcache.pool import FP8_MAX

REPO = pathlib.Path(__file__).resolve().parent.parent


def doc_token_windows(tokenizer, count: int, seed: int) -> list[list[int]]:
    text = "\n\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    ids = tokenizer.encode(text)
    rng = random.Random(seed)
    windows = []
    for _ in range(count):
        n = rng.randint(100, 500)
        start = rng.randrange(len(ids) - n)
        windows.append(ids[start : start + n])
    return windows


def calibrate(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """amax of K and V per (layer, kv head) over a float32-cache run of `prompts`: every K/V the
    model writes goes through KVPool.store on CPU, so recording its inputs sees all of them."""
    llm = LLM(kv_cache_dtype="auto")
    pool = llm.engine.kv_pool
    k_amax = torch.zeros(pool.num_layers, pool.num_kv_heads)
    v_amax = torch.zeros(pool.num_layers, pool.num_kv_heads)
    store = pool.store

    def recording_store(layer, k, v, out_loc):
        k_amax[layer] = torch.maximum(k_amax[layer], k.abs().amax(dim=(0, 2)))
        v_amax[layer] = torch.maximum(v_amax[layer], v.abs().amax(dim=(0, 2)))
        store(layer, k, v, out_loc)

    pool.store = recording_store
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return k_amax, v_amax


def fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    scale = (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


SIMULATED = {  # name: (what K goes through, what V goes through) before a float32 store
    "token": (fp8_per_token, fp8_per_token),
    "k-only": (lambda x: x.to(torch.float8_e4m3fn).float(), lambda x: x),
    "v-only": (lambda x: x, lambda x: x.to(torch.float8_e4m3fn).float()),
    "bf16": (lambda x: x.bfloat16().float(), lambda x: x.bfloat16().float()),
}


def run(prompts, kv_cache_dtype: str, scales=None, simulate: str | None = None):
    # 2048-token prefill steps: prompt log-probs hold a [tokens, vocab] float32 matrix per step
    llm = LLM(kv_cache_dtype=kv_cache_dtype, chunked_prefill_size=2048)
    pool = llm.engine.kv_pool
    if scales is not None:
        pool.set_scales(*scales)
    if simulate is not None:
        k_round, v_round = SIMULATED[simulate]
        store = pool.store
        pool.store = lambda layer, k, v, out_loc: store(layer, k_round(k), v_round(v), out_loc)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, prompt_logprobs=0)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    logprobs = [torch.tensor(o.prompt_logprobs.logprobs[1:], dtype=torch.float64) for o in outs]
    return logprobs, [o.token_ids for o in outs], seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument(
        "--scales",
        default="unit,head,token,k-only,v-only",
        help="comma-separated configurations (above)",
    )
    args = ap.parse_args()

    tokenizer = LLM(kv_cache_tokens=64).tokenizer
    prompts = doc_token_windows(tokenizer, args.prompts, seed=18)
    print(
        f"{len(prompts)} prompts, {sum(map(len, prompts))} tokens ({min(map(len, prompts))}-{max(map(len, prompts))} each)"
    )
    ref_lp, ref_tokens, seconds = run(prompts, "auto")
    print(f"float32 cache: {seconds:.0f} s")

    configs = args.scales.split(",")
    calibration = (
        calibrate(doc_token_windows(tokenizer, 8, seed=1800)) if {"head", "tensor"} & set(configs) else None
    )
    for name in configs:
        scales = None
        if name in ("head", "tensor"):
            k_amax, v_amax = calibration
            if name == "tensor":
                k_amax = k_amax.amax(1, keepdim=True).expand_as(k_amax)
                v_amax = v_amax.amax(1, keepdim=True).expand_as(v_amax)
            scales = (k_amax / FP8_MAX, v_amax / FP8_MAX)
        simulated = name in SIMULATED
        lp, tokens, seconds = run(
            prompts, "auto" if simulated else "fp8_e4m3", scales, name if simulated else None
        )
        delta = torch.cat([(a - b).abs() for a, b in zip(lp, ref_lp)])
        same = sum(a == b for a, b in zip(tokens, ref_tokens)) / len(prompts)
        ok = delta.mean().item() <= 0.02 and same >= 0.9
        print(
            f"{'PASS' if ok else 'FAIL'} {'simulated' if simulated else 'fp8_e4m3'} {name}: prompt log-prob |delta| mean "
            f"{delta.mean():.4f} max {delta.max():.4f} nats over {delta.numel()} tokens; greedy 32-token "
            f"continuations identical {same:.0%} ({seconds:.0f} s)"
        )


if __name__ == "__main__":
    main()
