"""The host KV tier through a real server: /v1/server_info reports its size, /metrics its traffic
after conversations that outgrow the device pool come back (the real openai client)."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import Server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = [
        "--kv-cache-tokens",
        "256",
        "--page-size",
        "16",
        "--host-kv-cache-gb",
        "0.05",
        "--log-level",
        "warning",
    ]
    srv = Server(args, tmp_path_factory.mktemp("hostkv") / "server.log", env={"OMP_NUM_THREADS": "1"})
    yield srv
    srv.stop()


def metrics(url: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if not sample.labels or set(sample.labels) == {"le"}:
                key = sample.name + (f"{{le={sample.labels['le']}}}" if sample.labels else "")
                out[key] = sample.value
    return out


def test_server_info_reports_the_host_tier(server):
    info = server.info()
    host, memory = info["host_kv_pool"], info["memory"]
    assert host["tokens"] == memory["host_kv_tokens"] > 256  # bigger than the device pool
    assert host["bytes"] == memory["host_kv_bytes"] <= 0.05 * (1 << 30)
    assert memory["host_available_bytes"] > 0 and host["pinned"] is False
    assert "host KV tier" in info["memory_line"] and "left available" in info["memory_line"]


def test_server_info_reports_the_staging_buffers(server):
    info = server.info()
    assert info["host_kv_pool"]["staging_bytes"] == info["memory"]["host_staging_bytes"] > 0
    assert "transfer staging" in info["memory_line"]


def test_metrics_count_offloads_and_loads(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    topics = ["the sea", "a mountain", "old trains", "winter markets", "a lighthouse"]
    prompts = [f"Write a long, detailed and friendly letter about {t}, " * 6 for t in topics]
    first = {}
    for p in prompts:  # five ~100-token prompts through a 256-token device pool: evictions
        first[p] = (
            client.completions.create(model=model, prompt=p, max_tokens=4, temperature=0).choices[0].text
        )
    before = metrics(server.url)
    assert before["minfer:host_cache_bytes_offloaded_total"] > 0
    assert before["minfer:host_cache_tokens_written_through_total"] == 0  # the default write_back
    assert before["minfer:host_cache_loads_joined_total"] == 0  # CPU loads are synchronous
    again = client.completions.create(model=model, prompt=prompts[0], max_tokens=4, temperature=0)
    assert again.choices[0].text == first[prompts[0]]
    after = metrics(server.url)
    assert after["minfer:host_cache_hits_total"] == before["minfer:host_cache_hits_total"] + 1
    assert (
        after["minfer:host_cache_tokens_loaded_total"] >= 64 + before["minfer:host_cache_tokens_loaded_total"]
    )
    assert after["minfer:host_cache_bytes_loaded_total"] > before["minfer:host_cache_bytes_loaded_total"]
    assert after["minfer:host_cache_load_seconds_count"] >= 1
    assert (
        after["minfer:host_cache_load_seconds_bucket{le=+Inf}"]
        == after["minfer:host_cache_load_seconds_count"]
    )
