"""OpenAI-style errors, and request bodies parsed into validated models (a 400 naming the
first bad field)."""
from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ValidationError

logger = logging.getLogger("pagellm.server")


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


# Anthropic's Messages API answers its errors in its own shape (server/anthropic_messages.py)
_ANTHROPIC_PATH = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {
        "type": _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500
                                     else "api_error"), "message": message}}


def error_body(err: APIError, path: str = "") -> dict:
    """The error's JSON in the shape the route's API uses: Anthropic's under /v1/messages,
    OpenAI's elsewhere."""
    if path == _ANTHROPIC_PATH or path.startswith(_ANTHROPIC_PATH + "/"):
        return anthropic_error_body(err.status_code, err.message)
    return err.body()


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
