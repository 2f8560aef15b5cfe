"""A row with no finite logit to draw from ends its request with an error, and only that request.

An argmax over a row of -inf or NaN returns token 0: before the sampler said NO_TOKEN there,
a model that produced NaN, or bans covering the whole vocabulary, gave a wrong token that
nothing noticed. Now the request ends "abort" with a stop_reason saying why, no token of that
pass reaches the client, and the KV pages and the trace stay consistent.
"""

from __future__ import annotations

import pytest
from tiny_models import save_tiny_model

from minfer import LLM, SamplingParams
from minfer.core import FinishReason, Phase
from minfer.observability.trace_check import check_file, format_report


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """A tiny random Llama without a tokenizer (none is needed; the GPU host has the default
    model's neither)."""
    path = tmp_path_factory.mktemp("tiny-undrawable")
    save_tiny_model("llama", path)
    return str(path)


PLAIN = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT, OTHER_PROMPT = list(range(20, 40)), list(range(50, 75))


def traced_llm(model: str, trace, **options) -> LLM:
    return LLM(
        model,
        kv_cache_tokens=256,
        disable_overlap_schedule=True,
        check_kv_invariants=True,
        trace_requests=str(trace),
        **options,
    )


def assert_trace_ok(llm: LLM, trace) -> None:
    llm.scheduler.tracer.flush()
    report = check_file(str(trace))
    assert report.ok, format_report(report)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_bans_covering_the_vocabulary_end_the_request_with_an_error(model, tmp_path, temperature):
    """min_tokens bans the stop tokens, and these are every token: nothing can be drawn."""
    expected_other = LLM(model, kv_cache_tokens=256).generate([OTHER_PROMPT], PLAIN, use_tqdm=False)
    llm = traced_llm(model, tmp_path / "trace.jsonl")
    vocab = llm.scheduler.engine.vocab_size
    banned_all = SamplingParams(
        temperature=temperature, seed=3, max_tokens=8, min_tokens=4, stop_token_ids=list(range(vocab))
    )
    out, other = llm.generate([PROMPT, OTHER_PROMPT], [banned_all, PLAIN], use_tqdm=False)
    assert (out.finish_reason, out.token_ids) == ("abort", [])
    assert other.token_ids == expected_other[0].token_ids
    assert not llm.scheduler.by_uid
    assert_trace_ok(llm, tmp_path / "trace.jsonl")


def test_nan_logits_end_only_their_request(model, tmp_path, monkeypatch):
    """One real decode pass whose logits for one request are NaN (a fault injected into the LM
    head's output): that request ends with an error and no token; the other one goes on."""
    expected_other = LLM(model, kv_cache_tokens=256).generate([OTHER_PROMPT], PLAIN, use_tqdm=False)
    # no CUDA graphs on a GPU: a replay would not call the patched compute_logits
    llm = traced_llm(model, tmp_path / "trace.jsonl", cuda_graph_max_bs=0)
    sched = llm.scheduler
    req = sched.add_request(PROMPT, PLAIN)
    other = sched.add_request(OTHER_PROMPT, PLAIN)
    for _ in range(20):  # until req has two tokens and its next pass is a decode step
        if req.output_len >= 2 and req.device_len == len(req.token_ids):
            break
        sched.step()
    batch = sched.schedule()
    assert batch is not None and batch.phase == Phase.DECODE and req in batch.reqs
    row = batch.reqs.index(req)
    model = sched.engine.model
    healthy = model.compute_logits

    def nan_for_one_row(hidden, out=None):
        logits = healthy(hidden, out)
        logits[row] = float("nan")
        return logits

    monkeypatch.setattr(model, "compute_logits", nan_for_one_row)
    batch.out_loc = sched.kv.allocate(batch.reqs, batch.extend_lens, write_device=False)
    sched.trace.scheduled(batch)
    result = sched.engine.forward_batch(batch)
    monkeypatch.setattr(model, "compute_logits", healthy)
    sched.advance(batch)
    outputs = sched.process(batch, result)
    sched.check_invariants()

    mine = [o for o in outputs if o.uid == req.uid]
    assert len(mine) == 1 and mine[0].token_id is None and mine[0].finish_reason == FinishReason.ABORT
    assert "no finite logit" in mine[0].stop_reason
    assert req.finished and req.output_len == 3  # the pass's position, never sent nor cached
    assert [o.token_id is not None for o in outputs if o.uid == other.uid] == [True]
    while sched.has_work:
        sched.step()
    assert other.token_ids[other.prompt_len :] == expected_other[0].token_ids
    sched.check_invariants()
    assert not sched.by_uid
    assert_trace_ok(llm, tmp_path / "trace.jsonl")


def test_a_model_that_turns_nan_mid_decode_ends_every_request_with_an_error(model):
    """NaN put into the final norm's weights after two tokens (a fault in the running model)
    makes every logit NaN: each request ends "abort", keeping the tokens drawn before it, where
    it had gone on drawing token 0. On a GPU this is the decode graph's own draw
    (kernels/sampling.py); on the CPU the torch sampler's."""
    sampled = SamplingParams(temperature=0.9, seed=5, max_tokens=6, ignore_eos=True)
    expected = LLM(model, kv_cache_tokens=256).generate(
        [PROMPT, OTHER_PROMPT], [PLAIN, sampled], use_tqdm=False
    )
    llm = LLM(model, kv_cache_tokens=256, check_kv_invariants=True)
    sched = llm.scheduler
    reqs = [sched.add_request(PROMPT, PLAIN), sched.add_request(OTHER_PROMPT, sampled)]
    outputs = []
    while min(r.output_len for r in reqs) < 2:
        outputs += sched.step()
    sched.engine.model.model.norm.weight.data.fill_(float("nan"))
    while sched.has_work:
        outputs += sched.step()
    for req, healthy in zip(reqs, expected):
        ends = [o for o in outputs if o.uid == req.uid and o.finish_reason]
        assert len(ends) == 1 and ends[0].finish_reason == FinishReason.ABORT and ends[0].token_id is None
        assert "no finite logit" in ends[0].stop_reason
        drawn = [o.token_id for o in outputs if o.uid == req.uid and o.token_id is not None]
        assert 2 <= len(drawn) < 6 and drawn == healthy.token_ids[: len(drawn)] == req.output_ids
    assert not sched.by_uid
    sched.check_invariants()
