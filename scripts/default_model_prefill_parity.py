"""The default model's prompt log-probabilities from minfer's two CPU prefill paths against
transformers' two attention implementations (float32, real weights, one prefill each).

    PYTHONPATH=. python3 scripts/default_model_prefill_parity.py [--prompts 6] [--tokens 600]

Prompts are windows of this repository's docs. Prints per prompt the max and mean |delta| of the
prompt tokens' log-probabilities for: the plain torch backend (the float32 default's) and the
SDPA prefill of `--quantization` models (`FastTorchAttentionBackend`), each against transformers
with attn_implementation "eager" and "sdpa" (its default).
"""

from __future__ import annotations

import argparse
import glob
import os

import torch
from transformers import AutoModelForCausalLM

from minfer import LLM
from minfer.attention.base import ForwardContext, build_metadata
from minfer.attention.torch_backend import TorchAttentionBackend
from minfer.attention.torch_fast import FastTorchAttentionBackend
from minfer.kvcache.pool import KVPool
from minfer.models.source import default_model_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def token_logprobs(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    logprobs = torch.log_softmax(logits.double(), -1)[:-1]
    return logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def minfer_logits(engine, ids: list[int], backend) -> torch.Tensor:
    """Every position's logits from one prefill through a throwaway head-major pool."""
    n = len(ids)
    cfg = engine.hf_config
    pool = KVPool(
        cfg.num_hidden_layers,
        n,
        engine.num_kv_heads,
        engine.head_dim,
        1,
        engine.dtype,
        engine.device,
        head_major=True,
    )
    meta = build_metadata([0], [0], [n], torch.arange(n, dtype=torch.int32)[None, :], False, engine.device)
    ctx = ForwardContext(meta, pool, backend, torch.arange(n))
    with torch.inference_mode():
        return engine.model.compute_logits(engine.model(torch.tensor(ids), torch.arange(n), ctx))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=600)
    args = ap.parse_args()
    engine = LLM(device="cpu", disable_overlap_schedule=True).engine
    path = default_model_path()
    references = {
        impl: AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path),
            gguf_file=os.path.basename(path),
            dtype=torch.float32,
            attn_implementation=impl,
        ).eval()
        for impl in ("eager", "sdpa")
    }
    text = ""
    for name in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        with open(name) as f:
            text += f.read()
    ids_all = engine.tokenizer.encode(text)
    ours = {"plain": TorchAttentionBackend(), "SDPA": FastTorchAttentionBackend()}
    for p in range(args.prompts):
        ids = ids_all[p * args.tokens : (p + 1) * args.tokens]
        with torch.inference_mode():
            theirs = {k: token_logprobs(m(torch.tensor([ids])).logits[0], ids) for k, m in references.items()}
        row = []
        for name, backend in ours.items():
            mine = token_logprobs(minfer_logits(engine, ids, backend), ids)
            for impl, ref in theirs.items():
                delta = (mine - ref).abs()
                row.append(f"{name} vs {impl}: max {delta.max():.1e}, mean {delta.mean():.1e}")
        print(f"prompt {p} ({len(ids)} tokens): " + "; ".join(row))


if __name__ == "__main__":
    main()
