"""A draft that scores only its first N token ids (SpeculativeConfig.draft_vocab_size): the
logits it gives, the proposals it makes, and greedy output unchanged. The sampled law with
such a draft is checked in test_sampled_distribution.py (draft_sub_vocab)."""
from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.config import DRAFT_VOCAB, SpeculativeConfig

PROMPTS = [[5, 9, 17, 33, 2, 40], [7] * 19, list(range(3, 40))]


def test_automatic_and_given_sizes():
    auto = SpeculativeConfig(method="draft_model")
    assert auto.draft_vocab(151936) == DRAFT_VOCAB  # Qwen2.5, Llama 3: the head is large
    assert auto.draft_vocab(49152) is None  # SmolLM2: under twice the limit, all of it
    assert SpeculativeConfig(method="draft_model", draft_vocab_size=0).draft_vocab(151936) is None
    assert SpeculativeConfig(method="draft_model", draft_vocab_size=1000).draft_vocab(256) is None
    assert SpeculativeConfig(method="draft_model", draft_vocab_size=100).draft_vocab(256) == 100
    with pytest.raises(ValueError, match="draft_vocab_size"):
        SpeculativeConfig(method="draft_model", draft_vocab_size=-1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_limited_head_scores_the_first_ids_only(dtype):
    """Default model (its packed Q8_0 head in bfloat16, a dense head in float32): the first n
    logits are the full head's, bit for bit (the same kernel over the same rows); the rest
    -inf; 1 row and several."""
    llm = LLM(dtype=dtype, kv_cache_memory="16MiB")
    model = llm.engine.model
    hidden = torch.randn(3, model.config.hidden_size).to(model.act_dtype or model.norm.weight.dtype)
    for rows in (1, 3):
        full = model.compute_logits(hidden[:rows])
        model.limit_vocab(1000)
        try:
            part = model.compute_logits(hidden[:rows])
        finally:
            model.limit_vocab(None)
        assert part.shape == full.shape and part.dtype == torch.float32
        assert torch.equal(part[:, :1000], full[:, :1000])
        assert bool((part[:, 1000:] == float("-inf")).all())


def test_greedy_output_unchanged_and_proposals_within_the_limit(tiny_llama):
    path, _ = tiny_llama
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in
            LLM(path, dtype="float32", kv_cache_memory=2**20).generate(PROMPTS, sp, use_tqdm=False)]
    llm = LLM(path, dtype="float32", kv_cache_memory=2**20,
              speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 3,
                                  "draft_vocab_size": 100, "adaptive": False})
    proposer = llm.engine.spec.proposer
    assert proposer.model.vocab_limit == 100
    proposed = []
    orig = proposer.propose

    def recording(seqs, ks):
        out = orig(seqs, ks)
        proposed.extend(t for p in out for t in p.token_ids)
        return out

    proposer.propose = recording
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    assert got == want
    assert proposed and max(proposed) < 100
    assert any(t >= 100 for ids in want for t in ids)  # the target still emits the others
