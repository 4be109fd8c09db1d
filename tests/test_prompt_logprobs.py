"""SamplingParams.prompt_logprobs: each prompt token's log-probability given the tokens before
it (and its position's top-N), equal to transformers' on the same weights, across chunked
prefill, preemption, prefix caching and batches that mix such requests with plain ones."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

from pagellm import LLM, Logprob, SamplingParams
from tests.helpers import make_tiny_model

PROMPTS = [[5, 17, 33, 4, 90, 12, 7], list(range(10, 61)), [200, 100, 50, 25, 12, 6, 3]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_prompt_lp")
    return str(path), make_tiny_model(path, "llama")


def _reference(hf, prompt):
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)


def _check(out, hf, k: int):
    prompt = out.prompt_token_ids
    ref = _reference(hf, prompt)
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(prompt) and lps[0] is None
    for i in range(1, len(prompt)):
        entry, row = lps[i], ref[i - 1]
        assert next(iter(entry)) == prompt[i]  # the prompt's own token first
        assert abs(entry[prompt[i]] - float(row[prompt[i]])) < 1e-4
        top = row.topk(k).indices.tolist() if k else []
        assert set(entry) == {prompt[i], *top}, (i, entry, top)
        for t, v in entry.items():
            assert abs(v - float(row[t])) < 1e-4
            _check_rank(v, row, t)


def _check_rank(v, row, t):
    """v.rank: 1 + the ids more likely than t in transformers' row (ids within 1e-4 of it
    may fall either side)."""
    assert int((row > row[t] + 1e-4).sum()) + 1 <= v.rank <= int((row > row[t] - 1e-4).sum()) + 1


@pytest.mark.parametrize("engine_kwargs", [
    dict(block_size=16),
    dict(block_size=4, max_num_batched_tokens=16),  # chunked prefill: rows over several steps
])
def test_prompt_logprobs_match_transformers(tiny, engine_kwargs):
    path, hf = tiny
    llm = LLM(path, dtype="float32", kv_cache_memory=2**20, **engine_kwargs)
    sp = [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=k, ignore_eos=True)
          for k in (0, 2, 5)]
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    for out, k in zip(outs, (0, 2, 5)):
        _check(out, hf, k)
    # a plain request in the same batch reports none, and its tokens are unchanged
    mixed = llm.generate(PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                      prompt_logprobs=1)], use_tqdm=False)
    alone = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                         use_tqdm=False)
    assert mixed[0].prompt_logprobs is None
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    _check(mixed[1], hf, 1)


def test_prompt_logprobs_skip_the_prefix_cache_and_survive_preemption(tiny):
    """A cached prompt is computed again for a request that asks its log-probabilities (cached
    tokens have no logits); a preempted request's entries are not made twice."""
    path, hf = tiny
    llm = LLM(path, dtype="float32", kv_cache_memory=2**20, block_size=4)
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([PROMPTS[1]], plain, use_tqdm=False)  # its blocks are now cached
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True,
                                                    prompt_logprobs=1), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    _check(out, hf, 1)
    # a pool too small for the batch: preemption recomputes prompts (and their rows)
    small = LLM(path, dtype="float32", block_size=2, kv_cache_memory=1024 * 32,
                max_num_batched_tokens=64)
    outs = small.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                  prompt_logprobs=2), use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    for out in outs:
        _check(out, hf, 2)


def test_bad_prompt_logprobs_is_a_value_error():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_one_token_prompts_and_rows_scored_in_slices(tiny, monkeypatch):
    """A one-token prompt has its single None entry; rows are scored a slice at a time (the
    [rows, vocab] temporaries stay small) with the same values."""
    from pagellm.engine.llm_engine import LLMEngine

    path, hf = tiny
    monkeypatch.setattr(LLMEngine, "_PROMPT_SLICE", 3)
    llm = LLM(path, dtype="float32", kv_cache_memory=2**20, block_size=4)
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    one, long = llm.generate([[42], PROMPTS[1]], sp, use_tqdm=False)
    assert one.prompt_logprobs == [None]
    _check(long, hf, 2)


def test_a_failure_scoring_one_prompt_ends_that_request_alone(tiny, monkeypatch):
    from pagellm.engine.llm_engine import LLMEngine

    path, hf = tiny
    real = LLMEngine._score_prompt_rows

    def flaky(self, seq, lo, logits):
        if seq.prompt_token_ids == PROMPTS[2]:
            raise RuntimeError("scoring failed")
        return real(self, seq, lo, logits)

    monkeypatch.setattr(LLMEngine, "_score_prompt_rows", flaky)
    llm = LLM(path, dtype="float32", kv_cache_memory=2**20, block_size=4)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length", "error"]
    for out in outs[:2]:
        _check(out, hf, 1)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("spec", [None, dict(method="ngram", num_speculative_tokens=3)])
def test_a_prompt_may_fill_the_context(tiny, spec):
    """A prompt of exactly max_model_len tokens (a whole window to score) is taken: its prompt
    logprobs are transformers', its one token comes from the last position (finish "length",
    nothing past the context runs), and its blocks return; one token more is refused."""
    path, hf = tiny
    kw = {"speculative_config": spec} if spec else {}
    llm = LLM(path, dtype="float32", kv_cache_memory=2**20, block_size=4, max_model_len=51,
              max_num_batched_tokens=16, **kw)
    prompt = PROMPTS[1]  # 51 tokens, over four chunks
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=1),
                       use_tqdm=False)[0]
    _check(out, hf, 1)
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    assert out.outputs[0].token_ids[0] == int(_reference(hf, prompt)[-1].argmax())
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([prompt + [3]], SamplingParams(max_tokens=1), use_tqdm=False)


def test_logprobs_read_as_vllm_logprob_objects(tmp_path):
    """Sampled and prompt log-probabilities are Logprob objects: the float they were, with
    vLLM's .logprob, .rank (of the whole vocabulary, as transformers' row ranks it) and
    .decoded_token (the token's text), kept through copy and pickle."""
    from pagellm.models.loader import load_model_files

    tok = load_model_files(None).tokenizer
    hf = make_tiny_model(tmp_path, "llama", vocab_size=len(tok))
    tok.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=2**20)
    params = [SamplingParams(temperature=t, seed=3, max_tokens=6, logprobs=3, prompt_logprobs=2,
                             ignore_eos=True) for t in (0, 1.0)]
    outs = llm.generate(["The capital of France is"] * 2, params, use_tqdm=False)
    sampled_ranks = []
    for out, p in zip(outs, params):
        comp = out.outputs[0]
        ref = _reference(hf, out.prompt_token_ids + comp.token_ids)
        n = len(out.prompt_token_ids)
        for i, (chosen, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
            row = ref[n - 1 + i]
            assert next(iter(entry)) == chosen and len(entry) in (3, 4)
            for t, lp in entry.items():
                assert isinstance(lp, Logprob) and lp.logprob == lp and type(lp.logprob) is float
                assert abs(lp.logprob - float(row[t])) < 1e-4
                _check_rank(lp, row, t)
                assert lp.decoded_token == tok.decode([t])
            if p.temperature == 0:
                assert entry[chosen].rank == 1
            sampled_ranks.append(entry[chosen].rank)
        _check(out, hf, 2)
        assert all(lp.decoded_token == tok.decode([t])
                   for entry in out.prompt_logprobs[1:] for t, lp in entry.items())
    assert max(sampled_ranks) > 1  # a sampled token below the top (a flat random model)
    lp = outs[1].outputs[0].logprobs[0][outs[1].outputs[0].token_ids[0]]
    for again in (copy.deepcopy(lp), *(pickle.loads(pickle.dumps(lp, protocol))
                                       for protocol in range(pickle.HIGHEST_PROTOCOL + 1))):
        assert (again, again.rank, again.decoded_token) == (lp, lp.rank, lp.decoded_token)
    assert repr(lp).startswith("Logprob(logprob=")
