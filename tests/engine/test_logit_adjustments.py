"""Penalties, logit_bias, min_tokens, allowed_token_ids and bad words on the device against their
definitions written as plain loops; offline prompt logprobs over chunked prefill against transformers."""

from __future__ import annotations

import pytest
import torch
from tiny_models import save_tiny_model

from minfer.core import Req, SamplingParams
from minfer.engine.penalties import apply_adjustments, build_adjustments
from minfer.kvcache.page_table import PageTable

VOCAB = 32


def reference(logits: torch.Tensor, req: Req) -> torch.Tensor:
    p, out = req.params, logits.clone()
    history = req.token_ids[: req.device_len]
    output = history[req.prompt_len :]
    for token in set(history):
        if p.repetition_penalty != 1:
            out[token] = (
                out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
            )
    for token in set(output):
        out[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    for token, bias in p.logit_bias.items():
        out[token] += bias
    if req.device_len - req.prompt_len < p.min_tokens:
        for token in {*p.stop_token_ids, *req.eos_token_ids}:
            out[token] = float("-inf")
    for word in p.bad_words_ids:  # banned where the output ends with the word's other tokens
        if len(output) >= len(word) - 1 and output[len(output) - len(word) + 1 :] == word[:-1]:
            out[word[-1]] = float("-inf")
    if p.allowed_token_ids is not None:
        keep = out.clone()
        out[:] = float("-inf")
        out[p.allowed_token_ids] = keep[p.allowed_token_ids]
    return out


def test_adjustments_match_their_definitions():
    table = PageTable(8, 64, torch.device("cpu"))
    params = [
        SamplingParams(frequency_penalty=0.7, presence_penalty=-0.3),
        SamplingParams(repetition_penalty=1.8, logit_bias={3: 5.0, 9: -2.0}),
        SamplingParams(),  # untouched between adjusted rows
        SamplingParams(min_tokens=6, stop_token_ids=[4], repetition_penalty=0.5),
        SamplingParams(allowed_token_ids=[2, 3, 30], logit_bias={3: 1.0}),
        # One-token words, words whose head is the output's tail (banned) or not, one longer
        # than the output, one whose head reaches into the prompt (not the output: not banned).
        SamplingParams(bad_words_ids=[[6], [0, 1, 2, 3, 5, 31], [1, 1, 9], [7, 7, 7, 7, 7, 7, 7, 7]]),
    ]
    gen = torch.Generator().manual_seed(0)
    reqs = []
    for row, p in enumerate(params):
        tokens = torch.randint(0, 8, (12,), generator=gen).tolist()  # few distinct ids: repeats
        req = Req(uid=row, token_ids=tokens, prompt_len=7, params=p, eos_token_ids=frozenset({1}))
        req.table_idx = table.take_row()
        table.write_tokens(req.table_idx, 0, tokens)
        reqs.append(req)
    # Make some bad words' heads the output's tail (positions 7-11 of 12; sampled at 12).
    tail = reqs[5].token_ids[7:12]
    reqs[5].params.bad_words_ids += [
        [*tail[-2:], 20],
        [tail[-1], 21],
        [*tail, 22],
        [reqs[5].token_ids[6], *tail, 23],
    ]
    logits = torch.randn(len(reqs), VOCAB, generator=gen)
    expected = torch.stack([reference(logits[i], r) for i, r in enumerate(reqs)])
    assert expected[5, [20, 21, 22]].isinf().all() and expected[5, 23].isfinite()  # the cases are live
    got = apply_adjustments(logits.clone(), build_adjustments(reqs, table, VOCAB, torch.device("cpu")))
    assert torch.allclose(got, expected, atol=1e-5)
    assert build_adjustments([reqs[2]], table, VOCAB, torch.device("cpu")) is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-logprobs")
    return str(path), save_tiny_model("qwen2", path)


def test_offline_prompt_and_sampled_logprobs(tiny):
    from minfer import LLM

    path, hf = tiny
    llm = LLM(path, device="cpu", chunked_prefill_size=5, kv_cache_tokens=4096)
    prompt = list(range(3, 20))
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=4, logprobs=2, prompt_logprobs=3)
    out = llm.generate_ids([prompt, prompt], [params, SamplingParams(max_tokens=4)], use_tqdm=False)[0]
    full = prompt + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), dim=-1)
    expected = ref[torch.arange(len(full) - 1), torch.tensor(full[1:])]
    got = out.prompt_logprobs.logprobs[1:] + out.logprobs.logprobs
    assert out.prompt_logprobs.logprobs[0] is None and out.prompt_logprobs.token_ids == prompt
    assert torch.allclose(torch.tensor(got), expected, atol=1e-4)
    for i, (ids, values) in enumerate(
        zip(out.prompt_logprobs.top_ids[1:], out.prompt_logprobs.top_logprobs[1:])
    ):
        top = ref[i].topk(3)
        assert ids == top.indices.tolist() and torch.allclose(torch.tensor(values), top.values, atol=1e-4)
    assert all(len(ids) == 2 for ids in out.logprobs.top_ids)
