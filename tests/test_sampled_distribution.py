"""Sampled decoding through the engine follows the exact target law, with every sampling
parameter on, with n > 1 and with speculation (n-gram and a draft model) on or off.

The exact law of every 4-token continuation is enumerated from transformers' float32 logits,
processed by a reference written here from the parameters' definitions (logit bias,
repetition / frequency / presence penalties, temperature, top-k, top-p, min-p); 1500 seeded
samples of one request (n = 1500) are compared with it by a chi-square test. Speculation must
not change the law: its rejection sampler verifies against p at every position, with the
penalties of the tokens accepted before it."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from pagellm import LLM, SamplingParams

SPECS = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False,
              "prompt_lookup_min": 1},
    # one layer of the target as the draft: q far from p, so rejections are frequent
    "draft": {"method": "draft_model", "num_speculative_tokens": 2, "draft_num_layers": 1,
              "adaptive": False},
    # a separate draft (the target's files, one layer) that scores only ids 0..127 of 256 and
    # the ids of its requests' own text: q is zero on the rest (most of the target's mass
    # past 127 at the first position), which the residual distribution must make up for
    "draft_sub_vocab": {"method": "draft_model", "model": "<target>", "num_speculative_tokens": 2,
                        "draft_num_layers": 1, "draft_vocab_size": 128, "adaptive": False},
    # n-gram lookup first (one-hot q), the separate draft (its own q) where it finds nothing
    # (batch 1: the test runs its samples as requests one by one)
    "lookup_first": {"method": "draft_model", "model": "<target>", "num_speculative_tokens": 2,
                     "draft_num_layers": 1, "adaptive": False, "prompt_lookup_first": True},
}
PARAMS = {
    "top_k": dict(temperature=1.0, top_k=3),
    "everything": dict(temperature=0.8, top_k=5, top_p=0.9, min_p=0.08, repetition_penalty=1.3,
                       frequency_penalty=0.5, presence_penalty=0.4,
                       logit_bias={7: 2.0, 100: 1.5}),
}
N, LENGTH = 1500, 4


def reference_probs(logits: torch.Tensor, p: SamplingParams, prompt: list[int],
                    output: list[int]) -> dict[int, float]:
    """Next-token law from raw logits, from each parameter's definition (vLLM's / OpenAI's)."""
    x = logits.double().clone()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if p.repetition_penalty != 1.0:  # every token of prompt and output
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):  # output tokens only
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    x = x / p.temperature
    order = sorted(range(len(x)), key=lambda t: -float(x[t]))
    kept = order[:p.top_k] if p.top_k > 0 else order
    probs = torch.softmax(x[kept], 0)
    if p.top_p < 1.0:  # the smallest prefix whose mass reaches top_p
        mass, cut = 0.0, []
        for t, q in zip(kept, probs.tolist()):
            if mass >= p.top_p:
                break
            cut.append(t)
            mass += q
        kept = cut
    if p.min_p > 0:  # at least min_p times the most likely token's probability
        probs = torch.softmax(x[kept], 0)
        kept = [t for t, q in zip(kept, probs.tolist()) if q >= p.min_p * float(probs.max())]
    probs = torch.softmax(x[kept], 0)
    return dict(zip(kept, probs.tolist()))


def exact_paths(hf, prompt: list[int], p: SamplingParams) -> dict[tuple[int, ...], float]:
    paths: dict[tuple[int, ...], float] = {}

    def walk(prefix: list[int], prob: float) -> None:
        if len(prefix) == LENGTH:
            paths[tuple(prefix)] = prob
            return
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + prefix])).logits[0, -1]
        for t, q in reference_probs(logits, p, prompt, prefix).items():
            walk(prefix + [t], prob * q)

    walk([], 1.0)
    return paths


def chi_square_ok(counts: Counter, exact: dict, n: int) -> tuple[bool, float, float]:
    """Pearson's chi-square over paths expected >= 5 times (the rest pooled), at p < 1e-4."""
    big = [k for k, q in exact.items() if q * n >= 5]
    obs = [counts.get(k, 0) for k in big] + [n - sum(counts.get(k, 0) for k in big)]
    exp = [exact[k] * n for k in big] + [n * (1 - sum(exact[k] for k in big))]
    cells = [(o, e) for o, e in zip(obs, exp) if e > 1e-9]
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    z = 3.72  # Wilson-Hilferty: the chi-square quantile for p = 1e-4
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return chi2 < limit, chi2, limit


@pytest.fixture(scope="module")
def prompt(tiny_llama) -> list[int]:
    """A seed and the model's own greedy continuation, twice: the tokens it samples mostly
    occur in the prompt, so the n-gram proposer finds matches."""
    _, hf = tiny_llama
    seed = [5, 6, 7, 8]
    with torch.no_grad():
        ids = hf.generate(torch.tensor([seed]), max_new_tokens=20, do_sample=False)[0].tolist()
    return ids + ids


@pytest.fixture(scope="module")
def engines(tiny_llama):
    path, _ = tiny_llama
    def own(spec):
        return spec and {k: (path if v == "<target>" else v) for k, v in spec.items()}

    return {name: LLM(path, dtype="float32", block_size=4, kv_cache_memory="48MiB",
                      max_num_seqs=256, speculative_config=own(spec))
            for name, spec in SPECS.items()}


@pytest.mark.parametrize("params", list(PARAMS))
@pytest.mark.parametrize("spec", list(SPECS))
def test_sampled_paths_follow_the_exact_law(tiny_llama, prompt, engines, spec, params):
    _, hf = tiny_llama
    sp = SamplingParams(n=N, max_tokens=LENGTH, ignore_eos=True, seed=5, **PARAMS[params])
    exact = exact_paths(hf, prompt, sp)
    assert abs(sum(exact.values()) - 1) < 1e-9 and len(exact) >= 8
    llm = engines[spec]
    drafted = llm.engine.spec.stats.num_draft_tokens if llm.engine.spec else 0
    if spec == "lookup_first":  # the lookup proposes at batch 1 only: N requests, one by one
        one = [SamplingParams(max_tokens=LENGTH, ignore_eos=True, seed=5 + i, **PARAMS[params])
               for i in range(N)]
        samples = [llm.generate([prompt], p, use_tqdm=False)[0].outputs[0] for p in one]
    else:
        samples = llm.generate([prompt], sp, use_tqdm=False)[0].outputs
    counts = Counter(tuple(c.token_ids) for c in samples)
    assert len(samples) == N and set(counts) <= set(exact), set(counts) - set(exact)
    ok, chi2, limit = chi_square_ok(counts, exact, N)
    assert ok, (chi2, limit, counts.most_common(8))
    if spec != "off":
        assert llm.engine.spec.stats.num_draft_tokens > drafted  # speculation really ran
    if spec == "draft_sub_vocab":
        assert llm.engine.spec.proposer.model.vocab_limit == 128
    if spec == "lookup_first":  # both proposers served this request's samples
        assert llm.engine.spec.controller.kinds.keys() - {0} and 0 in llm.engine.spec.controller.kinds


def test_the_chi_square_check_rejects_a_wrong_law(tiny_llama, prompt):
    """The check has power: samples of the law without its penalties fail against the law
    with them."""
    _, hf = tiny_llama
    with_penalties = SamplingParams(max_tokens=LENGTH, **PARAMS["everything"])
    without = SamplingParams(max_tokens=LENGTH, **{**PARAMS["everything"],
                                                     "repetition_penalty": 1.0,
                                                     "frequency_penalty": 0.0,
                                                     "presence_penalty": 0.0})
    wrong = exact_paths(hf, prompt, without)
    g = torch.Generator().manual_seed(0)
    keys = list(wrong)
    draws = torch.multinomial(torch.tensor([wrong[k] for k in keys]), N, replacement=True,
                              generator=g)
    counts = Counter(keys[i] for i in draws.tolist())
    assert not chi_square_ok(counts, exact_paths(hf, prompt, with_penalties), N)[0]
