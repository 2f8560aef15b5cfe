"""Sampling: seeded requests reproduce regardless of batch composition; filters behave."""

from __future__ import annotations

import pytest
import torch

from minfer import LLM, SamplingParams
from minfer.core import GREEDY_BELOW_TEMPERATURE, NO_TOKEN, InvalidRequestError
from minfer.engine.sampler import (
    SamplingTensors,
    _argmax,
    noise_bits,
    sample,
    table_token,
    uniform_noise,
    uniform_of_bits,
)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from tiny_models import save_tiny_model

    path = tmp_path_factory.mktemp("tiny-sampling")
    save_tiny_model("qwen3", path)
    return LLM(str(path), kv_cache_tokens=2048)


def test_seed_reproducible_across_batches(llm):
    target = [5, 6, 7, 8]
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate([target], [p], use_tqdm=False)[0].token_ids
    others = [[1, 2], [9, 9, 9, 9, 9, 9], [100] * 30]
    other_params = [SamplingParams(temperature=0.7, max_tokens=n, ignore_eos=True) for n in (3, 20, 7)]
    mixed = llm.generate(
        others[:2] + [target] + others[2:], other_params[:2] + [p] + other_params[2:], use_tqdm=False
    )
    assert mixed[2].token_ids == alone
    different_seed = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=99, ignore_eos=True)
    assert llm.generate([target], [different_seed], use_tqdm=False)[0].token_ids != alone


def test_noise_is_uniform_and_keyed():
    seeds = torch.tensor([1, 1, 2])
    pos = torch.tensor([10, 11, 10])
    u = uniform_noise(seeds, pos, 50_000)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert torch.equal(u[0], uniform_noise(seeds[:1], pos[:1], 50_000)[0])


def test_every_hash_gives_a_uniform_inside_the_interval_and_finite_noise():
    """All 2**23 values the hash's top bits take (its low bits do not count): the uniform is
    strictly inside (0, 1), so the Gumbel noise -log(-log(u)) is finite for every draw."""
    bits = (torch.arange(1 << 23, dtype=torch.int64) << 9) | 0x1FF
    u = uniform_of_bits(bits)
    assert u.min() > 0 and u.max() < 1
    assert torch.isfinite(-torch.log(-torch.log(u))).all()
    assert torch.unique(u).numel() == 1 << 23  # every value distinct: no two hashes share a draw


# Seed 0 at position 8010: vocabulary entry 58's hash has its top 24 bits set, the draw on which
# the 24-bit uniform was exactly 1 (its noise +inf): the entry won whatever its logit.
TOP_HASH = (0, 8010, 58)


def test_the_largest_hash_gives_finite_noise_and_cannot_overrule_the_logits():
    seed, position, column = TOP_HASH
    bits = noise_bits(torch.tensor([seed]), torch.tensor([position]), column + 1)[0, column].item()
    assert bits >> 8 == (1 << 24) - 1  # the premise: the largest uniform of any draw
    u = uniform_noise(torch.tensor([seed]), torch.tensor([position]), column + 1)[0, column]
    assert 0 < u < 1 and torch.isfinite(-torch.log(-torch.log(u)))
    vocab = 3000
    logits = torch.zeros(3, vocab)
    logits[0, column] = -30.0  # e**-30 of the others' weight
    logits[1, column] = float("-inf")  # masked (a grammar, logit_bias)
    logits[2, column] = float("-inf")
    params = [SamplingParams(temperature=1.0)] * 2 + [SamplingParams(temperature=1.0, top_k=5)]
    st = SamplingTensors.build(params, [seed] * 3, [position] * 3, vocab, torch.device("cpu"))
    assert column not in sample(logits, st).tolist()


def _tensors(params, vocab):
    return SamplingTensors.build(
        params, list(range(len(params))), [0] * len(params), vocab, torch.device("cpu")
    )


def test_filters_restrict_support():
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.05),
        SamplingParams(temperature=1.0, min_p=0.9),
    ]
    top3 = logits[1].topk(3).indices.tolist()
    for seed in range(50):
        st = SamplingTensors.build(params, [seed] * 4, [seed] * 4, 100, torch.device("cpu"))
        out = sample(logits, st).tolist()
        assert out[0] == logits[0].argmax().item()
        assert out[1] in top3
        assert out[2] == logits[2].argmax().item()  # top-p this small keeps only the best token
        assert (
            out[3] == logits[3].argmax().item()
            or logits[3].softmax(-1)[out[3]] >= 0.9 * logits[3].softmax(-1).max()
        )


def test_sampled_distribution_matches_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(4000, 1)
    st = SamplingTensors.build(
        [SamplingParams(temperature=1.0)] * 4000, list(range(4000)), [0] * 4000, 4, torch.device("cpu")
    )
    counts = torch.bincount(sample(logits, st), minlength=4).float() / 4000
    assert torch.allclose(counts, logits[0].softmax(-1), atol=0.03)


def test_cpu_argmax_takes_the_first_maximum():
    """sampler._argmax (max's indices on CPU) picks what argmax picks, ties and NaN included."""
    rows = torch.randn(5, 49152)
    rows[1, [70, 9000, 40000]] = 50.0  # a three-way tie: the first wins
    rows[2] = 1.0  # all equal
    rows[3, 123] = float("nan")  # NaN propagates, as in argmax
    assert torch.equal(_argmax(rows), rows.argmax(dim=-1))
    assert _argmax(rows)[1] == 70


def test_the_cache_rebuilds_whenever_the_requests_change_and_only_moves_positions_otherwise():
    """SamplingTensorCache against SamplingTensors.build: same requests in the same order share
    the parameters (new positions each pass); another set, another order or a new request
    object with another request's position is built afresh."""
    from minfer.core import Req
    from minfer.engine.sampler import SamplingTensorCache

    def req(uid, temperature, seed, length):
        r = Req(
            uid=uid,
            token_ids=[1] * length,
            prompt_len=length,
            params=SamplingParams(temperature=temperature, top_k=uid + 2),
            seed=seed,
        )
        r.device_len = length
        return r

    def built(reqs):
        return SamplingTensors.build(
            [r.params for r in reqs],
            [r.seed for r in reqs],
            [r.device_len for r in reqs],
            100,
            torch.device("cpu"),
        )

    a, b, c = req(0, 0.5, 11, 3), req(1, 0.0, 12, 5), req(2, 1.5, 13, 7)
    cache = SamplingTensorCache()
    for reqs in ([a, b], [a, b], [b, a], [a, b, c], [a, c], [req(0, 0.9, 99, 3), c]):
        for r in reqs:
            r.device_len += 1  # a decode step moved every request on
        got, want = cache.get(reqs, 100, torch.device("cpu")), built(reqs)
        for name in ("temperature", "top_k", "top_p", "min_p", "seeds", "positions"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert (got.all_greedy, got.any_top_k, got.any_top_p, got.any_min_p) == (
            want.all_greedy,
            want.any_top_k,
            want.any_top_p,
            want.any_min_p,
        )


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=5, top_p=0.9)]
)
def test_a_row_without_a_finite_logit_draws_no_token(params):
    """All -inf (every token banned), NaN (a broken model) or +inf: NO_TOKEN rather than the
    argmax's silent 0; the other rows draw as they would alone, and table_token gives the
    device a real id."""
    torch.manual_seed(3)
    vocab = 300
    logits = torch.randn(4, vocab)
    logits[0] = float("-inf")
    logits[1, 17] = float("nan")
    logits[2, 5] = float("inf")
    st = SamplingTensors.build([params] * 4, [1, 2, 3, 4], [7] * 4, vocab, torch.device("cpu"))
    drawn = sample(logits, st)
    alone = SamplingTensors.build([params], [4], [7], vocab, torch.device("cpu"))
    assert drawn[:3].tolist() == [NO_TOKEN] * 3
    assert drawn[3] == sample(logits[3:], alone)[0] != NO_TOKEN
    assert table_token(drawn).tolist() == [0, 0, 0, drawn[3].item()]


def test_a_vanishing_temperature_draws_greedily(llm):
    """logits / 1e-40 overflows float32 (every positive logit +inf): such temperatures, and any
    under GREEDY_BELOW_TEMPERATURE, take the argmax rather than the first +inf."""
    assert (
        SamplingParams(temperature=1e-40).greedy
        and SamplingParams(temperature=GREEDY_BELOW_TEMPERATURE / 2).greedy
    )
    assert not SamplingParams(temperature=GREEDY_BELOW_TEMPERATURE * 2).greedy
    prompt = [5, 6, 7, 8]
    greedy = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    tiny = SamplingParams(temperature=1e-40, max_tokens=8, ignore_eos=True, seed=3)
    assert llm.generate([prompt], tiny, use_tqdm=False)[0].token_ids == greedy[0].token_ids


def test_a_nan_temperature_is_refused():
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=float("nan")).validate()
