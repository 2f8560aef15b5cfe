"""The fused Gumbel-max kernel draws the torch sampler's tokens."""

from __future__ import annotations

import pytest
import torch

from minfer.core import NO_TOKEN, SamplingParams
from minfer.engine.sampler import SamplingTensors, sample
from minfer.kernels.sampling import CHUNK, SMALL_CHUNK, chunk_for, gumbel_argmax


def _kernel_tokens(logits: torch.Tensor, st: SamplingTensors, device: torch.device, chunk=None) -> list[int]:
    """The kernel's tokens for CPU inputs, computed on `device` (the GPU when there is one)."""
    return gumbel_argmax(
        logits.to(device), st.temperature.to(device), st.seeds.to(device), st.positions.to(device), chunk
    ).tolist()


def test_gumbel_argmax_matches_torch_sampler(device):
    torch.manual_seed(0)
    batch, vocab = 6, 3000
    logits = torch.randn(batch, vocab) * 3
    params = [SamplingParams(temperature=t) for t in (0.0, 0.6, 1.0, 1.5, 0.0, 0.9)]
    for trial in range(3):
        st = SamplingTensors.build(
            params, [trial * 10 + i for i in range(batch)], [5 + trial] * batch, vocab, torch.device("cpu")
        )
        expected = sample(logits, st)
        assert _kernel_tokens(logits, st, device) == expected.tolist()


@pytest.mark.parametrize("chunk", [SMALL_CHUNK, CHUNK])
def test_gumbel_argmax_across_chunks_and_ties(device, chunk):
    """A vocabulary of several chunks (the last one partial); greedy rows whose maximum appears
    in two chunks take the lower index, as torch.argmax does; either chunk size draws the same."""
    torch.manual_seed(1)
    batch, vocab = 4, 2 * CHUNK + 123
    logits = torch.randn(batch, vocab)
    logits[0, [5, CHUNK + 7]] = 50.0  # tie across chunks
    logits[1, [CHUNK + 3, 2 * CHUNK + 100]] = 50.0
    logits[2, vocab - 1] = 50.0  # the very last entry of the partial chunk
    params = [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(temperature=0.8)]
    st = SamplingTensors.build(params, [1, 2, 3, 4], [9] * batch, vocab, torch.device("cpu"))
    got = _kernel_tokens(logits, st, device, chunk)
    assert got[:3] == [5, CHUNK + 3, vocab - 1]
    assert got == sample(logits, st).tolist()


def test_the_largest_hash_cannot_overrule_the_logits(device):
    """The draw whose 24-bit uniform was exactly 1 (tests/engine/test_sampling.py, TOP_HASH):
    the kernel's noise is finite there too, so an entry of logit -30 does not win."""
    seed, position, column = 0, 8010, 58
    vocab = 3000
    logits = torch.zeros(2, vocab)
    logits[0, column] = -30.0
    logits[1, column] = float("-inf")
    st = SamplingTensors.build(
        [SamplingParams(temperature=1.0)] * 2, [seed] * 2, [position] * 2, vocab, torch.device("cpu")
    )
    got = _kernel_tokens(logits, st, device)
    assert column not in got
    assert got == sample(logits, st).tolist()


def test_small_batches_take_small_chunks(monkeypatch):
    """On an H200's 132 SMs: batches of 1-3 over Qwen3's vocabulary (38 large chunks a row)
    take small chunks (149 programs at batch 1), from 4 rows the large ones."""
    import minfer.kernels.sampling as sampling

    monkeypatch.setattr(sampling, "num_sms", lambda device: 132)
    h200 = torch.device("cpu")
    assert chunk_for(1, 151936, h200) == chunk_for(3, 151936, h200) == SMALL_CHUNK
    assert chunk_for(4, 151936, h200) == chunk_for(64, 151936, h200) == CHUNK


def test_gumbel_best_over_vocabulary_shards(device):
    """Each TP rank runs the kernel on its slice (col_offset = the slice's first entry): the best
    of the slices' winners is the whole-row token, and the values are the perturbed logits."""
    from minfer.kernels.sampling import gumbel_best

    torch.manual_seed(2)
    batch, vocab = 4, CHUNK + 517
    logits = torch.randn(batch, vocab) * 2
    params = [SamplingParams(temperature=t) for t in (0.0, 0.8, 1.0, 1.2)]
    st = SamplingTensors.build(params, [4, 5, 6, 7], [11] * batch, vocab, torch.device("cpu"))
    expected = sample(logits, st).tolist()
    half = vocab // 2
    parts = []
    for start, stop in ((0, half), (half, vocab)):
        cols, values = gumbel_best(
            logits[:, start:stop].contiguous().to(device),
            st.temperature.to(device),
            st.seeds.to(device),
            st.positions.to(device),
            start,
        )
        parts.append((cols.cpu() + start, values.cpu()))
    winners = [
        int(parts[0][0][r]) if parts[0][1][r] >= parts[1][1][r] else int(parts[1][0][r]) for r in range(batch)
    ]
    assert winners == expected
    assert parts[0][1][0] == logits[0, :half].max()  # a greedy row's value is its raw logit


def test_the_draw_writes_each_token_into_the_token_table_and_out(device):
    """With `table`, pass 2 also stores each row's token (int32) at its flat index of the token
    table, and nothing else there: the decode graph's draw, which feeds the next step's input."""
    torch.manual_seed(2)
    batch, vocab = 3, 2500
    logits = torch.randn(batch, vocab) * 2
    params = [SamplingParams(temperature=t) for t in (0.0, 0.8, 1.2)]
    st = SamplingTensors.build(params, [4, 5, 6], [9, 9, 9], vocab, torch.device("cpu"))
    tokens = torch.full((4, 16), -1, dtype=torch.int32, device=device)
    at = torch.tensor([1 * 16 + 9, 3 * 16 + 2, 0 * 16 + 15], device=device)
    out = torch.full((8,), -7, dtype=torch.int64, device=device)
    drawn = gumbel_argmax(
        logits.to(device),
        st.temperature.to(device),
        st.seeds.to(device),
        st.positions.to(device),
        out=out[:batch],
        table=(tokens.view(-1), at),
    )
    expected = sample(logits, st).tolist()
    assert drawn.data_ptr() == out.data_ptr() and out.tolist() == expected + [-7] * 5
    flat = tokens.view(-1).cpu()
    assert flat[at.cpu()].tolist() == expected
    untouched = torch.ones(flat.numel(), dtype=torch.bool)
    untouched[at.cpu()] = False
    assert (flat[untouched] == -1).all()


# numpy, under the interpreter, warns of the all-NaN row's reductions (the compiled kernel does not)
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
def test_a_row_without_a_finite_logit_draws_no_token(device):
    """A row of -inf (every token banned), of NaN, with +inf, or with any NaN has nothing to
    draw from: the kernel says NO_TOKEN there, as the torch sampler does, where an argmax said 0,
    while the token table gets a real id (the next pass may read it)."""
    vocab = 2 * CHUNK + 10
    logits = torch.randn(6, vocab)
    logits[0] = float("-inf")
    logits[1] = float("nan")
    logits[2, 77] = float("inf")
    logits[3, CHUNK + 5] = float("nan")  # one NaN, in the second chunk
    logits[4, 1234] = 40.0  # the healthy rows: one greedy, one sampled
    params = [SamplingParams(temperature=t) for t in (0.0, 0.7, 0.0, 0.8, 0.0, 0.9)]
    st = SamplingTensors.build(params, [1, 2, 3, 4, 5, 6], [6] * 6, vocab, torch.device("cpu"))
    tokens = torch.full((6,), 99, dtype=torch.int32, device=device)
    drawn = gumbel_argmax(
        logits.to(device),
        st.temperature.to(device),
        st.seeds.to(device),
        st.positions.to(device),
        table=(tokens, torch.arange(6, device=device)),
    ).tolist()
    expected = sample(logits, st).tolist()
    assert drawn == expected
    assert drawn[:4] == [NO_TOKEN] * 4 and drawn[4] == 1234 and drawn[5] != NO_TOKEN
    table = tokens.tolist()
    assert all(0 <= t < vocab for t in table) and table[4:] == drawn[4:]
