"""Vocabulary-parallel embedding and LM head: each rank holds vocab_size/tp rows."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from minfer.distributed.parallel import SINGLE, TPGroup
from minfer.kernels import gemv
from minfer.kernels.embedding import embedding_rows
from minfer.kernels.pdl import chained_rows, pdl_enabled
from minfer.layers.linear import on_triton, torch_linear
from minfer.layers.quantized_head import LowBitHead


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp.size)  # the last rank's tail rows stay zero
        self.start = tp.rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.zeros(self.rows_per_rank, hidden), requires_grad=False)
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        part = loaded[self.start : self.start + self.rows_per_rank]
        param.data[: part.shape[0]].copy_(part)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            if ids.is_cuda and pdl_enabled(ids.device) and chained_rows(ids.numel()):
                # the first layer's gemv then reads its weights during the gather
                return embedding_rows(ids, self.weight)
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits = hidden @ W.T, each rank computing its vocabulary slice, gathered at the end."""

    low_bit: LowBitHead | None = None  # --quantization (CPU, one rank): minfer.models.quantize

    def shard_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [T, rows_per_rank] of this rank's vocabulary slice (no communication;
        the last shard's padding columns are 0: `gather_logits` and the vocabulary-parallel
        sampler cut them off). Written into `out` when given."""
        if self.low_bit is not None:
            return self.low_bit.logits(hidden, out)
        logits = torch_linear(hidden, self.weight)
        return logits.float() if out is None else out.copy_(logits)

    def gather_logits(self, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's `shard_logits` side by side: float32 [T, vocab]."""
        return self.tp.all_gather_last_dim(shard)[..., : self.vocab_size]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [T, vocab], written into `out` when given."""
        if self.low_bit is not None:
            return self.low_bit.logits(hidden, out)
        by_gemv = self.tp.size == 1 and _gemv_takes(hidden, self.weight)
        if by_gemv or (self.tp.size == 1 and _mm_writes_fp32(hidden)):
            # Both write fp32 directly: the GEMM accumulates in fp32 anyway, and rounding the
            # logits to bf16 and widening them again took 0.1 ms at B=256 on an H200. One or two
            # rows (a small decode batch) go to gemv, which reads the weights, the whole cost,
            # before it waits for the final norm (kernels/gemv.py).
            if out is None:
                out = torch.empty(
                    (hidden.shape[0], self.vocab_size), dtype=torch.float32, device=hidden.device
                )
            if by_gemv:
                return gemv.gemv(hidden, self.weight, out=out)
            return torch.mm(hidden, self.weight.t(), out_dtype=torch.float32, out=out)
        logits = torch_linear(hidden, self.weight)
        if self.tp.size > 1:
            logits = self.tp.all_gather_last_dim(logits)
        logits = logits[..., : self.vocab_size]
        return logits.float() if out is None else out.copy_(logits)


def _gemv_takes(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the LM head's product goes to minfer.kernels.gemv (as linear.linear routes a
    projection's; MINFER_SMALL_GEMM=torch or MINFER_GEMV=off keep it on cuBLAS)."""
    return hidden.dim() == 2 and on_triton(hidden) and gemv.suits(hidden.shape[0], weight)


@functools.cache
def _mm_supports_fp32_out(device: torch.device) -> bool:
    """Whether torch.mm takes out_dtype=float32 for bf16 inputs here (CUDA builds of torch >= 2.8)."""
    try:
        a = torch.zeros((2, 8), dtype=torch.bfloat16, device=device)
        torch.mm(a, a.t(), out_dtype=torch.float32)
        return True
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _mm_writes_fp32(hidden: torch.Tensor) -> bool:
    return (
        hidden.is_cuda
        and hidden.dtype in (torch.bfloat16, torch.float16)
        and _mm_supports_fp32_out(hidden.device)
    )
