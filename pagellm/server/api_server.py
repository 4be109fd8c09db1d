"""OpenAI-compatible HTTP server: the app and its lifecycle. FastAPI routes over the
AsyncEngine (one module per route family: completions.py, chat.py, routes.py; shared state in
state.py, SSE in streaming.py), the API-key / drain gate, request limits (limits.py), error
responses, `pagellm serve` and the graceful SIGTERM drain.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both stream as server-sent events
ending in `data: [DONE]`), POST /v1/responses, POST /v1/messages (Anthropic's, and its
/count_tokens), POST /v1/embeddings, GET /v1/models, POST
/tokenize, POST /detokenize, GET /health, GET /metrics (Prometheus text), GET /version.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
import uuid
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagellm.chat_template import load_chat_template
from pagellm.engine.async_engine import RequestError
from pagellm.server import routes
from pagellm.server.anthropic_messages import count_tokens, create_message
from pagellm.server.chat import create_chat_completion
from pagellm.server.cors import CorsPolicy
from pagellm.server.completions import create_completion
from pagellm.server.embeddings import create_embedding
from pagellm.server.llama_cpp import create_infill, create_llama_completion
from pagellm.server.limits import LimitGate, Limits
from pagellm.server.openai_responses import create_response, delete_response, get_response
from pagellm.server.errors import APIError, error_body
from pagellm.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                     EmbeddingRequest, InfillRequest, LlamaCompletionRequest,
                                     MessagesRequest, ResponsesRequest, TokenizeRequest)
from pagellm.server.state import OpenAIServer

__all__ = ["OpenAIServer", "build_app", "default_model_name", "serve"]

logger = logging.getLogger("pagellm.server")
OPEN_PATHS = ("/health", "/metrics", "/version", "/ping")  # no API key needed


class Gate:
    """Pure ASGI middleware (streaming-safe): 503 while draining, 401 without the API key."""

    def __init__(self, app, api: OpenAIServer):
        self.app = app
        self.api = api

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            err = self.check(scope)
            if err is not None:
                await error_response(err, scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def check(self, scope) -> APIError | None:
        path = scope["path"]
        if self.api.draining and path != "/metrics":
            return APIError(503, "The server is shutting down.", code="shutting_down",
                            headers={"Retry-After": "5", "Connection": "close"})
        if self.api.api_key and path not in OPEN_PATHS:
            headers = dict(scope["headers"])
            # OpenAI's clients send Authorization: Bearer, Anthropic's x-api-key
            auth = headers.get(b"authorization", b"").decode("latin-1")
            key = headers.get(b"x-api-key", b"").decode("latin-1")
            expected = self.api.api_key.encode()
            if not (hmac.compare_digest(auth.encode(), b"Bearer " + expected)
                    or hmac.compare_digest(key.encode(), expected)):
                return APIError(401, "Invalid or missing API key: send it as the header "
                                "'Authorization: Bearer <key>' (or 'x-api-key: <key>').",
                                code="invalid_api_key")
        return None


def error_response(err: APIError, path: str = "") -> JSONResponse:
    """path: the request's (its API's error shape, errors.error_body)."""
    return JSONResponse(error_body(err, path), status_code=err.status_code, headers=err.headers)


def build_app(api: OpenAIServer, cors: CorsPolicy | None = None) -> FastAPI:
    """cors: which web origins may call it (server/cors.py; default: any, as vLLM's)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        api.loop = asyncio.get_running_loop()
        api.async_engine.start()
        try:
            yield
        finally:
            await api.async_engine.shutdown()
            api._tokenizer_thread.shutdown(wait=False)

    app = FastAPI(title="pagellm", lifespan=lifespan)
    app.state.api = api
    # Gate (drain, API key) runs first, then the limits (in-flight requests, body size).
    app.add_middleware(LimitGate, limits=api.limits, error_response=error_response)
    app.add_middleware(Gate, api=api)
    (cors or CorsPolicy()).install(app)  # outermost: preflights never reach the gate
    bodies = {"/v1/completions": (create_completion, CompletionRequest),
              "/v1/chat/completions": (create_chat_completion, ChatCompletionRequest),
              "/v1/responses": (create_response, ResponsesRequest),
              "/v1/messages": (create_message, MessagesRequest),
              "/v1/messages/count_tokens": (count_tokens, MessagesRequest),
              "/v1/embeddings": (create_embedding, EmbeddingRequest),
              "/infill": (create_infill, InfillRequest),
              "/completion": (create_llama_completion, LlamaCompletionRequest),
              "/completions": (create_llama_completion, LlamaCompletionRequest),
              "/tokenize": (routes.tokenize, TokenizeRequest),
              "/detokenize": (routes.detokenize, DetokenizeRequest)}
    for path, (route, _) in bodies.items():
        app.add_api_route(path, route, methods=["POST"])
    for path, route in (("/v1/models", routes.list_models), ("/metrics", routes.metrics),
                        ("/version", routes.version)):
        app.add_api_route(path, route, methods=["GET"])
    for path in ("/health", "/ping"):
        app.add_api_route(path, routes.health, methods=["GET"])
        # some probes send HEAD (out of the OpenAPI document: one operation a path and method)
        app.add_api_route(path, routes.health, methods=["HEAD"], include_in_schema=False)
    app.add_api_route("/v1/responses/{response_id}", get_response, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", delete_response, methods=["DELETE"])

    def openapi() -> dict:
        """The routes parse their bodies themselves (strict pydantic, errors naming the
        field); the OpenAPI document still describes each body, for clients and fuzzers."""
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for path, (_, model) in bodies.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(body.pop("$defs", {}))
                schemas[model.__name__] = body
                doc["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": {
                        "$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error_response(exc, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        return error_response(APIError(exc.status_code, str(exc.detail)), request.url.path)

    @app.exception_handler(Exception)
    async def _internal_error(request, exc: Exception):
        # the exception's text and traceback go to the log under an id the client gets, not
        # to the client (it would describe the server's code and files)
        error_id = uuid.uuid4().hex[:12]
        logger.exception("internal error %s on %s", error_id, request.url.path)
        return error_response(APIError(
            500, f"internal server error (id {error_id}; see the server log)"), request.url.path)

    return app


# ---- `pagellm serve` -------------------------------------------------------------------------
def default_model_name(model: str | None, model_path: str) -> str:
    if model:
        return model
    name = os.path.basename(model_path.rstrip("/"))
    return name.removesuffix(".gguf")


def make_api(args, engine_kwargs: dict, api_key: str | None = None,
             max_waiting: int | None = None) -> OpenAIServer:
    """The engine and the server state that `pagellm serve` and `pagellm run-batch` share:
    the model's name, sampling defaults, limits and reasoning parser from the arguments."""
    from pagellm.llm import LLM
    from pagellm.server.defaults import FIELDS, sampling_defaults

    template = getattr(args, "chat_template", None)
    if template is not None:  # checked before the model loads
        template = load_chat_template(template)
    engine = LLM(**engine_kwargs).engine
    if template is not None:
        if engine.tokenizer is None:
            raise ValueError("--chat-template: this model has no tokenizer")
        engine.tokenizer.chat_template = template  # every route's render_chat reads it
        logger.info("chat template: %s", args.chat_template if os.path.isfile(
            args.chat_template) else "given inline")
    name = args.served_model_name or default_model_name(engine_kwargs.get("model"),
                                                        engine.model_path)
    defaults, source = sampling_defaults(
        engine.model_path, getattr(args, "generation_config", "auto"),
        {f: getattr(args, f"default_{f}", None) for f in FIELDS})
    logger.info("sampling defaults for fields a request omits: %s, from %s",
                ", ".join(f"{k}={v}" for k, v in defaults.items()) or "none", source)
    kwargs = {} if max_waiting is None else {"max_waiting": max_waiting}
    loras = {}
    for spec in getattr(args, "lora_modules", None) or []:
        lora_name, sep, path = spec.partition("=")
        if not sep or not lora_name or not path:
            raise ValueError(f"--lora-modules: {spec!r} is not NAME=PATH")
        loras[lora_name] = path
    return OpenAIServer(engine, name, api_key=api_key, sampling_defaults=defaults,
                        limits=Limits.from_args(args), reasoning_parser=args.reasoning_parser,
                        lora_modules=loras, **kwargs)


def serve(args, engine_kwargs: dict) -> int:
    cors = CorsPolicy.from_args(args)  # a bad flag fails before the model loads
    api = make_api(args, engine_kwargs, args.api_key or os.environ.get("PAGELLM_API_KEY"),
                   args.max_waiting)
    name = api.model_name
    config = uvicorn.Config(build_app(api, cors), host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=5, lifespan="on")
    server = DrainingServer(config, api, args.drain_timeout)
    logger.info("serving %s on http://%s:%d", name, args.host, args.port)
    server.run()
    return 0 if server.started else 1


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains instead of closing the socket at once:
    new requests get 503 and /health turns 503 (load balancers stop routing), running requests
    get up to drain_timeout seconds to finish, the rest are aborted, then uvicorn shuts down.
    A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, api: OpenAIServer, drain_timeout: float):
        super().__init__(config)
        self.api = api
        self.drain_timeout = drain_timeout
        self.drain_started = False

    def handle_exit(self, sig, frame) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after shutdown and the
        # default SIGTERM action would turn the clean exit into -15.
        if self.drain_started or self.api.loop is None:
            self.force_exit = self.drain_started
            self.should_exit = True
            return
        self.drain_started = True
        self.api.loop.call_soon_threadsafe(asyncio.ensure_future, self._drain())

    async def _drain(self) -> None:
        await drain(self.api, self.drain_timeout)
        self.should_exit = True


async def drain(api: OpenAIServer, timeout: float) -> None:
    api.draining = True
    eng = api.async_engine
    logger.info("shutting down: new requests get 503; waiting up to %.0f s for %d requests",
                timeout, eng.num_active)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while eng.num_active and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if eng.num_active:
        logger.warning("drain timeout: aborting %d requests", eng.num_active)
        eng.abort_all(RequestError("The server is shutting down; the request was aborted.", 503))
        deadline = loop.time() + 5
        while eng.num_active and loop.time() < deadline:
            await asyncio.sleep(0.05)
    logger.info("drained")
