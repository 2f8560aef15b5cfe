"""`minfer bench offline`: nano-vllm's / Mini-SGLang's offline throughput workload.

Python random.seed(seed); for each of N requests a prompt of randint(100, input_len) token ids
each randint(0, 10000); then max_tokens = randint(100, output_len) per request; temperature
0.6, ignore_eos. Throughput = sum(max_tokens) / wall time of one generate call after a warm-up.
With the defaults (256 requests, 1024/1024) the workload is 133,966 output tokens.
"""

from __future__ import annotations

import argparse
import time

from minfer.bench.floor import (
    MoeWeights,
    attention_flops_per_pair,
    cuda_card,
    measure_host_card,
    workload_floor,
)
from minfer.bench.workloads import nano_vllm_draw
from minfer.config import EngineConfig
from minfer.core import SamplingParams

WORKLOAD_ARGS = ("num_requests", "input_len", "output_len", "bench_seed")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=256, help="requests in the workload")
    p.add_argument("--input-len", type=int, default=1024, help="upper end of the prompt length range")
    p.add_argument("--output-len", type=int, default=1024, help="upper end of the max_tokens range")
    p.add_argument("--bench-seed", type=int, default=0, help="seed of the workload's random draws")


def make_workload(num_requests: int = 256, input_len: int = 1024, output_len: int = 1024, seed: int = 0):
    """nano-vllm's draw (workloads.nano_vllm_draw) with its sampling: temperature 0.6, ignore_eos."""
    prompts, max_tokens = nano_vllm_draw(num_requests, input_len, output_len, seed)
    return prompts, [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]


def moe_weights_of(model, tp_size: int) -> MoeWeights | None:
    """The floor's view of a mixture-of-experts model's experts (None for a dense model); each
    rank holds 1/tp of every expert, so one expert's bytes are this rank's times tp_size."""
    from minfer.layers.moe import SparseMoeBlock

    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    if not blocks:
        return None
    experts = blocks[0].experts
    params = (experts.gate_up_proj.numel() + experts.down_proj.numel()) // experts.num_experts
    return MoeWeights(
        len(blocks),
        experts.num_experts,
        blocks[0].top_k,
        params * experts.gate_up_proj.element_size() * tp_size,
        params * tp_size,
    )


def _gpu_card(device: str):
    """floor.cuda_card of the GPU a run on `device` (the config's: auto, cpu or cuda) will use,
    or None for a CPU run."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return None
    return cuda_card(torch.device("cuda", torch.cuda.current_device()))


def run_offline_bench(config: EngineConfig, args: argparse.Namespace) -> int:
    from minfer import LLM
    from minfer.engine.engine import freeze_long_lived_objects

    # No model named: the embedded default (real weights). A shipped shape name: dummy weights.
    if (
        config.model
        and config.load_format == "auto"
        and not config.model.endswith(".gguf")
        and "/" not in config.model
    ):
        config.load_format = "dummy"
    gpu_card = _gpu_card(config.device)  # measured, if at all, while the GPU's memory is free
    llm = LLM(**vars(config))
    prompts, params = make_workload(args.num_requests, args.input_len, args.output_len, args.bench_seed)
    vocab = llm.engine.vocab_size
    prompts = [[t % vocab for t in p] for p in prompts]
    # Warm-up on a different draw of the same shapes (whole prefill, two decode steps): Triton
    # compiles a kernel variant for each new specialisation of its integer arguments (divisible
    # by 16 or not, ...), which must not happen inside the timed run. A 16-request warm-up
    # missed some: the timed prefill then took 1.39 s instead of 0.51 s on the H200.
    warm_prompts, _ = make_workload(args.num_requests, args.input_len, args.output_len, args.bench_seed + 1)
    llm.generate(
        [[t % llm.engine.vocab_size for t in p] for p in warm_prompts],
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=2),
        use_tqdm=False,
    )
    # As the server's scheduler process does after start-up: without this, full collections in
    # the timed run walk every object of the engine and the warm-up (0.1-0.2 s pauses seen).
    freeze_long_lived_objects()
    sched = llm.scheduler
    sched.counters.__init__()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    c = sched.counters
    output_tokens = sum(p.max_tokens for p in params)
    engine = llm.engine
    # imported here: it imports torch, and the CLI parser imports this module
    from minfer.engine.memory import parameter_bytes
    from minfer.models.quantize import decode_weight_bytes

    num_params = sum(p.numel() for p in {id(p): p for p in engine.model.parameters()}.values())
    # On a CPU the floor is the host's own measured bandwidth and GEMM rate (an H200 floor says
    # nothing about a CPU run); on CUDA, `cuda_card`'s: the H200's, or this GPU's, measured.
    card = measure_host_card() if engine.device.type == "cpu" else gpu_card.times(engine.tp.size)
    floor = workload_floor(
        card,
        num_params * engine.tp.size,
        decode_weight_bytes(engine.model, parameter_bytes(engine.model)) * engine.tp.size,
        engine.kv_bytes_per_token * engine.tp.size,
        [len(p) for p in prompts],
        [p.max_tokens for p in params],
        moe_weights_of(engine.model, engine.tp.size),
        attention_flops_per_pair(
            engine.head_dim, engine.hf_config.num_attention_heads, engine.hf_config.num_hidden_layers
        ),
    )
    mean_bs = c.decode_batch_total / max(c.decode_steps, 1)
    print(
        f"model {engine.source.name} ({engine.source.load_format}, {engine.dtype}, {engine.device}, "
        f"quantization {engine.config.quantization or 'none'}, "
        f"attention {engine.backend.name})"
    )
    print(f"requests {len(prompts)}, prompt tokens {sum(map(len, prompts))}, output tokens {output_tokens}")
    print(f"throughput {output_tokens / wall:,.0f} output tok/s, wall {wall:.2f} s")
    print(
        f"prefill {c.prefill_seconds:.2f} s in {c.prefill_steps} steps, decode {c.decode_seconds:.2f} s in "
        f"{c.decode_steps} steps (mean batch {mean_bs:.1f}), preemptions {c.preemptions}"
    )
    print(
        f"decode throughput {c.decode_batch_total / max(c.decode_seconds, 1e-9):,.1f} tok/s "
        f"({1e3 * c.decode_seconds / max(c.decode_steps, 1):.1f} ms per step)"
    )
    print(
        "decode ms per step by batch size: "
        + ", ".join(
            f"{low}-{2 * low - 1}: {1e3 * secs / steps:.2f} ({steps})"
            for low, (steps, secs) in sorted(c.decode_by_batch.items())
        )
        + "   [band: ms/step (steps)]"
    )
    print(
        f"card {card.name}: memory bandwidth {card.bandwidth / 1e9:,.1f} GB/s (copy, read + write), "
        f"matmul {card.matmul_rate / 1e9:,.1f} GFLOP/s"
    )
    print(
        f"floor on {card.name}: {floor.seconds:.2f} s = {output_tokens / floor.seconds:,.0f} tok/s "
        f"(decode bytes {floor.decode_seconds:.2f} s + prefill FLOPs {floor.prefill_seconds:.2f} s); "
        f"this run is at {100 * floor.seconds / wall:.1f}% of that floor"
    )
    print(
        f"with prefill's causal attention FLOPs too (+{floor.attention_seconds:.2f} s): "
        f"{floor.seconds_with_attention:.2f} s; this run is at {100 * floor.seconds_with_attention / wall:.1f}% of it"
    )
    return 0
