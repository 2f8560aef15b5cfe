"""The CUDA path of logprobs and logit adjustments: pinned asynchronous copies of the reduced
logprobs, adjustments on CUDA-graph logits (allowed_token_ids and bad words included), the fused
Gumbel sampler on adjusted logits."""

from __future__ import annotations

import pytest
import torch
from tiny_models import save_tiny_model

from minfer.core import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_logprobs_and_adjustments_on_cuda(tmp_path):
    from minfer import LLM

    hf = save_tiny_model("llama", tmp_path)
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", chunked_prefill_size=6, kv_cache_tokens=4096)
    prompt = list(range(3, 20))
    eos = min(llm.engine.eos_token_ids)
    params = [
        SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=0, max_tokens=16, frequency_penalty=2.0),
        SamplingParams(temperature=0.7, seed=3, max_tokens=8, logit_bias={42: 100.0}),  # fused sampler
        SamplingParams(temperature=0, max_tokens=8, min_tokens=4, logit_bias={eos: 100.0}),
        SamplingParams(temperature=0.9, seed=5, max_tokens=8, presence_penalty=2.0, logprobs=0),
    ]
    outs = llm.generate_ids([prompt] * len(params), params, use_tqdm=False)
    first = outs[0]
    full = prompt + first.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(
            hf.cuda()(torch.tensor([full], device="cuda")).logits[0].float(), dim=-1
        ).cpu()
    expected = ref[torch.arange(len(full) - 1), torch.tensor(full[1:])]
    got = torch.tensor(first.prompt_logprobs.logprobs[1:] + first.logprobs.logprobs)
    assert torch.allclose(got, expected, atol=2e-3), (got - expected).abs().max()
    assert first.logprobs.top_ids[0][0] == first.token_ids[0]
    assert len(set(outs[1].token_ids)) == 16
    assert outs[2].token_ids == [42] * 8
    assert outs[3].token_ids[4:] == [eos] and eos not in outs[3].token_ids[:4]
    assert len(set(outs[4].token_ids)) == 8 and len(outs[4].logprobs.logprobs) == 8
    # allowed_token_ids, and a bad word of two tokens (its head drawn, its tail then masked on the
    # device from the token table): graph logits sampled outside the graph's own draw.
    head, tail = first.token_ids[:2]
    limited = [
        SamplingParams(temperature=0.8, seed=2, max_tokens=12, allowed_token_ids=[5, 6, 7]),
        SamplingParams(temperature=0, max_tokens=6, bad_words_ids=[[head, tail]]),
    ]
    allowed, banned = llm.generate_ids([prompt] * 2, limited, use_tqdm=False)
    assert set(allowed.token_ids) <= {5, 6, 7} and len(allowed.token_ids) == 12
    assert banned.token_ids[0] == head and banned.token_ids[1] != tail
