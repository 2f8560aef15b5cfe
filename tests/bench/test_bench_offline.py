"""`minfer bench offline`: the workload is nano-vllm's exactly, and the command runs on CPU."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from minfer.bench.floor import H200, measure_host_card, workload_floor
from minfer.bench.offline import make_workload


def test_workload_matches_nano_vllm():
    prompts, params = make_workload()
    assert len(prompts) == 256
    assert sum(p.max_tokens for p in params) == 133_966
    assert all(100 <= len(p) <= 1024 and all(0 <= t <= 10000 for t in p) for p in prompts)
    assert all(p.temperature == 0.6 and p.ignore_eos for p in params)


def test_floor_of_the_standard_workload():
    """The issue's figure: 3.76 s (35,587 tok/s) for the Qwen3-0.6B shape on one H200."""
    prompts, params = make_workload()
    params_count = 596_049_920
    floor = workload_floor(
        H200,
        params_count,
        2 * params_count,
        114_688,
        [len(p) for p in prompts],
        [p.max_tokens for p in params],
    )
    assert abs(floor.seconds - 3.76) < 0.05
    assert (
        floor.seconds / 2
        == workload_floor(
            H200.times(2),
            params_count,
            2 * params_count,
            114_688,
            [len(p) for p in prompts],
            [p.max_tokens for p in params],
        ).seconds
    )


def test_bench_runs_on_cpu(tmp_path):
    from tiny_models import save_tiny_model

    save_tiny_model("qwen3", tmp_path, vocab_size=10001)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "minfer",
            "bench",
            "offline",
            str(tmp_path),
            "--num-requests",
            "6",
            "--input-len",
            "40",
            "--output-len",
            "12",
            "--kv-cache-tokens",
            "2048",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "throughput" in out and "decode throughput" in out
    # On CPU the floor is this host's, measured: not the H200's (which gave "0.0% of the H200 floor").
    assert "H200" not in out
    floor_line = next(line for line in out.splitlines() if line.startswith("floor on this CPU ("))
    percent = float(floor_line.split("this run is at ")[1].split("%")[0])
    assert 0 < percent <= 100, floor_line  # a tiny model is far from its floor: overheads dominate
    attention_line = next(
        line for line in out.splitlines() if line.startswith("with prefill's causal attention")
    )
    with_attention = float(attention_line.split("this run is at ")[1].split("%")[0])
    # a tiny model's attention FLOPs move the one-decimal figure little or not at all
    assert percent <= with_attention <= 100, attention_line
    assert re.search(r"card this CPU \(\d+ threads?, measured\): memory bandwidth [\d,.]+ GB/s", out)


def test_floor_counts_causal_attention_apart():
    """L (L + 1) / 2 (query, key) pairs per prompt at 4 x head_dim x heads x layers FLOPs each,
    in its own term: the floor's `seconds` (and every figure quoted against it) is unchanged.
    Llama-3.1-8B's 27,770-token prompt: 202 TFLOP, 0.26 s on an H200 (docs/BENCHMARKS.md)."""
    from minfer.bench.floor import attention_flops_per_pair, causal_attention_flops

    per_pair = attention_flops_per_pair(128, 32, 32)
    assert per_pair == 524_288
    assert causal_attention_flops([3, 1], per_pair) == (6 + 1) * per_pair  # 3 + 2 + 1 pairs, and 1
    assert abs(causal_attention_flops([27_770], per_pair) / H200.matmul_rate - 0.256) < 0.001
    common = (H200, 1_000_000, 2_000_000, 1000, [10, 20], [3, 3])
    plain = workload_floor(*common)
    counted = workload_floor(*common, flops_per_pair=per_pair)
    assert plain.attention_seconds == 0 and counted.seconds == plain.seconds
    assert counted.seconds_with_attention == plain.seconds + (55 + 210) * per_pair / H200.matmul_rate


def test_host_card_is_measured():
    card = measure_host_card(repeats=2)
    # Any host: more than a slow DIMM's 1 GB/s, less than an H200's; GEMM between 1 GFLOP/s and 100 TFLOP/s.
    assert 1e9 < card.bandwidth < H200.bandwidth and 1e9 < card.matmul_rate < 1e14
    assert "measured" in card.name


def test_moe_floor_reads_the_experts_a_step_can_touch():
    """Per decode step, E(1 - (1 - k/E)^B) experts per layer: top-k at batch 1, nearly all at
    batch 256 (Qwen3-30B-A3B: 128 experts, top 8); prefill FLOPs count only top-k experts."""
    from minfer.bench.floor import MoeWeights

    moe = MoeWeights(
        layers=48,
        num_experts=128,
        top_k=8,
        bytes_per_expert=2 * 3 * 768 * 2048,
        params_per_expert=3 * 768 * 2048,
    )
    assert moe.expected_experts(1) == 8
    assert moe.expected_experts(4) == 29.123046875  # 128 x (1 - (15/16)^4), by hand
    assert moe.expected_experts(256) > 127.99
    dense_params = 1_000_000
    one = dict(prompt_lens=[10], output_lens=[3])  # two decode steps at batch 1
    floor = workload_floor(H200, dense_params + moe.params, 2 * dense_params + moe.bytes, 0, moe=moe, **one)
    assert floor.decode_seconds == 2 * (2 * dense_params + 48 * 8 * moe.bytes_per_expert) / H200.bandwidth
    active = dense_params + 48 * 8 * moe.params_per_expert
    assert floor.prefill_seconds == 2 * active * 10 / H200.matmul_rate


def test_a_cpu_run_takes_no_gpu_card():
    """`bench offline --device cpu` (and any run on a machine without CUDA) is compared with
    the host's own measured floor, never a GPU's."""
    from minfer.bench.offline import _gpu_card

    assert _gpu_card("cpu") is None
    if not torch.cuda.is_available():
        assert _gpu_card("auto") is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_run_is_compared_with_its_own_card():
    """On an H200 the floor keeps the H200's measured figures; on any other GPU (an H100 printed
    "floor on H200" until the twenty-fifth session) it is that GPU's, measured."""
    from minfer.bench.floor import cuda_card

    device = torch.device("cuda", torch.cuda.current_device())
    card = cuda_card(device)
    if "H200" in torch.cuda.get_device_name(device):
        assert card is H200
    else:
        assert card.name.endswith("(measured)") and torch.cuda.get_device_name(device) in card.name
        assert 0.2e12 < card.bandwidth < 20e12, card  # bytes/s, read + written
        assert 20e12 < card.matmul_rate < 5e15, card  # bf16 FLOP/s
