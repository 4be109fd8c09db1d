"""A separate draft model: one that scores only its first N token ids and the ids of each
request's own text (SpeculativeConfig.draft_vocab_size: the logits it gives, the proposals it
makes, greedy output unchanged; the sampled law with such a draft is checked in test_sampled_distribution.py,
draft_sub_vocab), and its catch-up on context kept out of what the controller learns."""
from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.config import SpeculativeConfig

PROMPTS = [[5, 9, 17, 33, 2, 40], [7] * 19, list(range(3, 40))]


@pytest.mark.parametrize("size,limit", [(None, None), (0, None), (1000, None), (100, 100)])
def test_default_and_given_sizes(tiny_llama, size, limit):
    """None and 0 score every id, as does a size past the vocabulary (256 here)."""
    path, _ = tiny_llama
    llm = LLM(path, dtype="float32", kv_cache_memory=2**20,
              speculative_config={"method": "draft_model", "model": path, "draft_num_layers": 1,
                                  "draft_vocab_size": size})
    assert llm.engine.spec.proposer.model.vocab_limit == limit


def test_the_limit_is_in_place_before_the_kv_budget_is_read(tiny_llama, monkeypatch):
    """A limited head may keep a copy of its first rows (prepacked for oneDNN, bf16 units):
    memory of the draft's weights, so the limit is set when the draft loads, before the
    engine splits what is left between the two KV caches."""
    import pagellm.spec_decode.setup as setup

    path, _ = tiny_llama
    seen, load = [], setup.load_draft

    def loaded(*args, **kwargs):
        files, draft, dtype = load(*args, **kwargs)
        seen.append(draft.vocab_limit)
        return files, draft, dtype

    monkeypatch.setattr(setup, "load_draft", loaded)
    LLM(path, dtype="float32", kv_cache_memory=2**20,
        speculative_config={"method": "draft_model", "model": path, "draft_num_layers": 1,
                            "draft_vocab_size": 100})
    assert seen == [100]


def test_a_negative_size_is_refused():
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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_limited_head_also_scores_the_ids_it_is_given(dtype):
    """also_score: ids past the limit get the full head's logits (bit for bit where the head is
    packed: the same kernel over the same rows), the others past the limit stay -inf."""
    llm = LLM(dtype=dtype, kv_cache_memory="16MiB")
    model = llm.engine.model
    hidden = torch.randn(3, model.config.hidden_size,
                         generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(model.act_dtype or model.norm.weight.dtype)
    ids = torch.tensor([1000, 1733, 20000, model.config.vocab_size - 1])
    for rows in (1, 3):
        full = model.compute_logits(hidden[:rows])
        model.limit_vocab(1000)
        model.also_score(ids)
        try:
            part = model.compute_logits(hidden[:rows])
        finally:
            model.limit_vocab(None)
        assert model.extra_ids is None  # a new limit starts without extra ids
        assert torch.equal(part[:, :1000], full[:, :1000])
        if model.head_packed is not None:
            assert torch.equal(part[:, ids], full[:, ids])
        else:
            torch.testing.assert_close(part[:, ids], full[:, ids], rtol=1e-5, atol=1e-4)
        rest = torch.ones(full.shape[1], dtype=torch.bool)
        rest[:1000] = False
        rest[ids] = False
        assert bool((part[:, rest] == float("-inf")).all())


def test_greedy_output_unchanged_and_proposals_within_the_limit_or_the_requests_text(tiny_llama):
    """A draft scoring its first 100 ids proposes ids past them only where the texts of the
    requests in its step hold them (and the output is the target's alone)."""
    path, _ = tiny_llama
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in
            LLM(path, dtype="float32", kv_cache_memory=2**20).generate(PROMPTS, sp, use_tqdm=False)]
    llm = LLM(path, dtype="float32", kv_cache_memory=2**20,
              speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 3,
                                  "draft_vocab_size": 100, "adaptive": False})
    proposer = llm.engine.spec.proposer
    assert proposer.model.vocab_limit == 100
    proposed, past_limit = [], []
    orig = proposer.propose

    def recording(seqs, ks):
        # the ids of the texts of the requests in the step (a batch scores their union)
        text = {t for seq in seqs for t in seq.prompt_token_ids + seq.output_token_ids}
        out = orig(seqs, ks)
        for prop in out:
            proposed.extend(prop.token_ids)
            past_limit.extend((t, t in text) for t in prop.token_ids if t >= 100)
        return out

    proposer.propose = recording
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    assert got == want
    assert proposed and past_limit and all(mine for _, mine in past_limit), past_limit
    assert any(t >= 100 for ids in want for t in ids)  # the target still emits the others
    assert not proposer._past_limit  # released with their requests


def _limited_proposer(tiny_llama) -> tuple[LLM, object]:
    """An engine whose draft (the tiny model itself) scores its first 100 ids, and its draft
    proposer, with end-of-sequence ids 3 and 250."""
    path, _ = tiny_llama
    llm = LLM(path, dtype="float32", kv_cache_memory=2**20,
              speculative_config={"method": "draft_model", "model": path,
                                  "draft_vocab_size": 100})
    proposer = llm.engine.spec.proposer
    proposer.eos_token_id = {3, 250}
    return llm, proposer


def test_the_ids_past_the_limit_are_read_once_per_request(tiny_llama):
    """The proposer reads each request's new tokens only, keeps them per request, and scores
    the union of the batch's (plus the end-of-sequence id past the limit)."""
    from pagellm.sequence import Sequence

    _, proposer = _limited_proposer(tiny_llama)
    a = Sequence(0, "a", 0, [5, 120, 7, 120], SamplingParams(), None)
    b = Sequence(1, "b", 0, [130], SamplingParams(), None)
    proposer._score_own_text([a, b])
    assert proposer.model.extra_ids.tolist() == [120, 130, 250]
    a.prompt_token_ids[0] = 199  # read already: not read again
    a.output_token_ids += [9, 140]
    proposer._score_own_text([a])
    assert proposer.model.extra_ids.tolist() == [120, 140, 250]
    assert proposer._past_limit[0] == (6, {120, 140})
    proposer.eos_token_id = 3
    proposer._score_own_text([Sequence(2, "c", 0, [4], SamplingParams(), None)])
    assert proposer.model.extra_ids is None


def test_the_controller_never_sees_a_draft_catch_up(tiny_llama):
    """A separate draft catches up on a request's context at its first proposals (and on tokens
    emitted while speculation was off): that is paid once, not per step with k proposals, so
    neither the draft's round cost nor a step's wall that the controller learns from may hold
    it. The draft's catch-up rounds are slowed by 0.3 s here; no observation may show them.
    A first round of 2 tokens (the last proposal and the target's own token, after a step that
    accepted every proposal) is a proposal round: it is not slowed, and it is counted."""
    import time

    path, _ = tiny_llama
    llm = LLM(path, dtype="float32", kv_cache_memory=2**20,
              speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 3,
                                  "draft_num_layers": 1, "adaptive": False})
    spec = llm.engine.spec
    runner, controller = spec.proposer.runner, spec.controller
    slowed, steps, rounds = [], [], []
    execute, observe_step, observe_draft = runner.execute, controller.observe_decode_step, controller.observe_draft

    def slow_catch_up(out, rows, **kw):
        if max(out.num_tokens) > 2:
            slowed.append(1)
            time.sleep(0.3)
        return execute(out, rows, **kw)

    def step(batch, seconds, *args, **kw):
        steps.append(seconds)
        return observe_step(batch, seconds, *args, **kw)

    def draft(n, seconds):
        rounds.append((n, seconds))
        return observe_draft(n, seconds)

    runner.execute, controller.observe_decode_step, controller.observe_draft = slow_catch_up, step, draft
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.generate(PROMPTS, sp, use_tqdm=False)
    assert slowed and steps and rounds
    assert max(steps) < 0.25 and max(s for _, s in rounds) < 0.25
    assert all(n <= 3 for n, _ in rounds)  # a catch-up round is not a proposal round


def test_speculation_per_request():
    """SamplingParams.num_speculative_tokens caps one request's proposals (0: none), beside
    requests that use the engine's k; each request's greedy output is its own."""
    from pagellm.server.protocol import ChatCompletionRequest, CompletionRequest

    assert SamplingParams(num_speculative_tokens=0).num_speculative_tokens == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            SamplingParams(num_speculative_tokens=bad)
    # over HTTP: the request field, bounded like the engine's k
    req = CompletionRequest(model="m", prompt="x", num_speculative_tokens=2)
    assert req.sampling_params(8, None).num_speculative_tokens == 2
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}])
    assert chat.sampling_params(8, None).num_speculative_tokens is None
    with pytest.raises(ValueError):
        CompletionRequest(model="m", prompt="x", num_speculative_tokens=-1)


def test_per_request_caps_reach_the_proposer(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(path, dtype="float32", kv_cache_memory=2**20,
              speculative_config={"method": "draft_model", "model": path,
                                  "num_speculative_tokens": 3, "adaptive": False})
    proposer = llm.engine.spec.proposer
    asked: dict[int, list[int]] = {}
    orig = proposer.propose

    def recording(seqs, ks):
        for s, k in zip(seqs, ks):
            asked.setdefault(s.params.num_speculative_tokens, []).append(k)
        return orig(seqs, ks)

    proposer.propose = recording
    plain = LLM(path, dtype="float32", kv_cache_memory=2**20)
    for cap in (None, 0, 1):
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, num_speculative_tokens=cap)
        want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, sp, use_tqdm=False)]
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)] == want
    assert max(asked[None]) == 3 and max(asked[1]) == 1 and max(asked[0]) == 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_the_draft_catches_up_past_its_prefix_cache(tiny_llama, prefix_caching):
    """A request sharing 64 tokens (4 blocks) with an earlier one: the draft's own prefix cache
    serves them, so its catch-up computes only the rest (prefix caching on, as the target's),
    or the whole context (off). Greedy output stays the target's either way."""
    path, _ = tiny_llama
    first = list(range(3, 73))
    second = first[:64] + [200, 201, 202, 203, 204]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = LLM(path, dtype="float32", kv_cache_memory=2**20)
    want = [plain.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in (first, second)]
    llm = LLM(path, dtype="float32", kv_cache_memory=2**20, enable_prefix_caching=prefix_caching,
              speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 3,
                                  "draft_num_layers": 1, "adaptive": False})
    proposer = llm.engine.spec.proposer
    computed = []
    execute = proposer.runner.execute

    def counting(out, rows, **kw):
        computed.append(sum(out.num_tokens))
        return execute(out, rows, **kw)

    proposer.runner.execute = counting
    got = []
    for prompt in (first, second):
        computed.clear()
        got.append(llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids)
        catch_up = max(computed)
    assert got == want
    if prefix_caching:
        assert proposer.block_manager.prefix_hits == 64
        assert catch_up <= len(second) + 1 - 64  # the rest of the prompt and the first token
    else:
        assert proposer.block_manager.prefix_hits == 0
        assert catch_up >= len(second)


def test_a_failed_draft_round_leaves_nothing_in_its_prefix_cache(tiny_llama):
    """The catch-up round registers the prompt's full blocks before its forward: when that
    forward fails, they leave the draft's cache (a later request must not read KV never
    written), the step decodes without proposals, and the next request computes them."""
    path, _ = tiny_llama
    prompt = list(range(3, 73))
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = LLM(path, dtype="float32", kv_cache_memory=2**20).generate([prompt], sp, use_tqdm=False)[0]
    llm = LLM(path, dtype="float32", kv_cache_memory=2**20,
              speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 3,
                                  "draft_num_layers": 1, "adaptive": False})
    proposer = llm.engine.spec.proposer
    execute, failed = proposer.runner.execute, []

    def failing_catch_up(out, rows, **kw):
        if not failed and max(out.num_tokens) > 2:
            failed.append(1)
            raise RuntimeError("draft forward failed")
        return execute(out, rows, **kw)

    proposer.runner.execute = failing_catch_up
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert failed and out.outputs[0].token_ids == want.outputs[0].token_ids
    assert proposer.block_manager.prefix_hits == 0
    again = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == want.outputs[0].token_ids
    # the second request's draft found the blocks its own successful catch-up registered
    assert proposer.block_manager.prefix_hits == 64


def test_a_sampled_requests_draft_scores_its_own_text_only(tiny_llama):
    """In a batch the limited head scores the union of the requests' ids past the limit; a
    sampled request's q is masked back to its own (and the end-of-sequence ids), so its
    seeded proposals and q are the same alone and beside another request. Greedy rows keep
    the union (their output is the target's argmax either way)."""
    from pagellm.sequence import Sequence

    _, proposer = _limited_proposer(tiny_llama)
    sampled = SamplingParams(temperature=1.0, seed=7)
    a = Sequence(0, "a", 0, [5, 120, 7], sampled, None)
    b = Sequence(1, "b", 0, [130, 9, 160], SamplingParams(temperature=0), None)
    c = Sequence(2, "c", 0, [11, 140], SamplingParams(temperature=0.8), None)
    rows, cols = proposer._score_own_text([a, b, c])
    assert proposer.model.extra_ids.tolist() == [120, 130, 140, 160, 250]
    assert list(zip(rows.tolist(), cols.tolist())) == [(0, 130), (0, 140), (0, 160),
                                                        (2, 120), (2, 130), (2, 160)]
    assert proposer._score_own_text([b]) is None  # a greedy row alone: nothing to mask

    def propose(seqs):
        for s in seqs:
            s.generator = torch.Generator().manual_seed(s.params.seed or 0)
        out = proposer.propose(seqs, [3] * len(seqs))
        for s in seqs:
            proposer.release(s)
        return out

    fresh = lambda seq_id, prompt, params: Sequence(seq_id, str(seq_id), 0, list(prompt), params, None)  # noqa: E731
    alone = propose([fresh(10, a.prompt_token_ids, sampled)])[0]
    beside = propose([fresh(11, a.prompt_token_ids, sampled),
                      fresh(12, [130, 140, 160, 170] * 3, SamplingParams(temperature=0))])[0]
    assert len(alone.token_ids) == 3 and alone.token_ids == beside.token_ids
    # the same q up to the dense tiny model's float32 rounding over 1 or 2 rows; none of it
    # on the other request's ids
    torch.testing.assert_close(alone.probs, beside.probs, rtol=1e-5, atol=1e-7)
    assert bool((beside.probs[:, [130, 140, 160, 170]] == 0).all())
