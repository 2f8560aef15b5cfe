"""The api server's Prometheus metrics' schema: buckets, and names (minfer's or vLLM's).

`--metrics-prefix vllm` exists so that a Grafana dashboard built for vLLM works unchanged: the
metrics vLLM also has take vLLM's name (its dashboards use the v0 names below: "gpu_cache_usage_perc",
"time_per_output_token_seconds") and carry vLLM's `model_name` label, which those dashboards filter
on. Metrics vLLM has no counterpart for keep their `minfer:` name either way, so nothing is
exported under a vLLM name with a different meaning.
"""

from __future__ import annotations

METRIC_PREFIXES = ("minfer", "vllm")

# Host KV tier load time, seconds: from one small page on CPU to gigabytes over PCIe.
HOST_LOAD_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
REQUEST_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
FINISH_REASONS = ("stop", "length", "abort")

# minfer's name (without prefix) -> vLLM's (without "vllm:"). Counters get "_total" from
# prometheus_client in both schemes.
VLLM_NAMES = {
    "num_requests_running": "num_requests_running",
    "num_requests_waiting": "num_requests_waiting",
    "kv_cache_usage_perc": "gpu_cache_usage_perc",
    "time_to_first_token_seconds": "time_to_first_token_seconds",
    "inter_token_latency_seconds": "time_per_output_token_seconds",
    "e2e_request_latency_seconds": "e2e_request_latency_seconds",
    "request_queue_time_seconds": "request_queue_time_seconds",
    "request_success": "request_success",
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    "num_preemptions": "num_preemptions",
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
}


class MetricNames:
    """Names and the constant labels of one naming scheme."""

    def __init__(self, prefix: str = "minfer", model_name: str = ""):
        if prefix not in METRIC_PREFIXES:
            raise ValueError(f"metrics_prefix={prefix!r} is not one of {list(METRIC_PREFIXES)}")
        self.prefix = prefix
        self.model_name = model_name

    def name(self, minfer_name: str) -> str:
        if self.prefix == "vllm" and minfer_name in VLLM_NAMES:
            return "vllm:" + VLLM_NAMES[minfer_name]
        return "minfer:" + minfer_name

    def labels(self, minfer_name: str) -> dict[str, str]:
        """The constant labels of a metric: vLLM's model_name on the metrics that take vLLM's name."""
        if self.prefix == "vllm" and minfer_name in VLLM_NAMES:
            return {"model_name": self.model_name}
        return {}
