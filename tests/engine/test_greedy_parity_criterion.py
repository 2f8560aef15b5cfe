"""The near-tie criterion of tests/greedy_parity.py accepts only a divergence at a float tie."""

from __future__ import annotations

import pytest
import torch
from greedy_parity import assert_greedy_parity, near_tie_gap, reference_top2_float64
from tiny_models import hf_greedy, save_tiny_model

PROMPT = [3, 141, 59, 26, 5, 35, 89, 79, 32, 38, 46]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """The tiny llama, its greedy tokens after PROMPT, and the float64 top two at each of them."""
    hf = save_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-tie"))
    expected = hf_greedy(hf, PROMPT, 12)
    top2 = [reference_top2_float64(hf, PROMPT + expected[:i]) for i in range(len(expected))]
    return hf, expected, top2


def _diverge_at(expected, i, token):
    return expected[:i] + [token] + [(t + 1) % 256 for t in expected[i + 1 :]]


def test_identical_tokens_pass(case):
    hf, expected, _ = case
    assert_greedy_parity(hf, PROMPT, list(expected), expected, gap=0.0)


def test_a_clear_winner_not_taken_fails(case):
    """The runner-up taken where the reference's best leads by far is a real mismatch."""
    hf, expected, top2 = case
    gaps = [logits[0] - logits[1] for _, logits in top2]
    i = max(range(len(gaps)), key=gaps.__getitem__)
    assert gaps[i] > near_tie_gap(torch.bfloat16)  # a position the loosest tolerance cannot excuse
    got = _diverge_at(expected, i, top2[i][0][1])
    with pytest.raises(AssertionError, match=f"diverge at {i}"):
        assert_greedy_parity(hf, PROMPT, got, expected, near_tie_gap(torch.bfloat16))


def test_a_near_tie_is_accepted_and_only_within_the_tolerance(case):
    hf, expected, top2 = case
    gaps = [logits[0] - logits[1] for _, logits in top2]
    i = min(range(len(gaps)), key=gaps.__getitem__)
    got = _diverge_at(expected, i, top2[i][0][1])  # the runner-up, then anything
    assert_greedy_parity(hf, PROMPT, got, expected, gap=gaps[i] * 1.01)
    with pytest.raises(AssertionError, match="near-tie tolerance"):
        assert_greedy_parity(hf, PROMPT, got, expected, gap=gaps[i] * 0.99)


def test_a_token_outside_the_top_two_fails_even_at_a_tie(case):
    hf, expected, top2 = case
    wrong = next(t for t in range(256) if t not in top2[0][0])
    with pytest.raises(AssertionError, match="not one of them"):
        assert_greedy_parity(hf, PROMPT, _diverge_at(expected, 0, wrong), expected, gap=float("inf"))


def test_a_different_length_fails(case):
    hf, expected, _ = case
    with pytest.raises(AssertionError, match="lengths differ"):
        assert_greedy_parity(hf, PROMPT, expected[:-1], expected, gap=float("inf"))
