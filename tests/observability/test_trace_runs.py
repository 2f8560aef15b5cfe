"""`minfer trace show` on runs appended to one file: each run's requests stay apart (uids restart
at 0 in every run; merged, a request's queue time came out negative)."""

from __future__ import annotations

import time

from trace_workloads import finish_trace, traced_llm

from minfer import SamplingParams
from minfer.cli import main
from minfer.observability.timeline import build_timeline
from minfer.observability.trace_runs import split_runs


def summary_rows(out: str) -> list[list[str]]:
    return [
        line.split() for line in out.splitlines() if len(line.split()) == 13 and line.split()[0].isdigit()
    ]


def test_two_offline_runs_in_one_file(tiny_llama, tmp_path, capsys):
    path = tmp_path / "two-runs.jsonl"
    prompt_lens = ([5, 9, 13], [21, 7])
    for lens in prompt_lens:  # the same process appends a second run, uids restarting at 0
        llm = traced_llm(tiny_llama, path, kv_cache_tokens=256)
        llm.generate([list(range(3, 3 + n)) for n in lens], SamplingParams(max_tokens=3, ignore_eos=True))
        events = finish_trace(llm, path)
        time.sleep(0.01)  # the second run starts strictly later
    runs = split_runs(events)
    assert len(runs) == 2 and sum(map(len, runs)) == len(events)
    for run, lens in zip(runs, prompt_lens):
        timeline = build_timeline(run)
        requests = [r for r in timeline.requests.values() if r.queued is not None]
        assert sorted(r.prompt_len for r in requests) == sorted(lens)
        assert all(r.queue_wait >= 0 and r.output_len == 3 for r in requests)

    assert main(["trace", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "== run 1 of 2 (3 requests)" in out and "== run 2 of 2 (2 requests)" in out
    rows = summary_rows(out)
    assert [int(r[1]) for r in rows] == [5, 9, 13, 21, 7]  # prompt lengths, run by run
    assert all(float(r[3]) >= 0 for r in rows)  # queue_ms
    assert main(["trace", "show", str(path), "--run", "2", "--uid", "0"]) == 0
    assert "prompt_len 21" in capsys.readouterr().out
    assert main(["trace", "show", str(path), "--run", "3"]) == 2


def test_front_end_processes_join_the_run_that_started_before_them():
    """A served run: the scheduler (pid 10, 20) writes kv_pool; the api server (pid 11, 21) writes
    no kv_pool and may flush its first line before the scheduler's kv_pool line."""
    events = [
        {"ts": 1.5, "pid": 11, "uid": 0, "event": "received"},
        {"ts": 1.0, "pid": 10, "uid": -1, "event": "kv_pool"},
        {"ts": 1.6, "pid": 10, "uid": 0, "event": "queued"},
        {"ts": 2.0, "pid": 20, "uid": -1, "event": "kv_pool"},
        {"ts": 1.7, "pid": 11, "uid": 0, "event": "finished"},  # a late flush of the first run
        {"ts": 2.5, "pid": 21, "uid": 0, "event": "received"},
        {"ts": 2.6, "pid": 20, "uid": 0, "event": "queued"},
    ]
    first, second = split_runs(events)
    assert {(e["pid"], e["event"]) for e in first} == {
        (11, "received"),
        (10, "kv_pool"),
        (10, "queued"),
        (11, "finished"),
    }
    assert {e["pid"] for e in second} == {20, 21}
    assert split_runs(events[:3]) == [events[:3]]  # one kv_pool: one run
