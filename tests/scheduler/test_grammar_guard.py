"""A grammar and the sampler's other constraints: the grammar's end overrules min_tokens (with
both, every logit was -inf and the draw returned token 0), and a sampled token that its
request's grammar rejects ends that request with an abort that says why (the token is returned
with it, as sampled), and nothing else changes.

The grammar's mask makes a rejected token impossible unless something else is broken (a row of
NaN logits, a mask applied to the wrong row); before the guard the scheduler ignored the
matcher's refusal and returned text outside the format the client asked for. That fault is
injected into one real pass's sampled tokens, the only way to produce it without a defect.
"""

from __future__ import annotations

import re

import pytest

from minfer import LLM, SamplingParams
from minfer.core import FinishReason, Phase, StructuredOutput
from minfer.observability.trace_check import check_file, format_report

PLAIN = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def constrained() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=8, structured_output=StructuredOutput("regex", "[ab]{6}"))


def test_rejected_token_aborts_only_its_request(tiny_chat_model, tmp_path):
    prompt, other_prompt = list(range(20, 40)), list(range(50, 75))
    fresh = LLM(tiny_chat_model, kv_cache_tokens=256, disable_overlap_schedule=True)
    expected_other = fresh.generate([other_prompt], PLAIN, use_tqdm=False)[0].token_ids

    trace = tmp_path / "trace.jsonl"
    llm = LLM(
        tiny_chat_model,
        kv_cache_tokens=256,
        disable_overlap_schedule=True,
        check_kv_invariants=True,
        trace_requests=str(trace),
    )
    sched = llm.scheduler
    req = sched.add_request(prompt, constrained())
    other = sched.add_request(other_prompt, PLAIN)
    tokenizer = sched.engine.tokenizer
    rejected = tokenizer.encode("{", add_special_tokens=False)[0]  # not in [ab]

    # Let the constrained request sample twice, then corrupt its token in the third pass.
    outputs = []
    for _ in range(20):
        if len(req.token_ids) - req.prompt_len >= 2 and req.device_len == len(req.token_ids):
            break
        outputs += sched.step()
    batch = sched.schedule()
    assert batch is not None and req in batch.reqs
    batch.out_loc = sched.kv.allocate(batch.reqs, batch.extend_lens, write_device=batch.phase != Phase.DECODE)
    sched.trace.scheduled(batch)
    result = sched.engine.forward_batch(batch)
    sched.advance(batch)
    row = batch.reqs.index(req)
    tokens = result.next_tokens.clone()
    tokens[result.sampled_rows.index(row)] = rejected
    result.next_tokens = tokens
    step_outputs = sched.process(batch, result)
    sched.check_invariants()

    mine = [o for o in step_outputs if o.uid == req.uid]
    assert len(mine) == 1 and mine[0].token_id == rejected
    assert mine[0].finish_reason == FinishReason.ABORT
    assert "breaks the request's output grammar" in mine[0].stop_reason
    assert req.finished and req.token_ids[-1] == rejected
    assert re.fullmatch("[ab]{1,5}", tokenizer.decode(req.token_ids[req.prompt_len : -1]))

    # The other request goes on unharmed, and the pages and trace stay consistent.
    while sched.has_work:
        sched.step()
    assert other.token_ids[other.prompt_len :] == expected_other
    sched.check_invariants()
    assert not sched.by_uid
    llm.scheduler.tracer.flush()
    report = check_file(str(trace))
    assert report.ok, format_report(report)


def test_constrained_request_alone_matches_its_regex(tiny_chat_model):
    """The guard leaves a healthy constrained request alone: it ends by its grammar, "stop"."""
    llm = LLM(tiny_chat_model, kv_cache_tokens=256, check_kv_invariants=True)
    out = llm.generate([list(range(20, 40))], constrained(), use_tqdm=False)[0]
    assert re.fullmatch("[ab]{6}", out.text)
    assert out.finish_reason == "stop"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_grammar_end_overrules_min_tokens(tiny_chat_model, temperature):
    """min_tokens bans EOS; a grammar that allows nothing but EOS left every logit -inf, and the
    draw returned token 0 (aborted by the guard above, and before it, text outside the grammar).
    The grammar's end wins: the request ends "stop" with its complete match."""
    llm = LLM(tiny_chat_model, kv_cache_tokens=256, check_kv_invariants=True)
    done = SamplingParams(
        temperature=temperature,
        max_tokens=10,
        min_tokens=5,
        seed=1,
        structured_output=StructuredOutput("regex", "ab"),
    )
    out = llm.generate([list(range(20, 40))], done, use_tqdm=False)[0]
    assert (out.text, out.finish_reason) == ("ab", "stop")
    assert out.token_ids[-1] in llm.scheduler.engine.eos_token_ids


def test_min_tokens_still_holds_where_the_grammar_can_go_on(tiny_chat_model):
    """Where the grammar allows more than its end ("a+" after "a"), min_tokens keeps EOS banned."""
    llm = LLM(tiny_chat_model, kv_cache_tokens=256, check_kv_invariants=True)
    params = SamplingParams(
        temperature=0, max_tokens=12, min_tokens=6, structured_output=StructuredOutput("regex", "a+")
    )
    out = llm.generate([list(range(20, 40))], params, use_tqdm=False)[0]
    assert re.fullmatch("a+", out.text) and len(out.token_ids) >= 6
