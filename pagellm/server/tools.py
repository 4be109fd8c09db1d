"""Tool calling on /v1/chat/completions: tools into the prompt, tool_choice into a grammar,
tool calls out of the text.

One format on every model, the Hermes form that Qwen2.5 is trained on:

    <tool_call>
    {"name": "<function name>", "arguments": {<arguments as a JSON object>}}
    </tool_call>

A chat template that knows tools (it reads a `tools` variable, as Qwen2.5's does) renders the
tools, the assistant's earlier `tool_calls` and the `tool` results itself. For any other
template the tools go into a system message (TOOLS_SYSTEM_PROMPT, below), earlier calls into the
assistant's text in the form above, and tool results into a user message inside
<tool_response></tool_response>, so tool_choice works on every model.

tool_choice "required" or a named function constrains the output to calls of those functions
whose arguments follow each function's JSON schema (so they always parse); "auto" leaves the
model free and parses what it wrote, except that where a function is strict its calls follow
its schema (auto_grammar); "none" does not parse.
"""
from __future__ import annotations

import json
import re
import uuid

from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured.grammar import JSON_OPTIONS
from pagellm.server.errors import APIError

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"

TOOLS_SYSTEM_PROMPT = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


def tool_dicts(tools) -> list[dict]:
    """The request's tools as plain dicts (what templates and the system prompt show)."""
    return [t.model_dump(exclude_none=True) for t in tools or []]


def resolve_tool_choice(tool_choice, tools: list[dict]) -> tuple[str, str | None]:
    """-> ("none" | "auto" | "required", the one function's name for a named choice)."""
    names = [t["function"]["name"] for t in tools]
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise APIError(400, "tool_choice: must be 'none', 'auto', 'required' or "
                           f"{{'type': 'function', 'function': {{'name': ...}}}}, got "
                           f"{tool_choice!r}", param="tool_choice")
        if tool_choice != "none" and not tools:
            raise APIError(400, f"tool_choice: {tool_choice!r} needs `tools`", param="tool_choice")
        return tool_choice, None
    fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise APIError(400, "tool_choice: a named choice is {'type': 'function', 'function': "
                       "{'name': ...}}", param="tool_choice")
    if name not in names:
        raise APIError(400, f"tool_choice: function {name!r} is not in `tools` ({names})",
                       param="tool_choice")
    return "required", name


def template_knows_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return re.search(r"\btools\b", template) is not None


def prompt_messages(messages: list[dict], tools: list[dict], native: bool) -> list[dict]:
    """Messages for a template without tool support: tools in a system message, earlier calls
    and results as text. A native template gets the messages unchanged (and `tools=`)."""
    if native:
        return messages
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_call_text(c["function"]["name"], c["function"]["arguments"])
                              for c in m["tool_calls"])
            text = (m.get("content") or "").strip()
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        elif m["role"] == "tool":
            result = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "_tool_results": True})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        system = TOOLS_SYSTEM_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _call_text(name: str, arguments) -> str:
    return (f"{TOOL_OPEN}\n" + json.dumps({"name": name, "arguments": arguments},
                                          ensure_ascii=False) + f"\n{TOOL_CLOSE}")


def _call_schema(tools: list[dict], only: str | None, strict_only: bool = False,
                 strict_default: bool = False) -> dict:
    """The JSON schema of one call ({"name", "arguments"}) of the allowed functions, each
    call's arguments following the function's parameters (strict_only: only a strict
    function's, a function without `strict` taking strict_default; any object for the
    others)."""
    variants = []
    for t in tools:
        fn = t["function"]
        if only is not None and fn["name"] != only:
            continue
        params = fn.get("parameters") or {"type": "object"}
        if strict_only and not fn.get("strict", strict_default):
            params = {"type": "object"}
        variants.append({"type": "object", "properties": {
            "name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False})
    return _bounded_space(variants[0] if len(variants) == 1 else {"anyOf": variants})


def _tags(open_id: int | None, close_id: int | None) -> tuple[str, str]:
    return (f"<[{open_id}]>" if open_id is not None else json.dumps(TOOL_OPEN),
            f"<[{close_id}]>" if close_id is not None else json.dumps(TOOL_CLOSE))


def call_grammar(tools: list[dict], only: str | None, parallel: bool,
                 open_id: int | None, close_id: int | None,
                 answer_schema: dict | None = None) -> StructuredOutputsParams:
    """A grammar for one (or, with parallel calls, several) tool calls of the allowed
    functions, each call's arguments constrained to the function's parameters schema. Where the
    tokenizer has the tags as single tokens (Qwen2.5), the grammar names those tokens.
    answer_schema: or else an answer in JSON of that schema (tool_choice "auto" beside a JSON
    output format: the format is the final answer's, and the tools stay callable)."""
    schema = _call_schema(tools, only)
    open_tag, close_tag = _tags(open_id, close_id)
    repeat = ' ("\\n" call)*' if parallel else ""
    answer = (f" | %json {json.dumps(_bounded_space(answer_schema))}"
              if answer_schema is not None else "")
    lark = (f"start: call{repeat} \"\\n\"?{answer}\n"
            f"call: {open_tag} \"\\n\" %json {json.dumps(schema)} \"\\n\" {close_tag}\n")
    return StructuredOutputsParams(grammar=lark)


def has_strict(tools: list[dict], strict_default: bool = False) -> bool:
    """Whether a function is strict (strict_default: a function that does not say; OpenAI's
    Responses API defaults to strict, chat completions not)."""
    return any(t["function"].get("strict", strict_default) for t in tools)


def auto_grammar(tools: list[dict], parallel: bool, open_id: int | None,
                 close_id: int | None, strict_default: bool = False) -> StructuredOutputsParams:
    """tool_choice "auto" where a function is strict (OpenAI: its calls follow its schema):
    text, or text followed by calls in tags, or a bare JSON call (the whole answer, as small
    models write one, also in a ```json code block), every call's arguments following its
    function's schema where the function is strict (any object for the others); the calls end
    the answer (a new line may follow them). The text excludes what parse_tool_calls would
    read as a call: the tag spelled in text, and a start of white space and "{" or "[{" (a
    bare call or a list of them), fenced as a code block or not (a text answer may then not
    open with a JSON code block). Where the open tag is text the lead-in before a call is a
    lazy lexeme that ends at the tag (a greedy one would swallow it); where it is a single
    token no text lexeme can take it."""
    schema = json.dumps(_call_schema(tools, None, strict_only=True,
                                     strict_default=strict_default))
    open_tag, close_tag = _tags(open_id, close_id)
    more = f' ("\\n" {open_tag} body)*' if parallel else ""
    json_start = r"~/(?s:[ \t\r\n]*(```(json)?[ \t]*\n?[ \t\r\n]*)?(\{|\[[ \t\r\n]*\{).*)/"
    lark = (f"PROSE: /(?s:.*)/ & ~/(?s:.*{re.escape(TOOL_OPEN)}.*)/ & {json_start}\n"
            f"body: \"\\n\" %json {schema} \"\\n\" {close_tag}\n"
            f"bare: %json {schema} | FENCE %json {schema} \"\\n```\"\n"
            "FENCE: /```(json)?\\n/\n")
    if open_id is not None:
        lark = f"start: PROSE? ({open_tag} body{more} \"\\n\"?)? | bare\n" + lark
    else:
        # the lead-in may not start where a bare call does (a lazy lexeme alive beside one
        # keeps it from ending)
        lark = ("start: PROSE | lead calls | bare\n"
                f"lead[stop={open_tag}]: /(?s:.*)/ & {json_start}\n"
                f"calls: body{more} \"\\n\"?\n") + lark
    return StructuredOutputsParams(grammar=lark)


def _bounded_space(schema: dict) -> dict:
    """A schema inside a lark grammar with the white space a lone schema gets
    (structured/grammar.py's JSON_OPTIONS), unless it sets its own."""
    return schema if "x-guidance" in schema else {**schema, "x-guidance": JSON_OPTIONS}


def parse_tool_calls(text: str, tool_names: set[str],
                     bare_json: bool = True) -> tuple[str | None, list[dict]]:
    """Model text -> (content outside the calls or None, OpenAI tool_calls). Calls are the
    <tool_call> blocks holding {"name", "arguments"} of a known function, or (bare_json) the
    whole text as one such JSON object (or a list of them); anything else stays content.
    bare_json False: where a JSON text is an answer (a grammar of calls or a JSON answer)."""
    calls, spans = [], []
    for m in re.finditer(re.escape(TOOL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(TOOL_CLOSE)
                         + r"|$)", text, re.DOTALL):
        call = _as_call(m.group(1), tool_names)
        if call is None:
            continue
        calls.append(call)
        spans.append(m.span())
    if not calls:
        body = _bare_body(text) if bare_json else None
        # also without an outer pair of braces: `{{ ... }}`, as Qwen2.5-Coder's template
        # shows the call format
        for candidate in (body, body[1:-1] if body and body.startswith("{{") else None):
            if candidate is None:
                continue
            try:
                obj = _strict_json(candidate)
            except (ValueError, RecursionError):
                continue
            items = obj if isinstance(obj, list) else [obj]
            found = [_as_call(json.dumps(o), tool_names) for o in items]
            if items and all(found):
                return None, [_openai_call(c) for c in found]
        return text, []
    content, last = "", 0
    for a, b in spans:
        content += text[last:a]
        last = b
    content = (content + text[last:]).strip()
    return content or None, [_openai_call(c) for c in calls]


# A whole answer in one fenced JSON block (as small models write a call; llama.cpp reads it)
_FENCED = re.compile(r"```(?:json)?[ \t]*\n(.*?)\n?[ \t]*```", re.DOTALL)
_FENCE_START = re.compile(r"```(?:json)?[ \t]*\n?\s*[\[{]")


def _bare_body(text: str) -> str | None:
    """The JSON text of an answer that may be a bare call: the whole text, or what one fenced
    code block (```json ... ```) holds, where it opens with a brace or a bracket."""
    stripped = text.strip()
    m = _FENCED.fullmatch(stripped)
    if m:
        stripped = m.group(1).strip()
    return stripped if stripped.startswith(("{", "[")) else None


def _strict_json(text: str):
    """json.loads without NaN / Infinity (Python's extension): arguments must be JSON a
    client can parse, and a JSON response cannot carry them."""
    return json.loads(text, parse_constant=_no_constant)


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _as_call(body: str, tool_names: set[str]) -> dict | None:
    try:
        obj = _strict_json(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or obj.get("name") not in tool_names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = _strict_json(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": args}


def _openai_call(call: dict) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"],
                         "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}


class ToolStream:
    """Streaming with tools: content is sent as it comes until a tool call may be starting
    (a <tool_call> tag, a prefix of one at the end, or output that opens with a JSON object);
    the calls are parsed and sent when the choice finishes."""

    def __init__(self, tool_names: set[str], bare_json: bool = True):
        self.tool_names = tool_names
        self.bare_json = bare_json  # False: calls come only in tags (parse_tool_calls)
        self.text = ""
        self.sent = 0

    def feed(self, delta: str, finished: bool) -> tuple[str, list[dict]]:
        """-> (content to send now, tool calls: only at the finish)."""
        self.text += delta
        if finished:
            content, calls = parse_tool_calls(self.text, self.tool_names, self.bare_json)
            if not calls:
                return self._send(len(self.text)), []
            head = self.text[:self.text.find(TOOL_OPEN)] if TOOL_OPEN in self.text else ""
            rest = head[self.sent:].rstrip() if self.sent < len(head) else ""
            return rest, calls
        return self._send(self._safe_end()), []

    def _safe_end(self) -> int:
        head = self.text.lstrip()
        if self.bare_json and (head.startswith(("{", "[")) or _FENCE_START.match(head)
                               or (len(head) < 9 and any(f.startswith(head) for f in (
                                   "```json\n{", "```\n{")))):
            return self.sent  # maybe a bare JSON call (or one fenced): hold it
        i = self.text.find(TOOL_OPEN)
        if i >= 0:
            return max(self.sent, i)
        for n in range(min(len(TOOL_OPEN) - 1, len(self.text)), 0, -1):
            if TOOL_OPEN.startswith(self.text[-n:]):
                return max(self.sent, len(self.text) - n)
        return len(self.text)

    def _send(self, end: int) -> str:
        piece = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return piece
