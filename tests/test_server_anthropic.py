"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) with the official
`anthropic` client: the same answer as the chat completion it becomes, streamed and not, stop
sequences, tool use and results (a named tool forces a call from the tiny random model), the
token count, x-api-key, and bad requests as Anthropic-shaped 4xx errors after which nothing is
left running."""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from pagellm import LLM
# the tiny chat model and its shared server come from test_server's fixtures
from tests.test_server import (CHAT, ENGINE_KW, MODEL, post, running_server,  # noqa: F401
                               server, srv, tiny_path, wait_idle)

UNIT = {"name": "get_unit", "description": "The unit a country measures temperature in.",
        "input_schema": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}},
                         "required": ["unit"], "additionalProperties": False}}
SYSTEM, ASK = CHAT[0]["content"], CHAT[1:]


def client(srv, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0, timeout=120)


def greedy(**kw) -> dict:
    return {"model": MODEL, "max_tokens": 12, "extra_body": {"temperature": 0}, **kw}


def test_a_message_is_the_chat_completion_it_becomes(srv):
    c = client(srv)
    msg = c.messages.create(system=SYSTEM, messages=ASK, **greedy())
    chat = srv.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12,
                                              temperature=0)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == chat.choices[0].message.content
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        chat.choices[0].finish_reason]
    u = msg.usage  # input_tokens: the prompt tokens the prefix cache did not serve
    assert u.input_tokens + u.cache_read_input_tokens == chat.usage.prompt_tokens
    assert u.output_tokens == chat.usage.completion_tokens
    # the system prompt as text blocks, and content as text blocks, give the same prompt
    blocks = c.messages.create(system=[{"type": "text", "text": SYSTEM}], messages=[
        {"role": "user", "content": [{"type": "text", "text": ASK[0]["content"]}]}], **greedy())
    assert blocks.content[0].text == msg.content[0].text
    # a stream: the same text, and the documented events in order
    with c.messages.stream(system=SYSTEM, messages=ASK, **greedy()) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == msg.content[0].text and final.stop_reason == msg.stop_reason
    assert final.usage.output_tokens == msg.usage.output_tokens
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0, "stream": True,
            "system": SYSTEM, "messages": ASK}
    with httpx.stream("POST", srv.url + "/v1/messages", json=body, timeout=60) as r:
        kinds = [line.removeprefix("event: ") for line in r.iter_lines()
                 if line.startswith("event: ")]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_stop_sequences(srv):
    c = client(srv)
    free = c.messages.create(system=SYSTEM, messages=ASK, **greedy(max_tokens=24))
    text = free.content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    msg = c.messages.create(system=SYSTEM, messages=ASK, stop_sequences=[stop],
                            **greedy(max_tokens=24))
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[:text.index(stop)]
    with c.messages.stream(system=SYSTEM, messages=ASK, stop_sequences=[stop],
                           **greedy(max_tokens=24)) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_tool_use_and_its_result(srv):
    c = client(srv)
    ask = [{"role": "user", "content": "Which unit does France use?"}]
    msg = c.messages.create(messages=ask, tools=[UNIT], tool_choice={"type": "tool",
                                                                      "name": "get_unit"},
                            **greedy(max_tokens=60))
    assert msg.stop_reason == "tool_use"
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "get_unit" and use.input["unit"] in ("c", "f") and use.id
    with c.messages.stream(messages=ask, tools=[UNIT], tool_choice={"type": "any"},
                           **greedy(max_tokens=60)) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        (use.name, use.input)]
    # the result goes back: the prompt is the chat with the call and a tool message
    turns = ask + [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                     for b in msg.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                 "content": "celsius"}]}]
    count = c.messages.count_tokens(model=MODEL, messages=turns, tools=[UNIT]).input_tokens
    chat = ask + [{"role": "assistant", "content": "", "tool_calls": [{
        "id": use.id, "type": "function", "function": {
            "name": "get_unit", "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "celsius"}]
    tools = [{"type": "function", "function": {"name": UNIT["name"],
                                               "description": UNIT["description"],
                                               "parameters": UNIT["input_schema"]}}]
    assert count == post(srv, "/tokenize", {"messages": chat, "tools": tools}).json()["count"]
    answer = c.messages.create(messages=turns, tools=[UNIT], tool_choice={"type": "none"},
                               **greedy())
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"]


def test_a_last_assistant_message_is_continued(srv):
    """Anthropic's prefill: the reply goes on from the last assistant message's text, the
    chat completion with continue_final_message (vLLM's) that it becomes."""
    c = client(srv)
    turns = ASK + [{"role": "assistant", "content": "The answer is"}]
    msg = c.messages.create(system=SYSTEM, messages=turns, **greedy())
    chat = post(srv, "/v1/chat/completions", {
        "model": MODEL, "messages": [CHAT[0], *turns], "max_tokens": 12, "temperature": 0,
        "add_generation_prompt": False, "continue_final_message": True}).json()
    assert msg.content[0].text == chat["choices"][0]["message"]["content"]
    plain = c.messages.create(system=SYSTEM, messages=ASK, **greedy())
    u = msg.usage  # the prompt ends inside the assistant's turn: no end-of-turn, no new turn
    assert u.input_tokens + u.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
    assert chat["usage"]["prompt_tokens"] != plain.usage.input_tokens + \
        plain.usage.cache_read_input_tokens
    assert c.messages.count_tokens(model=MODEL, system=SYSTEM, messages=turns).input_tokens \
        == chat["usage"]["prompt_tokens"]  # the same prompt, counted
    r = post(srv, "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": ASK + [
        {"role": "assistant", "content": "The answer is "}]})
    assert r.status_code == 400 and "trailing whitespace" in r.json()["error"]["message"]


def test_a_stream_reports_the_cached_prompt_tokens(srv):
    """usage as the non-streamed answer gives it: input_tokens the prompt tokens the prefix
    cache did not serve, cache_read_input_tokens those it did (message_delta's usage)."""
    c = client(srv)
    words = " ".join(f"m{i}" for i in range(120))  # a prompt no other test sends
    turns = [{"role": "user", "content": f"anthropic-cache {words}"}]
    first = c.messages.create(messages=turns, **greedy(max_tokens=2))
    again = c.messages.create(messages=turns, **greedy(max_tokens=2))
    assert again.usage.cache_read_input_tokens > first.usage.cache_read_input_tokens
    with c.messages.stream(messages=turns, **greedy(max_tokens=2)) as stream:
        final = stream.get_final_message()
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens,
            final.usage.output_tokens) == (again.usage.input_tokens,
                                           again.usage.cache_read_input_tokens, 2)


def test_count_tokens(srv):
    c = client(srv)
    n = c.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK).input_tokens
    assert n == post(srv, "/tokenize", {"messages": CHAT}).json()["count"]
    with_tools = c.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK, tools=[UNIT])
    assert with_tools.input_tokens > n


@pytest.mark.parametrize("body, status, param", [
    ({"messages": ASK}, 400, "max_tokens"),
    ({"max_tokens": 4, "messages": []}, 400, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, 400, "messages[0].role"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}]}]}, 400, "messages[0].content[0].type"),
    ({"max_tokens": 4, "messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "x", "content": "y"}]}]}, 400,
     "messages[0].content[0].type"),
    ({"max_tokens": 4, "messages": ASK, "tools": [{"type": "web_search_20250305",
                                                    "name": "web_search"}]}, 400, "tools[0].type"),
    ({"max_tokens": 4, "messages": ASK, "tools": [UNIT], "tool_choice": {"type": "some"}}, 400,
     "tool_choice.type"),
    ({"max_tokens": 4, "messages": ASK, "tool_choice": {"type": "any"}}, 400, "tool_choice"),
    ({"max_tokens": 4, "messages": ASK, "temperature": -1}, 400, "temperature"),
    ({"max_tokens": 4, "messages": ASK, "thinking": {"type": "sometimes"}}, 400, "thinking.type"),
    ({"max_tokens": 4, "messages": ASK, "model": "nope"}, 404, "nope"),
])
def test_bad_requests_are_anthropic_errors(srv, body, status, param):
    r = post(srv, "/v1/messages", {"model": MODEL, **body})
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and param in err["error"]["message"]
    assert err["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    wait_idle(srv)


def test_the_client_raises_its_own_errors(srv):
    c = client(srv)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.content\[0\]\.type"):
        c.messages.create(model=MODEL, max_tokens=4,
                          messages=[{"role": "user", "content": [image]}])
    with pytest.raises(anthropic.NotFoundError, match="nope"):
        c.messages.create(model="nope", max_tokens=4, messages=ASK)


def test_x_api_key(tiny_path):
    with running_server(LLM(tiny_path, **ENGINE_KW), api_key="sekret") as srv:
        with pytest.raises(anthropic.AuthenticationError) as refused:
            client(srv, "wrong").messages.create(messages=ASK, **greedy(max_tokens=2))
        assert refused.value.body["error"]["type"] == "authentication_error"  # its own shape
        msg = client(srv, "sekret").messages.create(messages=ASK, **greedy(max_tokens=2))
        assert msg.usage.output_tokens == 2
        wait_idle(srv)
