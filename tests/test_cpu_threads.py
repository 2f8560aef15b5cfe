"""--cpu-threads: the torch threads of a process that runs the model."""

from __future__ import annotations

import os

import torch


def test_cpu_threads_default_to_the_process_affinity(monkeypatch):
    from minfer.device import cpu_thread_count, set_cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert cpu_thread_count(None) == cores
    assert cpu_thread_count(None, ranks_per_node=cores * 2) == 1
    assert cpu_thread_count(3) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # an explicit environment wins over the affinity
    assert cpu_thread_count(None) == 5
    assert cpu_thread_count(2) == 2
    before = torch.get_num_threads()
    try:
        assert set_cpu_threads(1) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
