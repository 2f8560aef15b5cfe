"""Prometheus metrics, per-request timings and the scheduler's periodic stats line.

Where each number comes from (one owner per value, so nothing is shared between processes):
  - the api server owns the only registry and serves /metrics. It observes what it sees
    itself: time to first token, inter-token latency, end-to-end latency and finish reasons,
    measured from the moment it submitted the request to the moment each reply arrived;
  - the scheduler process measures what only it sees: each request's queue time (arrival to
    admission) and prefill time (admission to first token), sent with the first token and
    observed by the api server; and its live state and running totals (requests running and
    waiting, KV usage, prompt/generation tokens, preemptions, prefix-cache queries and hits),
    which the api server fetches with an InfoQuery when /metrics is scraped and exports
    through a collector. Totals are the scheduler's own cumulative counters, so a lost or
    repeated scrape never double-counts.
This is why prometheus_client's multiprocess mode (mmap files in PROMETHEUS_MULTIPROC_DIR,
which must be set before any import and cleaned between runs) is not used: no metric is
written by two processes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from minfer.observability.host_tier_metrics import host_tier_families, host_tier_stats
from minfer.observability.metric_names import (
    FINISH_REASONS,
    ITL_BUCKETS,
    REQUEST_BUCKETS,
    TTFT_BUCKETS,
    MetricNames,
)

log = logging.getLogger("minfer.stats")
request_log = logging.getLogger("minfer.requests")


# -- scheduler process ---------------------------------------------------------------------------
def scheduler_stats(scheduler) -> dict:
    """The scheduler's live state and running totals, as plain numbers (sent to the api server).

    KV usage counts the pages that cannot be handed out without preempting someone: pages
    held by requests, including cached prefixes they borrow; unlocked cached pages are free
    room (the cache gives them up on demand).
    """
    kv, c = scheduler.kv, scheduler.counters
    cache = kv.prefix_cache.counters
    host = kv.host_tier.counters if getattr(kv, "host_tier", None) is not None else None
    return {
        **(host_tier_stats(host) if host is not None else {}),
        "running": len(scheduler.running) + len(scheduler.prefilling),
        "prefilling": len(scheduler.prefilling),
        "waiting": len(scheduler.waiting),
        "kv_total_pages": kv.num_pages,
        "kv_used_pages": kv.num_pages - kv.available_pages,
        "prefix_queried_tokens": cache.queried_tokens,
        "prefix_hit_tokens": cache.hit_tokens,
        "prompt_tokens": c.prompt_tokens,
        "generation_tokens": c.generation_tokens,
        "preemptions": c.preemptions,
        "prefill_steps": c.prefill_steps,
        "decode_steps": c.decode_steps,
        "prefill_tokens_computed": c.prefill_tokens_computed,
        "decode_batch_total": c.decode_batch_total,
    }


class RequestTimer:
    """Queue and prefill time of each request, measured where they happen (the scheduler).

    A request counts as admitted at the start of the first step after which it holds KV (or
    has its first token: admitted and finished within one step). Only prefill steps admit,
    so only they pay for the scan over the active requests. Times are time.monotonic().
    """

    def __init__(self):
        self._arrival: dict[int, float] = {}  # requests whose first token has not gone out yet
        self._admitted: dict[int, float] = {}

    def arrived(self, uid: int, arrival: float) -> None:
        self._arrival[uid] = arrival

    def after_step(self, scheduler, step_start: float, prefill: bool) -> None:
        if not prefill:
            return
        for reqs in (scheduler.prefilling, scheduler.running):
            for req in reqs:
                if req.uid in self._arrival:
                    self._admitted.setdefault(req.uid, step_start)

    def first_token(self, uid: int, step_start: float, now: float) -> tuple[float, float] | None:
        """(queue_s, prefill_s) when this is the request's first token, else None."""
        arrival = self._arrival.pop(uid, None)
        if arrival is None:
            return None
        admitted = self._admitted.pop(uid, step_start)
        return max(0.0, admitted - arrival), now - admitted

    def forget(self, uid: int) -> None:
        self._arrival.pop(uid, None)
        self._admitted.pop(uid, None)


class StatsLogger:
    """The periodic line: running, queued, tokens per pass, KV usage, prefix hit rate and
    generation throughput over the last interval."""

    def __init__(self, interval_s: float):
        """interval_s: EngineConfig.log_stats_interval (<= 0 turns the line off)."""
        self.interval_s = interval_s
        self._last: dict | None = None
        self._last_time = 0.0

    def maybe_log(self, scheduler, now: float | None = None) -> str | None:
        """Log (and return) the line when an interval passed since the last one; None otherwise."""
        if self.interval_s <= 0:
            return None
        now = time.monotonic() if now is None else now
        if self._last is not None and now - self._last_time < self.interval_s:
            return None
        stats = scheduler_stats(scheduler)
        previous, elapsed = self._last, now - self._last_time
        self._last, self._last_time = stats, now
        if previous is None:
            return None  # the first call only sets the baseline
        line = format_stats_line(stats, previous, elapsed)
        if line is not None:
            log.info(line)
        return line


def format_stats_line(now: dict, before: dict, elapsed_s: float) -> str | None:
    """Stats over `elapsed_s` between two `scheduler_stats` snapshots; None if no pass ran."""

    def delta(key: str) -> int:
        return now[key] - before[key]

    passes = delta("prefill_steps") + delta("decode_steps")
    if passes == 0:
        return None
    tokens = delta("prefill_tokens_computed") + delta("decode_batch_total")
    queried = delta("prefix_queried_tokens")
    hit_rate = f"{100 * delta('prefix_hit_tokens') / queried:.1f}%" if queried else "-"
    kv = now["kv_used_pages"] / max(1, now["kv_total_pages"])
    return (
        f"running {now['running']} ({now['prefilling']} prefilling), queued {now['waiting']}, "
        f"{tokens / passes:.1f} tokens/pass over {passes} passes, "
        f"KV {100 * kv:.1f}% ({now['kv_used_pages']}/{now['kv_total_pages']} pages), "
        f"prefix hit {hit_rate}, gen {delta('generation_tokens') / elapsed_s:.1f} tok/s, "
        f"{delta('preemptions')} preemptions (last {elapsed_s:.1f} s)"
    )


# -- api server process --------------------------------------------------------------------------
@dataclass
class _Timing:
    submitted: float
    first_token: float | None = None
    last_token: float | None = None


def _family(cls, names: MetricNames, name: str, doc: str, value: float):
    """One sample of a gauge or counter family, with the naming scheme's constant labels."""
    labels = names.labels(name)
    family = cls(names.name(name), doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


class _SchedulerCollector:
    """Exports the latest scheduler snapshot (fetched at scrape time) as gauges and counters."""

    def __init__(self, names: MetricNames):
        self.names = names
        self.stats: dict = {}
        self.updated: float | None = None  # time.monotonic() of the snapshot

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s, names = self.stats, self.names
        # A scrape while the scheduler is too busy to answer serves the last snapshot: say how old.
        age = -1.0 if self.updated is None else time.monotonic() - self.updated
        gauges = (
            (
                "scheduler_stats_age_seconds",
                "Age of the scheduler numbers below (0 when fetched for this scrape; -1: never fetched).",
                age,
            ),
            ("num_requests_running", "Requests holding KV (prefilling or decoding).", s.get("running", 0)),
            (
                "num_requests_waiting",
                "Requests waiting for admission (new or preempted).",
                s.get("waiting", 0),
            ),
            (
                "kv_cache_usage_perc",
                "Fraction of KV pages not available without preemption (1 = 100%).",
                s.get("kv_used_pages", 0) / max(1, s.get("kv_total_pages", 1)),
            ),
        )
        for name, doc, value in gauges:
            yield _family(GaugeMetricFamily, names, name, doc, value)
        counters = (
            ("prefix_cache_queries", "prefix_queried_tokens", "Prompt tokens looked up in the prefix cache."),
            ("prefix_cache_hits", "prefix_hit_tokens", "Prompt tokens found in the prefix cache."),
            ("prompt_tokens", "prompt_tokens", "Prompt tokens of accepted requests."),
            ("generation_tokens", "generation_tokens", "Tokens generated."),
            ("num_preemptions", "preemptions", "Requests preempted (KV given back, requeued)."),
        )
        for name, key, doc in counters:
            yield _family(CounterMetricFamily, names, name, doc, s.get(key, 0))
        if "host_cache_hits" in s:  # only with --host-kv-cache-gb
            yield from host_tier_families(s, names)


class ServerMetrics:
    """The api server's registry and what it observes per request.

    prefix: "minfer" or "vllm" (metric_names.py); model_name: vLLM's model_name label;
    log_requests: log one line per finished request (ServerConfig.log_requests)."""

    def __init__(self, prefix: str = "minfer", model_name: str = "", log_requests: bool = False):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.names = names = MetricNames(prefix, model_name)
        self.log_requests = log_requests
        self.registry = CollectorRegistry(auto_describe=True)

        def histogram(name: str, doc: str, buckets: tuple):
            labels = names.labels(name)
            metric = Histogram(names.name(name), doc, list(labels), buckets=buckets, registry=self.registry)
            return metric.labels(**labels) if labels else metric

        self.ttft = histogram(
            "time_to_first_token_seconds", "Time from submission to the first token.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between consecutive tokens of a request.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Time from submission to the last reply.", REQUEST_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Time in the scheduler's waiting queue before admission.",
            REQUEST_BUCKETS,
        )
        self._success_labels = names.labels("request_success")
        self.success = Counter(
            names.name("request_success"),
            "Requests finished, by finish reason.",
            ["finished_reason", *self._success_labels],
            registry=self.registry,
        )
        for reason in FINISH_REASONS:
            self._finished(reason)  # present at 0 before the first request
        self.scheduler = _SchedulerCollector(names)
        self.registry.register(self.scheduler)
        self._requests: dict[int, _Timing] = {}

    def _finished(self, reason: str):
        return self.success.labels(finished_reason=reason, **self._success_labels)

    def request_started(self, uid: int, now: float) -> None:
        self._requests[uid] = _Timing(now)

    def request_failed(self, uid: int) -> None:
        self._requests.pop(uid, None)

    def reply(self, reply, now: float) -> None:
        """One reply (a few tokens and/or the end) of a request, arriving at `now`."""
        timing = self._requests.get(reply.uid)
        if timing is None:
            return
        n = len(reply.token_ids)
        if n:
            if timing.last_token is None:
                timing.first_token = now
                self.ttft.observe(now - timing.submitted)
                gaps = [0.0] * (n - 1)  # tokens that arrived together with the first
            else:
                gaps = [(now - timing.last_token) / n] * n
            for gap in gaps:
                self.itl.observe(gap)
            timing.last_token = now
        if getattr(reply, "queue_s", None) is not None:
            self.queue_time.observe(reply.queue_s)
        if reply.finish_reason is not None:
            del self._requests[reply.uid]
            self.e2e.observe(now - timing.submitted)
            self._finished(reply.finish_reason).inc()
            if self.log_requests:
                request_log.info("%s", request_line(reply, timing, now))

    def clear(self) -> None:
        """The workers died: no reply will come for the open requests."""
        self._requests.clear()

    def update_scheduler(self, stats: dict) -> None:
        self.scheduler.stats = dict(stats)
        self.scheduler.updated = time.monotonic()

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def request_line(reply, timing: _Timing, now: float) -> str:
    """The --log-requests line of a finished request; times measured in the api server."""
    ttft = "-" if timing.first_token is None else f"{timing.first_token - timing.submitted:.3f} s"
    return (
        f"request {reply.uid} finished ({reply.finish_reason}): prompt {reply.prompt_tokens} tokens, "
        f"completion {reply.completion_tokens} tokens, TTFT {ttft}, total {now - timing.submitted:.3f} s"
    )
