"""SamplingParams validation, the sampler on handmade logits (exact masks and formulas, and a
statistical check of the sampled distribution), stop strings, and sampling on a tiny engine."""
from __future__ import annotations

import math

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.engine.detokenizer import find_stop_string
from pagellm.outputs import CompletionOutput
from pagellm.sampling.sampler import SamplingRow, logprobs_of, processed_logits, sample
from pagellm.sequence import Sequence
from tests.helpers import make_tiny_model


# ---- SamplingParams validation ------------------------------------------------------------
INVALID = [
    ("n", 0), ("n", -1), ("n", 1.5), ("n", True),
    ("temperature", -0.1), ("temperature", "hot"), ("temperature", float("nan")),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5),
    ("top_k", -2), ("top_k", 2.5),
    ("min_p", -0.01), ("min_p", 1.5),
    ("presence_penalty", 2.5), ("presence_penalty", -2.1),
    ("frequency_penalty", 3), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", float("inf")),
    ("temperature", float("inf")), ("presence_penalty", float("nan")),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 2.0),
    ("min_tokens", -1),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 1.5),
    ("seed", "abc"), ("seed", 1.5),
    ("stop", ""), ("stop", ["ok", ""]), ("stop", [3]), ("stop", 5),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("stop_token_ids", 5),
    ("stop_token_ids", [True]),
]


@pytest.mark.parametrize("field,value", INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_raises_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_names_min_tokens():
    with pytest.raises(ValueError, match=r"^min_tokens "):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_valid_edge_values_are_accepted():
    p = SamplingParams(n=3, temperature=0, top_p=1.0, top_k=-1, min_p=1.0, presence_penalty=-2,
                       frequency_penalty=2, repetition_penalty=0.5, max_tokens=1, min_tokens=1,
                       logprobs=20, seed=0, stop="x", stop_token_ids=(3, 4))
    assert p.top_k == 0 and p.greedy and p.stop_strings == ["x"] and p.stop_token_ids == [3, 4]
    assert SamplingParams(stop=["a", "b"], logprobs=0, max_tokens=None).stop_strings == ["a", "b"]
    assert not SamplingParams(temperature=0.5).greedy


# ---- sampler on handmade logits -----------------------------------------------------------
def row(params: SamplingParams, prompt=(), output=(), seed=0, eos=None) -> SamplingRow:
    return SamplingRow(params, list(prompt), list(output), torch.Generator().manual_seed(seed), eos)


def draws(logits: list[float], params: SamplingParams, n: int = 4000,
          seed: int = 0) -> torch.Tensor:
    """n independent draws (one generator, advanced by each row) -> counts per token."""
    gen = torch.Generator().manual_seed(seed)
    rows = [SamplingRow(params, [], [], gen, None) for _ in range(n)]
    tokens = sample(torch.tensor([logits]).repeat(n, 1), rows).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=len(logits)).float()


def finite(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits)).flatten().tolist())


PROBS = [0.5, 0.25, 0.15, 0.1]
LOGITS = [math.log(p) for p in PROBS]


def test_greedy_is_argmax_and_top_k_1_equals_greedy():
    torch.manual_seed(0)
    logits = torch.randn(16, 50) * 3
    greedy = sample(logits, [row(SamplingParams(temperature=0))] * 16).token_ids
    assert greedy == logits.argmax(-1).tolist()
    for seed in range(5):
        top1 = sample(logits, [row(SamplingParams(temperature=1.3, top_k=1), seed=seed + i)
                               for i in range(16)]).token_ids
        assert top1 == greedy


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 49152])
def test_native_argmax_is_torchs_with_ties_nans_and_infinities(vocab):
    """argmax_rows (kernels/cpu_sample.c) gives torch.argmax's index: the first maximum, the
    first NaN where a row has one, 0 for a row of -inf."""
    from pagellm.kernels import native
    from pagellm.sampling.sampler import argmax_rows

    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(8, vocab, generator=g)
    x[1] = float("-inf")
    x[2, vocab // 2:] = x[2].max() + 1  # a tie: the first of the equal maxima
    x[3, vocab - 1] = float("nan")  # NaN in the scalar tail (or the only value)
    x[4, vocab // 3] = float("nan")
    x[4, vocab - 1] = float("nan")  # two NaNs: the first
    x[5] = 0.0
    x[5, vocab // 2] = -0.0
    x[6, vocab - 1] = float("inf")
    if not native.available():
        pytest.skip("no C compiler on this machine")
    assert argmax_rows(x).tolist() == x.argmax(-1).tolist()


def test_greedy_rows_read_the_raw_logits_and_leave_them_alone():
    """Rows processed_logits does not change get the raw logits back, not a copy; any row
    that changes (here a penalty) gets a copy, and the raw logits stay as they were."""
    logits = torch.randn(3, 20)
    before = logits.clone()
    plain = [row(SamplingParams(temperature=0))] * 3
    assert processed_logits(logits, plain) is logits
    penalized = plain[:2] + [row(SamplingParams(temperature=0, presence_penalty=1.0),
                                 output=[int(logits[2].argmax())])]
    proc = processed_logits(logits, penalized)
    assert proc is not logits and torch.equal(logits, before)
    assert proc[2, int(logits[2].argmax())] == logits[2].max() - 1.0


@pytest.mark.parametrize("kwargs,support", [
    (dict(top_p=0.7), {0, 1}),  # 0.5 < 0.7 <= 0.75: the smallest nucleus is two tokens
    (dict(top_p=0.8), {0, 1, 2}),
    (dict(top_p=0.4), {0}),
    (dict(top_p=0.75), {0, 1}),  # reaching top_p exactly is enough (0.5 + 0.25 in float32)
    (dict(top_p=0.5), {0}),
    (dict(top_k=2), {0, 1}),
    (dict(top_k=3, top_p=0.6), {0, 1}),  # top-p over the renormalized top 3
    (dict(min_p=0.25), {0, 1, 2}),  # threshold 0.125
    (dict(min_p=0.45), {0, 1}),  # threshold 0.225
    (dict(), {0, 1, 2, 3}),
])
def test_truncation_keeps_exactly_the_expected_tokens(kwargs, support):
    params = SamplingParams(temperature=1.0, **kwargs)
    assert finite(processed_logits(torch.tensor([LOGITS]), [row(params)])[0]) == support
    counts = draws(LOGITS, params)
    seen = set(torch.nonzero(counts).flatten().tolist())
    assert seen == support
    # Within the support, the draws follow the renormalized distribution.
    target = torch.tensor([PROBS[i] if i in support else 0.0 for i in range(4)])
    target /= target.sum()
    assert 0.5 * (counts / counts.sum() - target).abs().sum() < 0.03


def test_top_k_without_top_p_keeps_exactly_k_even_when_one_token_dominates():
    # Regression: a float32 cumsum of the top-p step reached 1.0 after the first token and masked
    # the rest although top_p was 1 (off); likewise for a row batched with a top_p row.
    logits = torch.tensor([[30.0, 0.0, 0.0, 0.0, 0.0]] * 2)
    out = processed_logits(logits, [row(SamplingParams(top_k=3)),
                                    row(SamplingParams(top_p=0.5))])
    assert finite(out[0]) == {0, 1, 2}
    out = processed_logits(logits, [row(SamplingParams()), row(SamplingParams(top_p=0.5))])
    assert finite(out[0]) == {0, 1, 2, 3, 4} and finite(out[1]) == {0}


def test_sampled_histogram_matches_softmax_over_temperature():
    logits = [1.0, 0.5, 0.0, -0.5, -1.0, 2.0]
    temperature = 0.7
    counts = draws(logits, SamplingParams(temperature=temperature), n=20000, seed=1)
    empirical = counts / counts.sum()
    target = torch.softmax(torch.tensor(logits) / temperature, -1)
    wrong = torch.softmax(torch.tensor(logits), -1)  # what ignoring the temperature would give
    tv = 0.5 * (empirical - target).abs().sum()
    assert tv < 0.015, tv
    assert 0.5 * (target - wrong).abs().sum() > 0.08  # the bound can tell them apart
    # Pearson chi-square, 5 degrees of freedom: 20.5 is the 0.999 quantile.
    chi2 = float(((counts - 20000 * target) ** 2 / (20000 * target)).sum())
    assert chi2 < 20.5, chi2


def test_same_generator_seed_same_draws():
    params = SamplingParams(temperature=1.0)
    logits = torch.zeros(1, 1000)
    a = [sample(logits, [row(params, seed=7)]).token_ids[0] for _ in range(3)]
    b = [sample(logits, [row(params, seed=8)]).token_ids[0] for _ in range(3)]
    assert a[0] == a[1] == a[2] and b[0] == b[1] == b[2] and a[0] != b[0]


def test_penalties_match_the_formulas():
    torch.manual_seed(0)
    logits = torch.randn(1, 8) * 2
    logits[0, 1], logits[0, 2] = 1.5, -1.5  # one positive and one negative seen logit
    prompt, output = [1, 2, 2], [2, 3, 3, 5]
    params = SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.4,
                            presence_penalty=0.6)
    got = processed_logits(logits, [row(params, prompt, output)])[0]
    want = logits[0].clone()
    for t in {1, 2, 3, 5}:  # prompt and output tokens: repetition penalty
        want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
    for t, count in {2: 1, 3: 2, 5: 1}.items():  # output tokens only: frequency and presence
        want[t] -= 0.4 * count + 0.6
    torch.testing.assert_close(got, want)
    # Temperature divides after the penalties.
    hot = SamplingParams(temperature=2.0, repetition_penalty=1.3, frequency_penalty=0.4,
                         presence_penalty=0.6)
    torch.testing.assert_close(processed_logits(logits, [row(hot, prompt, output)])[0], want / 2)
    # No penalty: untouched.
    plain = processed_logits(logits, [row(SamplingParams(temperature=0), prompt, output)])[0]
    torch.testing.assert_close(plain, logits[0])


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0]])
    p = SamplingParams(temperature=0, presence_penalty=0.5)
    assert sample(logits, [row(p, [], [])]).token_ids == [1]
    assert sample(logits, [row(p, [], [1])]).token_ids == [2]
    r = SamplingParams(temperature=0, repetition_penalty=1.1)
    assert sample(logits, [row(r, [1], [])]).token_ids == [2]  # 3.0 / 1.1 < 2.9


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.tensor([[0.0, 1.0, 5.0, 0.0, 4.0, 3.0]])  # eos 2 first, stop id 4 second
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[4])
    early = processed_logits(logits, [row(params, output=[0, 0], eos=2)])[0]
    assert early[2] == -math.inf and early[4] == -math.inf
    assert sample(logits, [row(params, output=[0, 0], eos=2)]).token_ids == [5]
    assert sample(logits, [row(params, output=[0, 0, 0], eos=2)]).token_ids == [2]
    # Every end token of a model that has several.
    masked = processed_logits(logits, [row(params, output=[0], eos={2, 5})])[0]
    assert finite(masked) == {0, 1, 3}
    sampled = SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[4])
    gen = torch.Generator().manual_seed(0)
    toks = sample(logits.repeat(500, 1), [SamplingRow(sampled, [], [0], gen, 2)] * 500).token_ids
    assert not {2, 4} & set(toks)


def test_logprobs_are_raw_sorted_top_n():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5, 0.7]])
    raw = torch.log_softmax(logits[0], -1)
    res = sample(logits, [row(SamplingParams(temperature=0.5, top_k=1, logprobs=3,
                                             repetition_penalty=1.5), prompt=[1])])
    lp, top = res.logprobs[0]
    assert res.token_ids == [3]  # the penalty moved the choice; logprobs stay the model's
    assert lp == pytest.approx(float(raw[3]))
    assert list(top) == [1, 3, 4]
    assert list(top.values()) == pytest.approx(raw[[1, 3, 4]].tolist())
    assert logprobs_of(raw.unsqueeze(0), [2], [0]) == [(pytest.approx(float(raw[2])), {})]
    assert sample(logits, [row(SamplingParams())]).logprobs == [None]


# ---- stop strings (detokenizer) -----------------------------------------------------------
def seq_with_text(text: str, stop, include=False) -> Sequence:
    seq = Sequence(0, "r", 0, [1], SamplingParams(stop=stop, include_stop_str_in_output=include),
                   None)
    seq.text = text
    return seq


@pytest.mark.parametrize("text,delta,stop,include,found,after", [
    ("hello world", 6, ["wor"], False, "wor", "hello "),
    ("hello world", 6, ["wor"], True, "wor", "hello wor"),
    ("hello world", 1, ["wor"], False, None, "hello world"),  # lies wholly in old text
    # After min_tokens, an "ab" wholly in old text must not stop, whatever other strings exist.
    ("xxabc", 1, ["ab", "zzzzzzzz"], False, None, "xxabc"),
    ("xxabc", 1, ["ab", "bc"], False, "bc", "xxa"),
    ("xabcd", 3, ["cd", "bc"], False, "bc", "xa"),  # the earliest in the text wins
])
def test_find_stop_string(text, delta, stop, include, found, after):
    seq = seq_with_text(text, stop, include)
    assert find_stop_string(seq, delta) == found
    assert seq.text == after


def test_stable_text_len_holds_back_a_possible_stop_string():
    def stable(text, stop, finished=False):  # what a stream reads off an engine output
        return CompletionOutput(0, text, [], "stop" if finished else None,
                                stop_strings=stop).stable_text_len

    assert stable("hello wor", ["world"]) == len("hello ")
    assert stable("hello w", ["xx", "world", "ww"]) == len("hello ")
    assert stable("hello", ["world"]) == 5
    assert stable("hello wor", ["world"], finished=True) == 9


# ---- on a tiny engine ---------------------------------------------------------------------
@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny models run faster on one thread, and much faster when the cores are shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_tokenizer():
    """A small byte-level BPE tokenizer (printable ASCII + a few merges), built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    space, newline = "\u0120", "\u010a"  # GPT-2's byte-level names for b" " and b"\n"
    chars = [newline, space] + [chr(b) for b in range(33, 127)]
    merges = [(space, "t"), ("h", "e"), (space + "t", "he"), ("i", "n"), ("e", "r"),
              (space, "a"), ("o", "n"), ("a", "t"), (space, "s"), ("e", "n")]
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"] + chars
                                        + [a + b for a, b in merges])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


@pytest.mark.parametrize("clean_up", [False, True])
def test_the_detokenizers_decode_is_the_tokenizers_own(clean_up):
    """append_text decodes with the Rust backend where that is the same text (no clean-up of
    spaces), else with tokenizer.decode: the same strings either way, special tokens
    skipped or kept."""
    from pagellm.engine.detokenizer import _decode_fn

    tok = make_tokenizer()
    tok.clean_up_tokenization_spaces = clean_up
    decode = _decode_fn(tok)
    assert (decode == tok.backend_tokenizer.decode) is (not clean_up)
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 5, 17):
        for _ in range(40):
            ids = torch.randint(0, len(tok), (n,), generator=g).tolist()
            for skip in (False, True):
                assert decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)


@pytest.fixture(scope="module")
def text_llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_text")
    tokenizer = make_tokenizer()
    make_tiny_model(path, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(path)
    return LLM(str(path), dtype="float32", kv_cache_memory=2**20, block_size=4)


PROMPT = "the cat sat on the mat"


def run(llm: LLM, prompts, **params):
    outs = llm.generate(prompts, SamplingParams(**params), use_tqdm=False)
    return [o.outputs for o in outs]


def test_stop_strings_cut_the_text_and_never_leak(text_llm):
    tok = text_llm.get_tokenizer()
    (first,), = run(text_llm, [PROMPT], temperature=0, max_tokens=40, ignore_eos=True)
    text = first.text
    assert text == tok.decode(first.token_ids, skip_special_tokens=True) and len(text) > 12
    for start in (5, 9):
        stop = text[start:start + 3]
        cut = text.find(stop)
        for include in (False, True):
            (out,), = run(text_llm, [PROMPT], temperature=0, max_tokens=40, ignore_eos=True,
                          stop=[stop], include_stop_str_in_output=include)
            assert out.finish_reason == "stop" and out.stop_reason == stop
            assert out.text == (text[: cut + len(stop)] if include else text[:cut])
            # Generation stopped at the token that completed the stop string.
            ids = out.token_ids
            assert ids == first.token_ids[: len(ids)]
            assert stop in tok.decode(ids, skip_special_tokens=True)
            assert stop not in tok.decode(ids[:-1], skip_special_tokens=True)
    # Several stop strings: the one that appears first in the text wins.
    early, late = text[9:12], text[5:8]
    first_stop = early if text.find(early) < text.find(late) else late
    (out,), = run(text_llm, [PROMPT], temperature=0, max_tokens=40, ignore_eos=True,
                  stop=[late, early])
    assert out.stop_reason == first_stop and out.text == text[: text.find(first_stop)]
    # Streaming through engine.step(): no intermediate output ever contains the stop string.
    stop = text[9:12]
    eng = text_llm.engine
    eng.add_request("stream", PROMPT, SamplingParams(temperature=0, max_tokens=40, stop=stop))
    texts = []
    while eng.has_unfinished_requests():
        texts += [o.outputs[0].text for o in eng.step()]
    assert all(stop not in t for t in texts) and texts[-1] == text[: text.find(stop)]


def test_same_seed_same_tokens_in_any_batch(text_llm):
    params = dict(temperature=1.0, max_tokens=16, ignore_eos=True)
    (alone,), = run(text_llm, [PROMPT], seed=123, **params)
    outs = text_llm.generate(
        ["hello there", PROMPT, PROMPT],
        [SamplingParams(seed=5, **params), SamplingParams(seed=123, **params),
         SamplingParams(seed=124, **params)], use_tqdm=False)
    batched, other_seed = outs[1].outputs[0], outs[2].outputs[0]
    assert batched.token_ids == alone.token_ids and batched.text == alone.text
    assert other_seed.token_ids != alone.token_ids
    # Unseeded requests draw from the engine's generator: two runs differ.
    (a,), = run(text_llm, [PROMPT], **params)
    (b,), = run(text_llm, [PROMPT], **params)
    assert a.token_ids != b.token_ids


def test_n_samples_give_n_distinct_outputs(text_llm):
    (outs,) = run(text_llm, [PROMPT], n=3, temperature=1.0, seed=9, max_tokens=12, ignore_eos=True)
    assert [o.index for o in outs] == [0, 1, 2]
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) == 3
    (again,) = run(text_llm, [PROMPT], n=3, temperature=1.0, seed=9, max_tokens=12,
                   ignore_eos=True)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    (greedy,) = run(text_llm, [PROMPT], n=2, temperature=0, max_tokens=12, ignore_eos=True)
    assert greedy[0].token_ids == greedy[1].token_ids


def test_logprobs_top_n_present_and_sorted(text_llm):
    for params in (dict(temperature=0), dict(temperature=1.0, seed=3)):
        (out,), = run(text_llm, [PROMPT], max_tokens=10, logprobs=4, ignore_eos=True, **params)
        assert len(out.logprobs) == len(out.token_ids) == 10
        total = 0.0
        for token, lps in zip(out.token_ids, out.logprobs):
            assert next(iter(lps)) == token  # the sampled token comes first
            rest = [v for t, v in lps.items() if t != token]
            assert len(lps) in (4, 5) and len(rest) in (3, 4)
            assert rest == sorted(rest, reverse=True) and all(v <= 0 for v in lps.values())
            if len(lps) == 5:  # sampled token outside the top 4: it ranks below all of them
                assert lps[token] <= min(rest)
            if params["temperature"] == 0:
                assert lps[token] == pytest.approx(max(lps.values()))
            total += lps[token]
        assert out.cumulative_logprob == pytest.approx(total)
    (plain,), = run(text_llm, [PROMPT], max_tokens=3)
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_eos_stop_token_ids_max_tokens_and_min_tokens(tiny_llama, tmp_path):
    path, _ = tiny_llama
    prompt = [5, 17, 33, 4, 90, 12, 7]
    greedy = dict(temperature=0, max_tokens=12)
    llm = LLM(path, dtype="float32", kv_cache_memory=2**20, block_size=4)
    (ref,), = run(llm, [prompt], ignore_eos=True, **greedy)
    ids = ref.token_ids
    assert len(ids) == 12 and ref.finish_reason == "length"
    k = next(i for i in range(2, 10) if ids[i] not in ids[:i])
    # stop_token_ids: the stop token is the last output token; stop_reason is the id.
    (out,), = run(llm, [prompt], stop_token_ids=[ids[k]], **greedy)
    assert out.token_ids == ids[: k + 1] and out.finish_reason == "stop"
    assert out.stop_reason == ids[k]
    (out,), = run(llm, [prompt], temperature=0, max_tokens=5, ignore_eos=True)
    assert out.token_ids == ids[:5] and out.finish_reason == "length"
    # The same weights with ids[k] as EOS.
    eos_path = tmp_path / "eos"
    make_tiny_model(eos_path, eos_token_id=ids[k])
    eos_llm = LLM(str(eos_path), dtype="float32", kv_cache_memory=2**20, block_size=4)
    (out,), = run(eos_llm, [prompt], **greedy)
    assert out.token_ids == ids[: k + 1] and out.finish_reason == "stop"
    assert out.stop_reason is None
    (out,), = run(eos_llm, [prompt], ignore_eos=True, **greedy)
    assert out.token_ids == ids and out.finish_reason == "length"
    (out,), = run(eos_llm, [prompt], min_tokens=k + 2, **greedy)
    assert out.token_ids[:k] == ids[:k] and ids[k] not in out.token_ids[: k + 2]
    assert len(out.token_ids) >= k + 2


def test_stop_token_id_past_the_vocabulary_is_refused_at_add(tiny_llama):
    """With min_tokens > 0 an id past the vocabulary was masked inside the step, which raised
    and failed every sequence of the batch; now add_request refuses it, the others run on."""
    path, _ = tiny_llama
    llm = LLM(path, dtype="float32", kv_cache_memory=2**20, block_size=4)
    eng = llm.engine
    eng.add_request("good", [5, 17, 33], SamplingParams(temperature=0, max_tokens=4))
    with pytest.raises(ValueError, match=r"^stop_token_ids out of range \[0, 256\): \[256\]"):
        eng.add_request("bad", [5, 17, 33], SamplingParams(min_tokens=2, stop_token_ids=[3, 256]))
    assert "bad" not in eng.requests
    done = []
    while eng.has_unfinished_requests():
        done += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in done] == ["good"] and len(done[0].outputs[0].token_ids) == 4


def test_min_tokens_masks_every_end_token_the_config_lists(tiny_llama, tmp_path):
    path, _ = tiny_llama
    prompt = [5, 17, 33, 4, 90, 12, 7]
    llm = LLM(path, dtype="float32", kv_cache_memory=2**20, block_size=4)
    (ref,), = run(llm, [prompt], temperature=0, max_tokens=12, ignore_eos=True)
    ids = ref.token_ids
    k = next(i for i in range(2, 10) if ids[i] not in ids[:i] and ids[i] != 2)
    eos_path = tmp_path / "eos_list"
    make_tiny_model(eos_path, eos_token_id=[2, ids[k]])  # same weights, two end tokens
    eos_llm = LLM(str(eos_path), dtype="float32", kv_cache_memory=2**20, block_size=4)
    (out,), = run(eos_llm, [prompt], temperature=0, max_tokens=12)
    assert out.token_ids == ids[: k + 1] and out.finish_reason == "stop"  # either one ends it
    (out,), = run(eos_llm, [prompt], temperature=0, max_tokens=12, min_tokens=k + 2)
    assert ids[k] not in out.token_ids[: k + 2]
