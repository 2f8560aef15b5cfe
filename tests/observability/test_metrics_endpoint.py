"""/metrics, /generate timings and the trace of a real `minfer serve` (subprocess, tiny model);
the metrics helpers in-process."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import Server

from minfer.cli import main
from minfer.observability import events as schema
from minfer.observability.metrics import ServerMetrics, StatsLogger, format_stats_line
from minfer.observability.trace import read_trace
from minfer.observability.trace_check import check_events, format_report

GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
COUNTERS = (
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "num_preemptions_total",
)
HISTOGRAMS = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
)


def scrape(url: str) -> dict[str, dict]:
    """{sample name: {labels as a sorted tuple: value}} of a /metrics answer."""
    resp = httpx.get(url + "/metrics", timeout=10)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def value(samples, name: str, **labels) -> float:
    return samples["minfer:" + name][tuple(sorted(labels.items()))]


@pytest.fixture(scope="module")
def server(tiny_chat_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-metrics")
    trace = tmp / "trace.jsonl"
    trace.write_text('{"stale": "a previous run"}\n')  # the server empties it at start
    srv = Server(
        [tiny_chat_llama, "--kv-cache-tokens", "2048", "--trace-requests", str(trace)], tmp / "server.log"
    )
    yield srv, trace
    srv.stop()


def test_metrics_after_requests(server):
    srv, _ = server
    before = scrape(srv.url)
    for name in GAUGES + COUNTERS:
        assert value(before, name) == 0, name
    for reason in ("stop", "length", "abort"):
        assert value(before, "request_success_total", finished_reason=reason) == 0

    prompts = ["The quick brown fox", "Hello there, how", "The quick brown fox"]  # the third hits the first
    usage = []
    for prompt in prompts:
        r = srv.post(
            "/v1/completions", {"prompt": prompt, "max_tokens": 5, "ignore_eos": True, "temperature": 0}
        )
        assert r.status_code == 200, r.text
        usage.append(r.json()["usage"])
    gen = srv.post(
        "/generate",
        {
            "text": "Once upon a time",
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True, "temperature": 0},
        },
    )
    assert gen.status_code == 200, gen.text
    meta = gen.json()["meta_info"]
    t = meta["timings"]
    assert set(t) == {"queue_s", "prefill_s", "first_token_s", "decode_s", "e2e_s"}
    assert all(isinstance(v, float) and v >= 0 for v in t.values()), t
    assert t["queue_s"] + t["prefill_s"] <= t["first_token_s"] + 1e-3
    assert t["first_token_s"] + t["decode_s"] == pytest.approx(t["e2e_s"], abs=1e-6)
    assert meta["e2e_latency"] == t["e2e_s"]

    after = scrape(srv.url)
    n = 4
    prompt_tokens = sum(u["prompt_tokens"] for u in usage) + meta["prompt_tokens"]
    assert value(after, "prompt_tokens_total") == prompt_tokens
    assert value(after, "generation_tokens_total") == 3 * 5 + 4
    assert value(after, "request_success_total", finished_reason="length") == n
    assert value(after, "request_success_total", finished_reason="stop") == 0
    assert value(after, "num_requests_running") == 0 and value(after, "num_requests_waiting") == 0
    assert value(after, "num_preemptions_total") == 0
    assert "minfer.requests" not in srv.output()  # the per-request line is off without --log-requests
    # The prefix cache was asked for every prompt but its last token; the repeated prompt hit.
    assert value(after, "prefix_cache_queries_total") == prompt_tokens - n
    assert 0 < value(after, "prefix_cache_hits_total") <= usage[2]["prompt_tokens"] - 1
    assert 0 <= value(after, "kv_cache_usage_perc") <= 1
    for name in HISTOGRAMS:
        assert value(after, name.replace("_seconds", "_seconds_count")) == (
            3 * 4 + 3 if name.startswith("inter_token") else n
        ), name
        assert value(after, name.replace("_seconds", "_seconds_bucket"), le="+Inf") == value(
            after, name.replace("_seconds", "_seconds_count")
        )
        assert value(after, name.replace("_seconds", "_seconds_sum")) >= 0

    # An aborted request is counted under "abort".
    with httpx.stream(
        "POST",
        srv.url + "/v1/completions",
        timeout=30,
        json={"prompt": "hi", "max_tokens": 1500, "ignore_eos": True, "stream": True},
    ) as resp:
        assert resp.status_code == 200
        next(resp.iter_lines())
    for _ in range(100):
        later = scrape(srv.url)
        if value(later, "request_success_total", finished_reason="abort") == 1:
            break
    assert value(later, "request_success_total", finished_reason="abort") == 1
    assert value(later, "num_requests_running") == 0


def test_served_trace_passes_check(server, capsys):
    srv, trace = server
    r = srv.post("/v1/completions", {"prompt": "one two three", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200
    # Workers write every 50 ms: wait until the last request's events are in the file.
    for _ in range(100):
        events = read_trace(str(trace))
        if (
            sum(e["event"] in ("finished", "aborted") for e in events) >= 6
            and sum(e["event"] == "detokenized" and e["finish_reason"] is not None for e in events) >= 6
        ):
            break
        httpx.get(srv.url + "/health", timeout=5)
    assert "stale" not in events[0]
    report = check_events(events)
    assert report.ok, format_report(report)
    assert len(report.requests) == 6
    names = {e["event"] for e in events}
    assert {
        "received",
        "tokenized",
        "detokenized",
        "queued",
        "kv_slots_allocated",
        "finished",
        "aborted",
    } <= names
    # The front end's emitters write exactly the schema too (the scheduler's: test_trace_schema.py).
    mismatched = [err for e in events for err in schema.schema_errors(e, exact=True)]
    assert not mismatched, mismatched[:5]
    pids = {e["event"]: e["pid"] for e in events}
    assert len({pids["received"], pids["tokenized"], pids["queued"]}) == 3  # three processes, one file
    assert main(["trace", "check", str(trace)]) == 0


def test_server_metrics_in_process():
    from minfer.ipc.messages import Reply

    metrics = ServerMetrics()
    metrics.request_started(7, 100.0)
    metrics.reply(Reply(7, "a", [1], 3, 1, queue_s=0.25, prefill_s=0.5), 101.0)
    metrics.reply(Reply(7, "bc", [2, 3], 3, 3), 101.5)
    metrics.reply(Reply(7, "", [], 3, 3, "stop"), 102.0)
    metrics.reply(Reply(8, "", [4], 3, 1, "length"), 102.0)  # unknown uid: ignored
    reg = metrics.registry
    assert reg.get_sample_value("minfer:time_to_first_token_seconds_sum") == 1.0
    assert reg.get_sample_value("minfer:inter_token_latency_seconds_count") == 2
    assert reg.get_sample_value("minfer:inter_token_latency_seconds_sum") == 0.5
    assert reg.get_sample_value("minfer:e2e_request_latency_seconds_sum") == 2.0
    assert reg.get_sample_value("minfer:request_queue_time_seconds_sum") == 0.25
    assert reg.get_sample_value("minfer:request_success_total", {"finished_reason": "stop"}) == 1
    assert reg.get_sample_value("minfer:scheduler_stats_age_seconds") == -1.0  # never fetched
    metrics.update_scheduler(
        {"running": 2, "waiting": 1, "kv_used_pages": 3, "kv_total_pages": 12, "generation_tokens": 40}
    )
    assert reg.get_sample_value("minfer:kv_cache_usage_perc") == 0.25
    assert reg.get_sample_value("minfer:generation_tokens_total") == 40
    assert b"minfer:num_requests_waiting 1.0" in metrics.render()
    assert 0 <= reg.get_sample_value("minfer:scheduler_stats_age_seconds") < 5  # a stale one says how old


def test_stats_line(tiny_llama, caplog):
    from minfer import LLM, SamplingParams

    llm = LLM(tiny_llama, kv_cache_tokens=256)
    stats_log = StatsLogger(interval_s=10.0)
    assert stats_log.maybe_log(llm.scheduler, now=0.0) is None  # the baseline
    llm.generate([[5, 6, 7, 8]] * 2, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert stats_log.maybe_log(llm.scheduler, now=5.0) is None  # within the interval
    with caplog.at_level("INFO", logger="minfer.stats"):
        line = stats_log.maybe_log(llm.scheduler, now=10.0)
    assert line is not None and line in caplog.text
    assert line.startswith("running 0 (0 prefilling), queued 0,")
    assert "gen 0.8 tok/s" in line and "KV " in line and "prefix hit " in line and "0 preemptions" in line
    assert stats_log.maybe_log(llm.scheduler, now=20.0) is None  # no pass ran: nothing to say
    idle = {
        "prefill_steps": 1,
        "decode_steps": 0,
        "prefill_tokens_computed": 4,
        "decode_batch_total": 0,
        "prefix_queried_tokens": 0,
        "prefix_hit_tokens": 0,
        "kv_used_pages": 1,
        "kv_total_pages": 4,
        "generation_tokens": 1,
        "preemptions": 0,
        "running": 1,
        "prefilling": 0,
        "waiting": 0,
    }
    assert "prefix hit -" in format_stats_line(idle, dict.fromkeys(idle, 0), 1.0)
