"""Reasoning models' thinking apart from the answer (server/reasoning.py, `pagellm serve
--reasoning-parser`): the parsers' split of whole outputs, the same split however a stream
cuts the text (tags across deltas), and a live server whose tiny model is made to write a
think block by a regex, through chat completions, streamed and not, with the prompt leaving
<think> open or not."""
from __future__ import annotations

import json
import random

import httpx
import pytest

from pagellm import LLM
from pagellm.server.reasoning import ReasoningStream, split_reasoning
from tests.test_server import ENGINE_KW, MODEL, running_server, tiny_path, wait_idle  # noqa: F401

CASES = [  # parser, prompt left <think> open, output -> (thinking, answer)
    ("qwen3", False, "<think>\nplan it\n</think>\n\nThe answer.", ("plan it", "The answer.")),
    ("qwen3", False, "No thinking here, <think> later is text.",
     (None, "No thinking here, <think> later is text.")),
    ("qwen3", False, "  <think>x</think>y", ("x", "y")),
    ("qwen3", True, "opened by the prompt\n</think>\n\nanswer", ("opened by the prompt", "answer")),
    ("qwen3", False, "<think></think>\n\nonly an answer", (None, "only an answer")),
    ("qwen3", False, "<thin", (None, "<thin")),
    ("deepseek_r1", False, "thinks from the start\n</think>\n\nfinal", ("thinks from the start", "final")),
    ("deepseek_r1", False, "<think>\nwith the tag</think>final", ("with the tag", "final")),
    ("deepseek_r1", False, "cut by max_tokens </thi", ("cut by max_tokens </thi", "")),
    ("deepseek_r1", False, "a </think>b </think> c", ("a", "b </think> c")),
]


@pytest.mark.parametrize("parser,opened,text,want", CASES)
def test_whole_outputs_and_every_way_a_stream_cuts_them(parser, opened, text, want):
    assert split_reasoning(parser, text, opened) == want
    rng = random.Random(text)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(8, len(text) - 1))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream, thought, answer = ReasoningStream(parser, opened), "", ""
        for i, piece in enumerate(pieces):
            t, a = stream.feed(piece, i == len(pieces) - 1)
            thought, answer = thought + t, answer + a
        assert (thought or None, answer) == want, pieces


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="reasoning parser 'r2'"):
        ReasoningStream("r2")


@pytest.fixture(scope="module")
def thinking_server(tiny_path):  # noqa: F811
    with running_server(LLM(tiny_path, **ENGINE_KW), reasoning_parser="qwen3") as srv:
        yield srv


def _chat(srv, regex: str, stream: bool = False) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40,
            "temperature": 0, "guided_regex": regex, "stream": stream}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)


def _streamed(response: httpx.Response) -> tuple[str, str, list[dict]]:
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in response.text.splitlines()
              if line.startswith("data: {")]
    thought = "".join(d.get("reasoning_content", "") for d in deltas)
    assert thought == "".join(d.get("reasoning", "") for d in deltas)
    return thought, "".join(d.get("content") or "" for d in deltas), deltas


def test_the_server_splits_thinking_from_the_answer(thinking_server):
    srv = thinking_server
    regex = r"<think>\nfirst, the plan\n</think>\n\nThe answer is 4\."
    message = _chat(srv, regex).json()["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == "first, the plan"
    assert message["content"] == "The answer is 4."
    thought, answer, deltas = _streamed(_chat(srv, regex, stream=True))
    assert (thought, answer) == ("first, the plan", "The answer is 4.")
    assert not any("<think>" in (d.get("content") or "") for d in deltas)
    # the official client: the message's extra field
    r = srv.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=40,
        extra_body={"guided_regex": regex})
    assert r.choices[0].message.reasoning_content == "first, the plan"
    # an output without thinking: no reasoning field at all
    plain = _chat(srv, r"Just 4\.").json()["choices"][0]["message"]
    assert plain["content"] == "Just 4." and "reasoning" not in plain
    wait_idle(srv)


def test_a_prompt_that_opens_thinking(thinking_server):
    """A template whose generation prompt ends with <think> (Qwen3.5's, DeepSeek-R1's): the
    output is thinking until </think>, though it never writes <think> itself."""
    srv = thinking_server
    tok = srv.api.tokenizer
    saved = tok.chat_template
    tok.chat_template = saved + "{% if add_generation_prompt %}<think>\n{% endif %}"
    try:
        message = _chat(srv, r"weighing it\n</think>\n\nyes").json()["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == ("weighing it", "yes")
        thought, answer, _ = _streamed(_chat(srv, r"weighing it\n</think>\n\nyes", stream=True))
        assert (thought, answer) == ("weighing it", "yes")
    finally:
        tok.chat_template = saved
    wait_idle(srv)


def _respond(srv, regex: str, stream: bool = False, **extra) -> httpx.Response:
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 40, "temperature": 0,
            "guided_regex": regex, "stream": stream, **extra}
    return httpx.post(srv.url + "/v1/responses", json=body, timeout=120)


def _events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]


def test_the_responses_api_gives_a_reasoning_item(thinking_server):
    """/v1/responses: the thinking is a reasoning item (one reasoning_text part) before the
    message, streamed as reasoning_text deltas that close before the message opens; the
    message's log-probs are the answer's tokens only; usage counts the thinking's tokens; a
    later turn's chat holds the answer, not the thinking; an output without thinking has no
    reasoning item."""
    srv = thinking_server
    regex = r"<think>\nfirst, the plan\n</think>\n\nThe answer is 4\."
    logprobs = {"include": ["message.output_text.logprobs"], "top_logprobs": 1}
    body = _respond(srv, regex, **logprobs).json()
    kinds = [item["type"] for item in body["output"]]
    assert kinds == ["reasoning", "message"], kinds
    reasoning, message = body["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "first, the plan"}]
    assert reasoning["summary"] == [] and reasoning["status"] == "completed"
    part = message["content"][0]
    assert part["text"] == "The answer is 4."
    answer_tokens = "".join(lp["token"] for lp in part["logprobs"])
    assert answer_tokens.strip() == "The answer is 4." and "think" not in answer_tokens
    details = body["usage"]["output_tokens_details"]
    assert 0 < details["reasoning_tokens"] < body["usage"]["output_tokens"]

    events = _events(_respond(srv, regex, stream=True, **logprobs))
    kinds = [e["type"] for e in events]
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert thought == "first, the plan"
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [(e["output_index"], e["item"]["type"]) for e in done] == [(0, "reasoning"), (1, "message")]
    assert all(e["output_index"] == 1 for e in events if e["type"] == "response.output_text.delta")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "The answer is 4."
    final = events[-1]["response"]
    assert final["output"][0]["content"] == reasoning["content"]
    assert final["output"][1]["content"][0]["logprobs"] == part["logprobs"]
    assert final["usage"] == body["usage"]

    # the official client: the typed reasoning item, output_text the answer alone
    r = srv.client.responses.create(model=MODEL, input="Hi", max_output_tokens=40,
                                    extra_body={"guided_regex": regex})
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text == "first, the plan"
    assert r.output_text == "The answer is 4."
    # the next turn's prompt holds the answer as the assistant's turn, not the thinking
    kept = srv.api.response_store.get(r.id)[1]
    assert kept[-1] == {"role": "assistant", "content": "The answer is 4."}

    plain = _respond(srv, r"Just 4\.").json()
    assert [item["type"] for item in plain["output"]] == ["message"]
    assert plain["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
    wait_idle(srv)


def test_a_response_cut_while_thinking(thinking_server):
    """max_output_tokens inside the thinking: an incomplete reasoning item and no message,
    streamed or not; every output token counted as reasoning."""
    srv = thinking_server
    regex = r"<think>\n" + "a long plan " * 20 + r"\n</think>\n\nno"
    body = _respond(srv, regex, max_output_tokens=8).json()
    assert body["status"] == "incomplete"
    assert [(i["type"], i["status"]) for i in body["output"]] == [("reasoning", "incomplete")]
    usage = body["usage"]
    assert usage["output_tokens_details"]["reasoning_tokens"] == usage["output_tokens"] == 8
    events = _events(_respond(srv, regex, stream=True, max_output_tokens=8))
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert [(i["type"], i["status"], i["content"]) for i in final["response"]["output"]] == \
        [(i["type"], i["status"], i["content"]) for i in body["output"]]
    assert "response.output_text.delta" not in [e["type"] for e in events]
    wait_idle(srv)


def test_anthropic_messages_give_a_thinking_block(thinking_server):
    """/v1/messages: the thinking as a thinking block before the text, streamed as
    thinking_delta events in a block of their own (vLLM's guided_regex passed through)."""
    import anthropic

    srv = thinking_server
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    kw = dict(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": "Hi"}],
              thinking={"type": "enabled", "budget_tokens": 1024},
              extra_body={"temperature": 0, "guided_regex": r"<think>\nthe plan\n</think>\n\n4\."})
    msg = client.messages.create(**kw)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in msg.content] == [("thinking", "the plan"), ("text", "4.")]
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert (final.content[0].thinking, final.content[1].text) == ("the plan", "4.")
    wait_idle(srv)
