"""An untied GGUF embedding kept as the file's blocks (layers/embedding.py, kernels/cpu_dequant.c):
rows decoded bit for bit as gguf.quants.dequantize decodes them (every packable type, random
bytes included: NaN, infinities, subnormal scales), looked up as a dense table of the same file
gives them, out-of-range ids refused; a packed tiny GGUF with an untied Q4_K embedding holds no
dense table and gives the dense table's logits; a tied Q8_0 head with a prepacked copy (the
default model on a CPU with bf16 units) serves the lookups from its codes."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from pagellm import LLM
from pagellm.kernels import native
from pagellm.layers import quant
from pagellm.layers.embedding import BlockEmbedding, Q8RowsEmbedding
from tests.gguf_files import random_blocks

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler on this machine")
TYPES = sorted(quant.GGUF_PACKED_TYPES, key=lambda t: t.name)


def _rows(blocks: quant.GGUFBlocks, ids: torch.Tensor) -> torch.Tensor:
    out = torch.empty(ids.numel(), blocks.cols)
    rc = native.library().gguf_dequantize_rows(blocks.raw.data_ptr(), blocks.raw.shape[1],
                                                int(blocks.ggml_type), blocks.cols,
                                                ids.data_ptr(), ids.numel(), out.data_ptr())
    assert rc == 0
    return out


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_are_ggufs_own_decoding_bit_for_bit(qtype):
    ids = torch.tensor([5, 0, 39, 5, 17])
    g = torch.Generator().manual_seed(int(qtype))
    files = random_blocks(qtype, 40, 512, seed=int(qtype))
    noise = quant.GGUFBlocks(torch.randint(0, 256, files.raw.shape, dtype=torch.uint8, generator=g),
                             qtype, 512)  # any f16 scale: NaN, inf, subnormal, negative
    for blocks in (files, noise):
        with np.errstate(invalid="ignore", over="ignore"):  # NaN and inf scales
            want = torch.from_numpy(dequantize(blocks.raw.numpy(), qtype)).view(40, 512)[ids]
        got = _rows(blocks, ids)
        # where two NaNs meet, which payload survives is the compiler's operand order: NaN
        # where gguf has NaN, every other value's bits
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan), qtype.name
        assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32)), qtype.name


def test_a_wrong_row_size_is_refused():
    blocks = random_blocks(Q.Q4_K, 4, 512, seed=0)
    with pytest.raises(ValueError, match="bytes a row"):
        BlockEmbedding(quant.GGUFBlocks(blocks.raw[:, :-1], Q.Q4_K, 512), torch.bfloat16)
    ids = torch.tensor([0])
    out = torch.empty(1, 512)
    lib = native.library()
    assert lib.gguf_dequantize_rows(blocks.raw.data_ptr(), blocks.raw.shape[1] - 1, int(Q.Q4_K),
                                    512, ids.data_ptr(), 1, out.data_ptr()) == -2
    assert lib.gguf_dequantize_rows(blocks.raw.data_ptr(), blocks.raw.shape[1], int(Q.Q4_K),
                                    500, ids.data_ptr(), 1, out.data_ptr()) == -2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lookup_equals_a_dense_table_of_the_same_file(dtype):
    blocks = random_blocks(Q.Q6_K, 300, 256, seed=1)
    table = torch.nn.Embedding.from_pretrained(blocks.dequantize().to(dtype))
    emb = BlockEmbedding(blocks, dtype)
    ids = torch.tensor([[3, 299, 0], [3, 150, 7]])
    got = emb(ids)
    assert got.dtype == dtype and got.shape == (2, 3, 256)
    assert torch.equal(got, table(ids))
    assert emb(torch.tensor([], dtype=torch.int64)).shape == (0, 256)
    assert emb.to(torch.float32)(ids).dtype == torch.float32  # a model's .to(dtype) reaches it
    assert emb.raw.dtype == torch.uint8
    for bad in (300, -1):
        with pytest.raises(IndexError, match="out of range"):
            emb(torch.tensor([1, bad]))


def test_a_packed_model_keeps_its_untied_embedding_as_blocks(tmp_path):
    """The tiny Qwen2 GGUF (Q4_K embedding, Q6_K head: untied): the packed model holds the
    embedding's blocks and no dense table, counts them in its weight bytes, and gives the same
    logits as the same model whose embedding is a dense bf16 table (the dense table's rounding
    of the file's values is the lookup's)."""
    from tests import test_gguf_models as tiny

    path = tmp_path / "tiny.gguf"
    tiny.write_tiny_gguf(path, "qwen2")
    llm = LLM(str(path), kv_cache_memory=2**22, enable_prefix_caching=False)  # two full prefills
    model = llm.engine.model
    emb = model.embed_tokens
    assert isinstance(emb, BlockEmbedding) and emb.ggml_type == int(Q.Q4_K)
    assert "embed_tokens.weight" not in dict(model.named_parameters())
    before = model.weight_bytes()
    prompt = list(range(3, 40))
    logits = tiny._prefill_logits(llm, prompt)
    dense = torch.nn.Embedding.from_pretrained(
        quant.GGUFBlocks(emb.raw, Q.Q4_K, emb.embedding_dim).dequantize().to(torch.bfloat16))
    model.embed_tokens = dense
    assert model.weight_bytes() == before - emb.nbytes + dense.weight.numel() * 2
    assert torch.equal(tiny._prefill_logits(llm, prompt), logits)


def test_a_tied_q8_0_head_serves_the_lookups():
    """The default model (its tied head Q8_0): where the head has a prepacked bf16 copy for
    many rows (CPUs with bf16 units), the embedding reads the head's codes and no dense table
    is kept: lookups are the dense table's bit for bit, and so are the prefill's logits and a
    draft's limited head (its first ids prepacked from the codes, extra ids gathered), few
    and many rows. Elsewhere the dense head is what many-row products multiply: it stays."""
    from tests import test_gguf_models as tiny

    llm = LLM(kv_cache_memory=2**24, enable_prefix_caching=False)  # two full prefills
    model = llm.engine.model
    if model.head_onednn is None:
        assert isinstance(model.embed_tokens, torch.nn.Embedding)
        assert model.embed_tokens.weight.device.type == "cpu"
        return
    emb = model.embed_tokens
    assert isinstance(emb, Q8RowsEmbedding) and emb.head is model.head_packed
    assert "embed_tokens.weight" not in dict(model.named_parameters())
    table = quant.Int8Blocks(emb.head.codes, emb.head.scale).dequantize().to(torch.bfloat16)
    ids = torch.tensor([[0, 5, 49151], [77, 5, 1]])
    assert torch.equal(emb(ids), table[ids])
    prompt = list(range(3, 40))
    before, logits = model.weight_bytes(), tiny._prefill_logits(llm, prompt)
    hidden = [torch.randn(rows, table.shape[1]) for rows in (1, 70)]
    extra = torch.tensor([2000, 40000])

    def limited():
        model.limit_vocab(1000)
        model.also_score(extra)
        try:
            return [model.compute_logits(h) for h in hidden]
        finally:
            model.also_score(None)
            model.limit_vocab(None)

    got = limited()
    model.embed_tokens = torch.nn.Embedding.from_pretrained(table)
    assert model.weight_bytes() == before + table.numel() * 2
    assert torch.equal(tiny._prefill_logits(llm, prompt), logits)
    for g, w in zip(got, limited()):
        assert torch.equal(g, w) and torch.isfinite(g[:, extra]).all()
    model.embed_tokens = emb
