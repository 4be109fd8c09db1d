"""llama.cpp's own routes beside the OpenAI ones: POST /completion (its answer object, text,
token-id, mixed and several prompts, streaming) and /tokenize / /detokenize in its field names.
/infill is tests/test_infill.py's. Each answer is checked against /v1/completions on the same
prompt ids (greedy), so a prompt built otherwise than documented fails the test."""
from __future__ import annotations

import json

import pytest

from tests.test_server import MODEL, post, server, sse_events, srv, tiny_path  # noqa: F401


def _openai(srv, prompt, **kw):
    return srv.client.completions.create(model=MODEL, prompt=prompt, temperature=0, **kw)


def test_a_text_prompt_answers_as_the_openai_route(srv):
    ref = _openai(srv, "The capital of France is", max_tokens=8, logprobs=2)
    r = post(srv, "/completion", {"prompt": "The capital of France is", "n_predict": 8,
                                  "temperature": 0, "n_probs": 2, "return_tokens": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["content"] == ref.choices[0].text
    assert body["tokens_evaluated"] == ref.usage.prompt_tokens
    assert body["tokens_predicted"] == ref.usage.completion_tokens == len(body["tokens"])
    assert body["stop_type"] == ("limit" if ref.choices[0].finish_reason == "length" else "eos")
    assert [p["token"] for p in body["completion_probabilities"]] == ref.choices[0].logprobs.tokens
    # /completions is the same route; a stream joins to the same text
    assert post(srv, "/completions", {"prompt": "The capital of France is", "n_predict": 8,
                                      "temperature": 0}).json()["content"] == body["content"]
    events = [json.loads(e) for e in sse_events(srv, "/completion", {
        "prompt": "The capital of France is", "n_predict": 8, "temperature": 0, "stream": True})]
    assert "".join(e["content"] for e in events) == body["content"]
    assert events[-1]["stop"] and events[-1]["tokens_predicted"] == body["tokens_predicted"]


def test_token_id_mixed_and_several_prompts(srv):
    tok = srv.api.tokenizer
    ids = tok.encode("Hello there")
    more = tok.encode(", friend", add_special_tokens=False)
    ref = _openai(srv, ids + more, max_tokens=6)
    for prompt in (ids + more, ids + [", friend"]):  # ids, then ids and text mixed
        body = post(srv, "/completion", {"prompt": prompt, "n_predict": 6,
                                         "temperature": 0}).json()
        assert body["content"] == ref.choices[0].text
        assert body["tokens_evaluated"] == len(ids) + len(more)
    # several prompts: an answer each, in order
    prompts = ["Once upon a time", "The sea is"]
    answers = post(srv, "/completion", {"prompt": prompts, "n_predict": 5,
                                        "temperature": 0}).json()
    assert [a["content"] for a in answers] == [_openai(srv, p, max_tokens=5).choices[0].text
                                               for p in prompts]
    assert [a["index"] for a in answers] == [0, 1]
    answers = post(srv, "/completion", {"prompt": [ids, ids + more], "n_predict": 6,
                                        "temperature": 0}).json()
    assert answers[1]["content"] == ref.choices[0].text and len(answers) == 2


@pytest.mark.parametrize("body, param", [
    ({"prompt": ["a", "b"], "stream": True}, "stream"), ({"prompt": [10**9]}, "prompt"),
    ({"prompt": "a", "n": 2}, "n"), ({"prompt": ""}, "prompt"), ({"prompt": [[]]}, "prompt"),
    ({"prompt": {"a": 1}}, "prompt"), ({"prompt": [5] * 1024}, "prompt"),
    ({"prompt": "a", "logit_bias": [[5]]}, "logit_bias")])
def test_bad_requests(srv, body, param):
    r = post(srv, "/completion", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == param


def test_n_predict_past_the_context_is_capped_and_logit_bias_pairs(srv):
    """As llama.cpp: the answer ends at the full context ("limit"); [[id, false]] bans."""
    body = post(srv, "/completion", {"prompt": [5] * 1000, "n_predict": 10**6,
                                     "temperature": 0, "return_tokens": True}).json()
    assert body["tokens_predicted"] == 1024 - 1000 and body["stop_type"] == "limit"
    first = body["tokens"][0]
    banned = post(srv, "/completion", {"prompt": [5] * 1000, "n_predict": 1, "temperature": 0,
                                       "logit_bias": [[first, False]], "return_tokens": True})
    assert banned.json()["tokens"][0] != first
    pushed = post(srv, "/completion", {"prompt": "x", "n_predict": 2, "temperature": 0,
                                       "logit_bias": [[7, 100]], "return_tokens": True})
    assert pushed.json()["tokens"] == [7, 7]


def test_tokenize_and_detokenize_in_llama_cpps_names(srv):
    tok = srv.api.tokenizer
    text = "Hello there"
    r = post(srv, "/tokenize", {"content": text}).json()
    assert r["tokens"] == tok.encode(text, add_special_tokens=False)  # its default: no BOS
    assert post(srv, "/tokenize", {"content": text, "add_special": True}).json()["tokens"] == \
        tok.encode(text)
    assert post(srv, "/detokenize", {"tokens": r["tokens"]}).json()["content"] == text
    assert post(srv, "/tokenize", {"content": "a", "prompt": "b"}).status_code == 400
    pieces = post(srv, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == r["tokens"]
    assert "".join(p["piece"] for p in pieces) == text


def test_a_model_without_a_tokenizer_takes_ids_and_refuses_what_needs_text(tiny_llama):
    """Token texts (n_probs, logprobs) need a tokenizer: a 400 naming the field, not a 500."""
    from pagellm import LLM
    from tests.test_server import ENGINE_KW, running_server, wait_idle

    with running_server(LLM(tiny_llama[0], **ENGINE_KW)) as s:
        r = post(s, "/completion", {"prompt": [5, 6, 7], "n_predict": 3, "temperature": 0,
                                    "return_tokens": True})
        assert r.status_code == 200 and len(r.json()["tokens"]) == 3
        for path, body, param in (("/completion", {"prompt": [5], "n_probs": 2}, "n_probs"),
                                  ("/completion", {"prompt": "text"}, "prompt"),
                                  ("/v1/completions", {"prompt": [5], "logprobs": 1},
                                   "logprobs")):
            r = post(s, path, body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        wait_idle(s)
