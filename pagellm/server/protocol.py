"""OpenAI request schemas (pydantic, only here at the HTTP edge), errors, and response pieces.

Requests are validated strictly (no "1" -> 1 coercion): a wrong type or an out-of-range value is
a 400 naming the field. Unknown fields are accepted and ignored, as OpenAI's own server does for
fields it does not know (clients send extras such as `user`).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pagellm.sampling_params import SamplingParams

logger = logging.getLogger("pagellm.server")


# ---- errors ----------------------------------------------------------------------------------
class APIError(Exception):
    """Becomes {"error": {"message", "type", "param", "code"}} with the HTTP status."""

    def __init__(self, status_code: int, message: str, param: str | None = None,
                 code: str | int | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code if code is not None else status_code
        self.type = type or _ERROR_TYPES.get(
            status_code, "invalid_request_error" if status_code < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "invalid_request_error", 499: "request_aborted",
                503: "service_unavailable"}


def parse_request(model: type[BaseModel], body: bytes) -> Any:
    """JSON body -> validated model, or APIError(400) naming the first bad field."""
    try:
        req = model.model_validate_json(body or b"{}")
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            raise APIError(400, f"Invalid JSON body: {err['msg']}") from None
        if not err["loc"]:
            raise APIError(400, f"Request body: {err['msg']}") from None
        param = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{param}: {msg}", param=param) from None
    if req.model_extra:
        _note_unknown_fields(req.model_extra)
    return req


# Unknown fields are logged once per name, and only the first few names: a client that sends
# new names in every request must not flood the log.
_MAX_LOGGED_FIELDS = 64
_logged_fields: set[str] = set()


def _note_unknown_fields(fields) -> None:
    new = [f[:64] for f in sorted(fields) if f[:64] not in _logged_fields]
    room = _MAX_LOGGED_FIELDS - len(_logged_fields)
    if new and room > 0:
        _logged_fields.update(new[:room])
        logger.warning("ignoring unknown request fields (each named once): %s", new[:room])


def sampling_error(e: ValueError) -> APIError:
    """SamplingParams / engine ValueErrors name the field first: use it as `param`."""
    msg = str(e)
    first = msg.split(" ", 1)[0].rstrip(":")
    param = first if first.isidentifier() else None
    return APIError(400, msg, param=param)


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
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 16 or not all(stops):
            raise ValueError("must be a non-empty string or a list of at most 16 non-empty strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if v:
            raise ValueError("is not supported by this server")
        return v

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """ValueError (from SamplingParams) names the field on a bad combination."""
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0, min_p=self.min_p or 0.0, seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            stop=self.stop, stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False


class CompletionRequest(_Request):
    prompt: Any
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
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

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        if v:
            raise ValueError("is not supported by this server")
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
        return d


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        if v:
            raise ValueError("tool calling is not supported by this server")
        return v

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v):
        if v and v.get("type") != "text":
            raise ValueError("only {'type': 'text'} is supported by this server")
        return v


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    tokens: list[int]


_Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()


# ---- response pieces -------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _finite(lp: float) -> float:
    """JSON has no -inf: a token with zero probability (filtered by top-k/p) reports -9999."""
    return lp if math.isfinite(lp) else -9999.0


def _top(entries: dict[int, float], num: int) -> list[tuple[int, float]]:
    """The engine gives {sampled: lp, top...}; the top `num` by logprob."""
    return sorted(entries.items(), key=lambda kv: -kv[1])[:num]


def completion_logprobs(token_str, token_ids: list[int], logprobs: list[dict[int, float]],
                        num: int, text_offset: int) -> dict:
    """OpenAI completions format: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entries in zip(token_ids, logprobs):
        s = token_str(tid)
        tokens.append(s)
        token_lps.append(_finite(entries[tid]))
        tops.append({token_str(t): _finite(lp) for t, lp in _top(entries, num)})
        offsets.append(text_offset)
        text_offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(token_str, token_ids: list[int], logprobs: list[dict[int, float]],
                  num: int) -> dict:
    """OpenAI chat format: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(tid: int, lp: float) -> dict:
        s = token_str(tid)
        return {"token": s, "logprob": _finite(lp), "bytes": list(s.encode("utf-8"))}

    content = [{**entry(tid, entries[tid]),
                "top_logprobs": [entry(t, lp) for t, lp in _top(entries, num)]}
               for tid, entries in zip(token_ids, logprobs)]
    return {"content": content}
