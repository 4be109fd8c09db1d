"""OpenAI request schemas (pydantic, only here at the HTTP edge).

Requests are validated strictly (no "1" -> 1 coercion): a wrong type or an out-of-range value is
a 400 naming the field. Unknown fields are accepted and ignored, as OpenAI's own server does for
fields it does not know (clients send extras such as `user`).
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pagellm.chat_template import check_template_kwargs
from pagellm.sampling_params import SamplingParams, StructuredOutputsParams
from pagellm.server.errors import APIError



# ---- requests --------------------------------------------------------------------------------
class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    # Prefix-cache isolation (vLLM's field): requests share cached prefixes only with
    # requests of the same salt (tenants that must not learn each other's prompts by timing).
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    # speculative decoding for this request: at most this many proposals a step, 0: none
    num_speculative_tokens: int | None = Field(None, ge=0, le=16)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool | None = False  # null: false (clients that send every field)
    stream_options: StreamOptions | None = None
    # Structured outputs: OpenAI's response_format, vLLM's fields, llama.cpp's json_schema and
    # grammar (GBNF). At most one may be given.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    grammar: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if not all(stops):  # how many and how long: the server's Limits
            raise ValueError("must be a non-empty string or a list of non-empty strings")
        return v

    def structured(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The constraint this request asks for and the field that asked (APIError(400)
        naming the field when it is malformed or when two fields ask)."""
        found = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                found.append(("response_format", {"json_object": True}))
            elif kind == "json_schema":
                js = rf.get("json_schema")
                schema = js.get("schema") if isinstance(js, dict) else None
                if not isinstance(schema, dict):
                    raise APIError(400, "response_format.json_schema.schema: must be a JSON "
                                   "schema object", param="response_format.json_schema.schema")
                found.append(("response_format.json_schema.schema", {"json": schema}))
            elif kind != "text":
                raise APIError(400, "response_format.type: must be 'text', 'json_object' or "
                               f"'json_schema', got {kind!r}", param="response_format.type")
        if self.structured_outputs is not None:
            found.append(("structured_outputs", self.structured_outputs))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                           ("guided_choice", "choice"), ("guided_grammar", "grammar"),
                           ("json_schema", "json"), ("grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                found.append((name, {kind: value}))
        if not found:
            return None, None
        if len(found) > 1:
            raise APIError(400, f"{found[1][0]}: give only one structured output constraint "
                           f"(also got {found[0][0]})", param=found[1][0])
        field, value = found[0]
        try:
            return StructuredOutputsParams.from_any(value), field
        except ValueError as e:
            raise APIError(400, f"{field}: {e}", param=field) from None

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        defaults: dict | None = None,
                        structured: StructuredOutputsParams | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """ValueError (from SamplingParams) names the field on a bad combination. `defaults`:
        the server's values for the sampling fields a request leaves out."""
        d = defaults or {}

        def pick(name, off):
            value = getattr(self, name)
            return value if value is not None else d.get(name, off)

        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0), min_p=pick("min_p", 0.0), seed=self.seed,
            presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            stop=self.stop, stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens, logit_bias=self.logit_bias,
            structured_outputs=structured, num_speculative_tokens=self.num_speculative_tokens)

    def stop_ids_and(self, ids) -> list[int]:
        """stop_token_ids with `ids` added (those not already there)."""
        own = list(self.stop_token_ids or [])
        return own + [t for t in ids if t not in own]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far (not only the last)
    continuous_usage_stats: bool = False


class CompletionRequest(_Request):
    prompt: Any
    max_tokens: int | None = Field(16, ge=0)  # 0: with echo only (the prompt scored)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None  # fill-in-the-middle: the text after the insertion (pagellm.infill)
    best_of: int | None = Field(None, ge=1)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        def ids(x):
            return isinstance(x, list) and all(type(t) is int for t in x)

        ok = (isinstance(v, str) or ids(v)
              or (isinstance(v, list) and (all(isinstance(p, str) for p in v)
                                           or all(ids(p) and p for p in v))))
        if not ok:
            raise ValueError("must be a string, a list of strings, a list of token ids or a list "
                             "of token id lists")
        if v == [] or v == "":
            raise ValueError("must not be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and type(p[0]) is int):
            return [p]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None  # a string, or a list of {"type": "text", "text": ...} parts
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages that called tools
    tool_call_id: str | None = None  # tool messages: the call they answer

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        if v is None or isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ValueError("must be a string or a list of content parts")
        for part in v:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts ({{'type': 'text', 'text': ...}}) are "
                                 f"supported, got {kind or type(part).__name__!r}")
        return v

    def as_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part["text"] for part in content)
        d = {"role": "system" if self.role == "developer" else self.role,
             "content": content or ""}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_calls:
            d["tool_calls"] = [c.as_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _arguments(cls, v):
        try:
            args = json.loads(v) if v.strip() else {}
        except (ValueError, RecursionError):  # not JSON, or nested past the stack
            raise ValueError("must be a JSON object in a string") from None
        if not isinstance(args, dict):
            raise ValueError("must be a JSON object in a string")
        return v


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction

    def as_dict(self) -> dict:
        # Chat templates (Qwen2.5's) write the arguments with `tojson`: they get the object.
        args = self.function.arguments
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name,
                             "arguments": json.loads(args) if args.strip() else {}}}


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class _TemplateKwargs(BaseModel):
    # vLLM's: more variables for the chat template (Qwen3's {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v):
        check_template_kwargs(v, "")
        return v


class ChatCompletionRequest(_Request, _TemplateKwargs):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: go on writing the last (assistant) message
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        names = [t.function.name for t in v or []]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"function names must be unique, got {dup[0]!r} twice")
        return v


class ResponsesRequest(_Request):
    """POST /v1/responses (server/openai_responses.py turns input, instructions and tools into
    a chat). The chat-completion sampling fields above (top_k, stop, seed, ...) are taken
    too, as vLLM's Responses endpoint takes them."""
    input: Any  # a string, or a list of items (messages, function calls and their outputs)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # null: true
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema"}}
    store: bool | None = None  # null: true
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None

    @field_validator("background")
    @classmethod
    def _background(cls, v):
        if v:
            raise ValueError("background responses are not supported by this server")
        return v

    @field_validator("input")
    @classmethod
    def _input(cls, v):
        if isinstance(v, str) and v:
            return v
        if isinstance(v, list) and v and all(isinstance(item, dict) for item in v):
            return v
        raise ValueError("must be a non-empty string or a non-empty list of input items")


class InfillChunk(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # llama.vim also sends `time`
    filename: str = ""
    text: str


class LlamaCppRequest(_Request):
    """The fields llama.cpp's own routes (/completion, /infill) share: its names for the
    budget and sampling fields, and its answer's options. Fields of llama.cpp's own machinery
    (cache_prompt, samplers, t_max_prompt_ms, id_slot) are accepted and ignored like any
    unknown field: pagellm always caches prefixes and has one sampler order."""
    n_predict: int | None = Field(None, ge=-1)  # -1: until the context is full
    max_tokens: int | None = Field(None, ge=0)  # n_predict's other name in llama.cpp
    repeat_penalty: float | None = Field(None, gt=0)
    n_probs: int = Field(0, ge=0, le=20)
    n_indent: int = Field(0, ge=0)
    t_max_predict_ms: int = Field(0, ge=0)
    response_fields: list[str] | None = None
    return_tokens: bool = False
    # also llama.cpp's list form: [[token id, bias or false (never)], ...]
    logit_bias: dict[str, float] | list[list[int | float | bool]] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _pairs(cls, v):
        if not isinstance(v, list):
            return v
        out = {}
        for pair in v:
            ok = (len(pair) == 2 and type(pair[0]) is int and pair[1] is not True
                  and isinstance(pair[1], (int, float, bool)))
            if not ok:
                raise ValueError("a list holds [token id, bias or false] pairs")
            out[str(pair[0])] = -100.0 if pair[1] is False else float(pair[1])
        return out

    @field_validator("n")
    @classmethod
    def _one(cls, v):
        if v != 1:
            raise ValueError("must be 1 (llama.cpp's routes answer one completion a prompt)")
        return v

    def budget(self) -> int | None:
        """The generation budget asked for: None until the context is full, else a count."""
        n = self.n_predict if self.n_predict is not None else self.max_tokens
        return None if n is None or n < 0 else n


class InfillRequest(LlamaCppRequest):
    """llama.cpp's POST /infill (llama.vim, llama.vscode): the code before and after the
    cursor, and other files as context."""
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[InfillChunk] = []
    prompt: str = ""  # the text typed on the cursor's line: it ends the prefix


class LlamaCompletionRequest(LlamaCppRequest):
    """llama.cpp's POST /completion: a prompt (text, token ids, or text and ids mixed), or a
    list of prompts (an answer each, in a JSON array)."""
    prompt: str | list[str | int | list[str | int]]

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if v == "" or v == []:
            raise ValueError("must not be empty")
        if isinstance(v, list) and any(isinstance(x, list) for x in v):
            if not all(isinstance(x, str) and x or isinstance(x, list) and x for x in v):
                raise ValueError("a list of prompts holds strings or lists of token ids and "
                                 "strings, none empty")
        return v

    def prompts(self) -> list[str | list[str | int]]:
        p = self.prompt
        if isinstance(p, str) or not any(isinstance(x, list) for x in p):
            if isinstance(p, list) and all(isinstance(x, str) for x in p) and len(p) > 1:
                return list(p)  # several text prompts
            return [p if isinstance(p, str) else list(p)]
        return [x for x in p]


class TokenizeRequest(_TemplateKwargs):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    prompt: str | None = None
    content: str | None = None  # llama.cpp's /tokenize names the text so
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_special: bool | None = None  # llama.cpp's name (its default: false)
    with_pieces: bool = False  # llama.cpp: each token as {"id", "piece"}
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None  # vLLM's: messages rendered as a chat with these tools


def joined_text(content, at: str, kinds: tuple[str, ...], noun: str = "parts",
                sep: str = "") -> str:
    """A request's content: a string, or a list of text items (each {"type": one of kinds,
    "text": ...}) joined by sep; anything else a 400 naming the item (`at`: where it lies)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{at}: must be a string or a list of content {noun}", param=at)
    texts = []
    for j, item in enumerate(content):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind not in kinds or not isinstance(item.get("text"), str):
            raise APIError(400, f"{at}[{j}]: only text {noun} ({{'type': '{kinds[0]}', 'text': "
                           f"...}}) are supported, got {kind or type(item).__name__!r}",
                           param=f"{at}[{j}]")
        texts.append(item["text"])
    return sep.join(texts)


class MessagesRequest(BaseModel):
    """POST /v1/messages (Anthropic's Messages API; server/anthropic_messages.py turns it into
    a chat completion request, whose checks then apply). max_tokens is required there, and
    not part of /v1/messages/count_tokens."""
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings: OpenAI's fields (input: a string, strings, token ids or lists of
    them)."""
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    # vLLM's: whether the vector is scaled to unit length (default: yes, as OpenAI's are)
    normalize: bool = True

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str) or (x and type(x[0]) is int):
            return [x]
        return list(x)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    tokens: list[int]


_Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatMessage.model_rebuild()
ChatCompletionRequest.model_rebuild()
ResponsesRequest.model_rebuild()
EmbeddingRequest.model_rebuild()
LlamaCppRequest.model_rebuild()
InfillRequest.model_rebuild()
LlamaCompletionRequest.model_rebuild()
