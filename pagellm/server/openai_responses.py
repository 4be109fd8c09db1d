"""POST /v1/responses (OpenAI's Responses API, what agent SDKs call by default) on the chat
machinery, and GET / DELETE /v1/responses/{id} for the responses the server keeps.

A request becomes one chat: its `instructions` (a system message first), the conversation of
a kept response named by `previous_response_id`, then its `input`: a string (one user
message) or items: messages (text parts), the `function_call`s the model made before and the
`function_call_output`s that answer them. Function `tools` and `tool_choice` work as on chat
completions (server/tools.py: the same prompt form, grammar and parsing); `text.format`
constrains the answer (beside tools on "auto", to calls or that JSON). The output is a list of
items: with a reasoning parser (server/reasoning.py), a `reasoning` item holding the thinking
as one `reasoning_text` part; a `message` with one `output_text` part (with calls, the text
before the first), and a `function_call` item per call. A stream sends the documented typed
events (response.created, response.in_progress, output item / content part / reasoning text /
output text delta events, function call argument events, then response.completed, or
response.incomplete at max_output_tokens, or response.failed), each with its sequence_number.
A later request's input may carry reasoning items back; the chat leaves them out, as chat
templates leave out earlier turns' thinking.

`store` (default true) keeps the response and its chat in memory (state.py's ResponseStore,
bounded in count and bytes), so that a client can go on from it.
"""
from __future__ import annotations

import json
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from pagellm.engine.async_engine import RequestError
from pagellm.server.errors import APIError, parse_request, sampling_error
from pagellm.server.protocol import ResponsesRequest, Tool, joined_text
from pagellm.server.reasoning import (CLOSE, ReasoningStream, prompt_opens_thinking,
                                      split_reasoning)
from pagellm.server.responses import chat_logprobs
from pagellm.server.state import OpenAIServer, iterate
from pagellm.server.streaming import ChoiceStream, EventStream
from pagellm.server.tools import (TOOL_CLOSE, TOOL_OPEN, ToolStream, auto_grammar, call_grammar,
                                  has_strict, parse_tool_calls, prompt_messages,
                                  resolve_tool_choice, template_knows_tools)
from pagellm.sampling_params import StructuredOutputsParams

LOGPROBS_INCLUDE = "message.output_text.logprobs"
TEXT_PARTS = ("input_text", "output_text", "text")


# ---- request -> chat ---------------------------------------------------------------------------
def _text(content, at: str) -> str:
    """A message's content: a string, or text parts (input_text / output_text) joined."""
    return joined_text(content, at, TEXT_PARTS)


def _arguments(value, at: str) -> dict:
    try:
        args = json.loads(value) if isinstance(value, str) and value.strip() else {}
    except (ValueError, RecursionError):  # not JSON, or nested past the stack
        args = None
    if not isinstance(value, str) or not isinstance(args, dict):
        raise APIError(400, f"{at}: must be a JSON object in a string", param=at)
    return args


def input_messages(items) -> list[dict]:
    """`input` -> chat messages in the templates' form (server/tools.py's prompt_messages takes
    them on): function_call items join the assistant message before them as its tool_calls,
    function_call_output items become tool messages; reasoning items are passed over."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        at = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{at}.role: must be 'user', 'system', 'developer' or "
                               f"'assistant', got {role!r}", param=f"{at}.role")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text(item.get("content"), f"{at}.content")})
        elif kind == "function_call":
            name, call_id = item.get("name"), item.get("call_id")
            for field, value in (("name", name), ("call_id", call_id)):
                if not isinstance(value, str) or not value:
                    raise APIError(400, f"{at}.{field}: must be a non-empty string",
                                   param=f"{at}.{field}")
            call = {"id": call_id, "type": "function",
                    "function": {"name": name,
                                 "arguments": _arguments(item.get("arguments"), f"{at}.arguments")}}
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise APIError(400, f"{at}.call_id: must be a non-empty string",
                               param=f"{at}.call_id")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": _text(item.get("output"), f"{at}.output")})
        elif kind != "reasoning":
            raise APIError(400, f"{at}.type: must be 'message', 'function_call' or "
                           f"'function_call_output', got {kind!r}", param=f"{at}.type")
    return out


def chat_tools(tools: list[dict] | None) -> list[dict]:
    """Responses' function tools ({"type": "function", "name", "parameters", ...}) -> chat's
    ({"type": "function", "function": {...}}), validated as chat completions validates them."""
    out, names = [], set()
    for i, t in enumerate(tools or []):
        if t.get("type") != "function":
            raise APIError(400, f"tools[{i}].type: only function tools are supported, got "
                           f"{t.get('type')!r}", param=f"tools[{i}].type")
        fn = {k: v for k, v in t.items() if k != "type"}
        try:
            tool = Tool.model_validate({"type": "function", "function": fn})
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"][1:])
            raise APIError(400, f"tools[{i}].{where}: {err['msg']}",
                           param=f"tools[{i}].{where}") from None
        if tool.function.name in names:
            raise APIError(400, f"tools[{i}].name: function names must be unique, got "
                           f"{tool.function.name!r} twice", param=f"tools[{i}].name")
        names.add(tool.function.name)
        out.append(tool.model_dump(exclude_none=True))
    return out


def chat_tool_choice(choice):
    """Responses' {"type": "function", "name": ...} -> chat's named choice; strings pass."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, "tool_choice: must be 'none', 'auto', 'required' or {'type': "
                   "'function', 'name': ...}", param="tool_choice")


def text_format(req: ResponsesRequest) -> tuple[dict, dict | None]:
    """(text.format as the response reports it, the JSON schema the answer must follow or
    None for free text)."""
    fmt = (req.text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return fmt, None
    if kind == "json_object":
        return fmt, {"type": "object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("name"), str) or not fmt["name"]:
            raise APIError(400, "text.format.name: a json_schema format needs a name",
                           param="text.format.name")
        if not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "text.format.schema: must be a JSON schema object",
                           param="text.format.schema")
        return fmt, fmt["schema"]
    raise APIError(400, "text.format.type: must be 'text', 'json_object' or 'json_schema', "
                   f"got {kind!r}", param="text.format.type")


def check_calls_answered(conversation: list[dict]) -> None:
    """Every function_call_output answers an earlier call, and every call has its output
    (OpenAI refuses an input either way)."""
    answered: dict[str, bool] = {}
    for m in conversation:
        for call in m.get("tool_calls") or []:
            answered[call["id"]] = False
        if m["role"] == "tool":
            if m["tool_call_id"] not in answered:
                raise APIError(400, "input: no function call found for the "
                               f"function_call_output with call_id {m['tool_call_id']!r}",
                               param="input")
            answered[m["tool_call_id"]] = True
    missing = [call_id for call_id, done in answered.items() if not done]
    if missing:
        raise APIError(400, f"input: no function_call_output for the function call with "
                       f"call_id {missing[0]!r}", param="input")


# ---- output ----------------------------------------------------------------------------------
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str, logprobs: list | None) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text, logprobs)]}


def text_part(text: str, logprobs: list | None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def reasoning_item(item_id: str, thought: str | None, status: str) -> dict:
    """The thinking as a reasoning item (no summary: the model's own text, as vLLM gives it)."""
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [] if thought is None else [reasoning_part(thought)]}


def reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def call_item(call: dict, status: str = "completed", arguments: str | None = None) -> dict:
    """A parsed call (server/tools.py's chat form) as a function_call output item."""
    fn = call["function"]
    return {"id": "fc_" + call["id"].removeprefix("call_"), "type": "function_call",
            "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"] if arguments is None else arguments, "status": status}


def message_text(text: str, calls: list[dict]) -> str | None:
    """The message part of an output: all of it without calls; with calls, the text before the
    first <tool_call> (what a stream may have sent before it saw one; text after the calls is
    dropped), or None where that is only white space."""
    if not calls:
        return text
    if text.lstrip().startswith(("{", "[")):  # the calls were the whole text, as JSON
        return None
    i = text.find(TOOL_OPEN)
    head = text[:i] if i >= 0 else ""
    return head if head.strip() else None


class TokenCursor:
    """How many of an output's tokens lie within its first `limit` characters, the tokens'
    texts summed as the stream goes (each token's text read once, however often asked)."""

    def __init__(self, token_str):
        self.token_str = token_str
        self.count = 0  # tokens within the last limit
        self.end = 0  # their characters

    def within(self, token_ids: list[int], limit: int | None) -> int:
        if limit is None:
            self.count = len(token_ids)
            return self.count
        while self.count < len(token_ids):
            width = len(self.token_str(token_ids[self.count]))
            if self.end + width > limit:
                break
            self.end += width
            self.count += 1
        return self.count


def status_of(finish_reason: str | None) -> tuple[str, dict | None]:
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


class ResponseBuilder:
    """What a request's response says besides its output (the request's settings, usage)."""

    def __init__(self, api: OpenAIServer, req: ResponsesRequest, params, fmt: dict):
        self.id = _id("resp")
        self.created = int(time.time())
        self.api, self.req, self.params, self.fmt = api, req, params, fmt

    def body(self, status: str, output: list[dict], usage: dict | None = None,
             incomplete: dict | None = None, error: dict | None = None) -> dict:
        req = self.req
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "error": error, "incomplete_details": incomplete,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "model": self.api.model_name, "output": output,
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id, "reasoning": None,
                "store": req.store is not False, "temperature": self.params.temperature,
                "text": {"format": self.fmt}, "tool_choice": req.tool_choice or "auto",
                "tools": req.tools or [], "top_p": self.params.top_p,
                "top_logprobs": req.top_logprobs,
                "truncation": req.truncation or "disabled", "usage": usage,
                "metadata": req.metadata or {}, "user": req.user}


def response_usage(num_prompt: int, num_cached: int, num_generated: int,
                   num_reasoning: int = 0) -> dict:
    return {"input_tokens": num_prompt,
            "input_tokens_details": {"cached_tokens": num_cached, "cache_write_tokens": 0},
            "output_tokens": num_generated,
            "output_tokens_details": {"reasoning_tokens": num_reasoning},
            "total_tokens": num_prompt + num_generated}


def assistant_turn(content: str | None, calls: list[dict]) -> dict:
    """The output as the assistant message a later request's chat holds."""
    turn = {"role": "assistant", "content": content or ""}
    if calls:
        turn["tool_calls"] = [{"id": c["id"], "type": "function",
                               "function": {"name": c["function"]["name"],
                                            "arguments": json.loads(c["function"]["arguments"])}}
                              for c in calls]
    return turn


# ---- routes ----------------------------------------------------------------------------------
async def create_response(request: Request):
    api: OpenAIServer = request.app.state.api
    arrival = time.monotonic()
    req = parse_request(ResponsesRequest, await request.body())
    lora = api.check_model(req.model)
    api.need_tokenizer("input")
    if req.n != 1:
        raise APIError(400, "n: the Responses API gives one output (use n on chat completions)",
                       param="n")
    history: list[dict] = []
    if req.previous_response_id is not None:
        kept = api.response_store.get(req.previous_response_id)
        if kept is None:
            raise APIError(400, f"Previous response with id '{req.previous_response_id}' not "
                           "found.", param="previous_response_id",
                           code="previous_response_not_found")
        history = kept[1]
    added = input_messages(req.input)
    conversation = history + added
    check_calls_answered(conversation)
    tools = chat_tools(req.tools)
    tool_choice, only = resolve_tool_choice(chat_tool_choice(req.tool_choice), tools)
    parallel = req.parallel_tool_calls is not False
    native = template_knows_tools(api.tokenizer)
    api.limits.check_stop(req.stop)
    api.limits.check_logprobs(req.top_logprobs, "top_logprobs")
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []

    async def encode(turns: list[dict]) -> list[int]:
        try:
            return await api.off_loop(api.encode_chat,
                                      prompt_messages(system + turns, tools, native), True,
                                      tools if native else None)
        except APIError as e:  # the chat template's complaint is about the input
            raise APIError(400, e.message.replace("messages:", "input:", 1),
                           param="input") from None

    ids = await encode(conversation)
    if req.truncation == "auto":
        # OpenAI's "auto": the oldest items go until the input leaves room for the answer
        # (the kept conversation stays whole)
        fits = min(api.max_model_len - (req.max_output_tokens or 1),
                   api.limits.max_prompt_tokens or api.max_model_len)
        if len(ids) > fits:
            ids = await _truncated(conversation, encode, fits) or ids
    api.limits.check_prompt_tokens(len(ids), "input")
    parser = api.reasoning_parser
    opened = parser is not None and prompt_opens_thinking(
        await api.off_loop(api.tokenizer.decode, ids[-8:]))
    num_top = (req.top_logprobs or 0) if LOGPROBS_INCLUDE in (req.include or []) else None
    fmt, answer_schema = text_format(req)
    fmt_field = "text.format.schema" if fmt.get("type") == "json_schema" else "text.format"
    other, other_field = req.structured()
    if other is not None and answer_schema is not None:
        raise APIError(400, f"{other_field}: give only one structured output constraint "
                       "(also got text.format)", param=other_field)
    open_id, close_id = api.tag_id(TOOL_OPEN), api.tag_id(TOOL_CLOSE)
    if tool_choice == "required":  # calls only: text.format is a text answer's, and none comes
        if other is not None:
            raise APIError(400, f"tool_choice: a required tool call cannot be combined with "
                           f"{other_field}", param="tool_choice")
        structured, structured_field = call_grammar(tools, only, parallel, open_id,
                                                    close_id), "tools"
    elif answer_schema is not None and tool_choice == "auto":
        # the tools stay callable, and an answer follows the format (agents with an output
        # type and tools send both)
        structured, structured_field = call_grammar(tools, None, parallel, open_id, close_id,
                                                    answer_schema), fmt_field
    elif (answer_schema is None and other is None and tool_choice == "auto"
          and has_strict(tools, strict_default=True)):
        # strict functions (the Responses API's default): text, or calls whose arguments
        # follow their schemas
        structured, structured_field = auto_grammar(tools, parallel, open_id, close_id,
                                                    strict_default=True), "tools"
    elif answer_schema is not None:
        structured, structured_field = StructuredOutputsParams.from_any(
            {"json": answer_schema}), fmt_field
    else:
        structured, structured_field = other, other_field
    try:
        params = req.sampling_params(
            api.max_tokens(len(ids), req.max_output_tokens, "input", "max_output_tokens"),
            num_top, api.sampling_defaults, structured)
    except ValueError as e:
        raise sampling_error(e) from None
    builder = ResponseBuilder(api, req, params, fmt)
    slots = await api.add([ids], [params], arrival, builder.id, structured_field, req.cache_salt,
                          lora)
    tool_names = {t["function"]["name"] for t in tools} if tool_choice != "none" else set()
    # beside a JSON answer, calls come only in tags: a JSON text is the answer
    bare_json = not (answer_schema is not None and tool_choice == "auto")

    def logprobs(tids, lps) -> list | None:
        if num_top is None:
            return None
        return chat_logprobs(api.token_str, tids, lps, num_top)["content"]

    def keep(body: dict, content: str | None, calls: list[dict]) -> None:
        """A finished response into the store, with the chat it ends (its logprobs left out:
        they are most of a response's bytes)."""
        if req.store is False:
            return
        for item in body["output"]:
            for part in item.get("content", []):
                if part["type"] == "output_text":
                    part["logprobs"] = []
        turn = assistant_turn(content, calls)
        kept = conversation + [turn]  # counted whole: a chain's turns are shared, not copied,
        nbytes = len(json.dumps(body)) + len(json.dumps(kept))  # so this over-counts, safely
        api.response_store.put(builder.id, body, kept, nbytes)

    if req.stream:
        thinking = ReasoningStream(parser, opened) if parser else None
        events = _stream(api, slots, params, builder, tool_names, bare_json, num_top,
                         len(ids), logprobs, keep, thinking)
        return EventStream(events, on_close=lambda: api.abort(slots))

    (final,) = await api.final_outputs(request, slots)
    comp = final.outputs[0]
    status, incomplete = status_of(comp.finish_reason)
    thought, text = split_reasoning(parser, comp.text, opened) if parser else (None, comp.text)
    # the answer is the output's last characters: the tokens wholly before it are thinking
    skip = TokenCursor(api.token_str).within(comp.token_ids, len(comp.text) - len(text))
    answer_ids, answer_lps = comp.token_ids[skip:], (comp.logprobs or [])[skip:]
    calls = parse_tool_calls(text, tool_names, bare_json)[1] if tool_names else []
    content = message_text(text, calls) if text or thought is None else None  # thinking only
    n = TokenCursor(api.token_str).within(answer_ids, len(content or "") if calls else None)
    # the thinking ended (</think>) is complete whatever became of the answer, as streamed
    rs_status = "completed" if CLOSE in comp.text else status
    output = [reasoning_item(_id("rs"), thought, rs_status)] if thought is not None else []
    if content is not None:
        output.append(message_item(_id("msg"), content, status,
                                   logprobs(answer_ids[:n], answer_lps[:n])))
    body = builder.body(status, output + [call_item(c) for c in calls], response_usage(
        len(ids), final.num_cached_tokens, len(comp.token_ids), skip if thought else 0),
        incomplete)
    response = JSONResponse(body)
    keep(body, content, calls)
    return response


async def _truncated(turns: list[dict], encode, fits: int) -> list[int] | None:
    """The ids of the longest tail of the conversation whose prompt is at most `fits` tokens:
    its leading system messages kept, the rest cut before a user or assistant message (a
    call's outputs go with it), the cut found by bisection (a few encodes, however long the
    conversation). None: even the last such tail is too long."""
    lead = next((i for i, m in enumerate(turns) if m["role"] != "system"), len(turns))
    cuts = [i for i in range(lead + 1, len(turns)) if turns[i]["role"] in ("user", "assistant")]
    lo, hi, best = 0, len(cuts) - 1, None
    while lo <= hi:  # the first cut whose tail fits
        mid = (lo + hi) // 2
        ids = await encode(turns[:lead] + turns[cuts[mid]:])
        if len(ids) <= fits:
            best, hi = ids, mid - 1
        else:
            lo = mid + 1
    return best


async def _stream(api, slots, params, builder: ResponseBuilder, tool_names: set[str],
                  bare_json: bool, num_top: int | None, num_prompt: int, logprobs, keep,
                  thinking: ReasoningStream | None):
    """The typed events of one streamed response. With a reasoning parser (`thinking`), the
    thinking streams first as a reasoning item, closed when the answer starts. A message item
    opens with the first text that is not white space; with tools, text that may be a call is
    held back (ToolStream), and each delta carries the log-probs of the tokens whose text it
    completes (after the thinking's tokens)."""
    seq = 0

    def event(kind: str, **fields) -> str:
        nonlocal seq
        data = json.dumps({"type": kind, "sequence_number": seq, **fields}, ensure_ascii=False,
                          separators=(",", ":"))
        seq += 1
        return f"event: {kind}\ndata: {data}\n\n"

    yield event("response.created", response=builder.body("in_progress", []))
    yield event("response.in_progress", response=builder.body("in_progress", []))
    choice = ChoiceStream(0, params)
    tool_stream = ToolStream(tool_names, bare_json) if tool_names else None
    msg_id, opened, sent, held = _id("msg"), False, "", ""
    where = {"item_id": msg_id, "output_index": 0, "content_index": 0}
    tids: list[int] = []  # every token so far, and their log-prob entries
    entries: list = []
    lps: list = []  # the log-probs sent, formatted
    cursor = TokenCursor(api.token_str)
    rs_id, thought, reasoning = _id("rs"), "", None  # reasoning: None, "open" or its status
    rs_where = {"item_id": rs_id, "output_index": 0, "content_index": 0}
    fed = 0  # characters of output text fed to `thinking`
    start, skip = None, 0  # where the answer starts: characters, and the tokens wholly before

    def take_logprobs(limit: int | None) -> list:
        """The formatted log-probs of the answer's tokens not yet sent whose text lies within
        `limit` of its characters (None: all of them)."""
        if num_top is None:
            return []
        n = cursor.within(tids, None if limit is None else (start or 0) + limit)
        done = skip + len(lps)
        new = logprobs(tids[done:n], entries[done:n]) if n > done else []
        lps.extend(new)
        return new

    def open_message():
        where["output_index"] = 0 if reasoning is None else 1
        return [event("response.output_item.added", output_index=where["output_index"],
                      item={**message_item(msg_id, "", "in_progress", None), "content": []}),
                event("response.content_part.added", **where, part=text_part("", None))]

    def close_reasoning(status: str):
        nonlocal reasoning
        reasoning = status
        yield event("response.reasoning_text.done", **rs_where, text=thought)
        yield event("response.content_part.done", **rs_where, part=reasoning_part(thought))
        yield event("response.output_item.done", output_index=0,
                    item=reasoning_item(rs_id, thought, status))

    try:
        async for _, out in iterate(slots):
            comp = out.outputs[0]
            piece = choice.advance(comp, num_top is not None)
            if piece is None:
                continue
            delta, new_ids, new_lps = piece
            tids += new_ids
            entries += new_lps
            if thinking is not None:
                fed += len(delta)
                more, delta = thinking.feed(delta, comp.finished)
                if more:
                    if reasoning is None:
                        reasoning = "open"
                        yield event("response.output_item.added", output_index=0,
                                    item=reasoning_item(rs_id, None, "in_progress"))
                        yield event("response.content_part.added", **rs_where,
                                    part=reasoning_part(""))
                    thought += more
                    yield event("response.reasoning_text.delta", **rs_where, delta=more)
                if reasoning == "open" and (not thinking.thinking or comp.finished):
                    for e in close_reasoning("completed" if not thinking.thinking else
                                             status_of(comp.finish_reason)[0]):
                        yield e
                if delta and start is None:
                    # the answer's first characters: the tokens wholly before are thinking
                    start = fed - len(thinking.buf) - len(delta)
                    skip = cursor.within(tids, start)
            if tool_stream is not None:
                delta = tool_stream.feed(delta, comp.finished)[0]
            held += delta
            if held.strip() and not comp.finished:  # a message's text (white space waits)
                if not opened:
                    opened = True
                    for e in open_message():
                        yield e
                sent += held
                yield event("response.output_text.delta", **where, delta=held,
                            logprobs=take_logprobs(len(sent)))
                held = ""
            if not comp.finished:
                continue
            status, incomplete = status_of(comp.finish_reason)
            # the answer: the output's characters from its start (none: all was thinking)
            text = comp.text if thinking is None else "" if start is None else comp.text[start:]
            calls = parse_tool_calls(text, tool_names, bare_json)[1] if tool_names else []
            content = message_text(text, calls) if text or not thought else None
            output = [reasoning_item(rs_id, thought, reasoning)] if reasoning else []
            if content is not None:
                if not opened:
                    opened = True
                    for e in open_message():
                        yield e
                rest = content[len(sent):] if content.startswith(sent) else ""
                last = take_logprobs(len(content) if calls else None)
                if rest or last:
                    yield event("response.output_text.delta", **where, delta=rest, logprobs=last)
                sent += rest
                yield event("response.output_text.done", **where, text=sent, logprobs=lps)
                yield event("response.content_part.done", **where, part=text_part(sent, lps))
                item = message_item(msg_id, sent, status, lps)
                yield event("response.output_item.done", output_index=where["output_index"],
                            item=item)
                output.append(item)
            for call in calls:
                index = len(output)
                item = call_item(call, "in_progress", "")
                yield event("response.output_item.added", output_index=index, item=item)
                args = call["function"]["arguments"]
                yield event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=index, delta=args)
                yield event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=index, name=call["function"]["name"], arguments=args)
                item = call_item(call)
                yield event("response.output_item.done", output_index=index, item=item)
                output.append(item)
            if reasoning and start is None:  # all thinking
                skip = len(comp.token_ids)
            body = builder.body(status, output, response_usage(
                num_prompt, out.num_cached_tokens, len(comp.token_ids), skip if thought else 0),
                incomplete)
            final = event("response.completed" if status == "completed"
                          else "response.incomplete", response=body)
            keep(body, content, calls)
            yield final
    except RequestError as e:  # the engine failed the request: the stream says so and ends
        output = [message_item(msg_id, sent, "incomplete", lps)] if opened else []
        if reasoning:
            output.insert(0, reasoning_item(rs_id, thought, "incomplete"))
        body = builder.body("failed", output, error={
            "code": "server_error" if e.status_code >= 500 else "invalid_prompt",
            "message": e.message})
        failed = event("response.failed", response=body)
        keep(body, sent or None, [])  # kept as OpenAI keeps a failed response
        yield failed


async def get_response(request: Request, response_id: str):
    api: OpenAIServer = request.app.state.api
    kept = api.response_store.get(response_id)
    if kept is None:
        raise APIError(404, f"No response found with id '{response_id}'.", param="response_id",
                       code="not_found")
    return JSONResponse(kept[0])


async def delete_response(request: Request, response_id: str):
    api: OpenAIServer = request.app.state.api
    if not api.response_store.delete(response_id):
        raise APIError(404, f"No response found with id '{response_id}'.", param="response_id",
                       code="not_found")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
