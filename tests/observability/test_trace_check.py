"""`minfer trace check` passes real traces of every request path and fails corrupted ones."""

from __future__ import annotations

import copy
import json

import pytest
from trace_workloads import finish_trace, run_mixed_workload, traced_llm

from minfer import SamplingParams
from minfer.cli import main
from minfer.observability.trace import expand_ranges, read_trace, slot_ranges
from minfer.observability.trace_check import check_events, format_report


def states(events, uid, name):
    return [
        (e["cached_len"], e["device_len"], e["extend_len"])
        for e in events
        if e["uid"] == uid and e["event"] == name
    ]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_seed_scenario_13_token_prompt(tiny_llama, tmp_path, overlap):
    """The issue's scenario: 0/13/13 -> 13/14/1 -> 14/15/1 -> ... -> final cached 16 / device 17;
    13 slots in the prefill, then one per decode step."""
    path = tmp_path / "seed.jsonl"
    llm = traced_llm(tiny_llama, path, kv_cache_tokens=256, disable_overlap_schedule=not overlap)
    llm.generate(
        [list(range(1, 14))], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    events = finish_trace(llm, path)
    assert events[0]["event"] == "kv_pool" and events[0]["num_slots"] == 256
    request_events = [e["event"] for e in events if e["uid"] == 0]
    assert request_events[:4] == ["queued", "prefix_matched", "batch_scheduled", "kv_slots_allocated"]
    assert request_events[4:6] == ["request_state_updated", "prompt_cached"]
    allocs = [e for e in events if e["event"] == "kv_slots_allocated"]
    assert [(e["cached_len"], e["device_len"], e["extend_len"]) for e in allocs] == [
        (0, 13, 13),
        (13, 14, 1),
        (14, 15, 1),
        (15, 16, 1),
    ]
    assert [e["num_slots"] for e in allocs] == [13, 1, 1, 1]
    assert allocs[0]["out_loc"] == [[0, 13]] and allocs[0]["table_idx"] >= 0
    updates = [e for e in events if e["event"] == "request_state_updated"]
    chain = [
        (u["before"]["cached_len"], u["before"]["device_len"], u["before"]["extend_len"]) for u in updates
    ]
    chain.append(tuple(updates[-1]["after"][k] for k in ("cached_len", "device_len", "extend_len")))
    assert chain == [(0, 13, 13), (13, 14, 1), (14, 15, 1), (15, 16, 1), (16, 17, 1)]
    assert [e["output_len"] for e in events if e["event"] == "token_sampled"] == [1, 2, 3, 4]
    (released,) = [e for e in events if e["event"] == "kv_released"]
    assert released["cached"] == [[0, 16]] and released["freed"] == [] and released["cached_len"] == 16
    (end,) = [e for e in events if e["event"] == "finished"]
    assert (end["reason"], end["prompt_len"], end["output_len"]) == ("length", 13, 4)
    assert (end["cached_len"], end["device_len"], end["extend_len"]) == (16, 17, 1)
    for e in events:
        assert {"ts", "pid", "uid", "event"} <= e.keys()
    report = check_events(events)
    assert report.ok, format_report(report)
    assert main(["trace", "check", str(path)]) == 0


@pytest.mark.parametrize(
    "overlap,page_size,kv_cache_dtype",
    [(True, 1, "auto"), (True, 4, "auto"), (False, 1, "auto"), (False, 4, "auto"), (True, 4, "fp8_e4m3")],
)
def test_mixed_run_passes_check(tiny_llama, tmp_path, overlap, page_size, kv_cache_dtype, capsys):
    """Many concurrent requests with chunked prefill, prefix hits, stop tokens, an abort and
    preemption (a 128-token pool): every request passes (an fp8 cache changes none of it)."""
    path = tmp_path / "mixed.jsonl"
    llm = traced_llm(
        tiny_llama,
        path,
        kv_cache_tokens=128,
        chunked_prefill_size=16,
        page_size=page_size,
        disable_overlap_schedule=not overlap,
        kv_cache_dtype=kv_cache_dtype,
    )
    ran = run_mixed_workload(llm)
    events = finish_trace(llm, path)
    report = check_events(events)
    assert report.ok, format_report(report)
    by_uid = {r.uid: r for r in report.requests}
    assert len(by_uid) == 26
    # The paths were really taken.
    assert ran["preemptions"] > 0 and sum(r.preemptions for r in report.requests) == ran["preemptions"]
    assert by_uid[ran["aborted"]].end == "aborted"
    assert any(r.prefill_chunks > 1 for r in report.requests)
    assert by_uid[25].hit_tokens > 0  # the second of two identical prompts
    assert "finished:stop" in {r.end for r in report.requests}
    for uid, reason in ran["reasons"].items():
        r = by_uid[uid]
        assert r.end == ("aborted" if reason == "abort" else f"finished:{reason}")
        if reason != "abort":
            assert r.final_state[0] == r.prompt_len + r.output_len - 1
    assert main(["trace", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "PASS: 26/26 requests pass" in out and "FAIL" not in out


@pytest.fixture(scope="module")
def good_trace(mixed_trace) -> list[dict]:
    events = read_trace(mixed_trace)
    assert check_events(events).ok
    return events


def first(events, name, uid=None, after=0):
    return next(
        i
        for i, e in enumerate(events)
        if i >= after and e["event"] == name and (uid is None or e["uid"] == uid)
    )


def corrupt_drop(events, name, uid=None):
    out = copy.deepcopy(events)
    del out[first(out, name, uid)]
    return out


def fails(events, *needles) -> str:
    report = check_events(events)
    text = format_report(report, max_errors=50)
    assert not report.ok, "the corrupted trace passed"
    for needle in needles:
        assert needle in text, text
    return text


def test_dropped_events_fail(good_trace):
    fails(corrupt_drop(good_trace, "token_sampled", uid=0), "uid 0", "output_len")
    fails(corrupt_drop(good_trace, "kv_released", uid=0), "finished while holding KV")
    fails(corrupt_drop(good_trace, "forward_done", uid=0), "token_sampled without a forward_done")
    fails(corrupt_drop(good_trace, "batch_scheduled", uid=0), "kv_slots_allocated without batch_scheduled")
    fails(corrupt_drop(good_trace, "finished", uid=0), "never ended")
    fails(corrupt_drop(good_trace, "queued", uid=1), "before queued")


def test_wrong_lengths_fail(good_trace):
    events = copy.deepcopy(good_trace)
    i = first(events, "request_state_updated", uid=0)
    events[i]["after"]["cached_len"] += 1
    fails(events, "gave")
    events = copy.deepcopy(good_trace)
    i = first(events, "finished", uid=0)
    events[i]["cached_len"] += 1
    events[i]["extend_len"] -= 1
    fails(events, "final cached_len")
    events = copy.deepcopy(good_trace)
    i = first(events, "kv_slots_allocated", uid=0)
    events[i]["device_len"] += 1
    fails(events, "allocated at state")
    events = copy.deepcopy(good_trace)  # a decode pass that claims two slots
    i = next(i for i, e in enumerate(events) if e["event"] == "batch_scheduled" and e["phase"] == "decode")
    events[i]["chunk"] = 2
    fails(events, "decode chunk 2")


def test_slot_misuse_fails(good_trace):
    events = copy.deepcopy(good_trace)  # request B is given a slot request A still holds
    i0 = first(events, "kv_slots_allocated")
    holder = events[i0]["uid"]
    released = first(events, "kv_released", uid=holder)
    i1 = next(
        i
        for i in range(i0, released)
        if events[i]["event"] == "kv_slots_allocated" and events[i]["uid"] != holder
    )
    stolen = events[i0]["out_loc"][0][0]
    slots = expand_ranges(events[i1]["out_loc"])
    events[i1]["out_loc"] = slot_ranges([stolen] + slots[1:])
    fails(events, f"slot {stolen} allocated while uid {holder} holds it")
    events = copy.deepcopy(good_trace)  # a release that forgets a slot
    i = first(events, "kv_released", uid=0)
    rng = events[i]["cached"][-1]
    rng[1] -= 1
    fails(events, "released")


def test_ended_twice_fails(good_trace):
    events = copy.deepcopy(good_trace)
    i = first(events, "finished", uid=0)
    events.insert(i + 1, copy.deepcopy(events[i]))
    fails(events, "finished after the request ended")


def test_cli_check_exit_status(good_trace, tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in corrupt_drop(good_trace, "kv_released", uid=0)))
    assert main(["trace", "check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "uid 0:" in out
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["trace", "check", str(empty)]) == 1
    assert main(["trace", "check", str(tmp_path / "missing.jsonl")]) == 2
