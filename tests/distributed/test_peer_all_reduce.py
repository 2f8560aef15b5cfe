"""The all-reduce switch (distributed/peer_all_reduce.py) on CPU: the peer path itself needs CUDA
peer memory (tests/distributed/gpu_tp_check.py runs it on two GPUs); here, what every rank
process gets whatever the device: the choice read and checked, NVLink multicast turned off,
and a CPU group that keeps gloo under MINFER_TP_ALL_REDUCE=peer."""

from __future__ import annotations

import os

import pytest
from tiny_models import save_tiny_model

from minfer import LLM, SamplingParams
from minfer.distributed import peer_all_reduce


def test_the_choice_is_checked(monkeypatch):
    monkeypatch.delenv(peer_all_reduce.ENV, raising=False)
    assert peer_all_reduce.requested() == "nccl"
    monkeypatch.setenv(peer_all_reduce.ENV, "peer")
    assert peer_all_reduce.requested() == "peer"
    monkeypatch.setenv(peer_all_reduce.ENV, "nvls")
    with pytest.raises(ValueError, match="MINFER_TP_ALL_REDUCE='nvls': expected 'nccl' or 'peer'"):
        peer_all_reduce.requested()


def test_multicast_off_unless_the_user_says_otherwise(monkeypatch):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")  # an explicit choice stays
    peer_all_reduce.disable_nvlink_multicast()
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "0"


def test_tp2_on_cpu_with_peer_requested_runs_on_gloo(tmp_path, monkeypatch):
    save_tiny_model("qwen3", tmp_path)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[1, 2, 3], list(range(20))]
    expected = [
        o.token_ids for o in LLM(str(tmp_path), log_level="warning").generate(prompts, params, use_tqdm=False)
    ]
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", raising=False)
    monkeypatch.setenv(peer_all_reduce.ENV, "peer")
    llm = LLM(str(tmp_path), tp=2, log_level="warning")
    try:
        assert llm.engine.tp.peer is None  # peer memory is a CUDA path
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outs] == expected
    assert os.environ["NCCL_NVLS_ENABLE"] == "0" and os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"


def test_a_bad_choice_stops_tp_start_up_with_one_clear_error(tmp_path, monkeypatch):
    save_tiny_model("llama", tmp_path)
    monkeypatch.setenv(peer_all_reduce.ENV, "fast")
    with pytest.raises(ValueError, match="MINFER_TP_ALL_REDUCE='fast'"):
        LLM(str(tmp_path), tp=2, log_level="warning")
