"""`pagellm run-batch`: a file of requests in OpenAI's Batch API form, answered offline.

Each input line is one request:

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

and each output line its answer, in the input's order:

    {"id": "batch_req_...", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}

The requests go to the server's own routes in this process (the app of api_server.py through
httpx's ASGI transport, no socket), all at once up to `concurrency` in flight, so the engine
batches them as it batches a server's. The body gets exactly what an HTTP client would: a
request the route refuses is answered with its status code and OpenAI-style error body. A
line that is not such a request (not JSON, no custom_id, a repeated custom_id, another
method or url, a stream) gets `response: null` and an `error` saying why; the other lines
still run.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from typing import IO

import httpx
from tqdm import tqdm

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")


def _error(custom_id, code: str, message: str) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def parse_line(line: str, seen: set) -> tuple[dict | None, dict | None]:
    """-> (the request, None) or (None, its output line: why it cannot run)."""
    try:
        item = json.loads(line)
    except ValueError as e:
        return None, _error(None, "invalid_json", f"not a JSON object: {e}")
    if not isinstance(item, dict):
        return None, _error(None, "invalid_json", "not a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, _error(None, "invalid_request", "custom_id: must be a non-empty string")
    if custom_id in seen:
        return None, _error(custom_id, "duplicate_custom_id",
                            f"custom_id {custom_id!r} is used by an earlier line")
    seen.add(custom_id)
    if item.get("method", "POST") != "POST":
        return None, _error(custom_id, "invalid_request",
                            f"method: must be 'POST', got {item.get('method')!r}")
    if item.get("url") not in URLS:
        return None, _error(custom_id, "invalid_url",
                            f"url: must be one of {list(URLS)}, got {item.get('url')!r}")
    body = item.get("body")
    if not isinstance(body, dict):
        return None, _error(custom_id, "invalid_request", "body: must be a JSON object")
    if body.get("stream"):
        return None, _error(custom_id, "invalid_request", "body.stream: a batch request "
                            "cannot stream")
    return item, None


async def run_batch(app, lines: list[str], out: IO[str], concurrency: int = 256,
                    progress: bool = True) -> tuple[int, int]:
    """Answer every non-blank line; write the outputs to `out` in order. Returns (requests
    answered with a 2xx, lines in all)."""
    seen: set = set()
    parsed = [parse_line(line, seen) for line in lines if line.strip()]
    results: list[dict | None] = [err for _, err in parsed]
    gate = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(parsed), desc="batch", unit="req", disable=not progress)

    async def one(i: int, item: dict, client: httpx.AsyncClient) -> None:
        try:
            async with gate:
                r = await client.post(item["url"], json=item["body"])
        except Exception as e:  # noqa: BLE001 (a failure of this request alone: its line says so)
            results[i] = _error(item["custom_id"], "server_error", f"{type(e).__name__}: {e}")
            bar.update(1)
            return
        try:
            body = r.json()
        except ValueError:
            body = {"error": {"message": r.text, "type": "server_error"}}
        results[i] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": item["custom_id"],
                      "response": {"status_code": r.status_code,
                                   "request_id": f"req_{uuid.uuid4().hex}", "body": body},
                      "error": None}
        bar.update(1)

    # the app's 500 (its handler's error body) comes back as a response, not an exception
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with app.router.lifespan_context(app):  # the engine's loop runs while the batch does
        async with httpx.AsyncClient(transport=transport, base_url="http://batch",
                                     timeout=None) as client:
            bar.update(sum(err is not None for err in results))
            await asyncio.gather(*(one(i, item, client) for i, (item, _) in enumerate(parsed)
                                   if item is not None))
    bar.close()
    for result in results:
        out.write(json.dumps(result, ensure_ascii=False) + "\n")
    out.flush()
    ok = sum(1 for r in results if r["response"] and 200 <= r["response"]["status_code"] < 300)
    return ok, len(results)
