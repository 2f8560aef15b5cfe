"""A CPU decode step's few-row products spread over torch's threads (layers/linear.py:
torch_linear): the same products as F.linear, taken only where they apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minfer.layers.linear import CPU_GROUPED_MAX_ROWS, cpu_row_groups, torch_linear


@pytest.fixture
def threads():
    """Run the test with torch at the given thread count, restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


# the default model's projections (qkv, o, gate_up, down), its LM head's shape at a smaller
# vocabulary, and a Qwen-like one with a bias
SHAPES = [(960, 576, False), (576, 576, False), (3072, 576, False), (576, 1536, False), (4096, 576, False)]
SHAPES += [(1152, 896, True)]


@pytest.mark.parametrize("n,k,has_bias", SHAPES)
@pytest.mark.parametrize("rows", range(1, CPU_GROUPED_MAX_ROWS + 1))
def test_grouped_rows_equal_f_linear(threads, n, k, has_bias, rows):
    threads(2)
    gen = torch.Generator().manual_seed(n + k + rows)
    weight = torch.randn(n, k, generator=gen) * k**-0.5
    bias = torch.randn(n, generator=gen) if has_bias else None
    x = torch.randn(1, rows, k, generator=gen)  # [batch, tokens, K], as a layer sees it
    assert cpu_row_groups(x, weight) == 4
    out = torch_linear(x, weight, bias)
    assert out.shape == (1, rows, n)
    # the same dot products; MKL summed them bit for bit alike at most row counts on the
    # development machine, in another order at some (5-7, 9-11 rows: float32 rounding, ~1e-6)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_strided_rows(threads):
    threads(2)
    weight = torch.randn(960, 576)
    x = torch.randn(3, 1152)[:, :576]  # a view whose rows are strided, like qkv[:, :q_width]
    assert cpu_row_groups(x, weight) > 0
    torch.testing.assert_close(torch_linear(x, weight), F.linear(x, weight), rtol=1e-6, atol=1e-6)


def test_groups_follow_threads_and_divide_the_outputs(threads):
    x = torch.randn(1, 576)
    threads(2)
    assert cpu_row_groups(x, torch.randn(960, 576)) == 4
    assert cpu_row_groups(x, torch.randn(966, 576)) == 2  # 966 = 2 x 483: the largest that divides
    assert cpu_row_groups(x, torch.randn(963, 576)) == 0  # odd: no split
    threads(4)
    assert cpu_row_groups(x, torch.randn(960, 576)) == 8


def test_where_f_linear_stays(threads):
    weight = torch.randn(960, 576)
    threads(2)
    assert cpu_row_groups(torch.randn(CPU_GROUPED_MAX_ROWS + 1, 576), weight) == 0  # a prefill
    assert cpu_row_groups(torch.randn(0, 576), weight) == 0
    assert cpu_row_groups(torch.randn(1, 576, dtype=torch.bfloat16), weight.bfloat16()) == 0
    assert cpu_row_groups(torch.randn(1, 576), torch.randn(576, 960).t()) == 0  # not contiguous
    threads(1)
    assert cpu_row_groups(torch.randn(1, 576), weight) == 0
