"""Stop strings offline (`LLM.generate`): the regression of issue 14 (they were ignored there)."""

from __future__ import annotations

import pytest
from default_model import needs_default_model

from minfer import LLM, SamplingParams

pytestmark = needs_default_model


@pytest.fixture(scope="module")
def llm():
    return LLM(log_level="warning")  # the embedded default model: a real tokenizer


def test_stop_string_ends_the_request_and_cuts_the_text(llm):
    prompt = "Count: one, two, three,"
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "five" in free.text and free.finish_reason == "length"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop=["five"]), use_tqdm=False)[
        0
    ]
    assert out.finish_reason == "stop"
    assert out.text == free.text[: free.text.index("five")]
    assert free.token_ids[: len(out.token_ids)] == out.token_ids and len(out.token_ids) < 24
    kept = SamplingParams(temperature=0, max_tokens=24, stop=["five"], include_stop_str_in_output=True)
    assert llm.generate([prompt], kept, use_tqdm=False)[0].text == out.text + "five"
    while llm.scheduler.has_work:  # a pass launched before the stop was seen (overlap mode)
        llm.scheduler.step()
    assert llm.scheduler.kv.used_pages == 0


def test_stop_string_in_a_batch_leaves_the_others_alone(llm):
    prompts = ["Count: one, two, three,", "The capital of France is"]
    alone = llm.generate(prompts[1:], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, stop=["five"]), use_tqdm=False)
    assert outs[0].finish_reason == "stop"
    if "five" not in alone.text:
        assert (outs[1].token_ids, outs[1].finish_reason) == (alone.token_ids, alone.finish_reason)
