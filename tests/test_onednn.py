"""Dense bf16 products from a weight prepacked once into oneDNN's layout (layers/onednn.py)
are the plain bf16 product's values, at every row count and through the projection modules."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.layers import linear as lin
from pagellm.layers import onednn

pytestmark = pytest.mark.skipif(not onednn.bf16_runs(),
                                reason="PyTorch without oneDNN, or no oneDNN bf16 on this CPU")


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_prepacked_product_is_the_bf16_product(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g).to(torch.bfloat16)
    x = torch.randn(2, rows, 80, generator=g)
    y = onednn.OneDNNLinear(w)(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, rows, 96)
    assert torch.equal(y, F.linear(x.to(torch.bfloat16), w))


def test_projection_with_a_prepacked_weight(monkeypatch):
    """prepack_bf16 moves a bf16 projection's weight into oneDNN's layout (the dense one to
    the meta device) where bf16 products run natively; its outputs keep the activations'
    dtype and add the bias; a float32 projection is left alone."""
    monkeypatch.setattr(lin, "UPCAST_BF16", False)
    torch.manual_seed(0)
    col = lin.ColumnParallelLinear(48, ((32, 1), (16, 1)), bias=True)
    col.weight.data.normal_()
    col.bias.data.normal_()
    row = lin.RowParallelLinear(48, 24)
    row.weight.data.normal_()
    keep = lin.RowParallelLinear(48, 24)  # stays float32
    for m in (col, row):
        m.to(torch.bfloat16)
    col.bias.data = col.bias.data.float()  # (float32 biases, as float32_biases leaves them)
    want_col = F.linear(torch.ones(5, 48).to(torch.bfloat16), col.weight).float() + col.bias
    x = torch.randn(5, 48)
    want_row = F.linear(x.to(torch.bfloat16), row.weight).float()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.col, self.row, self.keep = col, row, keep

    assert lin.prepack_bf16(Model()) == 2
    assert col.weight.device.type == "meta" and row.weight.device.type == "meta"
    assert keep.onednn is None and keep.weight.device.type == "cpu"
    assert torch.equal(col(torch.ones(5, 48)), want_col)
    out = row(x)
    assert out.dtype == torch.float32 and torch.equal(out, want_row)


@pytest.mark.parametrize("tied", [True, False])
def test_prepacked_head_gives_the_plain_heads_logits(monkeypatch, tied):
    """prepack_head: the LM head from oneDNN's layout gives the plain bf16 head's logits at
    few and many rows, whole and limited to its first ids (a draft's head); an untied head's
    dense weight goes to the meta device, a tied one stays as the embedding."""
    import transformers

    from pagellm.attention.base import get_attention_backend
    from pagellm.models.llama import LlamaForCausalLM

    monkeypatch.setattr(lin, "UPCAST_BF16", False)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=300, tie_word_embeddings=tied)
    torch.manual_seed(1)
    model = LlamaForCausalLM(cfg, get_attention_backend(torch.device("cpu")), 64)
    for p in model.parameters():
        p.data.normal_()
    model.to(torch.bfloat16)
    hidden = [torch.randn(rows, 64) for rows in (1, 9, 70)]
    want = [model.compute_logits(h) for h in hidden]
    model.limit_vocab(100)
    want_limited = [model.compute_logits(h) for h in hidden]
    model.limit_vocab(None)
    assert model.prepack_head() and model.head_onednn is not None
    assert not model.prepack_head()  # once
    assert (model._head().device.type == "meta") == (not tied)
    assert model.embed_tokens.weight.device.type == "cpu"
    for h, w in zip(hidden, want):
        got = model.compute_logits(h)
        assert got.dtype == torch.float32 and torch.equal(got, w)
    before = model.weight_bytes()
    model.limit_vocab(100)
    assert (model._head_sub_onednn is not None) == tied
    # the prepacked copy of the first 100 rows is memory the weights take
    assert model.weight_bytes() - before == (100 * 64 * 2 if tied else 0)
    for h, w in zip(hidden, want_limited):
        got = model.compute_logits(h)
        assert torch.equal(got, w) and torch.isinf(got[:, 100:]).all()
    # extra ids past the limit (a draft's requests' own ids): the full head's logits there,
    # from the prepacked head (an untied one has no dense rows left to gather)
    ids = torch.tensor([150, 299])
    model.also_score(ids)
    for h, w in zip(hidden, want):
        got = model.compute_logits(h)
        torch.testing.assert_close(got[:, ids], w[:, ids], rtol=1e-2, atol=1e-2)
        assert torch.isinf(got[:, 100:150]).all() and torch.isinf(got[:, 151:299]).all()
