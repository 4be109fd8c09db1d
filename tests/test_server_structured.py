"""Structured outputs and tool calling over HTTP with the official `openai` client: parse()
with pydantic models on the real default model (greedy and sampled, n-gram speculation on and
off), the OpenAI / vLLM / llama.cpp constraint fields, a tool round trip (required, named,
streamed), logit_bias, server sampling defaults, and bad schemas, grammars and tools as 400s
naming the field, after which the server keeps serving and no block is leaked."""
from __future__ import annotations

import enum
import json
import re
from typing import Annotated

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from pagellm import LLM, SamplingParams
from pagellm.server.defaults import LLAMA_CPP, sampling_defaults
from pagellm.server.tools import (ToolStream, auto_grammar, call_grammar, parse_tool_calls,
                                  prompt_messages)
# the tiny chat model and its shared server come from test_server's fixtures
from tests.test_server import (ENGINE_KW, MODEL, offline, post, running_server,  # noqa: F401
                               server, srv, tiny_path, wait_idle)

DEFAULT_KW = {"kv_cache_memory": 2**26}


class Colour(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=24)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    favourite: Colour
    address: Address


class Inventory(BaseModel):
    # bounded strings: a 135M model left free writes one item for ever
    items: list[Annotated[str, Field(max_length=16)]] = Field(max_length=4)
    counts: list[Annotated[int, Field(ge=0, le=1000)]] = Field(max_length=4)
    price: float = Field(ge=0, le=1000)
    note: str | None = Field(default=None, max_length=30)


SCHEMAS = [(Person, "Describe Alice, a 30 year old who lives in Paris (zip 75001) and likes "
                    "blue, as JSON."),
           (Inventory, "List three fruits with counts and a price, as JSON.")]


@pytest.fixture(scope="module")
def real(request):
    """The real default model, plain and with n-gram speculation (fixed k)."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    with running_server(LLM(**DEFAULT_KW)) as plain, \
            running_server(LLM(speculative_config=spec, **DEFAULT_KW)) as ngram:
        yield {"off": plain, "ngram": ngram}


@pytest.fixture
def rsrv(real):
    yield real
    for s in real.values():
        wait_idle(s)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_parse_returns_valid_objects_with_and_without_speculation(rsrv, temperature):
    texts = {}
    for spec, srv in rsrv.items():
        for model, prompt in SCHEMAS:
            r = srv.client.chat.completions.parse(
                model=MODEL, messages=[{"role": "user", "content": prompt}], response_format=model,
                # room for the longest output the bounds allow (an emoji is ~4 tokens)
                temperature=temperature, seed=5, max_tokens=512, logprobs=True)
            choice = r.choices[0]
            assert choice.finish_reason == "stop", choice.message.content
            assert isinstance(choice.message.parsed, model)  # parse() validated it
            texts[spec, model.__name__] = [(t.token, t.logprob) for t in choice.logprobs.content]
    assert rsrv["ngram"].engine.spec.stats.num_draft_tokens > 0
    if temperature == 0:
        for model, _ in SCHEMAS:
            off, ngram = texts["off", model.__name__], texts["ngram", model.__name__]
            # The same greedy tokens up to the first near-tie: a verification step of several
            # rows and a decode step of one round differently in the bf16 / int16 kernels
            # (~1e-3 in a log-probability), which may flip a choice between two allowed tokens
            # whose log-probabilities are that close; a wrong token is far from the other.
            first = next((i for i, (a, b) in enumerate(zip(off, ngram)) if a[0] != b[0]), None)
            if first is None:
                assert len(off) == len(ngram)
            else:
                assert abs(off[first][1] - ngram[first][1]) < 0.05, (first, off[first],
                                                                     ngram[first])


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"], "additionalProperties": False}}}
# (closed schemas: with extra properties allowed, a sampled call of the 135M model can ramble
# on in made-up fields past any max_tokens; the tests are about the calls' shape)
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


def _check_call(call, name: str | None = None) -> dict:
    assert call.type == "function" and call.id
    assert call.function.name in ("get_weather", "get_time")
    if name is not None:
        assert call.function.name == name
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    else:
        assert set(args) >= {"zone"}
    return args


def test_tool_round_trip_required_then_answer(rsrv):
    client = rsrv["off"].client
    # the prompt once first: a cold prompt is prefilled in one many-row step (int8
    # activations where the products are q32 ones), a cached one's last block by the packed
    # kernels, and greedy tokens may part at a near-tie between the two; the requests compared
    # below both find it cached
    client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                   tool_choice="required", temperature=0, max_tokens=1)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                       tool_choice="required", temperature=0, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        _check_call(call)
    call = choice.message.tool_calls[0]
    # the same call, streamed: deltas assemble to it
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                            tool_choice="required", temperature=0,
                                            max_tokens=200, stream=True)
    calls, finish = {}, None
    for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    # the tool's result goes back; the model answers in text
    messages = ASK + [choice.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id,
                       "content": json.dumps({"temperature": 18, "sky": "sunny"})}]
    r2 = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                        tool_choice="none", temperature=0, max_tokens=40)
    answer = r2.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.tool_calls is None
    assert isinstance(answer.message.content, str) and answer.message.content


def test_named_tool_choice_and_one_call(rsrv):
    client = rsrv["ngram"].client
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0.7, seed=1, max_tokens=120)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    _check_call(calls[0], "get_time")


def test_constraint_fields_of_each_dialect(srv):
    """OpenAI's response_format, vLLM's guided_* and structured_outputs, llama.cpp's
    json_schema and GBNF grammar: each constrains the output (a random tiny model here, so the
    grammar alone makes the text valid)."""
    c = srv.client
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=60)
    r = c.chat.completions.create(**chat, response_format={
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}})
    assert 0 <= json.loads(r.choices[0].message.content)["n"] <= 9
    r = c.completions.create(model=MODEL, prompt="x", max_tokens=10,
                             extra_body={"guided_choice": ["alpha", "beta"]})
    assert r.choices[0].text in ("alpha", "beta")
    r = c.completions.create(model=MODEL, prompt="x", max_tokens=10,
                             extra_body={"guided_regex": r"[a-c]{4}"})
    assert re.fullmatch(r"[a-c]{4}", r.choices[0].text)
    r = c.chat.completions.create(**chat, extra_body={"structured_outputs": {"json": schema}})
    assert 0 <= json.loads(r.choices[0].message.content)["n"] <= 9
    r = c.chat.completions.create(**chat, extra_body={"json_schema": schema})
    assert 0 <= json.loads(r.choices[0].message.content)["n"] <= 9
    r = c.completions.create(model=MODEL, prompt="x", max_tokens=10, extra_body={
        "grammar": 'root ::= "go " dir\ndir ::= "left" | "right"'})
    assert r.choices[0].text in ("go left", "go right")
    r = c.chat.completions.create(**chat, n=2, seed=3, temperature=1.0,
                                  extra_body={"guided_grammar": 'start: "(" /[0-9]/ ")"'})
    assert all(re.fullmatch(r"\([0-9]\)", ch.message.content) for ch in r.choices)
    # streamed: the deltas assemble to constrained text
    text = "".join(chunk.choices[0].delta.content or "" for chunk in c.chat.completions.create(
        **chat, stream=True, extra_body={"guided_choice": ["stream me", "or me"]}))
    assert text in ("stream me", "or me")


def test_a_grammar_that_cannot_be_completed_is_a_400(srv, offline):  # noqa: F811
    """A regex of 4-byte UTF-8 characters: llguidance forces their bytes as tokens that it
    then refuses (its mask allows a token its parser rejects). The sequence ends ("error",
    stop_reason GRAMMAR_DEAD_END) and the request gets a 400 saying so, never a 500; the
    server goes on serving."""
    from pagellm.engine.llm_engine import GRAMMAR_DEAD_END
    from pagellm.sampling_params import StructuredOutputsParams

    regex = "\U0006d472\U00099f8f"
    out = offline.generate(["x"], SamplingParams(
        temperature=0, max_tokens=8,
        structured_outputs=StructuredOutputsParams(regex=regex)), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error"
    assert out.outputs[0].stop_reason == GRAMMAR_DEAD_END
    res = post(srv, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 8,
                                        "temperature": 0, "guided_regex": regex})
    assert res.status_code == 400, res.text
    assert "cannot be completed" in res.json()["error"]["message"]
    ok = post(srv, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4})
    assert ok.status_code == 200


def test_logit_bias_over_http(srv, offline):
    first = offline.generate("Hello", SamplingParams(temperature=0, max_tokens=1),
                             use_tqdm=False)[0].outputs[0].token_ids[0]
    r = post(srv, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 3,
                                      "temperature": 0, "logprobs": 0,
                                      "logit_bias": {str(first): -100}})
    assert r.status_code == 200
    tok = offline.get_tokenizer()
    assert r.json()["choices"][0]["logprobs"]["tokens"][0] != tok.decode([first])
    forced = post(srv, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 3,
                                           "temperature": 1, "logit_bias": {"300": 100}})
    assert forced.json()["choices"][0]["text"] == tok.decode([300] * 3)


SCHEMA_OK = {"type": "object", "properties": {"a": {"type": "integer"}}}
BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
    ({"grammar": 'root ::= "a'}, "grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_regex": "a", "json_schema": SCHEMA_OK}, "json_schema"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools.0.function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}], "tool_choice": "required"},
     "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
]


@pytest.mark.parametrize("extra,param", BAD, ids=[p for _, p in BAD])
def test_bad_constraint_or_tools_is_a_400_naming_the_field(srv, extra, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            **extra}
    r = post(srv, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param.split(".")[0] in err["message"], err
    ok = post(srv, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                            "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200  # the server keeps serving


def test_sampling_defaults_apply_to_omitted_fields(tiny_path, offline, tmp_path):  # noqa: F811
    with running_server(LLM(tiny_path, **ENGINE_KW), sampling_defaults={"temperature": 0.0}) as s:
        r = s.client.completions.create(model=MODEL, prompt="Hello", max_tokens=6)
        greedy = offline.generate("Hello", SamplingParams(temperature=0, max_tokens=6),
                                  use_tqdm=False)[0].outputs[0].text
        assert r.choices[0].text == greedy
        wait_idle(s)
    # where they come from
    folder = tmp_path / "m"
    folder.mkdir()
    assert sampling_defaults(str(folder)) == (LLAMA_CPP, "llama.cpp's (the model brings none)")
    (folder / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "do_sample": True, "eos_token_id": 2}))
    d, _ = sampling_defaults(str(folder), flags={"top_k": 20, "min_p": None})
    assert d == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    assert sampling_defaults(str(folder), "none")[0] == {}


def _strict(tool: dict) -> dict:
    return {**tool, "function": {**tool["function"], "strict": True}}


def test_strict_functions_under_auto_follow_their_schemas(rsrv):
    """tool_choice auto with a strict function (what OpenAI's Agents SDK sends): the model
    answers in text or calls, and a text answer carries no half-made call (the grammar's
    cases are test_the_strict_auto_grammar's; the real Qwen2.5-Coder's calls under it are in
    test_real_models.py)."""
    client = rsrv["off"].client
    for seed in range(4):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[_strict(WEATHER)],
                                           temperature=1.0, seed=seed, max_tokens=160)
        choice = r.choices[0]
        for call in choice.message.tool_calls or []:
            _check_call(call, "get_weather")
        if choice.finish_reason == "stop" and not choice.message.tool_calls:
            content = choice.message.content or ""
            assert "<tool_call>" not in content and not content.startswith("{")


def test_a_json_format_beside_auto_tools_leaves_them_callable(rsrv):
    """chat completions with response_format json_schema and tool_choice auto (as the
    Responses API): the model may call, and a text answer follows the format."""
    client = rsrv["off"].client
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 30}},
              "required": ["answer"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                           response_format=fmt, temperature=1.0, seed=seed,
                                           max_tokens=120)
        choice = r.choices[0]
        if choice.message.tool_calls:  # (a further call may be cut by max_tokens)
            assert choice.finish_reason in ("tool_calls", "length")
            for call in choice.message.tool_calls:
                _check_call(call)
        elif choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content)["answer"], str)


def _grammar_acceptor(tags_are_tokens: bool):
    """(the tag ids a tool grammar names, or Nones; whole(params, text): whether the grammar
    takes all of text and then the end of sequence), on the default model's tokenizer, the
    tags as single tokens where asked (as Qwen2.5's tokenizer has them)."""
    from pagellm.models.loader import load_model_files
    from pagellm.structured.matcher import GrammarBackend

    tok = load_model_files(None).tokenizer
    ids = (None, None)
    if tags_are_tokens:
        tok.add_tokens(["<tool_call>", "</tool_call>"])
        ids = tuple(tok.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>"))
    backend = GrammarBackend(tok, len(tok), {tok.eos_token_id})

    def whole(params, text):
        c = backend.constraint(params)
        return (all(c.accept(t) for t in tok.encode(text, add_special_tokens=False))
                and c.accept(tok.eos_token_id))
    return ids, whole


def _call(name, args):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


@pytest.mark.parametrize("tags_are_tokens", [False, True])
def test_the_strict_auto_grammar(tags_are_tokens):
    """Text, or text then calls of the strict function with valid arguments (any object for a
    function that is not strict); nothing after the calls; one call without parallel calls."""
    ids, whole = _grammar_acceptor(tags_are_tokens)

    def accepts(text, parallel=True, tools=(_strict(WEATHER), TIME)):
        return whole(auto_grammar(list(tools), parallel, *ids), text)

    good = _call("get_weather", {"city": "Oslo", "unit": "celsius"})
    assert accepts("It is sunny in Oslo < 20 degrees, no tool_call needed.")
    assert accepts("") and accepts(good) and accepts("Let me look.\n" + good)
    assert accepts(good + "\n" + _call("get_time", {"anything": [1, 2]}))  # TIME is not strict
    assert not accepts(good + "\n" + good, parallel=False)
    assert not accepts(_call("get_weather", {"city": "Oslo", "unit": "kelvin"}))
    assert not accepts(_call("get_weather", {"city": "Oslo"}))
    assert not accepts(_call("get_news", {}))
    assert not accepts(good + " and more text")
    assert not accepts("text <tool_call> and no call")
    # a bare JSON call (the whole answer) follows the schema too; other text may not start "{"
    assert accepts(json.dumps({"name": "get_weather", "arguments": {"city": "Oslo",
                                                                    "unit": "celsius"}}))
    assert not accepts(json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}}))
    assert not accepts('{"a": 1}') and accepts('The JSON {"a": 1}')
    # nothing the parser would read as a call escapes the schema: white space before a bare
    # call, a list of calls, the tag spelled in plain text
    half = json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}})
    for text in (" " + half, "\n" + half, "[" + half + "]", "<tool_call>\n" + half):
        assert not accepts(text)
    assert accepts("[1] A list {x}") and accepts(good + "\n")  # a new line may end the calls
    # a bare call in a code block follows the schema; a text may not open with a JSON block
    bare = json.dumps({"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}})
    assert accepts("```json\n" + bare + "\n```") and accepts("```\n" + bare + "\n```")
    assert not accepts("```json\n" + half + "\n```") and not accepts('```json\n{"a": 1}\n```')
    assert accepts("```python\nprint(1)\n```") and accepts('See:\n```json\n{"a": 1}\n```')


@pytest.mark.parametrize("tags_are_tokens", [False, True])
def test_the_required_call_grammar_may_end_after_a_new_line(tags_are_tokens):
    """tool_choice "required" or a named function: one call, or with parallel calls several
    separated by new lines, and the answer may end after a call's new line. Qwen2.5-Coder-1.5B
    writes "</tool_call>" then a new line; where only another call could follow that new line
    it repeated the same call until max_tokens (finish_reason "length", a cut call left as
    content); the last call's new line now ends the answer (tests/test_real_models.py)."""
    ids, whole = _grammar_acceptor(tags_are_tokens)

    def accepts(text, parallel=True, only=None, answer=None):
        return whole(call_grammar([WEATHER, TIME], only, parallel, *ids, answer), text)

    good = _call("get_weather", {"city": "Oslo", "unit": "celsius"})
    other = _call("get_time", {"zone": "CET"})
    for parallel in (True, False):
        assert accepts(good, parallel) and accepts(good + "\n", parallel)
        assert accepts(other, parallel, only="get_time")
        assert not accepts(good, parallel, only="get_time")
        assert not accepts("", parallel) and not accepts("Sunny.", parallel)
        assert not accepts(good + "\n\n", parallel) and not accepts(good + " ok", parallel)
    assert accepts(good + "\n" + other) and accepts(good + "\n" + other + "\n")
    assert not accepts(good + "\n" + other, parallel=False)
    # beside a JSON answer (tool_choice auto with a JSON response_format): calls as above, or
    # the answer alone
    answer = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert accepts(good + "\n", answer=answer) and accepts('{"a": 1}', answer=answer)
    assert not accepts('{"b": 1}', answer=answer) and not accepts(good + '{"a": 1}', answer=answer)


# ---- tool-call text: parsing, streaming hold-back, prompts for templates without tools -------
NAMES = {"get_weather", "get_time"}


def test_parse_tool_calls_forms():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}'
            '</tool_call>')
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]
    bare = parse_tool_calls('{"name": "get_time", "arguments": {"zone": "UTC"}}', NAMES)
    assert bare[0] is None and bare[1][0]["function"]["name"] == "get_time"
    # a bare call in a code block, or in the doubled braces Qwen2.5-Coder's template shows
    for wrapped in ('```json\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n```',
                    '```\n[{"name": "get_time", "arguments": {"zone": "UTC"}}]```',
                    '{{"name": "get_time", "arguments": {"zone": "UTC"}}}'):
        assert parse_tool_calls(wrapped, NAMES)[1][0]["function"]["arguments"] == \
            '{"zone": "UTC"}', wrapped
        assert parse_tool_calls(wrapped, NAMES, bare_json=False) == (wrapped, [])
    for plain in ['{"name": "unknown", "arguments": {}}', "<tool_call>not json</tool_call>",
                  "just text", '{"a": 1}', '```json\n{"a": 1}\n```', '```python\nprint(1)\n```',
                  'Call: ```json\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n```',
                  # NaN / Infinity are Python's, not JSON: no client could parse such arguments
                  '<tool_call>{"name": "get_time", "arguments": {"zone": NaN}}</tool_call>',
                  '{"name": "get_time", "arguments": "{\\"zone\\": -Infinity}"}']:
        assert parse_tool_calls(plain, NAMES) == (plain, [])


def test_tool_stream_holds_back_what_may_be_a_call():
    ts = ToolStream(NAMES)
    sent = [ts.feed("Sure, ", False)[0], ts.feed("<tool_", False)[0],
            ts.feed('call>{"name": "get_time", "arguments": {"zone": "UTC"}}', False)[0]]
    assert sent == ["Sure, ", "", ""]
    rest, calls = ts.feed("</tool_call>", True)
    assert rest == "" and calls[0]["function"]["name"] == "get_time"
    ts = ToolStream(NAMES)
    assert ts.feed("a <tool", False)[0] == "a "
    assert ts.feed("box> b", True) == ("<toolbox> b", [])  # not a call after all
    ts = ToolStream(NAMES)  # a code block: held while it may be a fenced call
    assert [ts.feed(d, False)[0] for d in ("``", "`json\n", '{"name": "get_time", ')] == [
        "", "", ""]
    rest, calls = ts.feed('"arguments": {"zone": "UTC"}}\n```', True)
    assert rest == "" and calls[0]["function"]["name"] == "get_time"
    ts = ToolStream(NAMES)
    assert [ts.feed(d, False)[0] for d in ("``", "`python\n", "x = 1")] == [
        "", "```python\n", "x = 1"]


def test_template_without_tools_gets_them_in_a_system_message():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "1", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "tool_call_id": "1", "content": "12 C"}]
    out = prompt_messages(msgs, [WEATHER], native=False)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.")
    assert '"name": "get_weather"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", '
                      '"arguments": {"city": "Oslo"}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n12 C\n</tool_response>"}
    assert prompt_messages(msgs, [WEATHER], native=True) is msgs


def test_sampling_defaults_from_gguf_metadata(tmp_path):
    """A GGUF's general.sampling.* keys are its generation config."""
    import gguf

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.25)
    writer.add_int32("general.sampling.top_k", 20)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    defaults, source = sampling_defaults(str(path))
    assert defaults == {"temperature": 0.25, "top_k": 20} and "generation config" in source
