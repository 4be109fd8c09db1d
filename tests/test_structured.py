"""Structured outputs in the engine: every kind of constraint holds for greedy and sampled
decoding, n > 1, preemption and speculation (n-gram and draft); greedy output is the same with
speculation on and off; the sampled distribution under a constraint is the target's restricted
to the grammar and renormalised, with and without a draft (checked against transformers'
probabilities); bad constraints are ValueErrors naming the field; logit_bias."""
from __future__ import annotations

import json
import math
import re
from collections import Counter

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.sampling_params import StructuredOutputsParams as SO
from tests.helpers import make_tiny_model

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "maxItems": 2,
                                  "items": {"enum": ["cat", "dog"]}},
                         "score": {"type": "number", "minimum": -1, "maximum": 1}},
          "required": ["name", "age"], "additionalProperties": False}
CHOICES = ["yes", "no", "maybe so"]
REGEX = r"[0-9]{3}-[a-c]{2}"
GBNF = 'root ::= animal " and " animal\nanimal ::= "cat" | "dog" | "cow"'
LARK = 'start: "(" num ("," num)* ")"\nnum: /[1-9]/'


def check_schema(text: str) -> bool:
    obj = json.loads(text)
    assert set(obj) <= set(SCHEMA["properties"]) and {"name", "age"} <= set(obj)
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 6
    assert type(obj["age"]) is int and 0 <= obj["age"] <= 120
    assert all(p in ("cat", "dog") for p in obj.get("pets", [])) and len(obj.get("pets", [])) <= 2
    assert -1 <= obj.get("score", 0) <= 1
    return True


CASES = {
    "json": (SO(json=SCHEMA), check_schema),
    "json_object": (SO(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    "choice": (SO(choice=CHOICES), lambda t: t in CHOICES),
    "regex": (SO(regex=REGEX), lambda t: re.fullmatch(REGEX, t) is not None),
    "gbnf": (SO(grammar=GBNF), lambda t: re.fullmatch(r"(cat|dog|cow) and (cat|dog|cow)", t)),
    "lark": (SO(grammar=LARK), lambda t: re.fullmatch(r"\([1-9](,[1-9])*\)", t)),
}


@pytest.fixture(scope="module")
def chat_path(tmp_path_factory) -> str:
    """Tiny random Llama with the default model's real tokenizer (the grammar engine needs
    one): random logits exercise the masks far more than a trained model would."""
    from pagellm.models.loader import load_model_files

    tok = load_model_files(None).tokenizer
    path = tmp_path_factory.mktemp("tiny_structured")
    make_tiny_model(path, "llama", vocab_size=len(tok), max_position_embeddings=1024)
    tok.save_pretrained(path)
    return str(path)


KW = {"dtype": "float32", "kv_cache_memory": 2**22, "block_size": 4}
SPEC = {"off": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False,
                  "prompt_lookup_min": 1},
        "draft": {"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 1,
                  "adaptive": False}}
PROMPTS = ["Reply in the format asked: ", "yes yes no no maybe so yes no {\"name\": 1-a"]


@pytest.fixture(scope="module")
def engines(chat_path):
    return {name: LLM(chat_path, speculative_config=spec, **KW) for name, spec in SPEC.items()}


def _run(llm, so, temperature, n=1, seed=None, max_tokens=120, **kw):
    sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, n=n, seed=seed,
                        structured_outputs=so, **kw)
    return [c for o in llm.generate(PROMPTS, sp, use_tqdm=False) for c in o.outputs]


@pytest.mark.parametrize("spec", list(SPEC))
@pytest.mark.parametrize("case", list(CASES))
def test_constraint_holds_greedy_and_sampled(engines, spec, case):
    so, valid = CASES[case]
    llm = engines[spec]
    greedy = _run(llm, so, 0.0)
    # unmasked first draws (plain sampling) and masked-first truncating rows (top-p)
    for comp in greedy + _run(llm, so, 1.0, n=3, seed=7) + _run(llm, so, 0.8, seed=9, top_p=0.9):
        # any JSON object is unbounded: a random model may still be writing one at max_tokens;
        # what it wrote must then be a start the grammar allows
        if case == "json_object" and comp.finish_reason == "length":
            fresh = llm.engine.structured.constraint(so)
            assert fresh.valid_prefix(comp.token_ids) == len(comp.token_ids), comp.text
            # not yet complete (a complete object would have ended the sequence with "stop")
            assert fresh.matcher.consume_tokens(comp.token_ids) and not fresh.is_stopped
            continue
        assert comp.finish_reason == "stop", (comp.text, comp.finish_reason)
        assert valid(comp.text), comp.text
    if spec != "off":  # greedy output is the same with speculation
        assert [c.token_ids for c in greedy] == [c.token_ids for c in _run(engines["off"], so, 0.0)]


def test_speculation_proposes_and_is_cut_at_the_grammar(engines):
    """Both proposers speculate under a constraint; n-gram proposals that the grammar forbids
    are cut before verification (so none is verified and rejected for breaking it)."""
    for name in ("ngram", "draft"):
        llm = engines[name]
        before = llm.engine.spec.stats.num_draft_tokens
        _run(llm, SO(json=SCHEMA), 0.0)
        assert llm.engine.spec.stats.num_draft_tokens > before, name
    from pagellm.spec_decode.base import Proposal
    from pagellm.spec_decode.decoder import _within_grammar

    llm = engines["off"]
    tok = llm.get_tokenizer()
    seq = type("S", (), {})()
    seq.constraint = llm.engine.structured.constraint(SO(regex=REGEX))
    good, bad = tok.encode("123-a", add_special_tokens=False), tok.encode("x", add_special_tokens=False)
    cut = _within_grammar(seq, Proposal(good + bad + good, torch.ones(len(good) * 2 + 1, 4)))
    assert cut.token_ids == good and cut.probs.shape[0] == len(good)


def test_n_samples_preemption_and_prefix_cache_keep_the_constraint(chat_path):
    """A pool so small that constrained samples are preempted and recomputed: the grammar
    state survives (it follows emitted tokens, not KV), every output validates."""
    for spec in ("off", "draft"):
        llm = LLM(chat_path, speculative_config=SPEC[spec], **{**KW, "kv_cache_memory": 2048 * 40})
        so, valid = CASES["json"]
        outs = _run(llm, so, 1.0, n=4, seed=3)
        assert llm.engine.scheduler.num_preemptions > 0
        for comp in outs:
            assert comp.finish_reason == "stop" and valid(comp.text), comp.text



def test_draft_rounds_under_a_grammar_get_full_logits(engines, monkeypatch):
    """A draft's shadow sequences carry no constraint of their own: its forwards for a greedy
    request under a grammar must still ask for full logits (the proposals are the argmax of
    the masked logits, which an argmax-only head does not give), and its unconstrained greedy
    rows may take the argmax-only head."""
    llm = engines["draft"]
    runner = llm.engine.spec.proposer.runner
    seen = []
    forward = runner.forward

    def spy(*args, **kw):
        seen.append(kw.get("argmax_only", False))
        return forward(*args, **kw)

    monkeypatch.setattr(runner, "forward", spy)
    _run(llm, SO(json=SCHEMA), 0.0, max_tokens=20)
    assert seen and not any(seen)
    seen.clear()
    llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                 use_tqdm=False)
    assert any(seen)

# ---- the sampled distribution -----------------------------------------------------------------
def _exact_paths(chat_path, llm, prompt_ids, so, top_k=0,
                 logit_bias=None) -> dict[tuple[int, ...], float]:
    """Every token path the grammar allows to its end, with its probability under the target
    restricted to the mask and renormalised at each position (transformers' float32 logits),
    then to the top_k most likely allowed tokens (the mask comes first)."""
    import transformers

    from pagellm.structured import batch_masks

    hf = transformers.AutoModelForCausalLM.from_pretrained(chat_path, dtype=torch.float32).eval()
    paths: dict[tuple[int, ...], float] = {}

    def walk(prefix: list[int], prob: float, constraint) -> None:
        if constraint.is_stopped:
            paths[tuple(prefix)] = prob
            return
        (mask,) = batch_masks([(constraint, [])])
        with torch.no_grad():
            logits = hf(torch.tensor([prompt_ids + prefix])).logits[0, -1]
        for t, b in (logit_bias or {}).items():
            logits[t] += b
        masked = logits + mask.bias[0]
        if top_k:
            masked[masked < masked.topk(top_k).values[-1]] = float("-inf")
        p = masked.softmax(-1)
        for t in torch.nonzero(p > 0).flatten().tolist():
            if t in llm.engine.eos_token_ids:
                paths[tuple(prefix)] = paths.get(tuple(prefix), 0.0) + prob * float(p[t])
                continue
            child = llm.engine.structured.constraint(so)
            assert child.matcher.consume_tokens(prefix + [t])
            walk(prefix + [t], prob * float(p[t]), child)

    walk([], 1.0, llm.engine.structured.constraint(so))
    return paths


@pytest.mark.parametrize("spec,top_k", [("off", 0), ("draft", 0), ("ngram", 0), ("off", 4),
                                        ("draft", 4)])
def test_sampled_paths_follow_the_masked_target_distribution(chat_path, engines, spec, top_k):
    """Sampled under a choice constraint (each choice has several tokenizations), the emitted
    token paths follow the exact distribution: transformers' p masked and renormalised at each
    position (then cut to its top-k). Plain rows draw unmasked first and compute the mask only
    when the grammar forbids the draw (rejection sampling), except truncating rows, masked
    first; the draft (one layer of the target: q far from p) and n-gram proposals are verified
    under the same masks, so their rejection sampling must give the same law."""
    so = SO(choice=["yes", "no", "maybe"])
    llm = engines[spec]
    tok = llm.get_tokenizer()
    prompt = tok.encode("yes no maybe yes no maybe yes")
    # With top-k, "yes" and "no" are pushed into the unmasked top-k beside forbidden tokens:
    # truncating before masking would then never emit "maybe"; masking first does.
    bias = ({tok.convert_tokens_to_ids(w): 1.5 for w in ("yes", "no")} if top_k else None)
    exact = _exact_paths(chat_path, llm, prompt, so, top_k, bias)
    assert abs(sum(exact.values()) - 1) < 1e-4 and len(exact) >= (3 if top_k else 6)
    n = 1200
    sp = SamplingParams(temperature=1.0, top_k=top_k, max_tokens=8, n=n, seed=11,
                        structured_outputs=so, logit_bias=bias)
    (out,) = llm.generate([prompt], sp, use_tqdm=False)
    counts = Counter(tuple(c.token_ids) for c in out.outputs)
    eos = llm.engine.eos_token_ids
    counts = Counter({tuple(t for t in k if t not in eos): v for k, v in counts.items()})
    assert set(counts) <= set(exact), set(counts) - set(exact)
    # chi-square over paths with expected count >= 5 (the rest pooled)
    big = [k for k, p in exact.items() if p * n >= 5]
    obs = [counts.get(k, 0) for k in big] + [n - sum(counts.get(k, 0) for k in big)]
    exp = [exact[k] * n for k in big] + [n * (1 - sum(exact[k] for k in big))]
    cells = [(o, e) for o, e in zip(obs, exp) if e > 0]
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    # p < 1e-4 for a chi-square of `dof` degrees (Wilson-Hilferty approximation)
    z = 3.72
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < limit, (chi2, limit, list(zip(obs, exp)))
    if spec == "draft":
        assert llm.engine.spec.stats.num_draft_tokens > 0


# ---- errors and logit_bias --------------------------------------------------------------------
@pytest.mark.parametrize("so,field", [
    (dict(json={"type": "object", "properties": {"a": {"type": "nope"}}}), "json"),
    (dict(json="{not json"), "json"),
    (dict(regex="a(b"), "regex"),
    (dict(grammar="start: undefined_rule"), "grammar"),
    (dict(grammar='root ::= "a'), "grammar"),
])
def test_bad_constraint_is_a_value_error_naming_the_field(engines, so, field):
    llm = engines["off"]
    with pytest.raises(ValueError, match=rf"structured_outputs\.{field}"):
        llm.generate("x", SamplingParams(structured_outputs=SO(**so)), use_tqdm=False)
    assert not llm.engine.requests
    out = llm.generate("x", SamplingParams(max_tokens=3, structured_outputs=SO(choice=["ok"])),
                       use_tqdm=False)
    assert out[0].outputs[0].text == "ok"


@pytest.mark.parametrize("kw,match", [
    (dict(structured_outputs={"json": SCHEMA, "regex": "a"}), "exactly one"),
    (dict(structured_outputs={"choice": []}), "choice"),
    (dict(structured_outputs={"colour": "red"}), "unknown fields"),
    (dict(structured_outputs=SO(regex="a"), guided_decoding={"regex": "a"}), "not both"),
    (dict(logit_bias={5: 101}), "logit_bias"),
    (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"),
])
def test_bad_sampling_fields(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_guided_decoding_dict_is_accepted():
    sp = SamplingParams(guided_decoding={"guided_regex": "a+"})
    assert sp.structured_outputs == SO(regex="a+") and sp.guided_decoding is None


def test_logit_bias(engines):
    llm = engines["off"]
    prompt = [5, 17, 33, 4]
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    first = base[0].outputs[0].token_ids[0]
    banned = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4,
                                                   logit_bias={first: -100}), use_tqdm=False)
    assert first not in banned[0].outputs[0].token_ids[:1]
    forced = llm.generate([prompt], SamplingParams(temperature=1.0, seed=0, max_tokens=4,
                                                   logit_bias={"77": 100}), use_tqdm=False)
    assert forced[0].outputs[0].token_ids == [77] * 4
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([prompt], SamplingParams(logit_bias={10**7: 1}), use_tqdm=False)


def test_grammar_mask_edge_rules():
    """The grammar beats min_tokens (a row where it allows only the banned end token keeps
    that token); a row where it allows nothing is left unmasked for the engine to end; rows
    without a grammar are untouched."""
    from pagellm.sampling.sampler import SamplingRow, processed_logits

    logits = torch.randn(3, 8)
    only_eos = torch.full((8,), float("-inf"))
    only_eos[2] = 0.0
    nothing = torch.full((8,), float("-inf"))
    sp = SamplingParams(temperature=0, min_tokens=5)
    rows = [SamplingRow(sp, [1], [], None, 2, grammar_bias=only_eos),
            SamplingRow(sp, [1], [], None, 2, grammar_bias=nothing),
            SamplingRow(sp, [1], [], None, 2)]
    out = processed_logits(logits, rows)
    assert out[0].argmax() == 2 and torch.isinf(out[0]).sum() == 7
    assert torch.equal(out[1], logits[1])
    expected = logits[2].clone()
    expected[2] = float("-inf")  # min_tokens bans the end token where no grammar overrides
    assert torch.equal(out[2], expected)
