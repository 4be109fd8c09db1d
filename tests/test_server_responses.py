"""/v1/responses with the official `openai` client (client.responses.create, .stream, .retrieve,
.delete): each answer is what chat completions gives for the same chat (text, tool calls,
usage, logprobs), streamed as the documented typed events; input items, instructions,
previous_response_id, function calls and their outputs, text.format, and bad requests as 400s
naming the field, after which no block is leaked (the srv fixture checks)."""
from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from pagellm import LLM
# the tiny chat model and its shared server come from test_server's fixtures
from tests.test_server import (MODEL, _aborted, post, running_server, server,  # noqa: F401
                               srv, tiny_path, wait_idle)

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 12},
               "unit": {"type": "string", "enum": ["c", "f"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "description": "Local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                  "maxLength": 12}},
                       "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def real_server():
    """The real default model: a random tiny model left to itself writes JSON whitespace for
    ever, even inside a tool call's grammar."""
    with running_server(LLM(kv_cache_memory=2**26)) as s:
        yield s


@pytest.fixture
def rsrv(real_server):
    yield real_server
    wait_idle(real_server)


def chat_form(tool: dict) -> dict:
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def test_text_is_chat_completions_text(srv):
    c = srv.client
    r = c.responses.create(model=MODEL, instructions="Answer briefly.", input="Name a colour.",
                           max_output_tokens=12, temperature=0)
    ref = c.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a colour."}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == ref.choices[0].message.content
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    length = ref.choices[0].finish_reason == "length"
    assert r.status == ("incomplete" if length else "completed")
    assert (r.incomplete_details is not None
            and r.incomplete_details.reason == "max_output_tokens") == length
    assert r.usage.input_tokens == ref.usage.prompt_tokens
    assert r.usage.output_tokens == ref.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Answer briefly." and r.max_output_tokens == 12


def test_stream_sends_the_typed_events(srv):
    c = srv.client
    kw = dict(model=MODEL, input="Tell me a story.", max_output_tokens=10, temperature=0)
    whole = c.responses.create(**kw)
    events = list(c.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-4].text
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if hasattr(e, "item_id"))
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == \
        whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    # the SDK's stream helper assembles the same text (its get_final_response wants
    # response.completed: a response cut at max_output_tokens ends with response.incomplete)
    with c.responses.stream(**kw) as stream:
        helper = list(stream)
    assert helper[0].type == "response.created" and helper[-1].type == kinds[-1]
    assert [e.snapshot for e in helper if e.type == "response.output_text.delta"][-1] == \
        whole.output_text


def test_input_items_and_previous_response_id(srv):
    c = srv.client
    items = [{"role": "developer", "content": "Be terse."},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "Hello "},
                          {"type": "input_text", "text": "there."}]}]
    r1 = c.responses.create(model=MODEL, input=items, max_output_tokens=6, temperature=0)
    chat = [{"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Hello there."}]
    ref1 = c.chat.completions.create(model=MODEL, messages=chat, max_tokens=6, temperature=0)
    assert r1.output_text == ref1.choices[0].message.content
    # going on from r1: its chat, its answer, then the new input
    r2 = c.responses.create(model=MODEL, previous_response_id=r1.id, input="And then?",
                            max_output_tokens=6, temperature=0)
    ref2 = c.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=chat + [
        {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": "And then?"}])
    assert r2.output_text == ref2.choices[0].message.content
    assert r2.previous_response_id == r1.id
    assert r2.usage.input_tokens == ref2.usage.prompt_tokens
    # kept responses can be read back and deleted
    assert c.responses.retrieve(r1.id).output_text == r1.output_text
    c.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r1.id)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=MODEL, previous_response_id=r1.id, input="x")
    assert e.value.body["code"] == "previous_response_not_found"
    unkept = c.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unkept.id)


def test_function_calls_round_trip(rsrv):
    """tool_choice "required": the calls are chat completions' calls, as function_call items
    (streamed too: their argument events); their outputs go back as function_call_output items
    and the answer is chat's answer to the same tool messages (the real default model)."""
    c = rsrv.client
    ask = "What is the weather in Oslo?"
    r = c.responses.create(model=MODEL, input=ask, tools=[WEATHER, TIME], tool_choice="required",
                           max_output_tokens=120, temperature=0)
    ref = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ask}],
                                    tools=[chat_form(WEATHER), chat_form(TIME)],
                                    tool_choice="required", max_tokens=120, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and r.status == "completed"
    assert [(o.name, json.loads(o.arguments)) for o in calls] == [
        (t.function.name, json.loads(t.function.arguments))
        for t in ref.choices[0].message.tool_calls]
    for o in calls:
        assert o.call_id.startswith("call_") and o.status == "completed"
        args = json.loads(o.arguments)
        assert o.name in ("get_weather", "get_time") and isinstance(args["city"], str)
    events = list(c.responses.create(model=MODEL, input=ask, tools=[WEATHER, TIME],
                                     tool_choice="required", max_output_tokens=120,
                                     temperature=0, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, json.loads(e.arguments)) for e in done] == [
        (o.name, json.loads(o.arguments)) for o in calls]
    assert [o.type for o in events[-1].response.output] == ["function_call"] * len(calls)
    with c.responses.stream(model=MODEL, input=ask, tools=[WEATHER, TIME], temperature=0,
                            tool_choice="required", max_output_tokens=120) as stream:
        final = stream.get_final_response()
    assert [(o.name, o.arguments) for o in final.output] == [(o.name, o.arguments) for o in calls]
    # the results go back; the answer is chat's for the same messages
    results = [{"type": "function_call_output", "call_id": o.call_id,
                "output": json.dumps({"temperature": 18})} for o in calls]
    follow = c.responses.create(model=MODEL, input=[{"role": "user", "content": ask}]
                                + [o.model_dump(exclude_none=True) for o in calls] + results,
                                tools=[WEATHER, TIME], tool_choice="none",
                                max_output_tokens=8, temperature=0)
    messages = [{"role": "user", "content": ask},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": o.call_id, "type": "function",
                     "function": {"name": o.name, "arguments": o.arguments}} for o in calls]}]
    messages += [{"role": "tool", "tool_call_id": o.call_id,
                  "content": json.dumps({"temperature": 18})} for o in calls]
    ref2 = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                     tools=[chat_form(WEATHER), chat_form(TIME)],
                                     tool_choice="none")
    assert follow.output_text == ref2.choices[0].message.content
    # the same, from the kept response: previous_response_id and the outputs alone
    again = c.responses.create(model=MODEL, previous_response_id=r.id, input=results,
                               tools=[WEATHER, TIME], tool_choice="none", max_output_tokens=8,
                               temperature=0)
    assert again.output_text == follow.output_text
    # a named function: one call of it
    one = c.responses.create(model=MODEL, input=ask, tools=[WEATHER, TIME],
                             tool_choice={"type": "function", "name": "get_time"},
                             parallel_tool_calls=False, max_output_tokens=120, temperature=0)
    assert [o.name for o in one.output if o.type == "function_call"] == ["get_time"]


def test_text_format_and_logprobs(srv):
    c = srv.client
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    r = c.responses.create(model=MODEL, input="A digit as JSON.", max_output_tokens=60,
                           text={"format": {"type": "json_schema", "name": "digit",
                                            "schema": schema, "strict": True}})
    assert 0 <= json.loads(r.output_text)["n"] <= 9
    assert r.text.format.type == "json_schema"
    r = c.responses.create(model=MODEL, input="Count.", max_output_tokens=5, temperature=0,
                           include=["message.output_text.logprobs"], top_logprobs=2)
    ref = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count."}],
                                    max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    lps = r.output[0].content[0].logprobs
    want = ref.choices[0].logprobs.content
    assert len(lps) == len(want) == r.usage.output_tokens
    for got, exp in zip(lps, want):
        assert got.token == exp.token and got.logprob == pytest.approx(exp.logprob, abs=1e-5)
        assert [t.token for t in got.top_logprobs] == [t.token for t in exp.top_logprobs]
    plain = c.responses.create(model=MODEL, input="Count.", max_output_tokens=5, temperature=0)
    assert plain.output[0].content[0].logprobs == []


def test_truncation_auto_drops_the_oldest_turns(srv):
    """truncation "auto": the oldest items go (cut before a user or assistant message; a
    leading system message stays) until the input leaves room for max_output_tokens; the
    answer is chat's for the turns kept. "disabled" (the default) is a 400 for the same
    input."""
    c, limit = srv.client, srv.api.max_model_len
    words = " ".join(f"w{i}" for i in range(60))
    turns = []
    for k in range(12):
        turns += [{"role": "user", "content": f"Question {k}: {words}"},
                  {"role": "assistant", "content": f"Answer {k}: {words}"}]
    turns.append({"role": "user", "content": "Last question?"})
    with pytest.raises(openai.BadRequestError):
        c.responses.create(model=MODEL, input=turns, max_output_tokens=16)
    r = c.responses.create(model=MODEL, input=turns, max_output_tokens=16, temperature=0,
                           instructions="Be brief.", truncation="auto")
    system = [{"role": "system", "content": "Be brief."}]
    for start in range(1, len(turns)):  # the longest tail that fits
        n = post(srv, "/tokenize", {"messages": system + turns[start:]}).json()["count"]
        if n + 16 <= limit:
            break
    assert start > 1 and r.usage.input_tokens == n
    ref = c.chat.completions.create(model=MODEL, messages=system + turns[start:], max_tokens=16,
                                    temperature=0)
    assert r.output_text == ref.choices[0].message.content
    # an agent's loop (one question, then calls and their outputs) is cut too, a call and its
    # output together; a developer message first stays
    loop = [{"role": "developer", "content": "Use tools."},
            {"role": "user", "content": "Go."}]
    for k in range(14):
        loop += [{"type": "function_call", "call_id": f"c{k}", "name": "get_time",
                  "arguments": json.dumps({"city": words[:40]})},
                 {"type": "function_call_output", "call_id": f"c{k}", "output": words}]
    r = c.responses.create(model=MODEL, input=loop, tools=[TIME], tool_choice="none",
                           max_output_tokens=16, truncation="auto")
    assert 0 < r.usage.input_tokens <= limit - 16
    # nothing to drop: still a 400
    with pytest.raises(openai.BadRequestError):
        c.responses.create(model=MODEL, input="w " * 1100, max_output_tokens=16,
                           truncation="auto")


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "web_search_call", "id": "w"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
     "input[0].arguments"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"input": "x", "tools": [WEATHER, WEATHER]}, "tools[1].name"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"input": "x", "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}},
     "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "json_object"}},
      "response_format": {"type": "json_object"}}, "response_format"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}},
     "text.format.name"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "1"}]}, "input"),
    ({"input": [{"role": "user", "content": "x"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]},
     "input"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f",
                 "arguments": "[" * 50000 + "]" * 50000}]}, "input[0].arguments"),
    ({"input": "x", "n": 2}, "n"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "previous_response_id": "resp_none"}, "previous_response_id"),
])
def test_bad_requests_are_400s_naming_the_field(srv, body, param):
    r = post(srv, "/v1/responses", {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    ok = srv.client.responses.create(model=MODEL, input="still serving", max_output_tokens=2)
    assert ok.usage.output_tokens >= 1


def test_text_before_a_call_and_its_logprobs_agree_streamed_or_not(srv):
    """An output of text, a call and more text (forced by a regex, tool_choice auto): the
    message is the text before the call, streamed or not, and so is the assistant turn a later
    request's chat holds; the message's log-probs are its own tokens'."""
    c = srv.client
    regex = (r'Sure thing\. <tool_call>\{"name": "get_time", "arguments": '
             r'\{"city": "Oslo"\}\}</tool_call> bye')
    kw = dict(model=MODEL, input="Time in Oslo?", tools=[WEATHER, TIME], max_output_tokens=80,
              temperature=0, include=["message.output_text.logprobs"], top_logprobs=1,
              extra_body={"guided_regex": regex})
    whole = c.responses.create(**kw)
    events = list(c.responses.create(**kw, stream=True))
    final = events[-1].response
    for r in (whole, final):
        assert [o.type for o in r.output] == ["message", "function_call"]
        assert r.output[0].content[0].text == "Sure thing. "
        assert (r.output[1].name, json.loads(r.output[1].arguments)) == ("get_time",
                                                                        {"city": "Oslo"})
        tokens = "".join(t.token for t in r.output[0].content[0].logprobs)
        assert "Sure thing. ".startswith(tokens) and len(tokens) >= len("Sure thing")
    assert [lp.token for lp in whole.output[0].content[0].logprobs] == \
        [lp.token for lp in final.output[0].content[0].logprobs]
    streamed = [lp.token for e in events if e.type == "response.output_text.delta"
                for lp in e.logprobs]
    assert streamed == [lp.token for lp in final.output[0].content[0].logprobs]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        "Sure thing. "
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == final.output[1].arguments
    # the kept chat is the same whichever way the response went
    follow = dict(model=MODEL, input=[{"type": "function_call_output",
                                       "call_id": None, "output": "12:00"}],
                  tools=[WEATHER, TIME], tool_choice="none", max_output_tokens=6,
                  temperature=0)
    answers = []
    for r in (whole, final):
        follow["input"][0]["call_id"] = r.output[1].call_id
        answers.append(c.responses.create(previous_response_id=r.id, **follow).output_text)
    assert answers[0] == answers[1]
    ref = c.chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0, tool_choice="none",
        tools=[chat_form(WEATHER), chat_form(TIME)], messages=[
            {"role": "user", "content": "Time in Oslo?"},
            {"role": "assistant", "content": "Sure thing. ", "tool_calls": [
                {"id": "x", "type": "function",
                 "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "x", "content": "12:00"}])
    assert answers[0] == ref.choices[0].message.content


def test_streamed_logprobs_and_cached_tokens(srv):
    c = srv.client
    prompt = "A prompt long enough to fill a block or two of the cache: " + "lorem ipsum " * 12
    kw = dict(model=MODEL, input=prompt, max_output_tokens=6, temperature=0,
              include=["message.output_text.logprobs"], top_logprobs=2)
    first = c.responses.create(**kw)
    events = list(c.responses.create(**kw, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    want = first.output[0].content[0].logprobs
    assert [(lp.token, len(lp.top_logprobs)) for lp in streamed] == \
        [(lp.token, 2) for lp in want]
    assert [lp.logprob for lp in streamed] == pytest.approx([lp.logprob for lp in want],
                                                            abs=1e-5)
    # the second request found the first's prompt in the prefix cache
    assert events[-1].response.usage.input_tokens_details.cached_tokens >= 16
    assert first.usage.input_tokens_details.cached_tokens < \
        events[-1].response.usage.input_tokens_details.cached_tokens


def test_instructions_are_not_carried_and_nulls_are_defaults(srv):
    c = srv.client
    r1 = c.responses.create(model=MODEL, instructions="Speak like a pirate.", input="Hi.",
                           max_output_tokens=4, temperature=0)
    r2 = c.responses.create(model=MODEL, previous_response_id=r1.id, input="Again.",
                            max_output_tokens=4, temperature=0)
    ref = c.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": "Hi."}, {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": "Again."}])
    assert r2.output_text == ref.choices[0].message.content
    r = post(srv, "/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 2,
                                    "store": None, "stream": None, "background": None,
                                    "parallel_tool_calls": None})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["store"] is True and body["parallel_tool_calls"] is True
    assert srv.client.responses.retrieve(body["id"]).id == body["id"]


def test_a_failed_stream_and_a_client_that_leaves(srv):
    """A grammar the model's tokens cannot complete fails the stream with response.failed (the
    server goes on); a client that leaves mid-stream has its request aborted."""
    events = list(srv.client.responses.create(
        model=MODEL, input="x", max_output_tokens=8, temperature=0, stream=True,
        extra_body={"guided_regex": "\U0006d472\U00099f8f"}))
    assert events[-1].type == "response.failed"
    assert events[-1].response.status == "failed"
    assert "cannot be completed" in events[-1].response.error.message
    kept = srv.client.responses.retrieve(events[-1].response.id)  # kept, as OpenAI keeps it
    assert kept.status == "failed" and kept.error.message == events[-1].response.error.message
    before = _aborted(srv)
    body = {"model": MODEL, "input": "Once upon a time", "max_output_tokens": 900,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", srv.url + "/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200
        deltas = 0
        for line in r.iter_lines():
            deltas += bool(re.match(r"event: response\.output_text\.delta", line))
            if deltas == 3:
                break
    wait_idle(srv)
    assert _aborted(srv) == before + 1


def test_a_json_format_beside_tools_leaves_them_callable(rsrv):
    """tool_choice auto with text.format json_schema (what an agent with an output type and
    tools sends): the model may call a tool, and an answer in text follows the schema."""
    c = rsrv.client
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 30}},
              "required": ["answer"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": schema}}
    r = c.responses.create(model=MODEL, input="What is the weather in Oslo? Use the tool.",
                           tools=[WEATHER, TIME], text=fmt, max_output_tokens=120,
                           temperature=0)
    kinds = [o.type for o in r.output]
    assert kinds in (["message"], ["function_call"], ["function_call", "function_call"])
    if kinds == ["message"]:
        assert isinstance(json.loads(r.output_text)["answer"], str)
    else:
        assert all(json.loads(o.arguments)["city"] for o in r.output)
    r = c.responses.create(model=MODEL, input="Say hello.", tools=[WEATHER, TIME], text=fmt,
                           tool_choice="none", max_output_tokens=60, temperature=0)
    assert isinstance(json.loads(r.output_text)["answer"], str)


def test_the_store_keeps_to_its_bounds():
    from pagellm.server.state import ResponseStore

    store = ResponseStore(capacity=3, max_bytes=100)
    for i in range(5):
        store.put(f"r{i}", {"i": i}, [], 10)
    assert [store.get(f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    store.put("big", {}, [], 80)  # past the count and the bytes: the oldest goes
    assert store.get("r2") is None and store.get("r3") is not None and store.num_bytes == 100
    store.put("bigger", {}, [], 95)  # the bytes alone: all but it go
    assert store.get("big") is None and store.get("r4") is None and store.num_bytes == 95
    assert store.delete("bigger") and store.num_bytes == 0 and not store.delete("bigger")


def test_json_nested_past_the_stack_is_a_400_on_chat_too(srv):
    deep = "[" * 50000 + "]" * 50000
    r = post(srv, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": deep}}]}]})
    assert r.status_code == 400 and "arguments" in r.json()["error"]["param"], r.text
    r = post(srv, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "guided_json": deep,
                                           "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json", r.text


def test_call_grammar_bounds_white_space_and_json_answers_stay_answers():
    """The schemas inside the tool grammar get the white-space bound a lone schema gets (a small
    model otherwise writes new lines until max_tokens); beside a JSON answer, a JSON text is
    the answer even when it looks like a call."""
    from pagellm.server.tools import ToolStream, call_grammar, parse_tool_calls
    from pagellm.structured.grammar import JSON_OPTIONS

    tools = [{"type": "function", "function": {k: v for k, v in TIME.items() if k != "type"}}]
    lark = call_grammar(tools, None, True, None, None, {"type": "object"}).grammar
    assert lark.count(json.dumps({"x-guidance": JSON_OPTIONS})[1:-1]) == 2, lark
    text = '{"name": "get_time", "arguments": {"city": "Oslo"}}'
    assert parse_tool_calls(text, {"get_time"})[1]  # a bare call where calls may be bare
    assert parse_tool_calls(text, {"get_time"}, bare_json=False) == (text, [])
    stream = ToolStream({"get_time"}, bare_json=False)
    assert stream.feed(text[:10], False) == (text[:10], [])  # an answer streams as it comes


# A chat template that renders tools, calls and their outputs itself (as Qwen2.5's does)
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def native_server(tmp_path_factory):
    from pagellm.models.loader import load_model_files
    from tests.helpers import make_tiny_model
    from tests.test_server import ENGINE_KW

    tok = load_model_files(None).tokenizer
    path = tmp_path_factory.mktemp("tiny_tools_template")
    make_tiny_model(path, "llama", vocab_size=len(tok), max_position_embeddings=4096)
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(path)
    with running_server(LLM(str(path), **ENGINE_KW)) as s:
        yield s
        wait_idle(s)


def test_a_template_that_renders_tools_gets_them_and_the_calls(native_server):
    """With a template that reads `tools`, the Responses input (a call and its output) renders
    what chat completions renders for the same chat: the tools and the call's arguments in
    the template's own form, and the same answer."""
    from pagellm.chat_template import render_chat

    c = native_server.client
    call = {"type": "function_call", "call_id": "c1", "name": "get_time",
            "arguments": json.dumps({"city": "Oslo"})}
    items = [{"role": "user", "content": "Time in Oslo?"}, call,
             {"type": "function_call_output", "call_id": "c1", "output": "12:00"}]
    r = c.responses.create(model=MODEL, input=items, tools=[TIME], tool_choice="none",
                           max_output_tokens=8, temperature=0)
    messages = [{"role": "user", "content": "Time in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "get_time", "arguments": call["arguments"]}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    ref = c.chat.completions.create(model=MODEL, messages=messages, tools=[chat_form(TIME)],
                                    tool_choice="none", max_tokens=8, temperature=0)
    assert r.output_text == ref.choices[0].message.content
    assert r.usage.input_tokens == ref.usage.prompt_tokens
    tok = native_server.api.tokenizer
    text = tok.decode(render_chat(tok, [{**m, "tool_calls": [
        {**tc, "function": {**tc["function"], "arguments": {"city": "Oslo"}}}
        for tc in m.get("tool_calls", [])]} for m in messages], True, [chat_form(TIME)]))
    assert '"name": "get_time"' in text and '{"city": "Oslo"}' in text and "12:00" in text
    assert len(tok.encode(text, add_special_tokens=False)) == r.usage.input_tokens


def test_functions_are_strict_by_default_under_auto(rsrv):
    """The Responses API takes a function without `strict` as strict (OpenAI's default): under
    tool_choice auto, an answer pushed to open with "{" must become a call that follows the
    schema; chat completions (not strict by default) leave the same push to write anything."""
    c = rsrv.client
    brace = rsrv.api.tokenizer.convert_tokens_to_ids("{")
    push = {"logit_bias": {str(brace): 30.0}}
    r = c.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER],
                           max_output_tokens=80, temperature=0, extra_body=push)
    (call,) = [o for o in r.output if o.type == "function_call"]
    args = json.loads(call.arguments)
    assert call.name == "get_weather" and set(args) == {"city", "unit"}
    assert args["unit"] in ("c", "f") and len(args["city"]) <= 12
    ref = c.chat.completions.create(model=MODEL, tools=[chat_form(WEATHER)], max_tokens=80,
                                    temperature=0, logit_bias={str(brace): 30},
                                    messages=[{"role": "user", "content": "Weather in Oslo?"}])
    assert not ref.choices[0].message.tool_calls  # the push alone makes no valid call
    strict_off = c.responses.create(model=MODEL, input="Weather in Oslo?", max_output_tokens=80,
                                    tools=[{**WEATHER, "strict": False}], temperature=0,
                                    extra_body=push)
    assert [o.type for o in strict_off.output] == ["message"]
