"""The small routes: GET /v1/models, POST /tokenize, POST /detokenize, GET /health (and
/ping), GET /metrics, GET /version."""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from pagellm.server.errors import APIError, parse_request
from pagellm.server.protocol import DetokenizeRequest, TokenizeRequest
from pagellm.server.state import OpenAIServer


async def list_models(request: Request):
    api: OpenAIServer = request.app.state.api
    # root: the served name, not the file's absolute path (which tells clients about the
    # server's file system); an adapter names the base model as its parent, as vLLM's do
    base = {"id": api.model_name, "object": "model", "created": api.created,
            "owned_by": "pagellm", "root": api.model_name, "parent": None,
            "max_model_len": api.max_model_len}
    return {"object": "list", "data": [base] + [
        {**base, "id": name, "root": name, "parent": api.model_name} for name in api.loras]}


async def tokenize(request: Request):
    api: OpenAIServer = request.app.state.api
    req = parse_request(TokenizeRequest, await request.body())
    api.check_model(req.model)
    given = [t for t in (req.prompt, req.content) if t is not None]  # content: llama.cpp's
    text = given[0] if given else None
    if len(given) + (req.messages is not None) != 1:
        raise APIError(400, "give exactly one of `prompt` (or `content`) and `messages`",
                       param="prompt")
    if req.tools is not None and req.messages is None:
        raise APIError(400, "tools: only with `messages`", param="tools")
    api.need_tokenizer("prompt" if req.messages is None else "messages")
    if req.messages is not None:
        ids = await api.chat_prompt_ids(req.messages, req.tools, req.add_generation_prompt,
                                        req.chat_template_kwargs, req.continue_final_message)
    else:
        special = (req.add_special if req.add_special is not None  # llama.cpp: default false
                   else False if req.content is not None else req.add_special_tokens)
        ids = await api.off_loop(lambda: api.tokenizer.encode(text, add_special_tokens=special))
    tokens = ([{"id": t, "piece": api.token_str(t)} for t in ids] if req.with_pieces
              else ids)
    return {"tokens": tokens, "count": len(ids), "max_model_len": api.max_model_len}


async def detokenize(request: Request):
    api: OpenAIServer = request.app.state.api
    req = parse_request(DetokenizeRequest, await request.body())
    api.check_model(req.model)
    api.need_tokenizer("tokens")
    bad = [t for t in req.tokens if not 0 <= t < api.engine.vocab_size]
    if bad:
        raise APIError(400, f"tokens: ids out of range [0, {api.engine.vocab_size}): {bad[:5]}",
                       param="tokens")
    text = await api.off_loop(api.tokenizer.decode, req.tokens)
    return {"prompt": text, "content": text}  # vLLM's name and llama.cpp's


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
