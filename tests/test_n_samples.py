"""n > 1: the samples of one request fork from one prefill, share its blocks, and copy a shared
partly filled block before writing into it (copy-on-write)."""
from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.engine.block_manager import BlockManager
from pagellm.sequence import Sequence

PROMPT = [5, 17, 33, 4, 90, 12, 7]  # 7 tokens: with block size 4, block 1 is partly filled


def test_fork_shares_blocks_and_copies_on_write():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    parent = Sequence(0, "r", 0, list(PROMPT), SamplingParams(), None)
    child = Sequence(1, "r", 1, list(PROMPT), SamplingParams(), None)
    assert bm.allocate_slots(parent, 7)
    parent.num_computed_tokens = 7
    assert parent.block_table == [0, 1]
    bm.fork(parent, child)
    assert child.block_table == [0, 1] and child.num_computed_tokens == 7
    assert [bm.blocks[b].ref_cnt for b in (0, 1)] == [2, 2]
    # The child writes position 7 into shared block 1: it gets a private copy first.
    child.output_token_ids.append(9)
    assert bm.allocate_slots(child, 1)
    assert child.block_table == [0, 2] and bm.take_pending_copies() == [(1, 2)]
    assert [bm.blocks[b].ref_cnt for b in (0, 1, 2)] == [2, 1, 1]
    # The parent is now the only holder of block 1: it writes in place, no copy.
    parent.output_token_ids.append(4)
    assert bm.allocate_slots(parent, 1)
    assert parent.block_table == [0, 1] and bm.take_pending_copies() == []
    bm.check_invariants([parent.block_table, child.block_table])
    bm.free(child)
    bm.free(parent)
    assert bm.num_free_blocks == 8


def test_copy_on_write_fails_cleanly_when_pool_is_full():
    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    parent = Sequence(0, "r", 0, list(PROMPT), SamplingParams(), None)
    child = Sequence(1, "r", 1, list(PROMPT), SamplingParams(), None)
    assert bm.allocate_slots(parent, 7)
    parent.num_computed_tokens = 7
    bm.fork(parent, child)
    child.output_token_ids.append(9)
    assert not bm.allocate_slots(child, 1)  # no block for the copy: nothing changes
    assert child.block_table == [0, 1] and bm.pending_copies == []
    bm.free(child)
    bm.free(parent)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_n_samples_match_reference_logprobs(tiny_llama, prefix_caching):
    """Every sample's reported logprobs equal the reference model's on that sample's own
    tokens: a sample never sees another sample's KV."""
    path, hf = tiny_llama
    llm = LLM(path, dtype="float32", kv_cache_memory=2**20, block_size=4,
              enable_prefix_caching=prefix_caching)
    out = llm.generate([PROMPT], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10,
                                                ignore_eos=True, logprobs=1), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3
    for o in out.outputs:
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([PROMPT + o.token_ids])).logits[0], -1)
        for i, (tok, lp) in enumerate(zip(o.token_ids, o.logprobs)):
            assert abs(lp[tok] - float(ref[len(PROMPT) - 1 + i, tok])) < 1e-4


def test_n_greedy_samples_identical_and_prefill_once(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(path, dtype="float32", kv_cache_memory=2**20, block_size=4)
    sp = SamplingParams(n=4, temperature=0, max_tokens=8, ignore_eos=True)
    computed, execute = [], llm.engine.runner.execute

    def counting(out, rows, **kw):
        computed.append(out.total_tokens)
        return execute(out, rows, **kw)

    llm.engine.runner.execute = counting
    try:
        out = llm.generate([PROMPT], sp, use_tqdm=False)[0]
    finally:
        del llm.engine.runner.execute
    # one prefill of the 7 prompt tokens, then 7 decode inputs for each of the 4 samples (the
    # 8th token needs none); a prefill per sample would compute 3 x 7 more (3 x 3 from cache)
    assert sum(computed) == len(PROMPT) + 4 * 7, computed
    single = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0]
    assert all(o.token_ids == single.outputs[0].token_ids for o in out.outputs)
