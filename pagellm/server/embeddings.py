"""POST /v1/embeddings: each input's embedding (pooling_params.py: the last token's final
hidden state, its first `dimensions` values, of unit length), in OpenAI's response form,
`encoding_format` "float" (a list) or "base64" (the float32 values' little-endian bytes).

The inputs run through the engine as one request each, batched with whatever else runs; a
model trained for embeddings (Qwen3-Embedding, gte-Qwen2, e5-mistral: last-token pooling)
gives retrieval-grade vectors."""
from __future__ import annotations

import base64
import time
import uuid

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse

from pagellm.pooling_params import PoolingParams
from pagellm.server.errors import APIError, parse_request
from pagellm.server.protocol import EmbeddingRequest
from pagellm.server.state import OpenAIServer


async def create_embedding(request: Request):
    api: OpenAIServer = request.app.state.api
    arrival = time.monotonic()
    req = parse_request(EmbeddingRequest, await request.body())
    lora = api.check_model(req.model)
    inputs = req.inputs()
    if not inputs:
        raise APIError(400, "input: must not be empty", param="input")
    if any(isinstance(x, str) and not x for x in inputs) or any(x == [] for x in inputs):
        raise APIError(400, "input: an input must not be empty", param="input")
    api.limits.check_sequences(len(inputs), 1)
    encoded = await api.off_loop(lambda: [api.encode_prompt(x) for x in inputs])
    vocab = api.engine.vocab_size
    for _, ids in encoded:
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"input: token ids out of range [0, {vocab}): {bad[:5]}",
                           param="input")
        api.check_scored_prompt(len(ids), "input")
    params = PoolingParams(normalize=req.normalize, dimensions=req.dimensions)
    slots = await api.add([ids for _, ids in encoded], [params] * len(encoded), arrival,
                          f"embd-{uuid.uuid4().hex}", "input", lora=lora)
    finals = await api.final_outputs(request, slots)
    data = []
    for i, out in enumerate(finals):
        vec = out.embedding
        if req.encoding_format == "base64":
            vec = base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")
        data.append({"object": "embedding", "index": i, "embedding": vec})
    tokens = sum(len(ids) for _, ids in encoded)
    return JSONResponse({"object": "list", "data": data, "model": api.model_name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
