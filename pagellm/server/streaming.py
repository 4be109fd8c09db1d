"""Server-sent events: framing, per-choice deltas (text held back while it could still grow
into a stop string), and the body both completion endpoints stream."""
from __future__ import annotations

import json
from fastapi.responses import StreamingResponse

from pagellm.engine.async_engine import RequestError
from pagellm.outputs import CompletionOutput
from pagellm.server.errors import APIError
from pagellm.server.state import iterate

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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

    def __init__(self, index: int, params, prefix: str = "", token_str=None):
        """token_str(id) -> the token's text: given, the stream keeps each delta's offset in
        the text (completions logprobs' text_offset) as part of its own state."""
        self.index = index
        self.params = params
        self.prefix = prefix  # echo: the prompt text, sent with the first delta
        self.token_str = token_str
        self.text_offset = len(prefix)  # where the next token's text starts
        self.delta_offset = len(prefix)  # where the latest delta's first token starts
        self.text_sent = 0
        self.tokens_sent = 0
        self.finished = False
        # echo with logprobs: the request's prompt log-probabilities, until the first chunk
        # has carried them (stream_events sets them from the first output that has them)
        self.prompt_logprobs = None
        self._prompt_seen = False

    def advance(self, comp: CompletionOutput, want_logprobs: bool, every_token: bool = False):
        """(text, token_ids, logprobs) new since the last call, or None if nothing to send.
        Text that could still turn into a stop string is held back (the engine says how much
        is stable: CompletionOutput.stable_text_len). New
        tokens alone make a chunk when logprobs are wanted or every_token is set (a model
        without a tokenizer has no text to stream)."""
        if self.finished:
            return None
        end = comp.stable_text_len
        text = comp.text[self.text_sent:end] if end > self.text_sent else ""
        new_tokens = len(comp.token_ids) > self.tokens_sent
        if not (text or comp.finished or ((want_logprobs or every_token) and new_tokens)):
            return None
        ids = comp.token_ids[self.tokens_sent:]
        lps = (comp.logprobs or [])[self.tokens_sent:] if want_logprobs else []
        self.delta_offset = self.text_offset
        if self.token_str is not None:
            self.text_offset += sum(len(self.token_str(t)) for t in ids)
        self.text_sent = max(self.text_sent, end)
        self.tokens_sent = len(comp.token_ids)
        self.finished = comp.finished
        text, self.prefix = self.prefix + text, ""
        return text, ids, lps


async def stream_events(slots, choices: list[ChoiceStream], n: int, want_logprobs: bool,
                        choice_chunk, usage_chunk, prelude=(), every_token: bool = False,
                        running_usage=None):
    """The SSE body of both endpoints. choice_chunk(choice, comp, text, token_ids, logprobs)
    builds one choice's chunk; usage_chunk(num_generated, num_cached) the final one (or None;
    num_cached: the prompts' tokens the prefix cache served); running_usage(num_generated),
    where given, every other chunk's usage (vLLM's continuous_usage_stats)."""
    num_generated = [0] * len(choices)
    cached: dict[int, int] = {}

    def counted(chunk: dict) -> dict:
        if running_usage is not None:
            chunk["usage"] = running_usage(sum(num_generated))
        return chunk

    try:
        for chunk in prelude:
            yield sse(counted(chunk))
        async for i, out in iterate(slots):
            cached[i] = out.num_cached_tokens
            for comp in out.outputs:
                ch = choices[i * n + comp.index]
                num_generated[ch.index] = len(comp.token_ids)
                if not ch._prompt_seen and out.prompt_logprobs is not None:
                    ch.prompt_logprobs, ch._prompt_seen = list(out.prompt_logprobs), True
                piece = ch.advance(comp, want_logprobs, every_token)
                if piece is not None:
                    yield sse(counted(choice_chunk(ch, comp, *piece)))
        last = usage_chunk(sum(num_generated), sum(cached.values()))
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
