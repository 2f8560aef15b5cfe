"""The embedding gather of chained decode steps (minfer.kernels.embedding): a copy of rows, so
bit-exact against torch's embedding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minfer.kernels.embedding import embedding_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1,), (2,), (3, 2)])
def test_embedding_rows_is_torch_embedding(dtype, shape, device):
    gen = torch.Generator().manual_seed(len(shape))
    weight = torch.randn((50, 1100), generator=gen).to(dtype).to(device)  # hidden over one block
    for index_dtype in (torch.int64, torch.int32):
        ids = torch.randint(0, 50, shape, generator=gen).to(index_dtype).to(device)
        out = embedding_rows(ids, weight)
        assert out.shape == (*shape, 1100) and out.dtype == dtype
        assert torch.equal(out, F.embedding(ids.long(), weight))
    assert embedding_rows(torch.zeros(0, dtype=torch.int64, device=device), weight).shape == (0, 1100)


@pytest.mark.gpu
def test_the_layer_gathers_chained_rows_with_the_kernel(monkeypatch):
    """On a GPU with programmatic dependent launch, one or two ids take the kernel; more take torch."""
    from minfer.kernels import pdl
    from minfer.layers import embedding

    if not pdl.pdl_enabled(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    layer = embedding.VocabParallelEmbedding(50, 64).cuda()
    layer.weight.data.normal_()
    used = []
    monkeypatch.setattr(
        embedding, "embedding_rows", lambda i, w: used.append(i.numel()) or embedding_rows(i, w)
    )
    for n in (1, 2, 3):
        ids = torch.arange(n, device="cuda") * 7
        assert torch.equal(layer(ids), layer.weight[ids])
    assert used == [1, 2]
