"""One bad request never hurts another, inside the engine: a failure in a step's forward, its
sampling, its verification or its token processing ends only the request that caused it (every
one of its n sequences, forks not yet made included), the rest of the batch gives exactly the
tokens it gives alone, and the prefix cache never names KV a failed step did not write.

Failures are injected where they would come from (the runner, the sampler, the detokenizer),
tied to one request, so each test fails if the engine ends the whole batch, leaves a sibling
running, or serves a prefix from blocks that were never written."""
from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.engine import llm_engine

PROMPTS = {
    "a": [5, 17, 33, 42, 61, 7, 9, 120, 44, 3],
    "b": [8, 8, 19, 200, 31, 77, 15, 6],
    "bad": [99, 14, 27, 140, 55, 18, 71, 9, 23],
    "c": [64, 3, 91, 12, 180, 7],
}
SHARED = [7, 3, 99, 41, 5, 18, 250, 64, 2, 9, 33, 33, 10, 77, 120, 6]  # 4 blocks of 4


def greedy(max_tokens=12, n=1):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)


def run(eng, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        eng.add_request(rid, prompt, params)
    finished = {}
    steps = 0
    while eng.has_unfinished_requests():
        steps += 1
        assert steps < 500, "the engine does not finish its requests"
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


@pytest.fixture(scope="module")
def engine(tiny_llama):
    path, _ = tiny_llama
    return LLM(path, dtype="float32", block_size=4, kv_cache_memory=2**20).engine


@pytest.fixture(scope="module")
def alone(engine):
    """Each prompt's greedy tokens when it runs alone."""
    return {rid: run(engine, {rid: (p, greedy())})[rid].outputs[0].token_ids
            for rid, p in [*PROMPTS.items(), ("shared1", SHARED + [1, 2]),
                           ("shared2", SHARED + [3, 4, 5])]}


def poison_runner(monkeypatch, eng, bad: str, when=lambda out: True):
    """The runner fails every forward whose batch holds request `bad` (and `when` holds)."""
    real = eng.runner.execute

    def execute(out, rows, **kw):
        if any(s.request_id == bad for s in out.seqs) and when(out):
            raise RuntimeError("injected forward failure")
        return real(out, rows, **kw)

    monkeypatch.setattr(eng.runner, "execute", execute)


def check_isolated(finished, alone, bad: str, n: int):
    assert set(finished) == {"a", "b", bad, "c"}
    for rid in ("a", "b", "c"):
        comp = finished[rid].outputs[0]
        assert comp.finish_reason == "length" and comp.token_ids == alone[rid], rid
    assert [c.finish_reason for c in finished[bad].outputs] == ["error"] * n


@pytest.mark.parametrize("after_tokens", [0, 4])
def test_a_forward_that_fails_with_one_request_ends_only_that_request(
        engine, alone, monkeypatch, after_tokens):
    """n=3: at the prompt (forks not yet made) and after 4 tokens (siblings running)."""
    poison_runner(monkeypatch, engine, "bad", lambda out: any(
        s.request_id == "bad" and s.num_output_tokens >= after_tokens for s in out.seqs))
    finished = run(engine, {"a": (PROMPTS["a"], greedy()), "bad": (PROMPTS["bad"], greedy(n=3)),
                            "b": (PROMPTS["b"], greedy()), "c": (PROMPTS["c"], greedy())})
    check_isolated(finished, alone, "bad", 3)
    assert not engine.scheduler.running and not engine.scheduler.waiting
    if after_tokens:
        assert all(len(c.token_ids) == after_tokens for c in finished["bad"].outputs)


@pytest.mark.parametrize("where", ["sample", "detokenize"])
def test_sampling_or_token_processing_failing_for_one_request_ends_only_it(
        engine, alone, monkeypatch, where):
    def is_bad(seq_or_row_params):
        return seq_or_row_params.seed == 666

    if where == "sample":
        real = llm_engine.sample

        def sample(logits, rows):
            if any(is_bad(r.params) and len(r.output_token_ids) >= 3 for r in rows):
                raise ValueError("injected sampling failure")
            return real(logits, rows)

        monkeypatch.setattr(llm_engine, "sample", sample)
    else:
        real = llm_engine.append_text

        def append_text(tokenizer, seq):
            if is_bad(seq.params) and seq.num_output_tokens >= 3:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            return ""  # the tiny model has no tokenizer: no text

        monkeypatch.setattr(llm_engine, "append_text", append_text)
        monkeypatch.setattr(engine, "tokenizer", object())  # append_text runs when one is set
    bad = SamplingParams(temperature=1.0, seed=666, max_tokens=12, n=2)
    finished = run(engine, {"a": (PROMPTS["a"], greedy()), "bad": (PROMPTS["bad"], bad),
                            "b": (PROMPTS["b"], greedy()), "c": (PROMPTS["c"], greedy())})
    check_isolated(finished, alone, "bad", 2)


def test_verification_failing_for_one_request_ends_only_it(tiny_llama, monkeypatch):
    path, _ = tiny_llama
    llm = LLM(path, dtype="float32", block_size=4, kv_cache_memory=2**20,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "adaptive": False})
    eng = llm.engine
    loop = [5, 6, 7, 8] * 4  # repeats: n-gram proposals on every step
    ref = {rid: run(eng, {rid: (p, greedy())})[rid].outputs[0].token_ids
           for rid, p in [("a", loop), ("b", loop[1:]), ("c", loop[2:])]}
    real = eng.spec.verify

    def verify(seqs, logits, rng):
        if any(s.request_id == "bad" for s in seqs):
            raise RuntimeError("injected verification failure")
        return real(seqs, logits, rng)

    monkeypatch.setattr(eng.spec, "verify", verify)
    finished = run(eng, {"a": (loop, greedy()), "bad": (loop[3:], greedy(n=2)),
                         "b": (loop[1:], greedy()), "c": (loop[2:], greedy())})
    for rid in "abc":
        assert finished[rid].outputs[0].token_ids == ref[rid], rid
    assert [c.finish_reason for c in finished["bad"].outputs] == ["error"] * 2
    assert eng.spec.stats.num_draft_tokens > 0


def test_a_failed_forward_leaves_no_cached_prefix_it_did_not_write(engine, alone, monkeypatch):
    """shared1 and shared2 are admitted in one step: shared2 takes shared1's first blocks as
    cache hits, blocks shared1's forward was to write. That forward fails for shared1 alone:
    shared2 recomputes (it would read KV nobody wrote), and a later request with the prefix
    is not served from those blocks."""
    engine.block_manager.cached.clear()  # nothing from the `alone` runs
    for b in engine.block_manager.blocks:
        b.block_hash = b.token_ids = b.parent = None
    poison_runner(monkeypatch, engine, "shared1")
    engine.add_request("shared1", SHARED + [1, 2], greedy())
    engine.add_request("shared2", SHARED + [3, 4, 5], greedy())
    out = engine.scheduler.schedule  # the first step admits both, shared2 with hits

    def schedule():
        o = out()
        monkeypatch.setattr(engine.scheduler, "schedule", out)
        s2 = next(s for s in o.seqs if s.request_id == "shared2")
        assert s2.num_cached_tokens == 16
        return o

    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    finished = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
    assert finished["shared1"].outputs[0].finish_reason == "error"
    assert finished["shared2"].outputs[0].token_ids == alone["shared2"]
    assert finished["shared2"].metrics.num_preemptions == 1  # it recomputed
    late = run(engine, {"late": (SHARED + [1, 2], greedy())})["late"]
    assert late.outputs[0].token_ids == alone["shared1"]


def test_a_step_whose_batch_call_always_fails_still_finishes_every_request(engine, alone,
                                                                          monkeypatch):
    """Every step's first forward fails and the retries alone succeed (a failure tied to the
    batch). shared2 is admitted with hits on blocks shared1's failed forward was to write, so
    it recomputes; readmitted, its hits from the first admission no longer count, so the
    blocks it registers itself and loses with the next failed batch call do not send it
    back again: every request finishes (it used to recompute forever) with its own tokens."""
    engine.block_manager.cached.clear()  # nothing from the `alone` runs
    for b in engine.block_manager.blocks:
        b.block_hash = b.token_ids = b.parent = None
    real = engine.runner.execute
    retry = {"alone": False}

    def execute(out, rows, **kw):
        if not retry["alone"]:  # each step's batch call; the retries alone follow it
            retry["alone"] = True
            raise RuntimeError("injected failure of the batch")
        return real(out, rows, **kw)

    def step_start(*a, **k):
        retry["alone"] = False
        return schedule(*a, **k)

    schedule = engine.scheduler.schedule
    monkeypatch.setattr(engine.runner, "execute", execute)
    monkeypatch.setattr(engine.scheduler, "schedule", step_start)
    finished = run(engine, {"shared1": (SHARED + [1, 2], greedy()),  # never ended before
                            "shared2": (SHARED + [3, 4, 5], greedy())})
    assert finished["shared1"].outputs[0].token_ids == alone["shared1"]
    assert finished["shared2"].outputs[0].token_ids == alone["shared2"]
    assert finished["shared2"].metrics.num_preemptions == 1
    assert finished["shared2"].num_cached_tokens == 0  # its second admission had no hits


def test_a_batch_failure_retried_alone_gives_every_request_its_tokens(engine, alone,
                                                                       monkeypatch):
    """A failure of the batch as a whole that does not recur alone (a transient one): every
    request still gives exactly its own tokens."""
    real = engine.runner.execute
    calls = {"n": 0}

    def execute(out, rows, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected transient failure")
        return real(out, rows, **kw)

    monkeypatch.setattr(engine.runner, "execute", execute)
    finished = run(engine, {rid: (PROMPTS[rid], greedy()) for rid in "abc"})
    for rid in "abc":
        assert finished[rid].outputs[0].token_ids == alone[rid]
        assert finished[rid].outputs[0].finish_reason == "length"


def test_outputs_of_a_running_request_are_views_fixed_at_their_length(engine):
    from pagellm.outputs import Prefix

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    engine.add_request("v", PROMPTS["a"], params)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    first, last = outs[0].outputs[0], outs[-1].outputs[0]
    assert isinstance(first.token_ids, Prefix) and isinstance(first.logprobs, Prefix)
    assert isinstance(outs[0].metrics.token_times, Prefix)
    assert len(first.token_ids) == len(first.logprobs) == 1  # not grown with the sequence
    assert type(last.token_ids) is list and type(last.logprobs) is list and len(last.token_ids) == 6
    assert first.token_ids == last.token_ids[:1]
