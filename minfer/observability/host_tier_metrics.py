"""The host KV tier's numbers: from its counters (scheduler process) to Prometheus families
(api server). Exported only when the tier is on (--host-kv-cache-gb)."""

from __future__ import annotations

from minfer.observability.metric_names import HOST_LOAD_BUCKETS, MetricNames

COUNTERS = (
    ("host_cache_hits", "Prefix hits that loaded pages from the host KV tier."),
    ("host_cache_tokens_loaded", "Tokens of K/V copied host -> device."),
    ("host_cache_bytes_loaded", "Bytes of K/V copied host -> device."),
    (
        "host_cache_bytes_offloaded",
        "Bytes of K/V copied device -> host (on eviction, or a write-through hit).",
    ),
    (
        "host_cache_tokens_written_through",
        "Tokens of K/V copied to the host on a second hit (write_through).",
    ),
    (
        "host_cache_loads_joined",
        "Loads still in flight that a pass was queued after on the GPU (expected to land soon: "
        "LOAD_JOIN_MAX_WAIT_S), instead of their request sitting out the pass.",
    ),
)


def host_tier_stats(host) -> dict:
    """HostTierCounters (kvcache/host_tier.py) as plain numbers, sent to the api server."""
    return {
        "host_cache_hits": host.hits,
        "host_cache_tokens_loaded": host.tokens_loaded,
        "host_cache_bytes_loaded": host.bytes_loaded,
        "host_cache_bytes_offloaded": host.bytes_offloaded,
        "host_cache_tokens_written_through": host.tokens_written_through,
        "host_cache_loads_joined": host.loads_joined,
        "host_cache_loads": host.loads,
        "host_cache_load_seconds_sum": host.load_seconds_sum,
        "host_cache_load_seconds_buckets": list(host.load_seconds_buckets),
    }


def host_tier_families(stats: dict, names: MetricNames):
    """The counters and the load-time histogram (cumulative buckets, as counted)."""
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    for name, doc in COUNTERS:
        labels = names.labels(name)
        family = CounterMetricFamily(names.name(name), doc, labels=list(labels))
        family.add_metric(list(labels.values()), stats[name])
        yield family
    labels = names.labels("host_cache_load_seconds")
    family = HistogramMetricFamily(
        names.name("host_cache_load_seconds"),
        "Time of one host -> device load (CUDA: its copy on the load stream; CPU: the copy itself).",
        labels=list(labels),
    )
    buckets = [(str(b), n) for b, n in zip(HOST_LOAD_BUCKETS, stats["host_cache_load_seconds_buckets"])]
    family.add_metric(
        list(labels.values()),
        buckets + [("+Inf", stats["host_cache_loads"])],
        stats["host_cache_load_seconds_sum"],
    )
    yield family
