"""The physical floor of a workload: the time no implementation can beat on a given card.

Decode: every step reads all weights once plus the KV of every running request (bytes over
memory bandwidth). Prefill: 2 x parameters FLOPs per prompt token (FLOPs over matmul rate).
The attention FLOPs and activation traffic are left out, so the floor is a true lower bound.
Prefill's causal attention FLOPs are kept apart (`Floor.attention_seconds`): negligible for
prompts of a few hundred tokens, a third of a 32k-token prompt's FLOPs on an 8B model, where a
floor without them would flatter nothing and understate how close a run is.

Mixture-of-experts models (`MoeWeights`): a decode step reads only the experts its tokens
chose. Under uniform routing, B tokens each picking k of E experts touch
E x (1 - (1 - k/E)^B) distinct experts per layer on average (an expert is missed by one token
with probability 1 - k/E); that many experts' bytes are read per MoE layer, besides the dense
weights. A prefill token costs 2 x (dense parameters + k experts' parameters per layer) FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Card:
    name: str
    bandwidth: float  # bytes/s, measured device-to-device copy (read + write)
    matmul_rate: float  # FLOP/s, measured bf16 GEMM

    def times(self, n: int) -> Card:
        """n cards working together (tensor parallelism): bandwidth and FLOP rate add up."""
        return self if n == 1 else Card(f"{n}x {self.name}", self.bandwidth * n, self.matmul_rate * n)


H200 = Card("H200", 4.26e12, 790e12)  # measured on the GPU host, see ../shared/gpu/README.md
# The same two figures' sizes on another GPU: a 1 GiB copy (far past any L2) and the bf16 8192^3
# GEMM the H200's rate comes from.
CUDA_COPY_BYTES = 2**30
CUDA_GEMM_SIZE = 8192

# Big enough to leave the CPU caches far behind (hundreds of MB of L3 at most), small enough to
# measure in well under a second.
HOST_COPY_BYTES = 256 * 2**20
HOST_GEMM_SIZE = 1024


def measure_host_card(repeats: int = 5) -> Card:
    """This CPU as a Card, measured now with torch at its current thread count: bandwidth of a
    large tensor copy (bytes read + written over the best time) and the fp32 GEMM rate, the
    same two figures the H200's card holds. A CPU run is then compared with its own floor."""
    import time

    import torch

    src = torch.ones(HOST_COPY_BYTES // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    a = torch.randn(HOST_GEMM_SIZE, HOST_GEMM_SIZE)

    def best(fn) -> float:
        fn()  # first touch of the pages, thread pool start-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    copy_s = best(lambda: dst.copy_(src))
    gemm_s = best(lambda: a @ a)
    threads = torch.get_num_threads()
    return Card(
        f"this CPU ({threads} threads, measured)",
        2 * HOST_COPY_BYTES / copy_s,
        2 * HOST_GEMM_SIZE**3 / gemm_s,
    )


def cuda_card(device, repeats: int = 5) -> Card:
    """The card a CUDA run's floor is computed for. On an H200, the H200's figures above (every
    GPU figure in docs/BENCHMARKS.md is against them); on any other GPU, that GPU measured now
    (the two figures the H200's card holds, timed with CUDA events), so that a run on an H100,
    say, is not compared with an H200's floor. Call it before the engine takes the memory."""
    import torch

    name = torch.cuda.get_device_name(device)
    if "H200" in name:
        return H200
    copy_s, gemm_s = _time_cuda_copy_and_gemm(device, repeats)
    torch.cuda.empty_cache()  # the engine that follows sizes its KV cache from the free memory
    return Card(f"{name} (measured)", 2 * CUDA_COPY_BYTES / copy_s, 2 * CUDA_GEMM_SIZE**3 / gemm_s)


def _time_cuda_copy_and_gemm(device, repeats: int) -> tuple[float, float]:
    """Best seconds of a CUDA_COPY_BYTES device-to-device copy and of a bf16 CUDA_GEMM_SIZE^3
    product, timed with CUDA events."""
    import torch

    src = torch.ones(CUDA_COPY_BYTES // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    a = torch.randn(CUDA_GEMM_SIZE, CUDA_GEMM_SIZE, dtype=torch.bfloat16, device=device)

    def best(fn) -> float:
        fn()  # cuBLAS picks its kernel, the allocator settles
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return min(times)

    return best(lambda: dst.copy_(src)), best(lambda: a @ a)


@dataclass(frozen=True)
class MoeWeights:
    """The experts of a mixture-of-experts model, of which each step reads only a part."""

    layers: int  # MoE layers
    num_experts: int
    top_k: int
    bytes_per_expert: int  # one expert of one layer (all TP ranks together)
    params_per_expert: int

    @property
    def bytes(self) -> int:
        return self.layers * self.num_experts * self.bytes_per_expert

    @property
    def params(self) -> int:
        return self.layers * self.num_experts * self.params_per_expert

    def expected_experts(self, batch: int) -> float:
        """Distinct experts per layer that `batch` tokens touch under uniform routing."""
        e, k = self.num_experts, self.top_k
        return e * (1 - (1 - k / e) ** batch)

    def step_bytes(self, batch: int) -> float:
        """Expert bytes one decode step of `batch` tokens reads, over all MoE layers."""
        return self.layers * self.bytes_per_expert * self.expected_experts(batch)


@dataclass
class Floor:
    decode_seconds: float
    prefill_seconds: float
    attention_seconds: float = 0.0  # prefill's causal attention FLOPs, not part of `seconds`

    @property
    def seconds(self) -> float:
        return self.decode_seconds + self.prefill_seconds

    @property
    def seconds_with_attention(self) -> float:
        return self.seconds + self.attention_seconds


def attention_flops_per_pair(head_dim: int, num_heads: int, num_layers: int) -> int:
    """FLOPs of one (query, key) pair over all layers and q heads: q.k and p.v, a multiply-add
    (2 FLOPs) per element of each."""
    return 4 * head_dim * num_heads * num_layers


def causal_attention_flops(prompt_lens: list[int], flops_per_pair: int) -> int:
    """Prefill's attention FLOPs: token j of a prompt attends to keys 0..j, L (L + 1) / 2 pairs."""
    return flops_per_pair * sum(n * (n + 1) // 2 for n in prompt_lens)


def workload_floor(
    card: Card,
    num_params: int,
    weight_bytes: int,
    kv_bytes_per_token: int,
    prompt_lens: list[int],
    output_lens: list[int],
    moe: MoeWeights | None = None,
    flops_per_pair: int = 0,
) -> Floor:
    """All requests run concurrently from the first decode step (the most favourable batching):
    step s reads the weights and, for each request still generating, prompt + s tokens of KV.
    The first output token comes from prefill, so a request of n outputs takes n - 1 decode steps.
    With `moe`, `num_params` and `weight_bytes` include the experts; step s reads the experts
    that its batch (the requests still generating) is expected to touch. `flops_per_pair`
    (attention_flops_per_pair) gives the prefill's causal attention its own term."""
    steps = max(output_lens) - 1
    kv_token_reads = sum(
        n * (p + (n - 1) / 2) for p, n in ((p, o - 1) for p, o in zip(prompt_lens, output_lens))
    )
    if moe is None:
        weight_reads = steps * weight_bytes
        prefill_params = num_params
    else:
        decode_steps = [o - 1 for o in output_lens]
        batches = [sum(n > s for n in decode_steps) for s in range(steps)]
        weight_reads = steps * (weight_bytes - moe.bytes) + sum(map(moe.step_bytes, batches))
        prefill_params = num_params - moe.params + moe.layers * moe.top_k * moe.params_per_expert
    decode = (weight_reads + kv_token_reads * kv_bytes_per_token) / card.bandwidth
    prefill = 2 * prefill_params * sum(prompt_lens) / card.matmul_rate
    attention = causal_attention_flops(prompt_lens, flops_per_pair) / card.matmul_rate
    return Floor(decode, prefill, attention)
