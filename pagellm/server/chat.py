"""POST /v1/chat/completions, with tool calling (server/tools.py) and reasoning models'
thinking apart from the answer (server/reasoning.py)."""
from __future__ import annotations

import json
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse

from pagellm.server.errors import APIError, parse_request, sampling_error
from pagellm.server.protocol import ChatCompletionRequest
from pagellm.server.reasoning import (ReasoningStream, message_fields, prompt_opens_thinking,
                                      split_reasoning)
from pagellm.server.responses import chat_logprobs, usage
from pagellm.server.state import OpenAIServer
from pagellm.server.streaming import ChoiceStream, EventStream, chunk_of, finish, stream_events
from pagellm.server.tools import (TOOL_CLOSE, TOOL_OPEN, ToolStream, auto_grammar, call_grammar,
                                  has_strict, parse_tool_calls, resolve_tool_choice, tool_dicts)


async def create_chat_completion(request: Request):
    arrival = time.monotonic()
    req = parse_request(ChatCompletionRequest, await request.body())
    return (await chat_completion(request, req, arrival))[0]


async def chat_completion(request: Request, req: ChatCompletionRequest,
                          arrival: float) -> tuple[JSONResponse | EventStream, int]:
    """(the answer, the prompt's token count): a JSON body, or chunks as server-sent events.
    Anthropic's Messages API (server/anthropic_messages.py) runs on it too."""
    api: OpenAIServer = request.app.state.api
    lora = api.check_model(req.model)
    api.need_tokenizer("messages")
    tools = tool_dicts(req.tools)
    tool_choice, only = resolve_tool_choice(req.tool_choice, tools)
    api.limits.check_sequences(1, req.n)
    api.limits.check_stop(req.stop)
    api.limits.check_logprobs(req.top_logprobs, "top_logprobs")
    ids = await api.chat_prompt_ids(req.messages, req.tools, req.add_generation_prompt,
                                    req.chat_template_kwargs, req.continue_final_message)
    api.limits.check_prompt_tokens(len(ids), "messages")
    parser = api.reasoning_parser
    opened = parser is not None and prompt_opens_thinking(
        await api.off_loop(api.tokenizer.decode, ids[-8:]))
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
    num_top = (req.top_logprobs or 0) if req.logprobs else None
    structured, structured_field = req.structured()
    bare_json = True
    if tool_choice == "required":
        if structured is not None:
            raise APIError(400, f"tool_choice: a required tool call cannot be combined with "
                           f"{structured_field}", param="tool_choice")
        structured, structured_field = call_grammar(
            tools, only, req.parallel_tool_calls, api.tag_id(TOOL_OPEN),
            api.tag_id(TOOL_CLOSE)), "tools"
    elif tool_choice == "auto" and structured is None and has_strict(tools):
        # strict functions: text, or calls whose arguments follow their schemas
        structured, structured_field = auto_grammar(
            tools, req.parallel_tool_calls, api.tag_id(TOOL_OPEN), api.tag_id(TOOL_CLOSE)), "tools"
    elif tool_choice == "auto" and structured is not None and structured.kind in (
            "json", "json_object"):
        # a JSON answer format beside tools: calls, or the answer in that format (as the
        # Responses API does; a JSON grammar alone would make the tools uncallable)
        answer = _answer_schema(structured, structured_field)
        structured = call_grammar(tools, None, req.parallel_tool_calls, api.tag_id(TOOL_OPEN),
                                  api.tag_id(TOOL_CLOSE), answer)
        bare_json = False  # a JSON text is the answer, not a call
    try:
        params = req.sampling_params(
            api.max_tokens(len(ids), req.max_completion_tokens or req.max_tokens, "messages"),
            num_top, api.sampling_defaults, structured)
    except ValueError as e:
        raise sampling_error(e) from None
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    slots = await api.add([ids], [params], arrival, rid, structured_field, req.cache_salt, lora)
    choices = [ChoiceStream(j, params) for j in range(req.n)]
    base = {"id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": api.model_name}
    tool_names = {t["function"]["name"] for t in tools} if tool_choice != "none" else set()

    def logprobs(tids, lps):
        return chat_logprobs(api.token_str, tids, lps, num_top) if req.logprobs else None

    def finish_of(comp, calls) -> dict:
        f = finish(comp)
        if calls and comp.finish_reason == "stop":
            f["finish_reason"] = "tool_calls"
        return f

    if req.stream:
        base["object"] = "chat.completion.chunk"
        tool_streams = [ToolStream(tool_names, bare_json) for _ in choices] if tool_names else None
        thinking = [ReasoningStream(parser, opened) for _ in choices] if parser else None

        def choice_chunk(ch, comp, text, tids, lps):
            calls, thought = [], ""
            if thinking is not None:
                thought, text = thinking[ch.index].feed(text, comp.finished)
            if tool_streams is not None:
                text, calls = tool_streams[ch.index].feed(text, comp.finished)
            delta = {"content": text} if text or not (comp.finished or thought) else {}
            delta.update(message_fields(thought or None))
            if calls:
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
            return chunk_of(base, {"index": ch.index, "delta": delta,
                                   "logprobs": logprobs(tids, lps), **finish_of(comp, calls)},
                            req.include_usage)

        def usage_chunk(num_generated, num_cached):
            return ({**base, "choices": [], "usage": usage(len(ids), num_generated, num_cached)}
                    if req.include_usage else None)

        roles = [chunk_of(base, {"index": ch.index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}, req.include_usage)
                 for ch in choices]
        running = ((lambda num_generated: usage(len(ids), num_generated))
                   if req.continuous_usage else None)
        events = stream_events(slots, choices, req.n, req.logprobs, choice_chunk, usage_chunk,
                               prelude=roles, running_usage=running)
        return EventStream(events, on_close=lambda: api.abort(slots)), len(ids)

    (final,) = await api.final_outputs(request, slots)
    out_choices = []
    for c in final.outputs:
        thought, text = split_reasoning(parser, c.text, opened) if parser else (None, c.text)
        content, calls = (parse_tool_calls(text, tool_names, bare_json) if tool_names
                          else (text, []))
        message = {"role": "assistant", "content": content, **message_fields(thought)}
        if calls:
            message["tool_calls"] = calls
        out_choices.append({"index": c.index, "message": message,
                            "logprobs": logprobs(c.token_ids, c.logprobs or []),
                            **finish_of(c, calls)})
    num_generated = sum(len(c.token_ids) for c in final.outputs)
    return JSONResponse({**base, "choices": out_choices,
                         "usage": usage(len(ids), num_generated, final.num_cached_tokens)}), len(ids)


def _answer_schema(structured, field: str) -> dict:
    """The JSON schema of a json / json_object constraint (400 naming the field if its text
    is not JSON)."""
    if structured.kind == "json_object":
        return {"type": "object"}
    schema = structured.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise APIError(400, f"{field}: not a JSON schema: {e}", param=field) from None
    if not isinstance(schema, dict):
        raise APIError(400, f"{field}: the schema must be a JSON object", param=field)
    return schema
