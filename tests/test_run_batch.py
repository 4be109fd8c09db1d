"""`pagellm run-batch`: a JSONL file of requests in OpenAI's Batch API form answered offline by
the server's own routes (server/batch.py): each answer in the input's order, the same body a
live request gets, refusals with their status code and error body, lines that are not
requests reported one by one while the others run, and no request or block left behind."""
from __future__ import annotations

import asyncio
import io
import json

import pytest

from pagellm import LLM, SamplingParams
from pagellm.cli import main
from pagellm.server.api_server import OpenAIServer, build_app
from pagellm.server.batch import run_batch
from tests.helpers import assert_no_leaks
from tests.test_server import ENGINE_KW, MODEL, tiny_path  # noqa: F401

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name a color."}],
        "max_tokens": 12, "temperature": 0}


def _lines() -> list[str]:
    good = [
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions", "body": CHAT},
        {"custom_id": "cmpl-1", "method": "POST", "url": "/v1/completions",
         "body": {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}},
        {"custom_id": "resp-1", "method": "POST", "url": "/v1/responses",
         "body": {"model": MODEL, "input": "Hi", "max_output_tokens": 6, "temperature": 0}},
        {"custom_id": "bad-body", "method": "POST", "url": "/v1/chat/completions",
         "body": {**CHAT, "max_tokens": -1}},
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/images/generations", "body": {}},
        {"custom_id": "stream", "method": "POST", "url": "/v1/chat/completions",
         "body": {**CHAT, "stream": True}},
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/completions", "body": {}},
    ]
    lines = [json.dumps(item) for item in good]
    lines.insert(3, "{not json")
    lines.insert(5, "")  # blank lines are skipped
    lines += [json.dumps({"custom_id": f"many-{i}", "url": "/v1/chat/completions",
                          "body": {**CHAT, "max_tokens": 4 + i % 5}}) for i in range(20)]
    lines.append(json.dumps({"custom_id": "embd-1", "url": "/v1/embeddings",
                             "body": {"input": ["a", "b"], "dimensions": 8}}))
    return lines


def test_a_batch_file_answered_in_order(tiny_path):  # noqa: F811
    llm = LLM(tiny_path, **ENGINE_KW)
    app = build_app(OpenAIServer(llm.engine, MODEL))
    out = io.StringIO()
    ok, total = asyncio.run(run_batch(app, _lines(), out, concurrency=8, progress=False))
    results = [json.loads(line) for line in out.getvalue().splitlines()]
    assert (ok, total, len(results)) == (24, 29, 29)
    ids = [r["custom_id"] for r in results]
    assert ids[:8] == ["chat-1", "cmpl-1", "resp-1", None, "bad-body", "bad-url", "stream", "chat-1"]
    assert ids[8:] == [f"many-{i}" for i in range(20)] + ["embd-1"]
    by_kind = {r["custom_id"]: r for r in results[:3]}

    # the same greedy answer as offline generation on the same chat
    want = llm.chat(CHAT["messages"], SamplingParams(temperature=0, max_tokens=12),
                    use_tqdm=False)[0].outputs[0].text
    chat = by_kind["chat-1"]["response"]
    assert chat["status_code"] == 200 and chat["body"]["object"] == "chat.completion"
    assert chat["body"]["choices"][0]["message"]["content"] == want
    assert by_kind["cmpl-1"]["response"]["body"]["object"] == "text_completion"
    assert by_kind["resp-1"]["response"]["body"]["object"] == "response"
    assert all(r["error"] is None and r["response"]["request_id"] for r in results[:3])

    bad = results[4]["response"]  # the route's own refusal: status and OpenAI error body
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "max_tokens"
    assert results[3]["error"]["code"] == "invalid_json" and results[3]["response"] is None
    assert results[5]["error"]["code"] == "invalid_url"
    assert "stream" in results[6]["error"]["message"]
    assert results[7]["error"]["code"] == "duplicate_custom_id"
    for i, r in enumerate(results[8:-1]):
        usage = r["response"]["body"]["usage"]
        assert usage["completion_tokens"] <= 4 + i % 5
    embd = results[-1]["response"]["body"]
    assert [len(d["embedding"]) for d in embd["data"]] == [8, 8]
    assert len({r["id"] for r in results}) == len(results)
    assert_no_leaks(llm.engine)


def test_the_command_line(tiny_path, tmp_path):  # noqa: F811
    """`pagellm run-batch -i ... -o ...` with the engine's arguments: the output file; a line
    whose JSON string holds a raw U+2028 (legal in JSON Lines) stays one request."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                         "url": "/v1/chat/completions", "body": CHAT,
                                         "note": "a\u2028b"}, ensure_ascii=False)
                             for i in range(3)) + "\n", encoding="utf-8")
    rc = main(["run-batch", "-i", str(src), "-o", str(dst), "--model", tiny_path,
               "--served-model-name", MODEL, "--dtype", "float32", "--kv-cache-memory", "16MiB",
               "--max-model-len", "1024", "--generation-config", "none"])
    assert rc == 0
    results = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["r0", "r1", "r2"]
    texts = {r["response"]["body"]["choices"][0]["message"]["content"] for r in results}
    assert len(texts) == 1  # greedy: the same answer three times


def test_a_request_that_fails_in_the_server_fails_alone(tiny_path, monkeypatch):  # noqa: F811
    """A route that raises (a server bug) answers that line with its 500 and error body; the
    lines around it are answered; a JSON string holding U+2028 stays one line."""
    llm = LLM(tiny_path, **ENGINE_KW)
    api = OpenAIServer(llm.engine, MODEL)
    real = api.encode_chat

    def encode_chat(messages, *args, **kwargs):
        if messages[-1]["content"] == "boom":
            raise RuntimeError("a bug")
        return real(messages, *args, **kwargs)

    monkeypatch.setattr(api, "encode_chat", encode_chat)
    bodies = [CHAT, {**CHAT, "messages": [{"role": "user", "content": "boom"}]},
              {**CHAT, "messages": [{"role": "user", "content": "a\u2028b"}]}]
    text = "\n".join(json.dumps({"custom_id": f"r{i}", "url": "/v1/chat/completions", "body": b},
                                ensure_ascii=False) for i, b in enumerate(bodies))
    lines = [line.removesuffix("\r") for line in text.split("\n")]  # as the command splits
    out = io.StringIO()
    ok, total = asyncio.run(run_batch(build_app(api), lines, out, progress=False))
    results = [json.loads(line) for line in out.getvalue().splitlines()]
    assert (ok, total) == (2, 3) and [r["custom_id"] for r in results] == ["r0", "r1", "r2"]
    assert results[1]["response"]["status_code"] == 500
    assert "internal server error" in results[1]["response"]["body"]["error"]["message"]
    assert_no_leaks(llm.engine)


TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_chat_template_given_on_the_command_line(tmp_path):
    """--chat-template (a file, or the template's text) serves chat requests for a model whose
    files have no template (a base model: without it, a 400 that names the flag); the prompt is
    LLM.chat's with the same template (`pagellm generate --chat --chat-template` prints its
    answer); neither a file nor a template, or a template that does not parse, is refused
    before the model loads."""
    from pagellm.chat_template import load_chat_template
    from pagellm.models.loader import load_model_files
    from tests.helpers import make_tiny_model

    tok = load_model_files(None).tokenizer
    tok.chat_template = None
    model = tmp_path / "base"
    make_tiny_model(model, "llama", vocab_size=len(tok), max_position_embeddings=1024)
    tok.save_pretrained(model)
    assert load_model_files(str(model)).tokenizer.chat_template is None
    (tmp_path / "t.jinja").write_text(TEMPLATE, encoding="utf-8")
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"custom_id": "c", "method": "POST",
                               "url": "/v1/chat/completions", "body": CHAT}) + "\n")
    engine = ["--model", str(model), "--served-model-name", MODEL, "--dtype", "float32",
              "--kv-cache-memory", "16MiB", "--max-model-len", "1024"]

    def answer(*flags):
        dst = tmp_path / "out.jsonl"
        assert main(["run-batch", "-i", str(src), "-o", str(dst), *engine, *flags]) == 0
        return json.loads(dst.read_text())["response"]

    refused = answer()
    assert refused["status_code"] == 400
    assert "--chat-template" in refused["body"]["error"]["message"]
    llm = LLM(str(model), dtype="float32", kv_cache_memory="16MiB", max_model_len=1024)
    want = llm.apply_chat_template(CHAT["messages"], chat_template=TEMPLATE)
    (out,) = llm.chat(CHAT["messages"], SamplingParams(temperature=0, max_tokens=12),
                      use_tqdm=False, chat_template=TEMPLATE)
    assert want == tok.encode(tok.apply_chat_template(CHAT["messages"], tokenize=False,
                                                      chat_template=TEMPLATE,
                                                      add_generation_prompt=True),
                              add_special_tokens=False)
    for given in (str(tmp_path / "t.jinja"), TEMPLATE):
        body = answer("--chat-template", given)["body"]
        assert body["usage"]["prompt_tokens"] == len(want)
        assert body["choices"][0]["message"]["content"] == out.outputs[0].text
    # what transformers' own compiler takes: loop controls, the assistant-mask tag
    assert load_chat_template("{% for m in messages %}{% break %}{% endfor %}")
    assert load_chat_template("{% generation %}{{ messages[0].content }}{% endgeneration %}")
    for bad, why in (("no-such-file", "neither a file nor"), ("{% if %}", "does not parse")):
        assert main(["run-batch", "-i", str(src), "-o", str(tmp_path / "x"), *engine,
                     "--chat-template", bad]) == 2
        with pytest.raises(ValueError, match=why):
            load_chat_template(bad)


def test_generate_with_a_chat_template(tmp_path, capsys, tiny_path):  # noqa: F811
    """`pagellm generate --chat --chat-template T`: the answer LLM.chat gives with T."""
    (tmp_path / "t.jinja").write_text(TEMPLATE, encoding="utf-8")
    kw = {"dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 1024}
    llm = LLM(tiny_path, **kw)
    (want,) = llm.chat([{"role": "user", "content": "Hi"}],
                       SamplingParams(temperature=0, max_tokens=6), use_tqdm=False,
                       chat_template=TEMPLATE)
    assert main(["generate", "Hi", "--chat", "--chat-template", str(tmp_path / "t.jinja"),
                 "--max-tokens", "6", "--model", tiny_path, "--dtype", "float32",
                 "--kv-cache-memory", "16MiB", "--max-model-len", "1024"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == want.outputs[0].text
    assert main(["generate", "Hi", "--chat-template", TEMPLATE, "--model", tiny_path]) == 2
    assert "--chat only" in capsys.readouterr().err
