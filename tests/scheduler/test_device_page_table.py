"""The page table as a GPU engine keeps it, exercised on the CPU: a device table apart from its
host mirror.

On CUDA the scheduler records a prefill's slots in both tables when it allocates them, and a
decode step's in the mirror alone: the step writes the device table itself, from the vectors it
stages (engine/decode_inputs.py, `DecodeInputs.start`). A CPU engine's two tables are one
tensor, so without this test that path would run only on a GPU. Here the mirror is split off a
CPU engine's table, so the attention reads a table that only those writes keep current, and the
KV check after every step compares each running request's row in both.
"""

from __future__ import annotations

import pytest
import split_page_table

from minfer import LLM, SamplingParams
from minfer.engine.decode_inputs import DecodeInputs
from minfer.kvcache.prefix_cache import KVInvariantError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SHARED = [(11 * i + 5) % 256 for i in range(24)]
# Prompts that share a prefix (radix hits, repointed rows) and others that do not; together with
# their outputs more than the pool holds, so decode steps preempt.
PROMPTS = [SHARED + [k, k + 1] for k in range(3)] + [[(7 * i + k) % 256 for i in range(30)] for k in range(4)]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from tiny_models import save_tiny_model

    path = tmp_path_factory.mktemp("tiny-device-table")
    save_tiny_model("qwen2", path)
    return str(path)


def _llm(model_path, overlap: bool, page_size: int, split_mirror: bool) -> LLM:
    llm = LLM(
        model_path,
        kv_cache_tokens=160,
        page_size=page_size,
        chunked_prefill_size=16,
        disable_overlap_schedule=not overlap,
        check_kv_invariants=True,
    )
    if split_mirror:  # as on CUDA: the kernels' table and the scheduler's mirror are two tensors
        split_page_table.split_mirror(llm)
    return llm


def _outputs(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("page_size", [1, 4])
def test_a_separate_device_table_gives_the_same_tokens(model_path, overlap, page_size):
    expected = _outputs(_llm(model_path, overlap, page_size, split_mirror=False))
    llm = _llm(model_path, overlap, page_size, split_mirror=True)
    assert _outputs(llm) == expected
    assert llm.scheduler.counters.preemptions > 0  # the pool was short: rows were given back


def test_the_check_catches_a_decode_step_that_leaves_the_device_table_stale(model_path, monkeypatch):
    """Without its device write, a decode step reads the slot the previous owner of that entry
    left; the KV check after the step names the request."""
    monkeypatch.setattr(
        DecodeInputs, "start", lambda self, table, meta=None: table.tokens_at(self.input_at).long()
    )
    llm = _llm(model_path, overlap=True, page_size=4, split_mirror=True)
    with pytest.raises(KVInvariantError, match="device page table differs from its host mirror"):
        _outputs(llm)
