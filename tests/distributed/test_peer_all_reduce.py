"""The all-reduce switch (distributed/peer_all_reduce.py) on CPU: the peer path itself needs CUDA
peer memory (tests/distributed/gpu_tp_check.py runs it on two GPUs); here, what every rank
process gets whatever the device: the choice read and checked, NVLink multicast turned off,
and a CPU group that keeps gloo under MINFER_TP_ALL_REDUCE=peer."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist
from tiny_models import save_tiny_model

from minfer import LLM, SamplingParams
from minfer.config import ConfigError
from minfer.distributed import peer_all_reduce
from minfer.runner.ranks import free_local_addr


def test_the_choice_is_checked(monkeypatch):
    _unset(monkeypatch, peer_all_reduce.ENV)
    assert peer_all_reduce.requested() == "nccl"
    monkeypatch.setenv(peer_all_reduce.ENV, "peer")
    assert peer_all_reduce.requested() == "peer"
    monkeypatch.setenv(peer_all_reduce.ENV, "nvls")
    with pytest.raises(ValueError, match="MINFER_TP_ALL_REDUCE='nvls': expected 'nccl' or 'peer'"):
        peer_all_reduce.requested()


def _unset(monkeypatch, *names):
    """Unset for this test, and restored (unset) after it: setenv first records the old state."""
    for name in names:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_multicast_off_unless_the_user_says_otherwise(monkeypatch):
    _unset(monkeypatch, "NCCL_NVLS_ENABLE")
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
    _unset(monkeypatch, "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")
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


def test_peer_across_nodes_is_refused_at_start_up(tmp_path, monkeypatch):
    """Peer memory is one host's; rank 0 says so before any rank waits for another."""
    save_tiny_model("llama", tmp_path)
    monkeypatch.setenv(peer_all_reduce.ENV, "peer")
    with pytest.raises(ConfigError, match="needs every rank on one host; this job spans 2 nodes"):
        LLM(str(tmp_path), tp=2, nnodes=2, dist_init_addr=free_local_addr(), log_level="warning")


def test_followers_take_rank_zeros_choice_whatever_their_environment(monkeypatch):
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    monkeypatch.setenv(peer_all_reduce.ENV, "peer")
    assert peer_all_reduce.agreed_kind(store, 0, 1) == "peer"
    monkeypatch.setenv(peer_all_reduce.ENV, "bogus")  # a follower's own setting is not read
    assert peer_all_reduce.agreed_kind(store, 1, 1) == "peer"
    monkeypatch.setattr(peer_all_reduce, "_used_in_process", True)  # a second TP job in one process
    monkeypatch.setenv(peer_all_reduce.ENV, "peer")
    assert peer_all_reduce.agreed_kind(store, 0, 1) == "nccl"
    assert peer_all_reduce.agreed_kind(store, 1, 1) == "nccl"
