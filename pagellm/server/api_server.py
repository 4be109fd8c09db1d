"""OpenAI-compatible HTTP server: FastAPI routes over the AsyncEngine, SSE streaming, metrics,
API key, bounded waiting queue and a graceful SIGTERM drain.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both stream as server-sent events
ending in `data: [DONE]`), GET /v1/models, POST /tokenize, POST /detokenize, GET /health,
GET /metrics (Prometheus text), GET /version.
"""
from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from types import SimpleNamespace

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagellm.engine.async_engine import AsyncEngine, RequestError, RequestSlot
from pagellm.engine.detokenizer import stable_text_len
from pagellm.metrics import ServerMetrics
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.server.chat_template import render_chat
from pagellm.server.limits import LimitGate, Limits
from pagellm.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                     DetokenizeRequest, TokenizeRequest, chat_logprobs,
                                     completion_logprobs, parse_request, sampling_error, usage)
from pagellm.server.tools import (TOOL_CLOSE, TOOL_OPEN, ToolStream, call_grammar,
                                  parse_tool_calls, prompt_messages, resolve_tool_choice,
                                  template_knows_tools, tool_dicts)
from pagellm.structured import StructuredOutputError

logger = logging.getLogger("pagellm.server")
OPEN_PATHS = ("/health", "/metrics", "/version", "/ping")  # no API key needed
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class OpenAIServer:
    """State shared by the routes: the engine loop, tokenizer, names and limits."""

    def __init__(self, engine, model_name: str, api_key: str | None = None,
                 max_waiting: int | None = None, sampling_defaults: dict | None = None,
                 limits: Limits | None = None):
        self.engine = engine
        self.limits = limits or Limits()
        # Values for the sampling fields a request leaves out (the model's generation config
        # or --default-* flags); empty: OpenAI's defaults.
        self.sampling_defaults = dict(sampling_defaults or {})
        self.metrics = ServerMetrics(engine, model_name)
        self.async_engine = AsyncEngine(engine, self.metrics)
        # The engine thread detokenizes with engine.tokenizer; the event loop gets its own copy.
        self.tokenizer = copy.deepcopy(engine.tokenizer) if engine.tokenizer is not None else None
        # Tokenizing and chat templating run here, one at a time (a tokenizer is not safe to
        # share between threads), never on the event loop: a megabyte prompt must not stall
        # every other client's stream.
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="pagellm-tokenize")
        self.model_name = model_name
        self.api_key = api_key
        self.max_waiting = max_waiting
        self.max_model_len = engine.max_model_len
        self.created = int(time.time())
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self._token_strs: dict[int, str] = {}

    # ---- helpers ------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist. This server serves "
                           f"`{self.model_name}`.", param="model", code="model_not_found")

    def token_str(self, token_id: int) -> str:
        s = self._token_strs.get(token_id)
        if s is None:
            s = self._token_strs[token_id] = self.tokenizer.decode([token_id])
        return s

    def tag_id(self, text: str) -> int | None:
        """The id of an added token spelled exactly `text` (Qwen2.5's <tool_call>), or None."""
        for tid, added in getattr(self.tokenizer, "added_tokens_decoder", {}).items():
            if added.content == text:
                return tid
        return None

    def need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise APIError(400, f"{what}: this model has no tokenizer; send token ids",
                           param=what)

    async def off_loop(self, fn, *args):
        """fn(*args) on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    def encode_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            self.need_tokenizer("prompt")
            ids = self.tokenizer.encode(prompt)  # as LLMEngine._tokenize does
        else:
            prompt, ids = None, list(prompt)
        self.limits.check_prompt_tokens(len(ids), "prompt")
        return prompt, ids

    def encode_chat(self, messages, add_generation_prompt: bool,
                    tools: list[dict] | None = None) -> list[int]:
        """messages: ChatMessage models or dicts already in the template's form."""
        try:
            ids = render_chat(self.tokenizer,
                              [m if isinstance(m, dict) else m.as_dict() for m in messages],
                              add_generation_prompt, tools)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        except Exception as e:  # a template that raises (jinja TemplateError, ...)
            raise APIError(400, f"messages: the chat template failed: {e}",
                           param="messages") from None
        self.limits.check_prompt_tokens(len(ids), "messages")
        return ids

    def max_tokens(self, num_prompt: int, requested: int | None, what: str) -> int:
        """The generation budget; 400 when prompt + max_tokens exceed the context."""
        limit = self.max_model_len
        if requested is None:
            if num_prompt >= limit:
                raise APIError(400, f"This model's maximum context length is {limit} tokens. "
                               f"However, you requested {num_prompt} tokens in the {what}, "
                               "which leaves no room for the completion. Please reduce the "
                               f"length of the {what}.", param=what,
                               code="context_length_exceeded")
            return limit - num_prompt
        if num_prompt + requested > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, "
                           f"you requested {num_prompt + requested} tokens ({num_prompt} in the "
                           f"{what}, {requested} in the completion). Please reduce the length "
                           f"of the {what} or completion.", param="max_tokens",
                           code="context_length_exceeded")
        return requested

    async def add(self, prompts: list[list[int]], params: list, arrival: float,
                  request_id: str, structured_field: str | None = None) -> list[RequestSlot]:
        """Hand the prompts to the engine (one engine request per prompt; n is SamplingParams.n).
        503 when the waiting queue is full; 400 when the engine refuses a prompt (a schema or
        grammar it cannot compile: 400 naming structured_field, the field that sent it)."""
        waiting = self.async_engine.num_waiting
        new = sum(p.n for p in params)  # every sequence of every prompt will wait
        if self.max_waiting is not None and waiting + new > self.max_waiting:
            raise APIError(503, f"The server is overloaded: {waiting} requests are waiting "
                           f"(--max-waiting {self.max_waiting}). Retry later.",
                           code="queue_full", headers={"Retry-After": "1"})
        waker = asyncio.Event()
        slots: list[RequestSlot] = []
        try:
            # Queued together, so the engine thread takes them all between two steps (one
            # await each would add one prompt per step).
            added = await asyncio.gather(*(
                self.async_engine.add_request(f"{request_id}-{i}", ids, p, waker, arrival)
                for i, (ids, p) in enumerate(zip(prompts, params))), return_exceptions=True)
            slots = [a for a in added if isinstance(a, RequestSlot)]
            for a in added:
                if isinstance(a, BaseException):
                    raise a
        except StructuredOutputError as e:
            self.abort(slots)
            field = structured_field or "structured_outputs"
            raise APIError(400, f"{field}: {e.detail}", param=field) from None
        except ValueError as e:
            self.abort(slots)
            raise sampling_error(e) from None
        except RequestError as e:
            self.abort(slots)
            raise APIError(e.status_code, e.message) from None
        except BaseException:
            self.abort(slots)
            raise
        return slots

    def abort(self, slots: list[RequestSlot]) -> None:
        for slot in slots:
            if not slot.done:
                self.async_engine.abort(slot.request_id)

    async def final_outputs(self, request: Request,
                            slots: list[RequestSlot]) -> list[RequestOutput]:
        """Wait for every slot to finish; abort them if the client goes away meanwhile."""
        finals: list[RequestOutput | None] = [None] * len(slots)

        async def collect():
            async for i, out in iterate(slots):
                if out.finished:
                    finals[i] = out

        task = asyncio.ensure_future(collect())
        watcher = asyncio.ensure_future(wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            task.cancel()
            self.abort(slots)
        if task not in done:
            raise APIError(499, "client disconnected")
        try:
            task.result()
        except RequestError as e:
            raise APIError(e.status_code, e.message) from None
        return finals


async def iterate(slots: list[RequestSlot]):
    """(slot index, newest output) as outputs arrive, until every slot is finished.
    Raises RequestError if a request failed."""
    waker = slots[0].waker
    while not all(s.consumed for s in slots):
        await waker.wait()
        waker.clear()
        for i, slot in enumerate(slots):
            if not slot.consumed:
                out = slot.take()
                if out is not None:
                    yield i, out


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """Server-sent events that abort their requests however the response ends (finished,
    client gone, cancelled), even when the body generator never got to start."""

    def __init__(self, events, on_close):
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class ChoiceStream:
    """What one choice (prompt i, sample j) has sent so far; yields the next delta."""

    def __init__(self, index: int, params, prefix: str = ""):
        self.index = index
        self.params = params
        self.prefix = prefix  # echo: the prompt text, sent with the first delta
        self.text_offset = len(prefix)  # completions logprobs: where the next token starts
        self.text_sent = 0
        self.tokens_sent = 0
        self.finished = False

    def advance(self, comp: CompletionOutput, want_logprobs: bool, every_token: bool = False):
        """(text, token_ids, logprobs) new since the last call, or None if nothing to send.
        Text that could still turn into a stop string is held back (stable_text_len). New
        tokens alone make a chunk when logprobs are wanted or every_token is set (a model
        without a tokenizer has no text to stream)."""
        if self.finished:
            return None
        view = SimpleNamespace(text=comp.text, params=self.params, is_finished=comp.finished)
        end = stable_text_len(view)
        text = comp.text[self.text_sent:end] if end > self.text_sent else ""
        new_tokens = len(comp.token_ids) > self.tokens_sent
        if not (text or comp.finished or ((want_logprobs or every_token) and new_tokens)):
            return None
        ids = comp.token_ids[self.tokens_sent:]
        lps = (comp.logprobs or [])[self.tokens_sent:] if want_logprobs else []
        self.text_sent = max(self.text_sent, end)
        self.tokens_sent = len(comp.token_ids)
        self.finished = comp.finished
        text, self.prefix = self.prefix + text, ""
        return text, ids, lps


async def stream_events(slots, choices: list[ChoiceStream], n: int, want_logprobs: bool,
                        choice_chunk, usage_chunk, prelude=(), every_token: bool = False):
    """The SSE body of both endpoints. choice_chunk(choice, comp, text, token_ids, logprobs)
    builds one choice's chunk; usage_chunk(num_generated) the final one (or None)."""
    num_generated = [0] * len(choices)
    try:
        for chunk in prelude:
            yield sse(chunk)
        async for i, out in iterate(slots):
            for comp in out.outputs:
                ch = choices[i * n + comp.index]
                num_generated[ch.index] = len(comp.token_ids)
                piece = ch.advance(comp, want_logprobs, every_token)
                if piece is not None:
                    yield sse(choice_chunk(ch, comp, *piece))
        last = usage_chunk(sum(num_generated))
        if last is not None:
            yield sse(last)
    except RequestError as e:
        yield sse(APIError(e.status_code, e.message).body())
    yield "data: [DONE]\n\n"


def chunk_of(base: dict, choice: dict, include_usage: bool) -> dict:
    chunk = {**base, "choices": [choice]}
    if include_usage:
        chunk["usage"] = None  # OpenAI: null on every chunk but the last
    return chunk


def finish(comp: CompletionOutput) -> dict:
    return {"finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason}


# ---- routes ----------------------------------------------------------------------------------
async def create_completion(request: Request):
    api: OpenAIServer = request.app.state.api
    arrival = time.monotonic()
    req = parse_request(CompletionRequest, await request.body())
    api.check_model(req.model)
    if req.best_of not in (None, req.n):
        raise APIError(400, "best_of: must equal n (best-of selection is not supported)",
                       param="best_of")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "logprobs: not supported together with echo (prompt logprobs are "
                       "not computed)", param="logprobs")
    prompts = req.prompts()
    api.limits.check_sequences(len(prompts), req.n)
    api.limits.check_stop(req.stop)
    api.limits.check_logprobs(req.logprobs, "logprobs")
    encoded = await api.off_loop(lambda: [api.encode_prompt(p) for p in prompts])
    structured, structured_field = req.structured()
    try:
        params = [req.sampling_params(api.max_tokens(len(ids), req.max_tokens, "prompt"),
                                      req.logprobs, api.sampling_defaults, structured)
                  for _, ids in encoded]
    except ValueError as e:
        raise sampling_error(e) from None
    if req.echo:
        api.need_tokenizer("echo")
    prefixes = [(text if text is not None else api.tokenizer.decode(ids)) if req.echo else ""
                for text, ids in encoded]
    rid = f"cmpl-{uuid.uuid4().hex}"
    slots = await api.add([ids for _, ids in encoded], params, arrival, rid, structured_field)
    choices = [ChoiceStream(i * req.n + j, params[i], prefixes[i])
               for i in range(len(slots)) for j in range(req.n)]
    base = {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": api.model_name}
    num_prompt = sum(len(ids) for _, ids in encoded)

    def logprobs(ch: ChoiceStream, ids, lps):
        if req.logprobs is None:
            return None
        lp = completion_logprobs(api.token_str, ids, lps, req.logprobs, ch.text_offset)
        ch.text_offset += sum(len(t) for t in lp["tokens"])
        return lp

    if req.stream:
        def choice_chunk(ch, comp, text, ids, lps):
            return chunk_of(base, {"index": ch.index, "text": text,
                                   "logprobs": logprobs(ch, ids, lps), **finish(comp)},
                            req.include_usage)

        def usage_chunk(num_generated):
            return ({**base, "choices": [], "usage": usage(num_prompt, num_generated)}
                    if req.include_usage else None)

        events = stream_events(slots, choices, req.n, req.logprobs is not None, choice_chunk,
                               usage_chunk, every_token=api.tokenizer is None)
        return EventStream(events, on_close=lambda: api.abort(slots))

    finals = await api.final_outputs(request, slots)
    out_choices = []
    for i, out in enumerate(finals):
        for comp in out.outputs:
            ch = choices[i * req.n + comp.index]
            out_choices.append({"index": ch.index, "text": ch.prefix + comp.text,
                                "logprobs": logprobs(ch, comp.token_ids, comp.logprobs or []),
                                **finish(comp)})
    num_generated = sum(len(c.token_ids) for out in finals for c in out.outputs)
    return JSONResponse({**base, "choices": out_choices,
                         "usage": usage(num_prompt, num_generated)})


async def create_chat_completion(request: Request):
    api: OpenAIServer = request.app.state.api
    arrival = time.monotonic()
    req = parse_request(ChatCompletionRequest, await request.body())
    api.check_model(req.model)
    api.need_tokenizer("messages")
    tools = tool_dicts(req.tools)
    tool_choice, only = resolve_tool_choice(req.tool_choice, tools)
    native = template_knows_tools(api.tokenizer)
    api.limits.check_sequences(1, req.n)
    api.limits.check_stop(req.stop)
    api.limits.check_logprobs(req.top_logprobs, "top_logprobs")
    messages = prompt_messages([m.as_dict() for m in req.messages], tools, native)
    ids = await api.off_loop(api.encode_chat, messages, req.add_generation_prompt,
                             tools if native else None)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
    num_top = (req.top_logprobs or 0) if req.logprobs else None
    structured, structured_field = req.structured()
    if tool_choice == "required":
        if structured is not None:
            raise APIError(400, f"tool_choice: a required tool call cannot be combined with "
                           f"{structured_field}", param="tool_choice")
        structured, structured_field = call_grammar(
            tools, only, req.parallel_tool_calls, api.tag_id(TOOL_OPEN),
            api.tag_id(TOOL_CLOSE)), "tools"
    try:
        params = req.sampling_params(
            api.max_tokens(len(ids), req.max_completion_tokens or req.max_tokens, "messages"),
            num_top, api.sampling_defaults, structured)
    except ValueError as e:
        raise sampling_error(e) from None
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    slots = await api.add([ids], [params], arrival, rid, structured_field)
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
        tool_streams = [ToolStream(tool_names) for _ in choices] if tool_names else None

        def choice_chunk(ch, comp, text, tids, lps):
            calls = []
            if tool_streams is not None:
                text, calls = tool_streams[ch.index].feed(text, comp.finished)
            delta = {"content": text} if text or not comp.finished else {}
            if calls:
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
            return chunk_of(base, {"index": ch.index, "delta": delta,
                                   "logprobs": logprobs(tids, lps), **finish_of(comp, calls)},
                            req.include_usage)

        def usage_chunk(num_generated):
            return ({**base, "choices": [], "usage": usage(len(ids), num_generated)}
                    if req.include_usage else None)

        roles = [chunk_of(base, {"index": ch.index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}, req.include_usage)
                 for ch in choices]
        events = stream_events(slots, choices, req.n, req.logprobs, choice_chunk, usage_chunk,
                               prelude=roles)
        return EventStream(events, on_close=lambda: api.abort(slots))

    (final,) = await api.final_outputs(request, slots)
    out_choices = []
    for c in final.outputs:
        content, calls = (parse_tool_calls(c.text, tool_names) if tool_names else (c.text, []))
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        out_choices.append({"index": c.index, "message": message,
                            "logprobs": logprobs(c.token_ids, c.logprobs or []),
                            **finish_of(c, calls)})
    num_generated = sum(len(c.token_ids) for c in final.outputs)
    return JSONResponse({**base, "choices": out_choices, "usage": usage(len(ids), num_generated)})


async def list_models(request: Request):
    api: OpenAIServer = request.app.state.api
    return {"object": "list", "data": [{
        "id": api.model_name, "object": "model", "created": api.created, "owned_by": "pagellm",
        # root: the served name, not the file's absolute path (which tells clients about the
        # server's file system)
        "root": api.model_name, "max_model_len": api.max_model_len}]}


async def tokenize(request: Request):
    api: OpenAIServer = request.app.state.api
    req = parse_request(TokenizeRequest, await request.body())
    api.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of `prompt` and `messages`", param="prompt")
    api.need_tokenizer("prompt" if req.messages is None else "messages")
    if req.messages is not None:
        ids = await api.off_loop(api.encode_chat, req.messages, req.add_generation_prompt)
    else:
        ids = await api.off_loop(lambda: api.tokenizer.encode(
            req.prompt, add_special_tokens=req.add_special_tokens))
    return {"tokens": ids, "count": len(ids), "max_model_len": api.max_model_len}


async def detokenize(request: Request):
    api: OpenAIServer = request.app.state.api
    req = parse_request(DetokenizeRequest, await request.body())
    api.check_model(req.model)
    api.need_tokenizer("tokens")
    bad = [t for t in req.tokens if not 0 <= t < api.engine.vocab_size]
    if bad:
        raise APIError(400, f"tokens: ids out of range [0, {api.engine.vocab_size}): {bad[:5]}",
                       param="tokens")
    return {"prompt": await api.off_loop(api.tokenizer.decode, req.tokens)}


async def health(request: Request):
    api: OpenAIServer = request.app.state.api
    if not api.async_engine.is_alive:
        raise APIError(503, "the engine loop is not running")
    return Response(status_code=200)


async def metrics(request: Request):
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(request.app.state.api.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def version(request: Request):
    from pagellm import __version__

    return {"version": __version__}


# ---- the app ---------------------------------------------------------------------------------
class Gate:
    """Pure ASGI middleware (streaming-safe): 503 while draining, 401 without the API key."""

    def __init__(self, app, api: OpenAIServer):
        self.app = app
        self.api = api

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            err = self.check(scope)
            if err is not None:
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def check(self, scope) -> APIError | None:
        path = scope["path"]
        if self.api.draining and path != "/metrics":
            return APIError(503, "The server is shutting down.", code="shutting_down",
                            headers={"Retry-After": "5", "Connection": "close"})
        if self.api.api_key and path not in OPEN_PATHS:
            auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(auth.encode(), f"Bearer {self.api.api_key}".encode()):
                return APIError(401, "Invalid or missing API key: send it as the header "
                                "'Authorization: Bearer <key>'.", code="invalid_api_key")
        return None


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers)


def build_app(api: OpenAIServer) -> FastAPI:
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
    bodies = {"/v1/completions": (create_completion, CompletionRequest),
              "/v1/chat/completions": (create_chat_completion, ChatCompletionRequest),
              "/tokenize": (tokenize, TokenizeRequest),
              "/detokenize": (detokenize, DetokenizeRequest)}
    for path, (route, _) in bodies.items():
        app.add_api_route(path, route, methods=["POST"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/ping", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/version", version, methods=["GET"])

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
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        return error_response(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _internal_error(request, exc: Exception):
        # the exception's text and traceback go to the log under an id the client gets, not
        # to the client (it would describe the server's code and files)
        error_id = uuid.uuid4().hex[:12]
        logger.exception("internal error %s on %s", error_id, request.url.path)
        return error_response(APIError(500, f"internal server error (id {error_id}; see the server log)"))

    return app


# ---- `pagellm serve` -------------------------------------------------------------------------
def default_model_name(model: str | None, model_path: str) -> str:
    if model:
        return model
    name = os.path.basename(model_path.rstrip("/"))
    return name.removesuffix(".gguf")


def serve(args, engine_kwargs: dict) -> int:
    from pagellm.llm import LLM

    engine = LLM(**engine_kwargs).engine
    name = args.served_model_name or default_model_name(engine_kwargs.get("model"),
                                                        engine.model_path)
    from pagellm.server.defaults import FIELDS, sampling_defaults

    defaults, source = sampling_defaults(
        engine.model_path, getattr(args, "generation_config", "auto"),
        {f: getattr(args, f"default_{f}", None) for f in FIELDS})
    logger.info("sampling defaults for fields a request omits: %s, from %s",
                ", ".join(f"{k}={v}" for k, v in defaults.items()) or "none", source)
    api = OpenAIServer(engine, name, api_key=args.api_key or os.environ.get("PAGELLM_API_KEY"),
                       max_waiting=args.max_waiting, sampling_defaults=defaults,
                       limits=Limits.from_args(args))
    config = uvicorn.Config(build_app(api), host=args.host, port=args.port, log_level="info",
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
