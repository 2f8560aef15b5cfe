"""Greedy parity with a transformers reference, allowing a float near-tie (and nothing else).

Two correct implementations may still pick different greedy tokens where the reference's two
best logits are nearly equal: a different summation order (a GPU GEMM, TF32, another split of a
reduction) moves logits by ~1e-6..1e-4, which is enough to swap a near-tied pair, and after the
swap the continuations have nothing in common. So a first divergence is accepted only when,
at that position, the reference computed in float64 has

    top1 - top2 < gap     and    the engine's token is one of those two,

and everything before it is identical. Anything else (a token outside the top two, a clear
winner not taken, a different length) fails. The float64 logits are recomputed from a float64
copy of the reference model over the prompt plus the agreed tokens, so the gap itself is
free of the float32 rounding that made the tie ambiguous.
"""

from __future__ import annotations

import copy

import torch

# The largest top-1 minus top-2 logit gap (float64 reference) at which a first divergence counts
# as a near-tie, by the engine's compute dtype. float32 engines agree with transformers to ~1e-6
# in logits (CPU), so 1e-4 leaves room for a GPU's other summation order and nothing more. On
# CUDA a float32 checkpoint runs in bfloat16 (models/loader.resolve_dtype): 8 mantissa bits put
# ~2e-3 of rounding on a logit of ~1 at the lm_head alone; 1e-2 allows for the layers before it.
# The tiny models' (tiny_models.py) median gap is 3e-2 (llama/mistral) to 3e-1 (qwen): a real
# mismatch still fails. The Mistral case that diverged on the H200 at token 10 sits on a 1.3e-3 gap.
NEAR_TIE_LOGIT_GAP = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def near_tie_gap(dtype: torch.dtype) -> float:
    """The near-tie tolerance for an engine computing in `dtype` (NEAR_TIE_LOGIT_GAP)."""
    return NEAR_TIE_LOGIT_GAP[dtype]


def reference_top2_float64(model, ids: list[int]) -> tuple[list[int], list[float]]:
    """The two most likely next tokens after `ids` and their logits, from a float64 copy of a
    transformers causal LM (the copy is made per call: only a divergence pays for it)."""
    ref64 = copy.deepcopy(model).to(torch.float64).eval()
    with torch.no_grad():
        logits = ref64(torch.tensor([ids])).logits[0, -1].to(torch.float64)
    top = logits.topk(2)
    return top.indices.tolist(), top.values.tolist()


def assert_greedy_parity(model, prompt: list[int], got: list[int], expected: list[int], gap: float) -> None:
    """Fail unless `got` equals `expected` (the reference's greedy tokens after `prompt`) or first
    differs from it at a near-tie of the reference (see the module docstring); `gap` is in
    logits, usually near_tie_gap(engine dtype)."""
    if got == expected:
        return
    agreed = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    if agreed is None:
        raise AssertionError(
            f"lengths differ after {min(len(got), len(expected))} identical tokens: got {got}, expected {expected}"
        )
    ids, logits = reference_top2_float64(model, prompt + expected[:agreed])
    margin = logits[0] - logits[1]
    if margin < gap and got[agreed] in ids:
        return
    raise AssertionError(
        f"greedy tokens diverge at {agreed}: got {got[agreed]}, reference {expected[agreed]}; the "
        f"reference's top two there are {ids} with logits {logits} (float64), a gap of {margin:.3g} "
        f"{'>=' if margin >= gap else '<'} the near-tie tolerance {gap:g}"
        f"{'' if got[agreed] in ids else ' and the engine token is not one of them'}\n"
        f"got      {got}\nexpected {expected}"
    )
