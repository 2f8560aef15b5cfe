"""`minfer trace check` on the host KV tier's events: a loaded prefix must be the one that was
offloaded into those host pages, and a loaded slot joins the prefix cache (the mixed trace
runs with a host tier behind a 128-token pool)."""

from __future__ import annotations

import copy

from minfer.observability.trace import read_trace
from minfer.observability.trace_check import check_events, format_report


def loads_of(events: list[dict]) -> list[int]:
    return [i for i, ev in enumerate(events) if ev["event"] == "kv_loaded"]


def test_mixed_trace_moves_pages_and_passes(mixed_trace):
    events = read_trace(mixed_trace)
    assert loads_of(events) and any(ev["event"] == "kv_offloaded" for ev in events)
    assert check_events(events).ok


def test_a_load_of_another_prefix_fails(mixed_trace):
    events = copy.deepcopy(read_trace(mixed_trace))
    load = events[loads_of(events)[0]]
    load["digests"][0] = "0" * 16  # the host page holds some other prefix's K/V
    report = check_events(events)
    assert not report.ok and any("the last offload there wrote prefix" in e for e in report.errors)


def test_a_load_from_a_never_written_host_page_fails(mixed_trace):
    events = copy.deepcopy(read_trace(mixed_trace))
    load = events[loads_of(events)[0]]
    start, end = load["host"][0]
    load["host"][0] = [start + 10**6, end + 10**6]
    report = check_events(events)
    assert not report.ok and any("never offloaded" in e for e in report.errors)


def test_a_load_without_the_event_leaves_a_borrow_unexplained(mixed_trace):
    """Drop every kv_loaded: the requests that hit loaded pages borrow slots the cache never held."""
    events = [ev for ev in read_trace(mixed_trace) if ev["event"] != "kv_loaded"]
    report = check_events(events)
    assert not report.ok
    assert any("borrowed, but the cache did not hold it" in e for r in report.failed for e in r.errors)


def test_write_through_copies_are_announced_before_they_are_loaded(tiny_llama, tmp_path):
    """Under write_through a host copy made on a node's second hit enters the trace when the
    node leaves the device, so a later load of it checks like a load of a write-back."""
    from trace_workloads import finish_trace, traced_llm

    from minfer import SamplingParams

    path = tmp_path / "write_through.jsonl"
    llm = traced_llm(
        tiny_llama,
        path,
        kv_cache_tokens=64,
        page_size=4,  # host slots and host page ids differ
        host_kv_cache_gb=2048 * 512 / (1 << 30),
        host_kv_write_policy="write_through",
        log_level="warning",
    )
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    head = list(range(10, 42))  # 8 pages
    for tail in ([1], [2], [3]):  # cached, then hit twice on the device: copied on the 2nd hit
        llm.generate([head + tail], params, use_tqdm=False)
    tier = llm.scheduler.kv.host_tier.counters
    assert tier.tokens_written_through >= len(head) and tier.hits == 0
    for k in range(3):  # other prompts push `head` out of the 64-token device pool
        llm.generate([[100 + 40 * k + j for j in range(40)]], params, use_tqdm=False)
    llm.generate([head + [4]], params, use_tqdm=False)  # loaded from its write-through copy
    assert tier.hits >= 1
    events = finish_trace(llm, path)
    report = check_events(events)
    assert report.ok, format_report(report)
