"""Fill-in-the-middle: the prompt (pagellm.infill), OpenAI's `suffix` on /v1/completions, and
llama.cpp's /infill with its own stop conditions.

A tiny random Llama with the default model's tokenizer plus Qwen2.5-Coder's FIM tokens keeps
the text paths real; each answer is checked against the same prompt ids sent as a plain
completion (greedy), so the test fails if the prompt is built otherwise than documented. The
default model (no FIM tokens) must refuse. tests/test_real_models.py fills a gap with the real
Qwen2.5-Coder file."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pagellm import LLM
from pagellm.infill import ExtraFile, fim_tokens, fit_infill, infill_prompt
from pagellm.server import llama_cpp as infill_route
from tests.test_server import (ENGINE_KW, MODEL, post, running_server, sse_events, tiny_path,
                               wait_idle)

FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>",
       "<|file_sep|>"]
__all__ = ["tiny_path"]  # the fixture, imported for the no-FIM server


@pytest.fixture(scope="module")
def fim_tokenizer():
    from pagellm.models.loader import load_model_files

    tok = load_model_files(None).tokenizer
    tok.add_special_tokens({"additional_special_tokens": FIM})
    return tok


@pytest.fixture(scope="module")
def fim_server(tmp_path_factory, fim_tokenizer):
    from tests.helpers import make_tiny_model

    path = tmp_path_factory.mktemp("tiny_fim")
    make_tiny_model(path, "llama", vocab_size=len(fim_tokenizer), max_position_embeddings=4096)
    fim_tokenizer.save_pretrained(path)
    with running_server(LLM(str(path), **ENGINE_KW)) as s:
        yield s


@pytest.fixture
def srv(fim_server):
    yield fim_server
    wait_idle(fim_server)


def ids_of(tok, *names):
    return [tok.convert_tokens_to_ids(n) for n in names]


# ---- the prompt ------------------------------------------------------------------------------
def test_the_prompt_is_prefix_suffix_middle(fim_tokenizer):
    tok = fim_tokenizer
    fim = fim_tokens(tok)
    pre, suf, mid, _, repo, sep = ids_of(tok, *FIM)
    assert (fim.prefix, fim.suffix, fim.middle, fim.repo_name, fim.file_sep) == (
        pre, suf, mid, repo, sep)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    ids = infill_prompt(tok, fim, "def f(x):\n    return ", "\n\nprint(f(2))\n")
    assert ids == [pre, *enc("def f(x):\n    return "), suf, *enc("\n\nprint(f(2))\n"), mid]
    # repository form: the repo's name, each file after a separator, then the edited file's name
    files = [ExtraFile("a.py", "A = 1\n"), ExtraFile("b.py", "B = 2\n")]
    ids = infill_prompt(tok, fim, "x = ", "", files, filename="c.py", repo="demo")
    assert ids == [repo, *enc("demo\n"), sep, *enc("a.py\nA = 1\n"), sep, *enc("b.py\nB = 2\n"),
                   sep, *enc("c.py\n"), pre, *enc("x = "), suf, mid]
    assert tok.decode(ids) == ("<|repo_name|>demo\n<|file_sep|>a.py\nA = 1\n<|file_sep|>b.py\n"
                               "B = 2\n<|file_sep|>c.py\n<|fim_prefix|>x = <|fim_suffix|>"
                               "<|fim_middle|>")


def test_other_families_and_models_without_fim_tokens(fim_tokenizer):
    from pagellm.models.loader import load_model_files

    assert fim_tokens(load_model_files(None).tokenizer) is None  # the default model
    assert fim_tokens(None) is None
    tok = load_model_files(None).tokenizer  # StarCoder's vocabulary: it has <file_sep>
    tok.add_special_tokens({"additional_special_tokens": ["<fim_prefix>", "<fim_middle>",
                                                          "<fim_suffix>"]})
    fim = fim_tokens(tok)
    assert (fim.prefix, fim.suffix, fim.middle, fim.repo_name, fim.file_sep) == (
        *ids_of(tok, "<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<repo_name>",
                "<file_sep>"),)
    # DeepSeek-Coder's spelling, which has no file separators: extra files become snippets
    tok = load_model_files(None).tokenizer
    names = ["<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>",
             "<\uff5cfim\u2581end\uff5c>"]
    tok.add_special_tokens({"additional_special_tokens": names})
    fim = fim_tokens(tok)
    assert (fim.prefix, fim.suffix, fim.middle, fim.file_sep) == (*ids_of(tok, *names), None)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    ids = infill_prompt(tok, fim, "p", "s", [ExtraFile("a.py", "A")])
    assert ids == [*enc("\n\n--- snippet ---\n\nA"), *enc("\n\n--- snippet ---\n\n"),
                   fim.prefix, *enc("p"), fim.suffix, *enc("s"), fim.middle]


def test_fitting_drops_old_files_then_cuts_far_code(fim_tokenizer):
    tok = fim_tokenizer
    fim = fim_tokens(tok)
    pre, suf = list(range(1000, 1100)), list(range(2000, 2100))  # 100 ids each
    files = [ExtraFile("old.py", "OLD = 1\n" * 5), ExtraFile("new.py", "NEW = 2\n")]
    full, cut = fit_infill(tok, fim, pre, suf, files)
    assert not cut
    ids, cut = fit_infill(tok, fim, pre, suf, files, budget=len(full))
    assert (ids, cut) == (full, False)
    # one token too many: the oldest file goes first, the newer stays
    ids, cut = fit_infill(tok, fim, pre, suf, files, budget=len(full) - 1)
    assert cut and ids == fit_infill(tok, fim, pre, suf, files[1:])[0]
    # no files left and still too long: the prefix loses its start, the suffix its end, the
    # suffix keeping a quarter of the room
    ids, cut = fit_infill(tok, fim, pre, suf, files, budget=83)
    room = 83 - 3
    assert cut and len(ids) == 83
    assert ids == [fim.prefix, *pre[-(room - room // 4):], fim.suffix, *suf[:room // 4],
                   fim.middle]
    # a short suffix keeps all of itself and the prefix takes the rest
    ids, _ = fit_infill(tok, fim, pre, suf[:5], budget=53)
    assert ids == [fim.prefix, *pre[-45:], fim.suffix, *suf[:5], fim.middle]
    with pytest.raises(ValueError, match="too small"):
        fit_infill(tok, fim, pre, suf, budget=2)


# ---- /v1/completions with suffix -------------------------------------------------------------
def test_completions_suffix_is_the_infill_prompt(srv, fim_tokenizer):
    c = srv.client
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(2, 3))\n"
    ids = infill_prompt(fim_tokenizer, fim_tokens(fim_tokenizer), prefix, suffix)
    r = c.completions.create(model=MODEL, prompt=prefix, suffix=suffix, max_tokens=12,
                             temperature=0, logprobs=2)
    ends = fim_tokens(fim_tokenizer).ends  # they end an infill whatever the model's EOS
    assert set(ids_of(fim_tokenizer, "<|fim_pad|>", "<|file_sep|>", "<|endoftext|>")) <= set(ends)
    ref = c.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                               logprobs=2, extra_body={"stop_token_ids": list(ends)})
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].text == ref.choices[0].text
    assert r.choices[0].logprobs.tokens == ref.choices[0].logprobs.tokens
    # token-id prompts are the prefix's ids; every prompt of a list gets the suffix
    pre_ids = fim_tokenizer.encode(prefix, add_special_tokens=False)
    r2 = c.completions.create(model=MODEL, prompt=[pre_ids, pre_ids], suffix=suffix,
                              max_tokens=12, temperature=0)
    assert [ch.text for ch in r2.choices] == [ref.choices[0].text] * 2


def test_completions_suffix_refusals(srv):
    r = post(srv, "/v1/completions", {"prompt": "a", "suffix": "b", "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    r = post(srv, "/v1/completions", {"prompt": "a", "suffix": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"


def test_a_model_without_fim_tokens_refuses(tiny_path):
    with running_server(LLM(tiny_path, **ENGINE_KW)) as s:
        r = post(s, "/v1/completions", {"prompt": "a", "suffix": "b", "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
        assert "fill-in-the-middle" in r.json()["error"]["message"]
        r = post(s, "/infill", {"input_prefix": "a", "input_suffix": "b"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_prefix"
        # without a suffix the same prompt is a plain completion
        assert post(s, "/v1/completions", {"prompt": "a", "max_tokens": 2}).status_code == 200
        wait_idle(s)


# ---- /infill ---------------------------------------------------------------------------------
INFILL = {"input_prefix": "def add(a, b):\n", "prompt": "    return ",
          "input_suffix": "\n\nprint(add(2, 3))\n",
          "input_extra": [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n",
                           "time": 12.5}]}


def test_infill_answers_what_the_prompt_completes_to(srv, fim_tokenizer):
    tok = fim_tokenizer
    ids = infill_prompt(tok, fim_tokens(tok), INFILL["input_prefix"] + INFILL["prompt"],
                        INFILL["input_suffix"], [ExtraFile("util.py", INFILL["input_extra"][0]["text"])])
    ref = srv.client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0,
                                        logprobs=3, extra_body={
                                            "stop_token_ids": list(fim_tokens(tok).ends)})
    # llama.vim's own knobs are accepted (cache_prompt, samplers, t_max_prompt_ms, id_slot)
    r = post(srv, "/infill", {**INFILL, "n_predict": 10, "temperature": 0, "n_probs": 3,
                              "return_tokens": True, "cache_prompt": True,
                              "samplers": ["top_k", "top_p", "infill"],
                              "t_max_prompt_ms": 500, "id_slot": -1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["content"] == ref.choices[0].text
    assert body["stop"] is True and body["truncated"] is False
    assert body["tokens_evaluated"] == len(ids) == ref.usage.prompt_tokens
    assert body["tokens_predicted"] == ref.usage.completion_tokens == len(body["tokens"])
    assert body["stop_type"] == ("limit" if ref.choices[0].finish_reason == "length" else "eos")
    # streamed, the tokens arrive in pieces that join to the same list
    events = [json.loads(e) for e in sse_events(srv, "/infill", {
        **INFILL, "n_predict": 10, "temperature": 0, "return_tokens": True, "stream": True})]
    assert [t for e in events for t in e["tokens"]] == body["tokens"]
    assert body["timings"]["predicted_n"] == body["tokens_predicted"]
    # the prompt was just computed by the completion above: only its uncached tail is counted
    assert body["timings"]["prompt_n"] < len(ids)
    probs = body["completion_probabilities"]
    assert [p["token"] for p in probs] == ref.choices[0].logprobs.tokens
    for p, lp, top in zip(probs, ref.choices[0].logprobs.token_logprobs,
                          ref.choices[0].logprobs.top_logprobs):
        assert p["logprob"] == pytest.approx(lp, abs=1e-5)
        assert {t["token"]: t["logprob"] for t in p["top_logprobs"]} == pytest.approx(top)
        assert bytes(p["bytes"]).decode() == p["token"] and p["id"] == body["tokens"][
            probs.index(p)]


def test_infill_stream_and_response_fields(srv):
    body = {**INFILL, "n_predict": 12, "temperature": 0}
    whole = post(srv, "/infill", body).json()
    events = [json.loads(e) for e in sse_events(srv, "/infill", {**body, "stream": True})]
    assert all(not e["stop"] for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["tokens_predicted"] == whole["tokens_predicted"]
    fields = ["content", "timings/prompt_n", "timings/predicted_n", "truncated",
              "tokens_cached", "no/such"]
    picked = post(srv, "/infill", {**body, "response_fields": fields}).json()
    assert set(picked) == set(fields) - {"no/such"}
    assert picked["content"] == whole["content"]
    assert picked["timings/predicted_n"] == whole["tokens_predicted"]


def test_infill_n_predict_zero_warms_the_cache(srv):
    body = {**INFILL, "input_prefix": "# warm\n" + INFILL["input_prefix"], "temperature": 0}
    warm = post(srv, "/infill", {**body, "n_predict": 0}).json()
    assert warm["content"] == "" and warm["tokens_predicted"] == 0
    r = post(srv, "/infill", {**body, "n_predict": 4}).json()
    assert r["tokens_evaluated"] == warm["tokens_evaluated"]
    assert r["timings"]["prompt_n"] < r["tokens_evaluated"] // 2  # read from the prefix cache


def test_infill_stop_words_and_truncation(srv, fim_tokenizer):
    base = {**INFILL, "n_predict": 12, "temperature": 0}
    text = post(srv, "/infill", base).json()["content"]
    word = text[3:6]
    assert word.strip()
    r = post(srv, "/infill", {**base, "stop": [word]}).json()
    assert (r["stop_type"], r["stopping_word"]) == ("word", word)
    assert r["content"] == text[:text.index(word)]
    # a prompt past the context: the extra file goes, then the far code (max_model_len 1024)
    long = {**INFILL, "input_prefix": "x = 1\n" * 600, "n_predict": 8, "temperature": 0}
    r = post(srv, "/infill", long).json()
    assert r["truncated"] is True and r["tokens_evaluated"] <= 1024 - 8
    assert r["tokens_predicted"] == 8
    # an n_predict past the context is capped, as llama.cpp caps it
    r = post(srv, "/infill", {**long, "n_predict": 5000, "t_max_predict_ms": 1}).json()
    assert r["truncated"] is True and r["tokens_evaluated"] <= 1024 // 2


@pytest.mark.parametrize("body, param", [
    ({"n": 2}, "n"), ({"n_predict": -2}, "n_predict"), ({"input_extra": [{"filename": "a"}]},
                                                         "input_extra.0.text"),
    ({"input_prefix": 3}, "input_prefix"), ({"n_probs": 50}, "n_probs"),
    ({"temperature": -1}, "temperature"),
    ({"n_indent": -1}, "n_indent")])
def test_infill_bad_requests(srv, body, param):
    r = post(srv, "/infill", {**INFILL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ---- the route's own stop conditions ---------------------------------------------------------
def _comp(text):
    return SimpleNamespace(text=text, token_ids=[1] * max(1, len(text)), stable_text_len=len(text))


def test_n_indent_ends_at_a_line_indented_less():
    w = infill_route._Watch(n_indent=4, t_max_predict_ms=0, warm_only=False)
    assert not w.check(_comp("x = 1"))
    assert not w.check(_comp("x = 1\n    y = 2\n"))
    assert w.visible(_comp("x = 1\n    y = 2\n  "), False) == len("x = 1\n    y = 2\n")
    grown = "x = 1\n    y = 2\n\n   \n    z"  # blank lines pass
    assert not w.check(_comp(grown))
    assert w.check(_comp(grown + "\nprint(y)\n"))  # the text only ever grows
    assert w.text(_comp(grown + "\nprint(y)\n")) == grown + "\n"
    assert w.visible(_comp(grown + "\nprint(y)\n"), False) == len(grown) + 1
    # tabs count as indentation; the first line (the cursor's) is never judged
    w = infill_route._Watch(n_indent=1, t_max_predict_ms=0, warm_only=False)
    assert not w.check(_comp("y\n\tz\n\tw"))
    assert w.check(_comp("y\n\tz\n\tw\nq"))


def test_t_max_predict_ms_ends_at_a_new_line_after_the_time(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(infill_route.time, "monotonic", lambda: now[0])
    w = infill_route._Watch(n_indent=0, t_max_predict_ms=500, warm_only=False)
    assert not w.check(_comp("a"))  # the first token: the clock starts
    assert not w.check(_comp("a\nb"))  # a new line within the time
    now[0] += 0.6
    assert not w.check(_comp("a\nbcd"))  # past the time, no new line in the new text
    assert w.check(_comp("a\nbcd e\nf"))  # the line the new text completes ends the answer
    assert w.text(_comp("a\nbcd e\nf")) == "a\nbcd e\n"
    assert w.visible(_comp("a\nbcd e\nf"), False) == len("a\nbcd e\n")


def test_the_last_output_is_judged_too():
    """An output that finishes (its budget spent) with an under-indented line still loses it."""
    w = infill_route._Watch(n_indent=4, t_max_predict_ms=0, warm_only=False)
    assert not w.check(_comp("x = 1\n    y"))
    comp = SimpleNamespace(text="x = 1\n    y = 2\nz = 3", token_ids=[7, 8, 9],
                           finish_reason="length", stop_reason=None, logprobs=None)
    out = SimpleNamespace(outputs=[comp], num_cached_tokens=0, metrics=SimpleNamespace(
        arrival_time=1.0, first_token_time=1.5, token_times=[1.5, 1.6, 1.7]))
    req = SimpleNamespace(return_tokens=True, n_probs=0, response_fields=[])
    api = SimpleNamespace(model_name="m")
    body = infill_route._completion(api, req, [1, 2], False, out, w)
    assert body["content"] == "x = 1\n    y = 2\n" and body["stop_type"] == "limit"
    assert body["tokens"] == [7, 8, 9] and body["timings"]["predicted_n"] == 3


def test_special_token_text_in_the_code_is_text(fim_tokenizer):
    """Code that spells a special token (a file about FIM, say) stays text in the prompt."""
    tok = fim_tokenizer
    fim = fim_tokens(tok)
    ids = infill_prompt(tok, fim, 'MID = "<|fim_middle|>"\n', "<|endoftext|>",
                        [ExtraFile("a.py", "<|file_sep|>")])
    assert ids.count(fim.middle) == 1 and ids[-1] == fim.middle
    assert ids.count(fim.file_sep) == 2  # the file's and the edited file's separators only
    assert not set(fim.ends) & set(ids[ids.index(fim.suffix):])
    assert tok.decode(ids).endswith('MID = "<|fim_middle|>"\n<|fim_suffix|><|endoftext|>'
                                    '<|fim_middle|>')


def test_infill_grammar_and_empty_suffix(srv):
    """llama.cpp's `grammar` constrains an infill; an empty `suffix` is a plain completion."""
    for _ in range(3):
        r = post(srv, "/infill", {**INFILL, "n_predict": 8, "temperature": 1.0,
                                  "grammar": 'root ::= "yes" | "no"'}).json()
        assert r["content"] in ("yes", "no") and r["stop_type"] == "eos"
    plain = srv.client.completions.create(model=MODEL, prompt="def f", max_tokens=6,
                                          temperature=0)
    empty = srv.client.completions.create(model=MODEL, prompt="def f", suffix="", max_tokens=6,
                                          temperature=0)
    assert empty.choices[0].text == plain.choices[0].text
    assert empty.usage.prompt_tokens == plain.usage.prompt_tokens
