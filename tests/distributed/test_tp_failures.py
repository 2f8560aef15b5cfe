"""A tensor-parallel rank that fails brings the whole group down, fast and with a clear error.

Faults are injected with MINFER_TEST_TP_FAULT=RANK:POINT (minfer/distributed/faults.py,
honoured only under pytest); rank 1 is a subprocess of this process (rank 0).
"""

from __future__ import annotations

import os
import time

import pytest
from tiny_models import save_tiny_model

from minfer import LLM, SamplingParams
from minfer.distributed.parallel import TensorParallelError

PARAMS = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tp-fault")
    save_tiny_model("llama", path)
    return str(path)


def children() -> set[int]:
    """Live child processes of this one, from /proc."""
    me, found = str(os.getpid()), set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":
            found.add(int(entry))
    return found


def assert_no_rank_left(before: set[int]) -> None:
    deadline = time.monotonic() + 10
    while children() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not children() - before, "a tensor-parallel rank outlived the failure"


def test_rank1_fails_while_loading(model, monkeypatch):
    monkeypatch.setenv("MINFER_TEST_TP_FAULT", "1:init")
    before, start = children(), time.monotonic()
    with pytest.raises(TensorParallelError, match=r"tensor-parallel rank 1 \(pid \d+\) exited with code 1"):
        LLM(model, tp=2, log_level="warning")
    assert time.monotonic() - start < 30
    assert_no_rank_left(before)


@pytest.mark.parametrize("rank", [1, 0])
def test_rank_fails_mid_generation(model, monkeypatch, rank):
    monkeypatch.setenv("MINFER_TEST_TP_FAULT", f"{rank}:step5")
    before = children()
    llm = LLM(model, tp=2, log_level="warning")
    start = time.monotonic()
    expected = (
        r"tensor-parallel rank 1 \(pid \d+\) exited with code 1"
        if rank == 1
        else "failed on rank 0: .*injected fault"
    )
    with pytest.raises(TensorParallelError, match=expected):
        llm.generate([[1, 2, 3], [4, 5]], PARAMS, use_tqdm=False)
    assert time.monotonic() - start < 10
    assert_no_rank_left(before)
    with pytest.raises(TensorParallelError):  # the group stays down
        llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False)
