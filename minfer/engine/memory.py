"""The memory budget: how big the KV pool is, as arithmetic a reader can redo.

On CUDA:
    budget         = total * mem_fraction
    kv_pool_bytes  = budget - in_use_before - weights - activation_reserve - graph_reserve
                     - host_staging   (the host KV tier's transfer buffers, when it is on)
    kv_pool_tokens = kv_pool_bytes // kv_bytes_per_token
where `in_use_before` is memory other processes (and the CUDA context) held before minfer
loaded anything, `weights` is measured after loading, `activation_reserve` is the peak
measured during a profiling forward pass of the largest prefill chunk, and `graph_reserve`
is set aside for the decode and prefill CUDA graphs (their real size is measured after capture and
printed beside it). On CPU the pool holds `--kv-cache-tokens` tokens.
`--kv-cache-tokens` overrides the derived size on CUDA too. docs/MEMORY.md works an example.
"""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass

import torch

from minfer.config import CPU_DEFAULT_KV_CACHE_TOKENS, DEFAULT_MAX_RUNNING_REQUESTS
from minfer.kvcache.host_pool import host_pool_pages
from minfer.kvcache.host_tier import staging_bytes
from minfer.layers.moe import expert_weight_bytes

GiB = 1 << 30


@dataclass
class MemoryBudget:
    device: str
    total_bytes: int
    in_use_before_bytes: int
    weights_bytes: int
    activation_reserve_bytes: int
    graph_reserve_bytes: int  # set aside for CUDA graphs before sizing the pool (estimate)
    mem_fraction: float
    kv_bytes_per_token: int
    kv_pool_tokens: int
    overridden: bool  # kv_pool_tokens came from --kv-cache-tokens
    graph_measured_bytes: int = 0  # what capturing the graphs actually took (after start-up)
    tp_size: int = 1  # with TP: per-rank figures, and the pool is the least any rank affords
    expert_weights_bytes: int = 0  # the part of weights_bytes in mixture-of-experts experts
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype: fp8_e4m3 halves kv_bytes_per_token
    host_kv_tokens: int = 0  # the host KV tier (--host-kv-cache-gb); 0: off
    host_kv_bytes: int = 0
    host_available_bytes: int = 0  # host RAM still available once the tier is allocated
    host_staging_bytes: int = 0  # device staging buffers of the host tier's transfers

    @property
    def weights_text(self) -> str:
        """The weights in GiB, and the experts' share of them for a mixture-of-experts model."""
        text = f"{self.weights_bytes / GiB:.2f}"
        if self.expert_weights_bytes:
            text += f" (experts {self.expert_weights_bytes / GiB:.2f})"
        return text

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def _kv_dtype_note(self) -> str:
        return f" ({self.kv_cache_dtype})" if self.kv_cache_dtype != "auto" else ""

    def describe(self, max_model_len: int) -> str:
        return self._describe_device(max_model_len) + self._describe_host()

    def _describe_host(self) -> str:
        if not self.host_kv_tokens:
            return ""
        where = "pinned host memory" if self.device == "cuda" else "host memory"
        return (
            f"; host KV tier {self.host_kv_bytes / GiB:.2f} GiB of {where} = {self.host_kv_tokens} tokens "
            f"({self.host_kv_tokens / max(1, self.kv_pool_tokens):.1f}x the device pool), "
            f"{self.host_available_bytes / GiB:.2f} GiB host RAM left available; "
            f"transfer staging {self.host_staging_bytes / GiB:.2f} GiB"
            + (" of device memory (set aside before the KV pool)" if self.device == "cuda" else "")
        )

    def _describe_device(self, max_model_len: int) -> str:
        full = self.kv_pool_tokens // max_model_len
        kv_gib = self.kv_pool_tokens * self.kv_bytes_per_token / GiB
        if self.device == "cpu" or self.overridden:
            how = "set by --kv-cache-tokens" if self.overridden else "CPU default"
            return (
                f"memory: weights {self.weights_text} GiB; KV pool {self.kv_pool_tokens} tokens "
                f"x {self.kv_bytes_per_token} B/token{self._kv_dtype_note} = {kv_gib:.2f} GiB ({how}); "
                f"{full} concurrent requests at full context ({max_model_len} tokens)"
            )
        return (
            f"memory: total {self.total_bytes / GiB:.2f} GiB x mem_fraction {self.mem_fraction} "
            f"- in use before {self.in_use_before_bytes / GiB:.2f} - weights {self.weights_text} "
            f"- activations {self.activation_reserve_bytes / GiB:.2f} "
            f"- cuda graphs {self.graph_reserve_bytes / GiB:.2f} = KV pool {kv_gib:.2f} GiB "
            f"/ {self.kv_bytes_per_token} B/token{self._kv_dtype_note} = {self.kv_pool_tokens} tokens"
            f"{f' (per rank; the least of {self.tp_size} TP ranks)' if self.tp_size > 1 else ''}; "
            f"{full} concurrent requests at full context ({max_model_len} tokens)"
            + (
                f"; graphs measured {self.graph_measured_bytes / GiB:.2f} GiB"
                if self.graph_measured_bytes
                else ""
            )
        )


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        # a oneDNN-packed matrix is opaque (no data pointer): its logical size, counted once
        key = t.data_ptr() if t.layout == torch.strided and not t.is_mkldnn else id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters, a tied matrix counted once."""
    return _tensor_bytes(model.parameters())


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights the model holds (the memory line's figure): its parameters, and the
    tensors a --quantization layer keeps beside them (`low_bit`: packed codes, scales, the
    pre-laid-out dense copy, a low-bit head's dense matrix), each storage counted once."""
    tensors = list(model.parameters())
    for module in model.modules():
        low_bit = getattr(module, "low_bit", None)
        if low_bit is not None:
            tensors += [t for t in vars(low_bit).values() if isinstance(t, torch.Tensor)]
            inner = getattr(low_bit, "low_bit", None)  # a LowBitHead wraps the kernel's weights
            if inner is not None:
                tensors += [t for t in vars(inner).values() if isinstance(t, torch.Tensor)]
    return _tensor_bytes(tensors)


def plan_memory(engine, in_use_before: int) -> MemoryBudget:
    cfg = engine.config
    weights = resident_weight_bytes(engine.model)
    experts = expert_weight_bytes(engine.model)
    per_token = engine.kv_bytes_per_token
    staging = host_staging_bytes(cfg, per_token)
    if engine.device.type != "cuda":
        tokens = cfg.kv_cache_tokens or CPU_DEFAULT_KV_CACHE_TOKENS
        overridden = cfg.kv_cache_tokens is not None
        return MemoryBudget(
            "cpu",
            0,
            0,
            weights,
            0,
            0,
            cfg.mem_fraction,
            per_token,
            tokens,
            overridden,
            expert_weights_bytes=experts,
            kv_cache_dtype=cfg.kv_cache_dtype,
            host_staging_bytes=staging,
        )
    total = torch.cuda.mem_get_info(engine.device)[1]
    activation = profile_activation_peak(engine)
    graphs = graph_reserve(engine, activation)
    if cfg.kv_cache_tokens:
        tokens = cfg.kv_cache_tokens
    else:
        kv_bytes = int(total * cfg.mem_fraction) - in_use_before - weights - activation - graphs - staging
        if kv_bytes < per_token * engine.max_model_len // 8:
            raise RuntimeError(
                f"not enough device memory for a KV pool: {kv_bytes / GiB:.2f} GiB left after weights, "
                f"activations and CUDA graphs; raise --mem-fraction or lower --chunked-prefill-size / "
                f"--max-model-len / --prefill-cuda-graph-max-tokens"
            )
        # Every TP rank must hold the same pool (their schedulers decide alike): the smallest.
        tokens = engine.tp.min_over_ranks(kv_bytes // per_token)
    return MemoryBudget(
        "cuda",
        total,
        in_use_before,
        weights,
        activation,
        graphs,
        cfg.mem_fraction,
        per_token,
        tokens,
        cfg.kv_cache_tokens is not None,
        tp_size=engine.tp.size,
        expert_weights_bytes=experts,
        kv_cache_dtype=cfg.kv_cache_dtype,
        host_staging_bytes=staging,
    )


def host_staging_bytes(cfg, bytes_per_token: int) -> int:
    """The host KV tier's device staging buffers (kvcache/host_tier.py), 0 when the tier is off."""
    pages = (
        host_pool_pages(cfg.host_kv_cache_gb, bytes_per_token, cfg.page_size)
        if cfg.host_kv_cache_gb > 0
        else 0
    )
    return staging_bytes(bytes_per_token * cfg.page_size, pages) if pages else 0


def graph_reserve(engine, activation: int) -> int:
    """Memory the CUDA graphs will hold. Decode's: the shared float32 logits buffer, the
    model-dtype logits inside the graph pool, and the largest batch's activations (a few
    hidden-size rows per layer, bounded generously). Prefill's: the largest captured pass's
    activations, taken as the measured peak of a chunk (`activation`) scaled to its tokens.
    Measured after capture and reported beside this estimate."""
    from minfer.engine.prefill_graph import prefill_graph_tokens

    cfg = engine.config
    if engine.device.type != "cuda" or engine.backend.name != "triton":
        return 0
    reserve = 0
    if cfg.cuda_graph_max_bs > 0:
        bs = min(cfg.cuda_graph_max_bs, cfg.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS)
        itemsize = torch.empty((), dtype=engine.dtype).element_size()
        hidden = engine.hf_config.hidden_size + 2 * engine.hf_config.intermediate_size
        reserve += bs * engine.vocab_size * (4 + itemsize) + 16 * bs * hidden * itemsize + 64 * (1 << 20)
    chunk = min(cfg.chunked_prefill_size, engine.max_model_len)
    return reserve + activation * prefill_graph_tokens(engine) // chunk


def profile_activation_peak(engine) -> int:
    """Peak bytes above the weights while one prefill of `chunked_prefill_size` tokens runs
    (through a throwaway pool just big enough for it) and its logits are computed."""
    from minfer.attention.base import ForwardContext, build_metadata
    from minfer.kvcache.pool import KVPool

    n = min(engine.config.chunked_prefill_size, engine.max_model_len)
    page = engine.config.page_size
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    pool = KVPool(
        engine.hf_config.num_hidden_layers,
        -(-n // page) * page,
        engine.num_kv_heads,
        engine.head_dim,
        page,
        engine.dtype,
        engine.device,
        engine.config.kv_cache_dtype,
    )
    pool_bytes = torch.cuda.memory_allocated() - base
    table = torch.arange(n, dtype=torch.int32, device=engine.device)[None, :]
    meta = build_metadata([0], [0], [n], table, False, engine.device)
    ctx = ForwardContext(meta, pool, engine.backend, torch.arange(n, device=engine.device))
    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        ids = torch.randint(0, engine.vocab_size, (n,), device=engine.device)
        hidden = engine.model(ids, torch.arange(n, device=engine.device), ctx)
        # Up to one row of logits per running request (plus the sort of top-k/top-p).
        engine.model.compute_logits(hidden[: min(n, 256)]).sort(dim=-1)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base - pool_bytes
    del pool, ctx, hidden
    torch.cuda.empty_cache()
    return int(peak)


def device_memory_in_use(device: torch.device) -> int:
    """Bytes of the device in use before this engine loads (0 on a CPU). An engine dropped just
    before (an `LLM` of an earlier job in this process) may still sit in a reference cycle that
    only the collector frees, with its KV pool: collected first, it does not shrink this pool."""
    if device.type != "cuda":
        return 0
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return total - free
