"""Linear layers sharded for tensor parallelism.

Column-parallel layers split the output features across ranks (each rank computes a slice,
no communication); row-parallel layers split the input features and all-reduce the partial
sums. Attention and MLP use one of each, so a block needs exactly two all-reduces.
Each parameter carries a `weight_loader(param, full_tensor, shard_id)` that cuts this rank's
slice out of a checkpoint tensor, so weights are sharded while they load.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from minfer.distributed.parallel import SINGLE, TPGroup
from minfer.layers.activation import silu_and_mul
from minfer.layers.norm import RMSNorm
from minfer.layers.quantized_linear import LowBitWeight

# Decode-sized GEMMs on CUDA go to minfer.kernels.gemv (a few rows: weights read before x is
# ready) or minfer.kernels.gemm (split over K so every SM reads a slice of the weights);
# MINFER_SMALL_GEMM=cublas keeps them on cuBLAS, for A/B measurements.
_SMALL_GEMM = os.environ.get("MINFER_SMALL_GEMM", "triton")
_HALF = (torch.bfloat16, torch.float16)
# At one or two rows the RMSNorm before qkv / gate_up and the SiLU-and-multiply before down can
# run inside gemv (minfer.kernels.gemv's prologues), a launch fewer each. MINFER_GEMV_PROLOGUE:
# "auto" (the default) folds them where gemv.prologue_pays, "on" wherever gemv takes the product,
# "off" never (the last two for A/B runs).
_GEMV_PROLOGUE = os.environ.get("MINFER_GEMV_PROLOGUE", "auto")
if _GEMV_PROLOGUE not in ("auto", "on", "off"):
    raise ValueError(f"MINFER_GEMV_PROLOGUE={_GEMV_PROLOGUE!r}: expected auto, on or off")
# Where gemv takes the gate_up product, the SiLU-and-multiply is its epilogue instead
# (gemv.gate_up_gemv: no launch, no re-read). MINFER_GEMV_EPILOGUE=off leaves it to the down
# projection's prologue or its own launch, for A/B runs.
_GEMV_EPILOGUE = os.environ.get("MINFER_GEMV_EPILOGUE", "on")
if _GEMV_EPILOGUE not in ("on", "off"):
    raise ValueError(f"MINFER_GEMV_EPILOGUE={_GEMV_EPILOGUE!r}: expected on or off")


def on_triton(x: torch.Tensor) -> bool:
    """Whether a product of x goes to minfer's Triton kernels rather than torch's."""
    return x.is_cuda and x.dtype in _HALF and _SMALL_GEMM == "triton"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if on_triton(x):
        from minfer.kernels import gemm, gemv

        rows = x.numel() // x.shape[-1]
        if gemv.suits(rows, weight):
            return gemv.gemv(x, weight, bias)
        if gemm.suits(rows, weight):
            return gemm.linear(x, weight, bias)
    return torch_linear(x, weight, bias)


# On the CPU a decode step's products are matrix-vector products of one to a few rows, and
# torch's float32 GEMM runs those on one thread, however many torch has, at about half of one
# core's read bandwidth (SmolLM2-135M's weights, 2-core AMD EPYC: 12 GB/s, where a plain sum reads
# 22). Cutting the weight's output rows into groups and handing them to one batched product lets
# torch's threads take the groups: the default model's decode step with two threads, 63-67 -> 40-47
# ms at one request, 100 -> 72 at 4, 127 -> 97 at 16 (docs/BENCHMARKS.md, forty-second session).
# Each output is a dot product of the same row and weights as F.linear's: bit for bit with MKL at
# 1-4, 8 and 12-16 rows on that machine; at 5-7 and 9-11 rows MKL sums F.linear's in another
# order. Up to 16 rows (the CPU's default --max-running-requests), not on one thread (no gain).
# MINFER_CPU_ROW_GROUPS=off keeps F.linear, for A/B runs.
CPU_GROUPED_MAX_ROWS = 16
_CPU_ROW_GROUPS = os.environ.get("MINFER_CPU_ROW_GROUPS", "on")
if _CPU_ROW_GROUPS not in ("on", "off"):
    raise ValueError(f"MINFER_CPU_ROW_GROUPS={_CPU_ROW_GROUPS!r}: expected on or off")


def cpu_row_groups(x: torch.Tensor, weight: torch.Tensor) -> int:
    """How many groups of output rows `torch_linear` splits x @ weight.T into (0: not split):
    twice torch's threads, halved until they divide the output features, for 1-16 rows of a
    float32 product on the CPU with two or more threads."""
    if _CPU_ROW_GROUPS == "off" or x.device.type != "cpu" or x.dtype != torch.float32:
        return 0
    if weight.dtype != x.dtype or weight.dim() != 2 or not weight.is_contiguous():
        return 0
    threads = torch.get_num_threads()
    if threads < 2 or not 0 < x.numel() // x.shape[-1] <= CPU_GROUPED_MAX_ROWS:
        return 0
    groups = 2 * threads
    while groups > 1 and weight.shape[0] % groups:
        groups //= 2
    return groups if groups > 1 else 0


def torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with a CPU decode step's few rows spread over torch's threads (cpu_row_groups)."""
    groups = cpu_row_groups(x, weight)
    return grouped_linear(x, weight, bias, groups) if groups else F.linear(x, weight, bias)


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, groups: int
) -> torch.Tensor:
    """x @ weight.T (+ bias) as `groups` groups of the weight's output rows in one batched product
    (a contiguous weight whose output features `groups` divides)."""
    n, k = weight.shape
    rows = x.reshape(-1, k)
    xs = rows.unsqueeze(0).expand(groups, rows.shape[0], k)
    ws = weight.view(groups, n // groups, k).transpose(1, 2)  # [groups, K, N / groups]
    y = torch.bmm(xs, ws) if bias is None else torch.baddbmm(bias.view(groups, 1, n // groups), xs, ws)
    return y.transpose(0, 1).reshape(*x.shape[:-1], n)  # [groups, M, N / groups] -> [..., N]


def _folds_prologue(x: torch.Tensor, weight: torch.Tensor, silu: bool) -> bool:
    """Whether x's rows go through minfer.kernels.gemv with the step before it (the SiLU-and-
    multiply with `silu`, else an RMSNorm) folded in."""
    if _GEMV_PROLOGUE == "off" or not on_triton(x):
        return False
    if x.dim() != 2:  # a MoE block's unreduced terms [tokens, top_k, hidden]: the norm kernel sums them
        return False
    from minfer.kernels import gemv

    rows = x.shape[0]
    return gemv.suits(rows, weight) if _GEMV_PROLOGUE == "on" else gemv.prologue_pays(rows, weight, silu)


def _divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what}={a} is not divisible by the tensor-parallel size {b}")
    return a // b


class ColumnParallelLinear(nn.Module):
    # --quantization: the same weights in a low-bit kernel's form (minfer.models.quantize)
    low_bit: LowBitWeight | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.out_per_rank = _divide(out_features, tp.size, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features), requires_grad=False)
        self.weight.weight_loader = self._load_column
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False)
            self.bias.weight_loader = self._load_column

    def _load_column(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = self.out_per_rank
        param.data.copy_(loaded.narrow(0, self.tp.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.low_bit is not None:
            y = self.low_bit.matmul(x, self.weight)
            return y if self.bias is None else y + self.bias
        return linear(x, self.weight, self.bias)

    def forward_normed(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None = None):
        """(self(norm(x [+ residual])), the residual stream after the add): what the norm and
        this layer return one after the other (x itself is the stream without `residual`); one
        kernel where the prologue folds (see _GEMV_PROLOGUE)."""
        if (
            self.low_bit is None
            and norm.weight.dtype == x.dtype
            and _folds_prologue(x, self.weight, silu=False)
        ):
            from minfer.kernels.gemv import normed_gemv

            return normed_gemv(x, self.weight, norm.weight, norm.eps, residual, self.bias)
        if residual is None:
            return self(norm(x)), x
        normed, residual = norm(x, residual)
        return self(normed), residual


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stored as one (gate and up projections)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False, tp: TPGroup = SINGLE):
        super().__init__(in_features, sum(out_sizes), bias, tp)
        self.shard_sizes = [_divide(s, tp.size, "output features") for s in out_sizes]
        self.weight.weight_loader = self._load_merged

    def _load_merged(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        size = self.shard_sizes[shard_id]
        offset = sum(self.shard_sizes[:shard_id])
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp.rank * size, size))

    def folds_silu(self, x: torch.Tensor) -> bool:
        """Whether `forward_silu` is one gemv launch with the SiLU-and-multiply as its epilogue:
        for [gate | up] of equal halves, where gemv takes the product (see _GEMV_EPILOGUE)."""
        if _GEMV_EPILOGUE == "off" or self.low_bit is not None or not on_triton(x):
            return False
        from minfer.kernels import gemv

        halves = len(self.shard_sizes) == 2 and self.shard_sizes[0] == self.shard_sizes[1]
        return halves and gemv.suits(x.numel() // x.shape[-1], self.weight)

    def forward_silu(self, norm: RMSNorm | None, x: torch.Tensor, residual: torch.Tensor | None = None):
        """(silu(gate) * up for [gate | up] = self(norm(x [+ residual])), the residual stream):
        forward_normed then the SiLU-and-multiply (x itself through the product without `norm`),
        where `folds_silu(x)`: one kernel where the norm's prologue folds too, else the norm and
        that kernel."""
        from minfer.kernels.gemv import gate_up_gemv

        if norm is not None and norm.weight.dtype == x.dtype and _folds_prologue(x, self.weight, silu=False):
            return gate_up_gemv(x, self.weight, norm.weight, norm.eps, residual, self.bias)
        stream = x
        if norm is not None:
            x, stream = (norm(x), x) if residual is None else norm(x, residual)
        return gate_up_gemv(x, self.weight, bias=self.bias)[0], stream


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matrix. Each rank holds num_heads/tp query heads and
    max(1, num_kv_heads/tp) KV heads; with fewer KV heads than ranks, KV heads are replicated."""

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp: TPGroup = SINGLE,
    ):
        self.num_heads = _divide(num_heads, tp.size, "attention heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = _divide(num_kv_heads, tp.size, "KV heads")
        else:
            _divide(tp.size, num_kv_heads, "tensor-parallel size vs KV heads")
            self.num_kv_heads = 1
        self.head_dim = head_dim
        self.kv_replicas = max(1, tp.size // num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp.size
        super().__init__(hidden, out, bias, tp)
        self.weight.weight_loader = self._load_qkv
        if self.bias is not None:
            self.bias.weight_loader = self._load_qkv

    def _load_qkv(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        d = self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            offset, size, src = 0, q_size, self.tp.rank * q_size
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, src = kv_size, (self.tp.rank // self.kv_replicas) * kv_size
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, src, size))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.head_dim
        return qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)


class RowParallelLinear(nn.Module):
    low_bit: LowBitWeight | None = None  # as ColumnParallelLinear's

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.in_per_rank = _divide(in_features, tp.size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank), requires_grad=False)
        self.weight.weight_loader = self._load_row
        self.bias = None
        if bias:  # added once, after the reduction
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)

    def _load_row(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = self.in_per_rank
        param.data.copy_(loaded.narrow(1, self.tp.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight) if self.low_bit is None else self.low_bit.matmul(x, self.weight)
        return self._reduce(y)

    def forward_gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu(gate) * up) for gate_up [..., 2 x in_per_rank] holding [gate | up]; one
        kernel where the prologue folds (see _GEMV_PROLOGUE)."""
        if self.low_bit is None and _folds_prologue(gate_up, self.weight, silu=True):
            from minfer.kernels.gemv import gated_gemv

            return self._reduce(gated_gemv(gate_up, self.weight))
        return self(silu_and_mul(gate_up))

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The sum of the ranks' partial products, plus the bias once."""
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias
