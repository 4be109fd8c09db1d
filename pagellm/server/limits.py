"""Request limits at the HTTP edge: what one client may ask of a server that many share.

Each is a `pagellm serve` flag with a default no ordinary client reaches; going over is a clear
4xx naming the limit (413 for the body, 400 for a field, 503 + Retry-After for load), never a
slow or failed engine. The engine's own checks (context length, KV capacity, token ids) stay
where they are; these bound the work a request makes before it gets there.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagellm.server.errors import APIError


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 8 * 2**20  # a request body (413 past it)
    max_sequences: int = 256  # prompts x n of one request
    max_prompt_tokens: int | None = None  # per prompt; None: the model's context length
    max_stop_strings: int = 16
    max_stop_length: int = 256  # characters per stop string
    max_logprobs: int = 20  # logprobs / top_logprobs (20 is also the most SamplingParams takes)
    max_connections: int = 512  # HTTP requests in flight at once (503 past it)

    def __post_init__(self):
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_logprobs > 20:
            raise ValueError(f"max_logprobs must be at most 20, got {self.max_logprobs}")

    @classmethod
    def from_args(cls, args) -> Limits:
        return cls(**{f: getattr(args, f) for f in cls.__dataclass_fields__
                      if getattr(args, f, None) is not None})

    # ---- checks of one request's fields (APIError 400) -----------------------------------------
    def check_sequences(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > self.max_sequences:
            raise APIError(400, f"prompt: {num_prompts} prompts x n={n} asks for "
                           f"{num_prompts * n} sequences; this server allows at most "
                           f"{self.max_sequences} per request (--max-sequences)",
                           param="prompt" if num_prompts > 1 else "n")

    def check_prompt_tokens(self, num_tokens: int, what: str) -> None:
        if self.max_prompt_tokens is not None and num_tokens > self.max_prompt_tokens:
            raise APIError(400, f"{what}: {num_tokens} tokens; this server allows at most "
                           f"{self.max_prompt_tokens} per prompt (--max-prompt-tokens)",
                           param=what, code="context_length_exceeded")

    def check_stop(self, stop) -> None:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > self.max_stop_strings:
            raise APIError(400, f"stop: {len(stops)} stop strings; at most "
                           f"{self.max_stop_strings} (--max-stop-strings)", param="stop")
        longest = max((len(s) for s in stops), default=0)
        if longest > self.max_stop_length:
            raise APIError(400, f"stop: a stop string of {longest} characters; at most "
                           f"{self.max_stop_length} (--max-stop-length)", param="stop")

    def check_logprobs(self, value: int | None, field: str) -> None:
        if value is not None and value > self.max_logprobs:
            raise APIError(400, f"{field}: {value} is more than this server's "
                           f"{self.max_logprobs} (--max-logprobs)", param=field)


UNLIMITED = ("/health", "/ping", "/metrics", "/version")
# A refused body is read and dropped up to this much before the 413 goes out: closing a socket
# with unread bytes in it resets the connection, and a client still sending (or slow to read)
# then loses the 413 itself to a connection error. Past this, the client is cut off.
DRAIN_BYTES = 64 * 2**20


class LimitGate:
    """Pure ASGI middleware: 503 + Retry-After past max_connections requests in flight (health
    probes and metric scrapes are never refused), and 413 for a body over max_body_bytes, told by Content-Length or counted as it arrives (a
    chunked body is read up to the limit, then handed on whole)."""

    def __init__(self, app, limits: Limits, error_response):
        self.app = app
        self.limits = limits
        self.error_response = error_response
        self.in_flight = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] in UNLIMITED:  # probes and scrapes must answer under any load
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limits.max_connections:
            await self._refuse(APIError(
                503, f"The server is at its limit of {self.limits.max_connections} requests in "
                "flight (--max-connections). Retry later.", code="too_many_connections",
                headers={"Retry-After": "1"}), scope, receive, send)
            return
        self.in_flight += 1
        try:
            receive = await self._bounded_body(scope, receive, send)
            if receive is not None:
                await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _bounded_body(self, scope, receive, send):
        """A receive that replays the body read here, or None once a 413 has been sent."""
        limit = self.limits.max_body_bytes
        length = dict(scope["headers"]).get(b"content-length")
        too_big = APIError(413, f"Request body larger than this server's {limit} bytes "
                           "(--max-body-bytes).", code="request_too_large")
        if length is not None and length.isdigit() and int(length) > limit:
            await _drain(receive, 0)
            await self._refuse(too_big, scope, None, send)
            return None
        if scope["method"] in ("GET", "HEAD"):
            return receive
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return _replay([message], receive)
            size += len(message.get("body", b""))
            if size > limit:
                if message.get("more_body", False):
                    await _drain(receive, size)
                await self._refuse(too_big, scope, None, send)
                return None
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        return _replay([{"type": "http.request", "body": b"".join(chunks),
                         "more_body": False}], receive)

    async def _refuse(self, err: APIError, scope, receive, send) -> None:
        headers = dict(err.headers or {})
        headers.setdefault("Connection", "close")
        err.headers = headers
        await self.error_response(err, scope["path"])(scope, receive or _no_body, send)


def _replay(messages: list[dict], receive):
    async def replay():
        return messages.pop(0) if messages else await receive()
    return replay


async def _drain(receive, size: int) -> None:
    """Read and drop the rest of a request body, up to DRAIN_BYTES in all."""
    while size <= DRAIN_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def _no_body():
    return {"type": "http.disconnect"}
