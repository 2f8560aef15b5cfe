"""The LM head under --quantization: int4 (or bfloat16) logits, refined in float32 at the top.

SmolLM2-135M's head is its tied float32 embedding, [49152, 576]: 113 MB, most of what a
quantized decode step reads. Measured on a 2-core AVX512 + AMX CPU, one thread (ms per call):
  rows                           1     4     8     16
  float32 F.linear               7.3   17.6  -     24.3
  int8 per channel, bf16 x       2.2   3.5   6.3   13.6
  int4 blocks of 32, bf16 x      1.5   2.9   5.6   -
  bfloat16 F.linear              5.7   6.2   7.0   8.2
So up to `max_rows` rows the int4 kernel runs (14 MB of codes, 3.5 MB of scales and zeros; its
error in the tail moved the mean |d log-prob| of scripts/quant_accuracy.py from 0.0110 with the
int8 head to 0.0117, the answers not at all), past it a bfloat16 copy.
Both kernels write bfloat16, which rounds a logit of 20 by up to 0.06: enough to flip a
greedy choice between two close tokens. So the `refine_top` largest logits of every row are
recomputed from the float32 matrix (the embedding itself, no copy): the greedy token, and the
log-prob mass that matters, are then the float32 head's; only the tail keeps bfloat16 values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minfer.layers.quantized_linear import LowBitWeight

HEAD_LOW_BIT_MAX_ROWS = 8  # int4 vs bfloat16 cross at ~10 rows in the table above
REFINE_TOP = 16  # candidates per row recomputed in float32 (a few us; argmax never falls outside)
TOPK_CHUNK = 128  # vocabulary slice per candidate chunk of `top_indices`


@dataclass
class LowBitHead:
    """Logits from a low-bit head, the top of each row exact (see the module docstring)."""

    low_bit: LowBitWeight  # int4 blocks, for up to its max_rows rows
    dense: torch.Tensor  # the weights for more rows (bfloat16 where the CPU multiplies it)
    exact: torch.Tensor  # float32 [vocab, hidden]: the model's own head matrix
    refine_top: int = REFINE_TOP

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [T, vocab]; written into `out` when given."""
        logits = self.low_bit.matmul(hidden, self.dense).float()
        top = top_indices(logits, self.refine_top)
        exact = torch.bmm(self.exact[top], hidden.float().unsqueeze(-1)).squeeze(-1)
        logits.scatter_(-1, top, exact)
        return logits if out is None else out.copy_(logits)

    @property
    def nbytes(self) -> int:
        return self.low_bit.nbytes


def top_indices(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of each row's k largest values, unordered: `logits.topk(k).indices` as a set
    (ties aside). torch's CPU topk costs as much as the head's int4 matmul at 16 rows (0.92 ms at
    [16, 49152], one thread); the k largest lie in the k chunks of TOPK_CHUNK values with the
    largest maxima (a value outside them has k chunk maxima above it), so topk runs on the chunk
    maxima and then on those k chunks only: 0.28 ms."""
    rows, vocab = logits.shape
    chunks = vocab // TOPK_CHUNK
    if vocab % TOPK_CHUNK or chunks < 4 * k:
        return logits.topk(k, dim=-1, sorted=False).indices
    chunked = logits.view(rows, chunks, TOPK_CHUNK)
    best_chunks = chunked.amax(dim=-1).topk(k, dim=-1, sorted=False).indices  # [rows, k]
    spans = best_chunks.unsqueeze(-1).expand(rows, k, TOPK_CHUNK)
    within = chunked.gather(1, spans).view(rows, k * TOPK_CHUNK).topk(k, dim=-1, sorted=False).indices
    return best_chunks.gather(1, within // TOPK_CHUNK) * TOPK_CHUNK + within % TOPK_CHUNK
