"""`--metrics-prefix vllm` (vLLM's names and model_name label) and `--log-requests` on a real
`minfer serve`; both naming schemes in-process."""

from __future__ import annotations

import re

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import Server

from minfer.observability.metric_names import VLLM_NAMES
from minfer.observability.metrics import ServerMetrics

# What vLLM's Grafana dashboard queries (v0 names), counters with prometheus_client's _total.
VLLM_SERIES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:gpu_cache_usage_perc",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket",
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
)


def samples_of(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


@pytest.mark.parametrize("prefix", ["minfer", "vllm"])
def test_naming_schemes(prefix):
    metrics = ServerMetrics(prefix, model_name="my-model")
    samples = samples_of(metrics.render().decode())
    names = set(samples)
    if prefix == "minfer":
        assert not any(n.startswith("vllm:") for n in names)
        assert "minfer:num_requests_running" in names and "minfer:prompt_tokens_total" in names
        assert all(not s.labels.get("model_name") for group in samples.values() for s in group)
    else:
        assert set(VLLM_SERIES) <= names
        # Only metrics without a vLLM counterpart keep minfer's name.
        kept = {
            re.sub(r"_(total|bucket|sum|count|created)$", "", n) for n in names if n.startswith("minfer:")
        }
        assert kept == {"minfer:scheduler_stats_age_seconds"}
        assert all(s.labels["model_name"] == "my-model" for n in VLLM_SERIES for s in samples[n])
    assert len(VLLM_NAMES) == len(set(VLLM_NAMES.values()))  # no two minfer metrics on one vLLM name


def test_bad_prefix_is_refused():
    with pytest.raises(ValueError, match="metrics_prefix='prom'"):
        ServerMetrics("prom")


@pytest.fixture(scope="module")
def vllm_server(tiny_chat_llama, tmp_path_factory):
    srv = Server(
        [
            tiny_chat_llama,
            "--kv-cache-tokens",
            "2048",
            "--served-model-name",
            "tiny",
            "--metrics-prefix",
            "vllm",
            "--log-requests",
        ],
        tmp_path_factory.mktemp("serve-vllm-metrics") / "server.log",
    )
    yield srv
    srv.stop()


def test_vllm_prefix_and_request_log(vllm_server):
    import httpx

    body = {"model": "tiny", "prompt": "hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    resp = vllm_server.post("/v1/completions", body)
    assert resp.status_code == 200, resp.text
    samples = samples_of(httpx.get(vllm_server.url + "/metrics", timeout=10).text)
    assert set(VLLM_SERIES) <= set(samples)
    generated = samples["vllm:generation_tokens_total"][0]
    assert generated.labels == {"model_name": "tiny"} and generated.value >= 5
    success = {s.labels["finished_reason"]: s.value for s in samples["vllm:request_success_total"]}
    assert success["length"] == 1
    assert samples["vllm:time_to_first_token_seconds_count"][0].value == 1
    prompt_tokens = resp.json()["usage"]["prompt_tokens"]
    line = re.search(r"minfer\.requests: request (\d+) finished \((\w+)\): (.*)", vllm_server.output())
    assert line, vllm_server.output()[-2000:]
    assert line.group(2) == "length"
    assert re.fullmatch(
        rf"prompt {prompt_tokens} tokens, completion 5 tokens, TTFT \d+\.\d{{3}} s, total \d+\.\d{{3}} s",
        line.group(3),
    )
