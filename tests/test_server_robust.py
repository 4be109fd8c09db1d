"""A server many clients share keeps every other request whole, whatever one client sends.

- Limits: each `pagellm serve` limit is a clear 4xx naming it (413 for the body, 400 for a
  field, 503 + Retry-After for load), and the server keeps serving.
- Isolation: well-formed greedy float32 streams running while hostile requests arrive give
  exactly the tokens they give alone.
- Fuzzing: bodies generated from the server's own OpenAPI document (schemathesis), valid and
  invalid, plus hand-written hostile ones: never a 5xx, never a hung request, and afterwards
  the server is healthy and every KV block is back in the pool.
"""
from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pagellm import LLM
from pagellm.server.limits import Limits
from tests.test_server import (ENGINE_KW, MODEL, _c, _chat, post, running_server,  # noqa: F401
                               tiny_path, wait_idle)


LIMITS = Limits(max_body_bytes=64 * 1024, max_sequences=6, max_prompt_tokens=200,
                max_stop_strings=4, max_stop_length=20, max_logprobs=5, max_connections=64)


@pytest.fixture(scope="module")
def server(tiny_path):
    llm = LLM(tiny_path, **{**ENGINE_KW, "max_model_len": 256})
    with running_server(llm, limits=LIMITS, max_waiting=64) as srv:
        yield srv


@pytest.fixture
def srv(server):
    yield server
    wait_idle(server)


def error_of(r: httpx.Response, status: int, param: str | None = None) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    if param is not None:
        assert err["param"] == param, err
    return err["message"]


# ---- limits ------------------------------------------------------------------------------------
def test_a_body_over_the_limit_is_413_declared_or_chunked(srv):
    big = _c(prompt="x " * 40_000)  # ~80 kB
    assert "--max-body-bytes" in error_of(post(srv, "/v1/completions", big), 413)

    def chunks():  # no Content-Length: counted as it arrives
        data = json.dumps(big).encode()
        for i in range(0, len(data), 8192):
            yield data[i:i + 8192]

    r = httpx.post(srv.url + "/v1/completions", content=chunks(), timeout=30,
                   headers={"Content-Type": "application/json"})
    assert "--max-body-bytes" in error_of(r, 413)
    # just under the limit is served (a chunked body is handed on whole)
    small = json.dumps(_c(prompt="hi " * 10)).encode()
    r = httpx.post(srv.url + "/v1/completions", content=iter([small[:7], small[7:]]),
                   timeout=30, headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text


def _raw_post(srv, head: bytes, body: bytes) -> bytes:
    """Send a whole request on a plain socket, then read the answer to its end: what a client
    that writes its body before it reads (as most do) sees."""
    host, port = srv.url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\n" + head + b"\r\n" + body)
        time.sleep(0.2)  # the server has answered and closed before this client reads
        data = b""
        while chunk := s.recv(65536):  # a reset connection raises here and loses the answer
            data += chunk
    return data


def test_a_refused_body_is_read_so_the_client_gets_its_413_whole(srv):
    body = b"x" * 2_000_000
    declared = _raw_post(srv, b"Content-Length: %d\r\n" % len(body), body)
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(c), c)
                       for c in (body[i:i + 65536] for i in range(0, len(body), 65536)))
    counted = _raw_post(srv, b"Transfer-Encoding: chunked\r\n", chunked + b"0\r\n\r\n")
    for data in (declared, counted):
        assert data.startswith(b"HTTP/1.1 413"), data[:80]
        assert b"--max-body-bytes" in data.split(b"\r\n\r\n", 1)[1]
    assert post(srv, "/v1/completions", _c(max_tokens=2)).status_code == 200


@pytest.mark.parametrize("path,body,param,flag", [
    ("/v1/completions", _c(prompt=["a", "b", "c", "d"], n=2), "prompt", "--max-sequences"),
    ("/v1/completions", _c(n=7), "n", "--max-sequences"),
    ("/v1/chat/completions", _chat(n=7), "n", "--max-sequences"),
    ("/v1/completions", _c(prompt="hello " * 300), "prompt", "--max-prompt-tokens"),
    ("/v1/completions", _c(prompt=[5] * 201), "prompt", "--max-prompt-tokens"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": "hello " * 300}]),
     "messages", "--max-prompt-tokens"),
    ("/v1/completions", _c(stop=["a", "b", "c", "d", "e"]), "stop", "--max-stop-strings"),
    ("/v1/chat/completions", _chat(stop="y" * 21), "stop", "--max-stop-length"),
    ("/v1/completions", _c(logprobs=6), "logprobs", "--max-logprobs"),
    ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=6), "top_logprobs",
     "--max-logprobs"),
])
def test_each_request_limit_is_a_400_naming_it(srv, path, body, param, flag):
    assert flag in error_of(post(srv, path, body), 400, param)


def test_the_limits_themselves_pass(srv):
    ok = [("/v1/completions", _c(prompt=["a", "b", "c"], n=2, max_tokens=2)),
          ("/v1/completions", _c(prompt=[5] * 200, max_tokens=2)),
          ("/v1/completions", _c(stop=["a", "b", "c", "y" * 20], logprobs=5, max_tokens=2)),
          ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=5, max_tokens=2))]
    for path, body in ok:
        r = post(srv, path, body)
        assert r.status_code == 200, r.text
    # /tokenize counts any prompt: the prompt-token limit is for generation
    r = post(srv, "/tokenize", {"model": MODEL, "messages": [
        {"role": "user", "content": "hello " * 300}]})
    assert r.status_code == 200 and r.json()["count"] > 200


def test_waiting_queue_counts_every_sequence_of_a_request(tiny_path):
    """--max-waiting counts prompts x n, not one per HTTP request."""
    llm = LLM(tiny_path, **ENGINE_KW)
    with running_server(llm, max_waiting=4) as srv:
        r = post(srv, "/v1/completions", _c(prompt=["a", "b", "c"], n=2))
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert post(srv, "/v1/completions", _c(prompt=["a", "b"], n=2)).status_code == 200
        wait_idle(srv)


def test_requests_past_max_connections_get_503_with_retry_after(tiny_path):
    llm = LLM(tiny_path, **{**ENGINE_KW, "max_model_len": 4096}, max_num_seqs=1)
    with running_server(llm, limits=Limits(max_connections=2)) as srv:
        body = {"model": MODEL, "prompt": "Long", "max_tokens": 3000, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as a, \
                httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as b:
            assert a.status_code == b.status_code == 200
            r = post(srv, "/v1/completions", _c())
            assert "--max-connections" in error_of(r, 503)
            assert r.headers["retry-after"] == "1"
            assert httpx.get(srv.url + "/health").status_code == 200  # probes still answer
            assert httpx.get(srv.url + "/metrics").status_code == 200
        wait_idle(srv)
        assert post(srv, "/v1/completions", _c()).status_code == 200
        wait_idle(srv)


def test_limits_are_checked_at_start():
    for bad in (dict(max_body_bytes=0), dict(max_sequences=-1), dict(max_logprobs=21)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Limits(**bad)


# ---- isolation ---------------------------------------------------------------------------------
GOOD = [("Once upon a time", 24), ("The capital of France is", 20), ("def fib(n):", 28)]


def hostile_bodies() -> list[tuple[str, bytes | dict]]:
    return [
        ("/v1/completions", _c(stop_token_ids=[10**9], min_tokens=2)),
        ("/v1/completions", _c(prompt=[10**9])),
        ("/v1/completions", _c(repetition_penalty=1e308 * 10)),  # inf
        ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "temperature": NaN}'),
        ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "max_tokens": 1e400}'),
        ("/v1/completions", _c(n=10**6)),
        ("/v1/completions", _c(logit_bias={"999999999": 5})),
        ("/v1/completions", _c(response_format={"type": "json_schema",
                                                "json_schema": {"schema": {"type": "nope"}}})),
        ("/v1/completions", _c(guided_regex="(((")),
        ("/v1/chat/completions", _chat(messages=[{"role": "wizard", "content": "x"}])),
        ("/v1/chat/completions", _chat(tools=[{"type": "function",
                                               "function": {"name": "bad name!"}}])),
        ("/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"),  # deep
        ("/v1/completions", b'\xff\xfe{"prompt": "\xc3\x28"}'),  # not UTF-8
        ("/v1/completions", b'{"model": "tiny", "prompt": "a", "prompt": 5}'),  # duplicate key
        ("/v1/completions", b"x" * 100_000),  # over the body limit
        ("/v1/completions", _c(seed=2**70)),
        ("/v1/completions", _c(max_tokens=-1)),
        ("/v1/completions", _c(stop=[""])),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}),
        ("/tokenize", {"model": MODEL, "prompt": 5}),
        ("/detokenize", {"model": MODEL, "tokens": [-1, 10**12]}),
    ]


def test_hostile_requests_never_change_concurrent_well_formed_streams(srv):
    """Well-formed greedy streams run while every hostile body above arrives (several times,
    from threads): each stream gives exactly its tokens alone, each hostile one a 4xx."""
    alone = {}
    for prompt, n in GOOD:
        r = post(srv, "/v1/completions", _c(prompt=prompt, max_tokens=n, temperature=0,
                                            ignore_eos=True))
        alone[prompt] = r.json()["choices"][0]["text"]

    async def stream(client, prompt, n):
        text = ""
        async with client.stream("POST", srv.url + "/v1/completions", json=_c(
                prompt=prompt, max_tokens=n, temperature=0, ignore_eos=True, stream=True)) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    text += chunk["choices"][0]["text"]
        return text

    statuses = []

    async def hostile(client, path, body):
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = await client.post(srv.url + path, content=content,
                              headers={"Content-Type": "application/json"})
        statuses.append((r.status_code, path, content[:80]))

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            goods = [asyncio.ensure_future(stream(client, p, n)) for p, n in GOOD * 2]
            await asyncio.sleep(0.05)
            for _ in range(3):
                await asyncio.gather(*(hostile(client, p, b) for p, b in hostile_bodies()))
            return await asyncio.gather(*goods)

    texts = asyncio.run(main())
    assert texts == [alone[p] for p, _ in GOOD * 2]
    assert all(400 <= s < 500 for s, _, _ in statuses), [s for s in statuses if s[0] >= 500
                                                        or s[0] < 400]
    assert httpx.get(srv.url + "/health").status_code == 200


# ---- fuzzing -----------------------------------------------------------------------------------
def operations(srv):
    import schemathesis

    doc = httpx.get(srv.url + "/openapi.json").json()
    schema = schemathesis.openapi.from_dict(doc)
    return [r.ok() for r in schema.get_all_operations()]


def send(srv, case) -> httpx.Response:
    from schemathesis.core import NotSet

    body = case.body
    content = (b"" if isinstance(body, NotSet) else body if isinstance(body, bytes)
               else json.dumps(body).encode())
    return httpx.request(case.method.upper(), srv.url + case.formatted_path, content=content,
                         headers={"Content-Type": "application/json"}, timeout=60)


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_fuzzing_every_endpoint_from_the_openapi_document(srv, mode):
    from schemathesis import GenerationMode

    ops = operations(srv)
    assert {f"{o.method.upper()} {o.path}" for o in ops} >= {
        "POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize",
        "POST /detokenize", "GET /v1/models", "GET /health", "GET /metrics",
        "POST /v1/responses", "GET /v1/responses/{response_id}",
        "DELETE /v1/responses/{response_id}", "POST /infill", "POST /v1/messages",
        "POST /v1/messages/count_tokens"}
    seen = []
    for op in ops:
        if mode == "negative" and op.method.lower() != "post":
            continue  # nothing to make invalid in a GET without parameters
        strategy = op.as_strategy(GenerationMode(mode))

        @settings(max_examples=40 if op.method.lower() == "post" else 5, deadline=None,
                  database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(data=st.data())
        def fuzz(data):
            case = data.draw(strategy)
            r = send(srv, case)
            seen.append(r.status_code)
            assert r.status_code < 500, (op.path, case.body, r.status_code, r.text[:300])

        fuzz()
    assert len(seen) >= 100
    if mode == "negative":
        assert sum(400 <= s < 500 for s in seen) > len(seen) // 3
    else:
        assert sum(s == 200 for s in seen) >= 20  # valid bodies that really generate
    wait_idle(srv, timeout=120)
    assert httpx.get(srv.url + "/health").status_code == 200


# ---- prefix-cache isolation -------------------------------------------------------------------
def _prefix_hits(srv) -> float:
    text = httpx.get(srv.url + "/metrics").text
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("pagellm:prefix_cache_hits_total")))


def test_cache_salt_keeps_tenants_apart(srv):
    """Requests share cached prefixes only with requests of the same cache_salt."""
    prompt = list(range(300, 348))  # three full blocks of 16
    assert post(srv, "/v1/completions", _c(prompt=prompt, cache_salt="tenant-a")).status_code == 200
    hits = _prefix_hits(srv)
    assert post(srv, "/v1/completions", _c(prompt=prompt, cache_salt="tenant-b")).status_code == 200
    assert _prefix_hits(srv) == hits  # another tenant: nothing served from a's blocks
    assert post(srv, "/v1/completions", _c(prompt=prompt, cache_salt="tenant-a")).status_code == 200
    assert _prefix_hits(srv) == hits + 32  # the same tenant: two full blocks reused
    assert "cache_salt" in error_of(post(srv, "/v1/completions", _c(cache_salt="")), 400,
                                    "cache_salt")


# ---- the memory budget's split in /metrics -----------------------------------------------------
def test_metrics_expose_the_memory_split(tiny_path):
    """Target and draft weights and KV pools, as /metrics reports them and as they are."""
    from prometheus_client.parser import text_string_to_metric_families

    spec = {"method": "draft_model", "model": tiny_path, "num_speculative_tokens": 2,
            "draft_num_layers": 1, "adaptive": False}
    llm = LLM(tiny_path, **ENGINE_KW, speculative_config=spec)
    with running_server(llm) as srv:
        text = httpx.get(srv.url + "/metrics").text
        got = {(s.labels["model"], s.labels["part"]): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "pagellm:memory_bytes"}
        eng = llm.engine
        pool = lambda runner: sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)  # noqa: E731
        assert got[("target", "weights")] == eng.model.weight_bytes() > 0
        assert got[("target", "kv")] == pool(eng.runner) > 0
        proposer = eng.spec.proposer
        assert got[("draft", "weights")] == proposer.model.weight_bytes() > 0
        assert got[("draft", "kv")] == pool(proposer.runner) > 0
        # one budget: the two pools together stay within the configured KV memory
        assert got[("target", "kv")] + got[("draft", "kv")] <= 16 * 2**20
        wait_idle(srv)
