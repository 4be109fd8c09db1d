"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API (what Anthropic's
SDKs and agents built on them call), as vLLM and llama.cpp serve it, on the chat machinery.

A request becomes a chat completion request: `system` a system message first; each message's
text blocks its text, an assistant's `tool_use` blocks its tool_calls, a user's `tool_result`
blocks tool messages (before its text, as the API orders them); thinking blocks sent back are
passed over, as chat templates leave out earlier turns' thinking. `tools` ({name, description,
input_schema}) are chat's function tools and `tool_choice` maps auto / any / tool / none onto
chat's (`disable_parallel_tool_use` onto parallel_tool_calls); `stop_sequences`, temperature,
top_p and top_k are chat's fields, and so are vLLM's sampling and constraint fields a request
adds (min_p, seed, guided_regex, ...: CHAT_EXTRAS); `thinking` turns a template's
`enable_thinking` on or off.
The chat's answer comes back as content blocks: thinking (with a reasoning parser), text, then
a tool_use block per call, and `stop_reason` end_turn / max_tokens / stop_sequence / tool_use;
a stream sends the documented events (message_start, content_block_start / _delta / _stop,
message_delta with the stop reason and output tokens, message_stop). Errors are Anthropic's
shape: {"type": "error", "error": {"type", "message"}} (errors.error_body: the gates' and the
app's too). `usage.input_tokens` counts the prompt tokens the prefix cache did not serve
(`cache_read_input_tokens` the ones it did; a stream's message_delta says both). A last
assistant message is the answer's start (Anthropic's prefill): the reply continues it.
"""
from __future__ import annotations

import json
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse

from pagellm.server.chat import chat_completion
from pagellm.server.errors import APIError, anthropic_error_body, parse_request
from pagellm.server.protocol import ChatCompletionRequest, MessagesRequest, joined_text
from pagellm.server.state import OpenAIServer
from pagellm.server.streaming import EventStream

# vLLM's sampling and constraint fields a request may add (the SDK's extra_body): passed to
# the chat request as they are (n, logprobs and the stream's options stay the route's)
CHAT_EXTRAS = ("min_p", "seed", "cache_salt", "stop_token_ids", "presence_penalty",
               "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens",
               "num_speculative_tokens", "include_stop_str_in_output", "skip_special_tokens",
               "logit_bias", "structured_outputs", "guided_json", "guided_regex",
               "guided_choice", "guided_grammar", "chat_template_kwargs")
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                "abort": "end_turn"}


# ---- request -> chat ---------------------------------------------------------------------------
def _text(content, at: str) -> str:
    """A string, or text blocks joined (a tool_result's content, the system prompt)."""
    return joined_text(content, at, ("text",), noun="blocks", sep="\n")


def chat_messages(req: MessagesRequest) -> list[dict]:
    """`system` and `messages` -> chat completion messages (OpenAI's form)."""
    out = [] if req.system is None else [{"role": "system",
                                          "content": _text(req.system, "system")}]
    for i, message in enumerate(req.messages):
        at = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise APIError(400, f"{at}.role: must be 'user' or 'assistant', got {role!r}",
                           param=f"{at}.role")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise APIError(400, f"{at}.content: must be a string or a list of content blocks",
                           param=f"{at}.content")
        texts, calls = [], []
        for j, block in enumerate(content):
            where = f"{at}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise APIError(400, f"{where}.text: must be a string", param=f"{where}.text")
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                for field in ("id", "name"):
                    if not isinstance(block.get(field), str) or not block[field]:
                        raise APIError(400, f"{where}.{field}: must be a non-empty string",
                                       param=f"{where}.{field}")
                if not isinstance(block.get("input", {}), dict):
                    raise APIError(400, f"{where}.input: must be an object",
                                   param=f"{where}.input")
                calls.append({"id": block["id"], "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise APIError(400, f"{where}.tool_use_id: must be a string",
                                   param=f"{where}.tool_use_id")
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": _text(block.get("content", ""), f"{where}.content")})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue
            else:
                allowed = ("text, tool_use, thinking" if role == "assistant"
                           else "text, tool_result")
                raise APIError(400, f"{where}.type: a {role} message takes {allowed} blocks, "
                               f"got {kind!r}", param=f"{where}.type")
        if role == "assistant":
            out.append({"role": "assistant", "content": "\n".join(texts),
                        **({"tool_calls": calls} if calls else {})})
        elif texts:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


def chat_tools(req: MessagesRequest) -> dict:
    """tools and tool_choice -> chat's tools, tool_choice and parallel_tool_calls."""
    fields: dict = {}
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if t.get("type") not in (None, "custom"):  # Anthropic's server tools (web search...)
                raise APIError(400, f"tools[{i}].type: only client tools ({{name, description, "
                               f"input_schema}}) are supported, got {t.get('type')!r}",
                               param=f"tools[{i}].type")
            fn = {"name": t.get("name"), "parameters": t.get("input_schema", {})}
            if t.get("description") is not None:
                fn["description"] = t["description"]
            tools.append({"type": "function", "function": fn})
        fields["tools"] = tools
    choice = req.tool_choice
    if choice is not None:
        kind = choice.get("type")
        if kind == "tool":
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in ("auto", "any", "none"):
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
        else:
            raise APIError(400, "tool_choice.type: must be 'auto', 'any', 'tool' or 'none', got "
                           f"{kind!r}", param="tool_choice.type")
        if choice.get("disable_parallel_tool_use"):
            fields["parallel_tool_calls"] = False
    return fields


def chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    body = {"model": req.model, "messages": chat_messages(req), "max_tokens": req.max_tokens,
            "stream": req.stream, **chat_tools(req)}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    for field in ("temperature", "top_p", "top_k"):
        if getattr(req, field) is not None:
            body[field] = getattr(req, field)
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    body.update((k, v) for k, v in (req.model_extra or {}).items() if k in CHAT_EXTRAS)
    if req.thinking is not None:
        kind = req.thinking.get("type")
        if kind not in ("enabled", "disabled"):
            raise APIError(400, f"thinking.type: must be 'enabled' or 'disabled', got {kind!r}",
                           param="thinking.type")
        kwargs = body.get("chat_template_kwargs")
        body["chat_template_kwargs"] = {**(kwargs if isinstance(kwargs, dict) else {}),
                                        "enable_thinking": kind == "enabled"}
    if not body["messages"] or body["messages"][-1]["role"] == "system":
        raise APIError(400, "messages: at least one message is required", param="messages")
    last = body["messages"][-1]
    if last["role"] == "assistant" and not last.get("tool_calls"):
        # a last assistant turn is the start of the answer (Anthropic's prefill): the model
        # goes on writing it, and the reply holds what it adds
        if last["content"] != last["content"].rstrip():
            raise APIError(400, f"messages[{len(req.messages) - 1}].content: the final "
                           "assistant content cannot end with trailing whitespace",
                           param=f"messages[{len(req.messages) - 1}].content")
        body.update(continue_final_message=True, add_generation_prompt=False)
    # the chat request's own checks (its field names are these fields' names)
    return parse_request(ChatCompletionRequest, json.dumps(body).encode())


# ---- chat -> message ---------------------------------------------------------------------------
def stop_of(choice: dict, stops: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat choice."""
    hit = choice.get("stop_reason")
    if choice.get("finish_reason") == "stop" and isinstance(hit, str) and hit in (stops or []):
        return "stop_sequence", hit
    return STOP_REASONS.get(choice.get("finish_reason"), "end_turn"), None


def message_usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": output_tokens}


def tool_use(call: dict) -> dict:
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"] or "{}")}


def message_of(chat: dict, req: MessagesRequest) -> dict:
    choice = chat["choices"][0]
    msg = choice["message"]
    content = []
    thought = msg.get("reasoning_content")
    if thought:
        content.append({"type": "thinking", "thinking": thought, "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    content += [tool_use(c) for c in msg.get("tool_calls") or []]
    stop_reason, stop_sequence = stop_of(choice, req.stop_sequences)
    u = chat["usage"]
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"id": "msg_" + chat["id"].removeprefix("chatcmpl-"), "type": "message",
            "role": "assistant", "model": req.model or chat["model"], "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": message_usage(u["prompt_tokens"], cached, u["completion_tokens"])}


def event(kind: str, **fields) -> str:
    data = json.dumps({"type": kind, **fields}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n"


async def message_events(chunks, req: MessagesRequest, msg_id: str, num_prompt: int,
                         model: str):
    """The chat's SSE chunks -> the Messages API's events. A block opens with its first delta
    (text, thinking) and closes when another kind starts; each tool call is a whole block."""
    yield event("message_start", message={
        "id": msg_id, "type": "message", "role": "assistant", "model": req.model or model,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": message_usage(num_prompt, 0, 0)})
    yield event("ping")
    index, open_kind = -1, None
    stop_reason, stop_sequence, usage = "end_turn", None, message_usage(num_prompt, 0, 0)

    def start(kind: str, block: dict):
        nonlocal index, open_kind
        if open_kind is not None:
            yield event("content_block_stop", index=index)
        index, open_kind = index + 1, kind
        yield event("content_block_start", index=index, content_block=block)

    async for raw in chunks:
        if not raw.startswith("data: ") or raw.startswith("data: [DONE]"):
            continue
        chunk = json.loads(raw[6:])
        if "error" in chunk:  # the engine failed the request: the stream says so and ends
            err = chunk["error"]
            yield event("error", error=anthropic_error_body(err.get("code") if isinstance(
                err.get("code"), int) else 500, err["message"])["error"])
            return
        if chunk.get("usage"):  # the last chunk: the whole request's
            u = chunk["usage"]
            cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            usage = message_usage(u["prompt_tokens"], cached, u["completion_tokens"])
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {})
            if delta.get("reasoning_content"):
                if open_kind != "thinking":
                    for e in start("thinking", {"type": "thinking", "thinking": "",
                                                "signature": ""}):
                        yield e
                yield event("content_block_delta", index=index, delta={
                    "type": "thinking_delta", "thinking": delta["reasoning_content"]})
            if delta.get("content"):
                if open_kind != "text":
                    for e in start("text", {"type": "text", "text": ""}):
                        yield e
                yield event("content_block_delta", index=index,
                            delta={"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or []:
                for e in start("tool_use", {"type": "tool_use", "id": call["id"],
                                            "name": call["function"]["name"], "input": {}}):
                    yield e
                yield event("content_block_delta", index=index, delta={
                    "type": "input_json_delta",
                    "partial_json": call["function"]["arguments"] or "{}"})
            if choice.get("finish_reason") is not None:
                stop_reason, stop_sequence = stop_of(choice, req.stop_sequences)
    if open_kind is not None:
        yield event("content_block_stop", index=index)
    yield event("message_delta", delta={"stop_reason": stop_reason,
                                        "stop_sequence": stop_sequence},
                usage=usage)
    yield event("message_stop")


# ---- routes ----------------------------------------------------------------------------------
async def create_message(request: Request):
    arrival = time.monotonic()
    req = parse_request(MessagesRequest, await request.body())
    if req.max_tokens is None:
        raise APIError(400, "max_tokens: Field required", param="max_tokens")
    response, num_prompt = await chat_completion(request, chat_request(req), arrival)
    if isinstance(response, EventStream):
        events = message_events(response.body_iterator, req, f"msg_{uuid.uuid4().hex}",
                                num_prompt, request.app.state.api.model_name)
        return EventStream(events, on_close=response.on_close)
    return JSONResponse(message_of(json.loads(response.body), req))


async def count_tokens(request: Request):
    """{"input_tokens": N}: the prompt the same request to /v1/messages would get."""
    api: OpenAIServer = request.app.state.api
    chat = chat_request(parse_request(MessagesRequest, await request.body()))
    api.check_model(chat.model)
    api.need_tokenizer("messages")
    ids = await api.chat_prompt_ids(chat.messages, chat.tools, chat.add_generation_prompt,
                                    chat.chat_template_kwargs, chat.continue_final_message)
    return JSONResponse({"input_tokens": len(ids)})
