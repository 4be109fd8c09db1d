"""End to end: a live OpenAI-compatible server on 127.0.0.1 (free port), driven by the official
`openai` client and raw HTTP.

The in-process servers run uvicorn on a background thread so that the tests can look at the
engine: after every test all requests are gone and every KV block is back in the pool. A tiny
random Llama with the default model's real tokenizer (and chat template) keeps the text paths
real and the steps fast; one test checks the real default model against offline generate; one
runs `python -m pagellm.cli serve` in a subprocess and drains it with SIGTERM.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import re
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from pagellm import LLM, SamplingParams
from pagellm.server.api_server import OpenAIServer, build_app, default_model_name
from pagellm.server.cors import CorsPolicy, parse_list
from tests.helpers import assert_no_leaks, make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"
ENGINE_KW = dict(dtype="float32", kv_cache_memory="16MiB", max_model_len=1024)


# ---- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    """Tiny random Llama (4096 positions) with the default model's tokenizer and chat template."""
    from pagellm.models.loader import load_model_files

    tok = load_model_files(None).tokenizer
    path = tmp_path_factory.mktemp("tiny_chat")
    make_tiny_model(path, "llama", vocab_size=len(tok), max_position_embeddings=4096)
    tok.save_pretrained(path)
    return str(path)


@contextlib.contextmanager
def running_server(llm: LLM, name: str = MODEL, cors: CorsPolicy | None = None, **server_kw):
    """uvicorn on a background thread, on a socket bound to a free port of 127.0.0.1."""
    api = OpenAIServer(llm.engine, name, **server_kw)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(api, cors), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    try:
        yield SimpleNamespace(url=url, api=api, engine=llm.engine, api_app=server.config.app,
                              client=openai.OpenAI(
            base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120))
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()
        assert not thread.is_alive()


def wait_idle(srv, timeout: float = 30.0) -> None:
    """Every request finished or aborted, and every block back in the pool."""
    deadline = time.monotonic() + timeout
    while srv.api.async_engine.num_active or srv.engine.requests:
        assert time.monotonic() < deadline, f"requests left: {list(srv.engine.requests)}"
        time.sleep(0.02)
    assert_no_leaks(srv.engine)


@pytest.fixture(scope="module")
def server(tiny_path):
    with running_server(LLM(tiny_path, **ENGINE_KW)) as srv:
        yield srv


@pytest.fixture
def srv(server):
    """The shared server; after the test, nothing is left running and no block leaked."""
    yield server
    wait_idle(server)


@pytest.fixture(scope="module")
def offline(tiny_path) -> LLM:
    return LLM(tiny_path, **ENGINE_KW)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def post(srv, path: str, body, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(srv.url + path, content=content, timeout=60,
                      headers={"Content-Type": "application/json", **(headers or {})})


def sse_events(srv, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", srv.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]


# ---- completions and chat: equal to offline generate -----------------------------------------
PROMPTS = ["Hello there", "The capital of France is", [5, 17, 33, 4, 90]]
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colours."}]


def test_models_health_version(srv):
    models = srv.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    listing = httpx.get(srv.url + "/v1/models").text
    assert srv.engine.model_path not in listing and models.data[0].root == MODEL  # no server paths
    assert httpx.get(srv.url + "/health").status_code == 200
    assert httpx.head(srv.url + "/health").status_code == 200  # probes that send HEAD
    assert httpx.get(srv.url + "/version").json()["version"]


def test_completion_equals_offline(srv, offline):
    for prompt in PROMPTS:
        ref = offline.generate(prompt, greedy(24), use_tqdm=False)[0]
        res = srv.client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                            temperature=0)
        assert res.object == "text_completion" and res.id.startswith("cmpl-")
        (choice,) = res.choices
        assert choice.text == ref.outputs[0].text
        assert choice.finish_reason == ref.outputs[0].finish_reason
        assert res.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert res.usage.completion_tokens == len(ref.outputs[0].token_ids)
    # A list of prompts: one choice per prompt, in order.
    refs = offline.generate(PROMPTS[:2], greedy(8), use_tqdm=False)
    res = srv.client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=8,
                                        temperature=0)
    assert [c.text for c in res.choices] == [r.outputs[0].text for r in refs]
    assert [c.index for c in res.choices] == [0, 1]


def test_chat_equals_offline(srv, offline):
    ref = offline.chat(CHAT, greedy(20), use_tqdm=False)[0]
    res = srv.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20,
                                             temperature=0)
    assert res.object == "chat.completion"
    (choice,) = res.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.outputs[0].text
    assert res.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert res.usage.completion_tokens == 20
    # max_completion_tokens is the newer name of max_tokens.
    res2 = srv.client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0,
                                              max_completion_tokens=20)
    assert res2.choices[0].message.content == ref.outputs[0].text


def test_streaming_completion(srv, offline):
    ref = offline.generate(PROMPTS[0], greedy(24), use_tqdm=False)[0].outputs[0]
    stream = srv.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 24
    events = sse_events(srv, "/v1/completions", {"model": MODEL, "prompt": PROMPTS[0],
                                                 "max_tokens": 5, "stream": True})
    assert events[-1] == "[DONE]"
    assert all("usage" not in json.loads(e) for e in events[:-1])


def test_streaming_chat(srv, offline):
    ref = offline.chat(CHAT, greedy(20), use_tqdm=False)[0].outputs[0]
    stream = srv.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 20
    events = sse_events(srv, "/v1/chat/completions", {"model": MODEL, "messages": CHAT,
                                                      "max_tokens": 3, "stream": True})
    assert events[-1] == "[DONE]"


def test_n_and_seed_reproducible(srv, offline):
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=1.0, n=3, seed=7)
    first = srv.client.completions.create(**kw)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert len(texts) == 3 and len(set(texts)) > 1  # independent samples
    assert [c.text for c in sorted(srv.client.completions.create(**kw).choices,
                                   key=lambda c: c.index)] == texts
    ref = offline.generate(PROMPTS[1], SamplingParams(n=3, temperature=1.0, seed=7,
                                                      max_tokens=12), use_tqdm=False)[0]
    assert [o.text for o in ref.outputs] == texts
    other = srv.client.completions.create(**{**kw, "seed": 8})
    assert sorted(c.text for c in other.choices) != sorted(texts)
    # Streaming n > 1: each index assembles its own text.
    streamed = {i: "" for i in range(3)}
    for chunk in srv.client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[i] for i in range(3)] == texts
    chat = srv.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, n=2,
                                              temperature=1.0, seed=1)
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_stop_strings(srv, offline):
    full = offline.generate(PROMPTS[0], greedy(32, ignore_eos=True), use_tqdm=False)[0]
    text = full.outputs[0].text
    stop = text[10:14]
    expected = text[:text.find(stop)]
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=32, temperature=0, stop=[stop],
              extra_body={"ignore_eos": True})
    res = srv.client.completions.create(**kw)
    assert res.choices[0].text == expected
    assert res.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in srv.client.completions.create(**kw, stream=True))
    assert streamed == expected  # a stop string never leaks into the stream
    chat_ref = offline.chat(CHAT, greedy(24), use_tqdm=False)[0].outputs[0].text
    chat_stop = chat_ref[6:9]
    chunks = srv.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24,
                                                temperature=0, stop=chat_stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        chat_ref[:chat_ref.find(chat_stop)]


def test_logprobs(srv, offline):
    ref = offline.generate(PROMPTS[0], greedy(10, logprobs=3), use_tqdm=False)[0].outputs[0]
    res = srv.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10,
                                        temperature=0, logprobs=3)
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
    for tid, value, top, entries in zip(ref.token_ids, lp.token_logprobs, lp.top_logprobs,
                                        ref.logprobs):
        assert value == pytest.approx(entries[tid], abs=1e-4)
        assert len(top) == 3 and max(top.values()) == pytest.approx(value, abs=1e-4)  # greedy
    # one running sum of the token texts over prompt and completion, from 0
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    chat = srv.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5,
                                              temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob, abs=1e-4)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    stream = srv.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10,
                                           temperature=0, logprobs=1, stream=True)
    values = [v for c in stream for v in c.choices[0].logprobs.token_logprobs]
    assert values == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_echo_with_logprobs_scores_the_prompt(srv, offline):
    """echo + logprobs (how evaluation harnesses score a continuation): the choice's logprobs
    hold every prompt token, the first with null logprob and top_logprobs, then the generated
    ones; the prompt's values are the offline engine's prompt_logprobs. Token-id prompts (as
    lm-evaluation-harness sends them) and streams alike."""
    tok = offline.get_tokenizer()
    context, continuation = tok.encode("The sky is"), tok.encode(" blue today")
    ids = context + continuation
    ref = offline.generate([ids], greedy(1, prompt_logprobs=1, logprobs=1),
                           use_tqdm=False)[0]
    res = srv.client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0,
                                        logprobs=1, echo=True)
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(ref.prompt_logprobs[i][ids[i]], abs=1e-4)
        assert lp.tokens[i] in lp.top_logprobs[i] or len(lp.top_logprobs[i]) == 1
        assert max(lp.top_logprobs[i].values()) >= lp.token_logprobs[i] - 1e-6
    assert lp.token_logprobs[-1] == pytest.approx(ref.outputs[0].logprobs[0][
        ref.outputs[0].token_ids[0]], abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert res.choices[0].text.startswith(tok.decode(ids))
    # the harness's sum over the continuation
    score = sum(lp.token_logprobs[len(context):-1])
    assert score == pytest.approx(sum(ref.prompt_logprobs[i][ids[i]]
                                      for i in range(len(context), len(ids))), abs=1e-3)
    stream = srv.client.completions.create(model=MODEL, prompt=ids, max_tokens=3,
                                           temperature=0, logprobs=1, echo=True, stream=True)
    chunks = [c.choices[0].logprobs for c in stream]
    values = [v for c in chunks for v in c.token_logprobs]
    assert values[0] is None and len(values) == len(ids) + 3
    tokens = [t for c in chunks for t in c.tokens]
    assert [o for c in chunks for o in c.text_offset] == [sum(map(len, tokens[:i]))
                                                          for i in range(len(tokens))]
    assert values[1:len(ids)] == pytest.approx(lp.token_logprobs[1:len(ids)], abs=1e-4)
    # without logprobs, echo alone computes no prompt log-probabilities
    plain = srv.client.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True)
    assert plain.choices[0].logprobs is None
    # max_tokens 0 with echo (the legacy API's scoring form): the prompt alone, nothing generated
    for stream in (False, True):
        res = srv.client.completions.create(model=MODEL, prompt=ids, max_tokens=0, logprobs=1,
                                            echo=True, stream=stream,
                                            **({"stream_options": {"include_usage": True}}
                                               if stream else {}))
        chunks = list(res) if stream else [res]
        choices = [c.choices[0] for c in chunks if c.choices]
        assert "".join(c.text for c in choices) == tok.decode(ids)
        values = [v for c in choices for v in c.logprobs.token_logprobs]
        assert values[0] is None and values[1:] == pytest.approx(lp.token_logprobs[1:len(ids)],
                                                                 abs=1e-4)
        assert choices[-1].finish_reason == "length"
        assert chunks[-1].usage.completion_tokens == 0
        assert chunks[-1].usage.prompt_tokens == len(ids)
    # a prompt whose characters span several tokens: the running sum still goes on over the
    # generated tokens (token texts of partial characters are not the echoed text's length)
    res = srv.client.completions.create(model=MODEL, prompt="Caf\u00e9 \u65e5\u672c \U0001f642 is",
                                        max_tokens=3, temperature=0, logprobs=1, echo=True)
    lp = res.choices[0].logprobs
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    # a one-token prompt: its one entry, null
    one = srv.client.completions.create(model=MODEL, prompt=ids[:1], max_tokens=0, logprobs=1,
                                        echo=True, extra_body={"min_tokens": 4})
    assert one.choices[0].logprobs.token_logprobs == [None]
    assert one.choices[0].logprobs.text_offset == [0]
    bad = post(srv, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_scoring_a_whole_context_window(srv, offline):
    """max_tokens 0 with echo scores a prompt of exactly max_model_len tokens (a harness's
    rolling-window perplexity); one token more is a 400 naming the prompt, as is generating
    after a prompt that fills the context."""
    window = [(7 * i + 3) % 4000 + 10 for i in range(ENGINE_KW["max_model_len"])]
    ref = offline.generate([window], greedy(1, prompt_logprobs=0), use_tqdm=False)[0]
    res = srv.client.completions.create(model=MODEL, prompt=window, max_tokens=0, logprobs=0,
                                        echo=True)
    values = res.choices[0].logprobs.token_logprobs
    assert len(values) == len(window) and values[0] is None
    assert values[1:] == pytest.approx([ref.prompt_logprobs[i][window[i]]
                                        for i in range(1, len(window))], abs=1e-4)
    assert res.usage.prompt_tokens == len(window) and res.usage.completion_tokens == 0
    for body in ({"prompt": window + [11], "max_tokens": 0, "echo": True},
                 {"prompt": window, "max_tokens": 1}, {"prompt": window}):
        r = post(srv, "/v1/completions", {"model": MODEL, **body})
        assert r.status_code == 400, (body.keys(), r.text)
        assert r.json()["error"]["code"] == "context_length_exceeded"


def test_echo_and_extra_fields_accepted(srv):
    res = post(srv, "/v1/completions", {"model": MODEL, "prompt": "Hi there", "max_tokens": 3,
                                        "echo": True, "user": "u1", "some_new_field": {"a": 1},
                                        "best_of": 1, "suffix": None, "logit_bias": {}})
    assert res.status_code == 200, res.text
    assert res.json()["choices"][0]["text"].startswith("Hi there")
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name three "},
                                          {"type": "text", "text": "colours."}]}]
    a = srv.client.chat.completions.create(model=MODEL, messages=parts, max_tokens=4,
                                           temperature=0)
    b = srv.client.chat.completions.create(model=MODEL, messages=[CHAT[1]], max_tokens=4,
                                           temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_tokenize_detokenize(srv, offline):
    tok = offline.get_tokenizer()
    r = post(srv, "/tokenize", {"model": MODEL, "prompt": "Hello world"}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 1024
    assert post(srv, "/detokenize", {"tokens": r["tokens"]}).json()["prompt"] == "Hello world"
    chat = post(srv, "/tokenize", {"messages": CHAT}).json()
    assert chat["tokens"] == offline.apply_chat_template(CHAT)
    # with tools: the prompt a chat completion with them gets (vLLM's /tokenize takes them)
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    with_tools = post(srv, "/tokenize", {"messages": CHAT, "tools": tools}).json()
    answer = srv.client.chat.completions.create(model=MODEL, messages=CHAT, tools=tools,
                                                max_tokens=1)
    assert with_tools["count"] == answer.usage.prompt_tokens > chat["count"]
    assert "get_weather" in post(srv, "/detokenize", {"tokens": with_tools["tokens"]}).json()[
        "prompt"]
    bad = post(srv, "/tokenize", {"prompt": "Hello", "tools": tools})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"
    bad = post(srv, "/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400 and "out of range" in bad.json()["error"]["message"]


def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(srv):
    """usage.prompt_tokens_details.cached_tokens (OpenAI's field): the whole blocks of a prompt
    the prefix cache served, so more when the same prompt comes again (a first chat request
    may already share the template's system prompt with earlier ones: a block of it); chat
    and completions, streamed (the usage chunk) or not."""
    c = srv.client
    words = " ".join(f"w{i}" for i in range(120))  # a prompt no other test sends
    msgs = [{"role": "user", "content": f"cached-usage {words}"}]
    first = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    seen = first.usage.prompt_tokens_details.cached_tokens
    assert seen % 16 == 0 and seen < 64, seen  # at most the template's opening
    again = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert seen + 16 * 10 < cached < again.usage.prompt_tokens and cached % 16 == 0, cached
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    prompt = f"cached-usage completions {words}"
    assert c.completions.create(model=MODEL, prompt=prompt, max_tokens=2
                                ).usage.prompt_tokens_details.cached_tokens == 0
    done = c.completions.create(model=MODEL, prompt=[prompt, prompt + " more"], max_tokens=2)
    both = done.usage.prompt_tokens_details.cached_tokens  # each prompt's cached blocks, summed
    assert both > 0 and both % 16 == 0
    chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, stream=True,
                                       stream_options={"include_usage": True}))
    assert 0 < chunks[-1].usage.prompt_tokens_details.cached_tokens <= both


def test_continuous_usage_stats(srv):
    """vLLM's stream_options.continuous_usage_stats: with include_usage, every chunk carries
    the usage so far (the prompt's tokens, the tokens generated up to it), the last the whole;
    without it (or without include_usage) the chunks carry none."""
    c = srv.client
    for chat, make in (
            (True, lambda **kw: c.chat.completions.create(model=MODEL, messages=CHAT, **kw)),
            (False, lambda **kw: c.completions.create(model=MODEL, prompt="Hello there", **kw))):
        chunks = list(make(max_tokens=8, stream=True, extra_body={
            "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
        final = chunks[-1].usage
        assert not chunks[-1].choices and final.completion_tokens == 8
        counts = [ch.usage.completion_tokens for ch in chunks[:-1]]
        assert all(ch.usage.prompt_tokens == final.prompt_tokens for ch in chunks)
        # chat's first chunk is the role, before any token; a completion's first chunk may
        # already hold several tokens (a loaded machine coalesces steps into one chunk)
        assert counts == sorted(counts) and counts[-1] == 8 and (counts[0] == 0 or not chat)
        assert all(ch.usage.total_tokens == ch.usage.prompt_tokens + ch.usage.completion_tokens
                   for ch in chunks)
        for options in ({"include_usage": True}, {"continuous_usage_stats": True}):
            plain = list(make(max_tokens=4, stream=True, stream_options=options))
            assert all(ch.usage is None for ch in plain if ch.choices)


def test_continue_final_message(srv, offline):
    """vLLM's continue_final_message: the prompt ends inside the last (assistant) message, with
    no end of turn after it, as transformers renders it; on chat completions (the official
    client's extra_body), /tokenize and LLM.chat / apply_chat_template alike. The reply holds
    the continuation only. With add_generation_prompt (the default) it is a 400 naming it."""
    begun = CHAT + [{"role": "assistant", "content": "Red, green and"}]
    tok = offline.get_tokenizer()
    want = tok.encode(tok.apply_chat_template(begun, tokenize=False, continue_final_message=True),
                      add_special_tokens=False)
    closed = offline.apply_chat_template(begun, add_generation_prompt=False)
    assert want == offline.apply_chat_template(begun, add_generation_prompt=False,
                                               continue_final_message=True)
    assert want == closed[:len(want)] and len(closed) > len(want)  # the end of turn is gone
    assert tok.decode(want).endswith("Red, green and")
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    assert post(srv, "/tokenize", {"messages": begun, **flags}).json()["tokens"] == want
    r = srv.client.chat.completions.create(model=MODEL, messages=begun, max_tokens=4,
                                           temperature=0, extra_body=flags)
    assert r.usage.prompt_tokens == len(want)
    sp = SamplingParams(temperature=0, max_tokens=4)
    (out,) = offline.chat(begun, sp, use_tqdm=False, **flags)
    assert r.choices[0].message.content == out.outputs[0].text
    for path in ("/v1/chat/completions", "/tokenize"):
        bad = post(srv, path, {"model": MODEL, "messages": begun, "max_tokens": 2,
                               "continue_final_message": True})
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == "continue_final_message", bad.text
    with pytest.raises(ValueError, match="continue_final_message"):
        offline.apply_chat_template(begun, continue_final_message=True)
    bad = post(srv, "/v1/chat/completions", {"model": MODEL, "messages": begun, **flags,
                                             "chat_template_kwargs": {"continue_final_message": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


def test_chat_template_kwargs(srv, offline):
    """vLLM's chat_template_kwargs are variables of the chat template (Qwen3's
    enable_thinking): on chat completions (the official client's extra_body) and /tokenize,
    the prompt is LLM.apply_chat_template's with the same variables; a variable the server
    sets itself (tools, add_generation_prompt, ...) is a 400 naming the field."""
    think = ("{% if enable_thinking is defined and not enable_thinking %}"
             "<think>\n\n</think>\n\n{% endif %}")
    tokenizers = [srv.api.tokenizer, offline.get_tokenizer()]
    saved = [t.chat_template for t in tokenizers]
    try:
        for t in tokenizers:
            t.chat_template = t.chat_template + think
        off = {"enable_thinking": False}
        plain = post(srv, "/tokenize", {"messages": CHAT}).json()["tokens"]
        quiet = post(srv, "/tokenize", {"messages": CHAT, "chat_template_kwargs": off}).json()["tokens"]
        assert quiet == offline.apply_chat_template(CHAT, chat_template_kwargs=off)
        assert plain == offline.apply_chat_template(CHAT) and len(quiet) > len(plain)
        r = srv.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                               extra_body={"chat_template_kwargs": off})
        assert r.usage.prompt_tokens == len(quiet)
        bad = post(srv, "/v1/chat/completions", {"model": MODEL, "messages": CHAT,
                                                 "chat_template_kwargs": {"tools": []}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
        with pytest.raises(ValueError, match="chat_template_kwargs: 'tools'"):
            offline.apply_chat_template(CHAT, chat_template_kwargs={"tools": []})
    finally:
        for t, template in zip(tokenizers, saved):
            t.chat_template = template


# ---- bad requests ----------------------------------------------------------------------------
def _c(**kw):
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **kw}


def _chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


BAD = [
    ("/v1/completions", b"{not json", 400, "Invalid JSON"),
    ("/v1/completions", b"[1, 2]", 400, "object"),
    ("/v1/completions", {"model": MODEL, "max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", _c(max_tokens="ten"), 400, "max_tokens"),
    ("/v1/completions", _c(max_tokens=-1), 400, "max_tokens"),
    ("/v1/completions", _c(temperature=5), 400, "temperature"),
    ("/v1/completions", _c(temperature="hot"), 400, "temperature"),
    ("/v1/completions", _c(top_p=0), 400, "top_p"),
    ("/v1/completions", _c(top_k=-5), 400, "top_k"),
    ("/v1/completions", _c(min_p=1.5), 400, "min_p"),
    ("/v1/completions", _c(n=0), 400, "n"),
    ("/v1/completions", _c(logprobs=50), 400, "logprobs"),
    ("/v1/completions", _c(presence_penalty=3), 400, "presence_penalty"),
    ("/v1/completions", _c(frequency_penalty=-3), 400, "frequency_penalty"),
    ("/v1/completions", _c(repetition_penalty=0), 400, "repetition_penalty"),
    ("/v1/completions", _c(stop=[""]), 400, "stop"),
    ("/v1/completions", _c(stream="yes"), 400, "stream"),
    ("/v1/completions", _c(seed="x"), 400, "seed"),
    ("/v1/completions", _c(min_tokens=9), 400, "min_tokens"),
    ("/v1/completions", _c(prompt=""), 400, "prompt"),
    ("/v1/completions", _c(prompt=[1, "a"]), 400, "prompt"),
    ("/v1/completions", _c(prompt=[10**9]), 400, "out of range"),
    ("/v1/completions", _c(logit_bias={"five": 10}), 400, "logit_bias"),
    ("/v1/completions", _c(logit_bias={"5": 500}), 400, "logit_bias"),
    ("/v1/completions", _c(logit_bias={str(10**7): 1}), 400, "logit_bias"),
    ("/v1/completions", _c(model="gpt-4"), 404, "gpt-4"),
    ("/v1/completions", _c(prompt=list(range(100, 1200))), 400, "maximum context length"),
    ("/v1/completions", _c(max_tokens=5000), 400, "maximum context length"),
    ("/v1/chat/completions", _chat(messages=[]), 400, "messages"),
    ("/v1/chat/completions", _chat(messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages.0.role"),
    ("/v1/chat/completions", _chat(messages="hi"), 400, "messages"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, "image_url"),
    ("/v1/chat/completions", _chat(top_logprobs=2), 400, "top_logprobs"),
    ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=99), 400, "top_logprobs"),
    ("/v1/chat/completions", _chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("/v1/chat/completions", _chat(tools=[{"type": "function"}]), 400, "tool"),
    ("/v1/chat/completions", _chat(model="nope"), 404, "nope"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", _c(stop_token_ids=[10**6], min_tokens=1), 400, "stop_token_ids"),
    ("/v1/completions", b'{"model": "%s", "prompt": "hi", "repetition_penalty": Infinity}' % MODEL.encode(),
     400, "repetition_penalty"),
]


@pytest.mark.parametrize("path,body,status,needle", BAD, ids=[f"{i}-{b!r:.40}" for i, (_, b, _, _) in enumerate(BAD)])
def test_bad_request(srv, path, body, status, needle):
    """Each class of bad request gets its status and a message naming the problem, in OpenAI's
    error shape (each case on its own: one failure does not hide the rest)."""
    r = post(srv, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert needle in err["message"], err


def test_server_serves_after_bad_requests(srv):
    for path, body, _, _ in BAD:
        post(srv, path, body)
    r = httpx.get(srv.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    assert httpx.get(srv.url + "/health").status_code == 200  # still serving
    assert srv.client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices


def test_bad_requests_raise_in_openai_client(srv):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        srv.client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        srv.client.chat.completions.create(model="other", messages=CHAT)
    with pytest.raises(openai.NotFoundError):  # an endpoint this server does not have
        srv.client.images.generate(model=MODEL, prompt="x")
    assert srv.client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices


# ---- concurrency, disconnects, slow clients, failures -----------------------------------------
def test_32_concurrent_streams(srv, offline):
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(4, 40))] for _ in range(32)]
    lengths = [rng.randrange(8, 33) for _ in range(32)]
    refs = offline.generate(prompts, [greedy(n, ignore_eos=True) for n in lengths],
                            use_tqdm=False)

    async def one(client, prompt, n):
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage = "", None
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return text, usage.completion_tokens

    async def all_of_them():
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0,
                                    timeout=120)
        return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))

    results = asyncio.run(all_of_them())
    for (text, num), ref, n in zip(results, refs, lengths):
        assert text == ref.outputs[0].text
        assert num == n


def _aborted(srv) -> float:
    """pagellm:request_success_total{finished_reason="abort"} as /metrics reports it."""
    text = httpx.get(srv.url + "/metrics").text
    found = re.search(r'^pagellm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_disconnect_mid_stream_frees_blocks(srv):
    """A client that leaves has its request aborted (counted as such) and its blocks freed;
    a request that merely ran to its end would count as "length", so a broken abort fails."""
    bm = srv.engine.block_manager
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1000, "stream": True,
            "ignore_eos": True}
    before = _aborted(srv)
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got == 3:
                break
        assert bm.num_free_blocks < bm.num_blocks  # the request holds blocks now
    wait_idle(srv)  # the server noticed, aborted it and took its blocks back
    assert _aborted(srv) == before + 1
    # Non-streaming: the client leaves once the engine runs its request (no timing race: a
    # client timeout could fire before the request was even added).
    payload = json.dumps({**body, "stream": False}).encode()
    raw = socket.create_connection(("127.0.0.1", int(srv.url.rsplit(":", 1)[1])))
    raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
    deadline = time.monotonic() + 60
    while not srv.engine.requests:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    raw.close()
    wait_idle(srv)
    assert _aborted(srv) == before + 2


def _limit_gate(app):
    """The LimitGate instance inside the app's middleware stack (it counts requests in flight:
    a response still being written counts)."""
    from pagellm.server.limits import LimitGate

    layer = app.middleware_stack
    while layer is not None and not isinstance(layer, LimitGate):
        layer = getattr(layer, "app", None)
    return layer


def test_slow_client_does_not_stall_others(srv):
    """A streaming client that never reads, with a 4 KiB receive buffer and a response of
    megabytes: the server's writes to it block (its response stays in flight after the engine
    has finished it), and meanwhile the engine finishes it and keeps serving everyone else."""
    body = json.dumps({"model": MODEL, "prompt": "Slow", "max_tokens": 900, "stream": True,
                       "ignore_eos": True, "n": 8, "logprobs": 5}).encode()
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.connect(("127.0.0.1", int(srv.url.rsplit(":", 1)[1])))
    raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body)
    try:
        deadline = time.monotonic() + 30
        while not srv.engine.requests:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for _ in range(3):
            res = srv.client.completions.create(model=MODEL, prompt="Fast", max_tokens=8)
            assert res.usage.completion_tokens == 8
        deadline = time.monotonic() + 120
        while srv.engine.requests:  # the engine finishes the slow one without waiting on it
            assert time.monotonic() < deadline
            time.sleep(0.05)
        gate = _limit_gate(srv.api_app)
        time.sleep(0.5)
        assert gate.in_flight >= 1  # its response is still being written: the client blocks it
        received, tail = 0, b""
        raw.settimeout(30)
        while chunk := raw.recv(1 << 16):
            received += len(chunk)
            tail = (tail + chunk)[-256:]
            if b"data: [DONE]" in tail:
                break
        assert received > 1 << 20  # megabytes that waited for the client, not the engine
    finally:
        raw.close()

def test_engine_step_failure_fails_requests_and_keeps_serving(srv, monkeypatch):
    original = srv.engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated kernel failure")
        return original()

    monkeypatch.setattr(srv.engine, "step", flaky_step)
    r = post(srv, "/v1/completions", _c(max_tokens=4))
    message = r.json()["error"]["message"]
    # a 500 says what failed, not the exception's text (that stays in the server log)
    assert r.status_code == 500 and "engine step failed" in message
    assert "simulated kernel failure" not in message
    wait_idle(srv)
    calls["n"] = 0
    with pytest.raises(openai.APIError, match="engine step failed") as failed:
        for _ in srv.client.completions.create(model=MODEL, prompt="hi", max_tokens=4,
                                               stream=True):
            pass
    assert "simulated kernel failure" not in str(failed.value)
    assert srv.client.completions.create(model=MODEL, prompt="hi", max_tokens=4).choices


def test_unknown_fields_are_logged_once_each_and_boundedly(srv, monkeypatch, caplog):
    from pagellm.server import errors

    monkeypatch.setattr(errors, "_logged_fields", set())
    with caplog.at_level("WARNING", logger=errors.logger.name):
        for _ in range(3):
            assert post(srv, "/v1/completions", _c(max_tokens=1, my_field=1)).status_code == 200
        for i in range(200):  # a new name in every request
            post(srv, "/tokenize", {"model": MODEL, "prompt": "hi", f"f{i}": 1})
    logged = [r.getMessage() for r in caplog.records if "unknown request fields" in r.getMessage()]
    assert sum("my_field" in m for m in logged) == 1
    assert len(logged) <= errors._MAX_LOGGED_FIELDS and len(errors._logged_fields) == errors._MAX_LOGGED_FIELDS


def test_internal_error_keeps_its_details_in_the_log(srv, monkeypatch, caplog):
    """An unexpected exception in a handler: a 500 with an id, the text only in the log."""
    class Broken:
        def encode(self, *args, **kwargs):
            raise KeyError("/secret/path/on/the/server")

    monkeypatch.setattr(srv.api, "tokenizer", Broken())
    with caplog.at_level("ERROR"):
        r = post(srv, "/tokenize", {"model": MODEL, "prompt": "hi"})
    assert r.status_code == 500
    message = r.json()["error"]["message"]
    assert "secret" not in message and "KeyError" not in message
    error_id = message.split("(id ")[1].split(";")[0]
    assert any(error_id in rec.getMessage() for rec in caplog.records)
    monkeypatch.undo()
    assert post(srv, "/tokenize", {"model": MODEL, "prompt": "hi"}).status_code == 200


# ---- metrics ---------------------------------------------------------------------------------
def scrape(srv) -> dict[str, float]:
    """{sample name{labels}: value} of every pagellm: sample."""
    r = httpx.get(srv.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.name.startswith("pagellm:"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                                  if k != "model_name")
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_metrics(srv):
    before = scrape(srv)
    for name in ["pagellm:time_to_first_token_seconds_count",
                 "pagellm:inter_token_latency_seconds_count",
                 "pagellm:e2e_request_latency_seconds_count", "pagellm:prompt_tokens_total",
                 "pagellm:generation_tokens_total", "pagellm:num_requests_running",
                 "pagellm:num_requests_waiting", "pagellm:kv_cache_usage_perc",
                 "pagellm:prefix_cache_queries_total", "pagellm:prefix_cache_hits_total",
                 "pagellm:num_preemptions_total"]:
        assert name in before, name
    prompt = list(range(1000, 1040))  # 40 tokens: two full blocks of 16 are cacheable
    for _ in range(2):
        srv.client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                      extra_body={"ignore_eos": True})
    after = scrape(srv)

    def moved(name):
        return after[name] - before.get(name, 0)

    assert moved("pagellm:prompt_tokens_total") == 80
    assert moved("pagellm:generation_tokens_total") == 10
    assert moved("pagellm:time_to_first_token_seconds_count") == 2
    assert moved("pagellm:e2e_request_latency_seconds_count") == 2
    assert moved("pagellm:inter_token_latency_seconds_count") == 8
    assert moved("pagellm:prefix_cache_queries_total") == 80
    assert moved("pagellm:prefix_cache_hits_total") == 32
    assert moved("pagellm:request_success_total{finished_reason=length}") == 2
    assert after["pagellm:num_requests_running"] == 0
    assert after["pagellm:kv_cache_num_blocks"] == srv.engine.block_manager.num_blocks


def test_speculative_metrics_move(tiny_path):
    """A server with speculation (the model drafting for itself) reports drafts and
    acceptance per position."""
    llm = LLM(tiny_path, speculative_config={"method": "draft_model", "num_speculative_tokens": 3,
                                             "adaptive": False}, **ENGINE_KW)
    with running_server(llm) as srv:
        prompt = [7, 8, 9, 10] * 8
        srv.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                      extra_body={"ignore_eos": True})
        wait_idle(srv)
        spec = scrape(srv)
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0
    assert spec["pagellm:spec_decode_num_drafts_total"] == stats.num_drafts
    assert spec["pagellm:spec_decode_num_draft_tokens_total"] == stats.num_draft_tokens
    assert spec["pagellm:spec_decode_num_accepted_tokens_total"] == stats.num_accepted_tokens
    assert spec["pagellm:spec_decode_num_accepted_tokens_per_pos_total{position=0}"] == (
        stats.accepted_per_position[0])


def test_api_key(tiny_path):
    with running_server(LLM(tiny_path, **ENGINE_KW), api_key="sekret") as srv:
        r = post(srv, "/v1/completions", _c())
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = post(srv, "/v1/completions", _c(), headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert httpx.get(srv.url + "/health").status_code == 200  # probes need no key
        with pytest.raises(openai.AuthenticationError):
            srv.client.models.list()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0)
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
        wait_idle(srv)


def test_cors(tiny_path):
    """A browser's preflight and cross-origin calls: answered for any origin by default (vLLM's
    and llama.cpp's), before the API-key gate (browsers send no credentials with a
    preflight), errors included; a restricted list refuses other origins; '[]' turns it off."""
    page = "http://localhost:3000"
    preflight = {"Origin": page, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with running_server(LLM(tiny_path, **ENGINE_KW), api_key="sekret") as srv:
        r = httpx.options(srv.url + "/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        ok = post(srv, "/v1/completions", _c(), headers={"Origin": page,
                                                          "Authorization": "Bearer sekret"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "*"
        denied = post(srv, "/v1/completions", _c(), headers={"Origin": page})
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "*"
        wait_idle(srv)
    only = CorsPolicy(origins=parse_list('["http://localhost:3000"]', "--allowed-origins"))
    with running_server(LLM(tiny_path, **ENGINE_KW), cors=only) as srv:
        r = httpx.options(srv.url + "/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        other = httpx.options(srv.url + "/v1/chat/completions",
                              headers={**preflight, "Origin": "http://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        plain = post(srv, "/v1/completions", _c(), headers={"Origin": "http://evil.example"})
        assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers
        wait_idle(srv)
    with running_server(LLM(tiny_path, **ENGINE_KW), cors=CorsPolicy(origins=())) as srv:
        r = httpx.options(srv.url + "/v1/chat/completions", headers=preflight)
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers


def test_cors_flags():
    assert parse_list(None, "--allowed-origins") == ("*",)
    assert parse_list("http://a:1, http://b", "--allowed-origins") == ("http://a:1", "http://b")
    assert parse_list('["http://a"]', "--allowed-origins") == ("http://a",)
    assert parse_list("[]", "--allowed-origins") == parse_list("none", "--x") == ()
    args = SimpleNamespace(allowed_origins=None, allowed_methods="get, post",
                           allowed_headers=None, allow_credentials=False)
    assert CorsPolicy.from_args(args).methods == ("GET", "POST")  # as browsers send them
    for bad in ('["http://a"', '[1]', "http://a,,http://b"):
        with pytest.raises(ValueError, match="--allowed-origins"):
            parse_list(bad, "--allowed-origins")


def test_full_queue_gets_503(tiny_path):
    llm = LLM(tiny_path, **{**ENGINE_KW, "max_model_len": 4096}, max_num_seqs=1)
    with running_server(llm, max_waiting=1) as srv:
        body = {"model": MODEL, "prompt": "Long", "max_tokens": 3000, "stream": True,
                "ignore_eos": True}
        with contextlib.ExitStack() as stack:
            running = stack.enter_context(httpx.stream("POST", srv.url + "/v1/completions",
                                                       json=body, timeout=60))
            lines = running.iter_lines()  # kept: a closed iterator would close the stream
            next(line for line in lines if line.startswith("data: "))
            waiting = stack.enter_context(httpx.stream("POST", srv.url + "/v1/completions",
                                                       json=body, timeout=60))
            assert waiting.status_code == 200 and srv.engine.num_waiting == 1
            r = post(srv, "/v1/completions", _c())
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert "overloaded" in r.json()["error"]["message"]
        wait_idle(srv)  # closing both streams aborted them
        assert post(srv, "/v1/completions", _c()).status_code == 200
        wait_idle(srv)


# ---- SIGTERM drain of a real `pagellm serve` process ------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DRAIN = 3  # seconds: ample for 30 tokens of the tiny model, far too few for 4000


def test_sigterm_drains_and_exits_cleanly(tiny_path, tmp_path):
    """Requests running at SIGTERM finish within the drain timeout; the one that cannot is
    aborted with "shutting down" once it expires; new requests get 503 meanwhile."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagellm.cli", "serve", tiny_path, "--port", str(port),
             "--dtype", "float32", "--kv-cache-memory", "16MiB", "--drain-timeout", str(DRAIN),
             "--served-model-name", MODEL], stdout=log, stderr=subprocess.STDOUT, env=env,
            cwd=ROOT)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "server did not come up"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.3)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        results: dict[str, object] = {}
        started = {name: threading.Event() for name in ("short1", "short2", "long")}

        def run(name: str, max_tokens: int):
            text, finish = "", None
            try:
                for chunk in client.completions.create(
                        model=MODEL, prompt=f"Stream {name}", max_tokens=max_tokens,
                        stream=True, extra_body={"ignore_eos": True}):
                    started[name].set()
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                results[name] = finish
            except openai.APIError as e:
                results[name] = e
            finally:
                started[name].set()

        threads = [threading.Thread(target=run, args=a) for a in
                   (("short1", 30), ("short2", 30), ("long", 4000))]
        for t in threads:
            t.start()
        for ev in started.values():
            assert ev.wait(60)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        deadline = signalled + 10
        while True:  # draining: /health says 503 (the socket stays open meanwhile)
            status = None
            with contextlib.suppress(httpx.HTTPError):
                status = httpx.get(url + "/health", timeout=5).status_code
            if status == 503:
                break
            assert time.monotonic() < deadline, f"/health answered {status} while draining"
            time.sleep(0.02)
        r = httpx.post(url + "/v1/completions", json=_c(), timeout=5)
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        for t in threads:
            t.join(60)
        assert proc.wait(60) == 0
        # the long request kept the server draining until the timeout (an immediate abort
        # would have exited at once)
        assert time.monotonic() - signalled >= DRAIN - 0.5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text()
    for name in ("short1", "short2"):  # 30 tokens: well within the drain timeout
        assert results[name] == "length", (results[name], log[-3000:])
    assert isinstance(results["long"], openai.APIError), results["long"]
    assert "shutting down" in str(results["long"])
    assert "Traceback" not in log, log[-3000:]


# ---- the real default model ------------------------------------------------------------------
def test_default_model_equals_offline():
    llm = LLM(None, dtype="float32", kv_cache_memory="64MiB", max_model_len=1024,
              enable_prefix_caching=False)
    prompt = "The capital of France is"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ref = llm.generate(prompt, greedy(10), use_tqdm=False)[0].outputs[0].text
    ref_chat = llm.chat(messages, greedy(10), use_tqdm=False)[0].outputs[0].text
    name = default_model_name(None, llm.engine.model_path)
    with running_server(llm, name=name) as srv:
        res = srv.client.completions.create(model=name, prompt=prompt, max_tokens=10,
                                            temperature=0)
        assert res.choices[0].text == ref
        chat = srv.client.chat.completions.create(model=name, messages=messages, max_tokens=10,
                                                  temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chat) == ref_chat
        wait_idle(srv)


# ---- the serving benchmark client --------------------------------------------------------------
def test_benchmark_client_against_server(srv, tmp_path):
    from pagellm.benchmarks.serve import main as bench_serve

    assert bench_serve(["--base-url", srv.url, "--num-prompts", "3", "--request-rates", "inf",
                        "--input-len", "4", "--output-len", "3", "--token-range", "1000,2000",
                        "--out", str(tmp_path), "--no-plot"]) == 0
    data = json.loads((tmp_path / "serve.json").read_text())
    (row,) = data["results"]
    assert data["kind"] == "serve" and row["completed"] == 3 and row["failed"] == 0
    assert row["ttft_s"]["p50"] > 0 and row["output_throughput"] > 0
    assert "TTFT" in (tmp_path / "serve.md").read_text()
    with pytest.raises(SystemExit, match="loopback"):
        bench_serve(["--base-url", "http://example.com:8000", "--out", str(tmp_path)])
