"""Option defaults that depend on the device and the weights, for fields left at None.

The engine resolves them once it knows its device (engine/engine.py); config.py re-exports them
beside the options they complete.
"""

from __future__ import annotations

# Values used when a field is left at None and the device is a CPU.
CPU_DEFAULT_KV_CACHE_TOKENS = 16384
DEFAULT_MAX_RUNNING_REQUESTS = 256
# `minfer bench offline` on the default model stops gaining throughput past this many running
# requests on CPU; with --quantization a row costs less and serving throughput still grows at 32
# (concurrency 64: 95.1 vs 84.2 tok/s at 16), and prefill steps of 2048 tokens, not 8192, serve
# concurrency 64 at 111.3 vs 100.5 tok/s (docs/BENCHMARKS.md "CPU serving").
CPU_DEFAULT_MAX_RUNNING_REQUESTS = 16
CPU_QUANTIZED_DEFAULT_MAX_RUNNING_REQUESTS = 32
DEFAULT_CHUNKED_PREFILL_SIZE = 8192
CPU_QUANTIZED_CHUNKED_PREFILL_SIZE = 2048


def default_max_running_requests(device_type: str, quantization: str | None = None) -> int:
    """The running-request cap when `max_running_requests` is not given."""
    if device_type != "cpu":
        return DEFAULT_MAX_RUNNING_REQUESTS
    unquantized = quantization in (None, "none")
    return CPU_DEFAULT_MAX_RUNNING_REQUESTS if unquantized else CPU_QUANTIZED_DEFAULT_MAX_RUNNING_REQUESTS


def default_chunked_prefill_size(device_type: str, quantization: str | None = None) -> int:
    """The prefill step's token budget when `chunked_prefill_size` is not given."""
    quantized_cpu = device_type == "cpu" and quantization not in (None, "none")
    return CPU_QUANTIZED_CHUNKED_PREFILL_SIZE if quantized_cpu else DEFAULT_CHUNKED_PREFILL_SIZE
