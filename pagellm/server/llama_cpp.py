"""llama.cpp's own routes: POST /completion, and POST /infill, its fill-in-the-middle endpoint
as editor plugins call it (llama.vim, llama.vscode; the prompt is pagellm.infill's). The answer
is llama.cpp's completion object ({"content", "stop", "stop_type", "timings", ...}), streamed
as `data:` events of the same shape. Two stop conditions are the routes' own, as llama.cpp's:
`n_indent` (a new line indented less than the cursor's line ends the answer, without that
line) and `t_max_predict_ms` (past this long since the first token, the answer ends with the
next line it completes)."""
from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse

from pagellm.engine.async_engine import RequestError
from pagellm.infill import ExtraFile, fit_infill
from pagellm.outputs import RequestOutput
from pagellm.server.errors import APIError, parse_request, sampling_error
from pagellm.server.protocol import InfillRequest, LlamaCompletionRequest, LlamaCppRequest
from pagellm.server.responses import llama_cpp_probabilities
from pagellm.server.state import OpenAIServer, iterate
from pagellm.server.streaming import EventStream, sse


async def create_infill(request: Request):
    api: OpenAIServer = request.app.state.api
    arrival = time.monotonic()
    req = parse_request(InfillRequest, await request.body())
    api.need_tokenizer("input_prefix")
    fim = api.infill_tokens("input_prefix")
    budget = req.budget()
    # the prompt's share of the context; without a budget a quarter (at most 512) is kept
    # for the answer, so that a long context still leaves room to write
    # (a budget past half the context is capped when generating, as llama.cpp caps it)
    keep = (min(budget, api.max_model_len // 2) if budget is not None
            else min(512, api.max_model_len // 4))
    room = api.max_model_len - max(keep, 1)
    if api.limits.max_prompt_tokens is not None:
        room = min(room, api.limits.max_prompt_tokens)
    files = [ExtraFile(c.filename, c.text) for c in req.input_extra]

    def encode():
        return fit_infill(api.tokenizer, fim, req.input_prefix + req.prompt, req.input_suffix,
                          files, budget=room)

    try:
        ids, truncated = await api.off_loop(encode)
    except ValueError as e:
        raise APIError(400, f"input_prefix: {e}", param="input_prefix") from None
    # the vocabulary's end tokens end the infill whatever the model's EOS
    return await _serve(request, api, req, [(ids, truncated)], fim.ends, arrival, "infill")


async def create_llama_completion(request: Request):
    """POST /completion (and /completions): llama.cpp's own completion route."""
    api: OpenAIServer = request.app.state.api
    arrival = time.monotonic()
    req = parse_request(LlamaCompletionRequest, await request.body())
    prompts = req.prompts()
    api.limits.check_sequences(len(prompts), 1)
    if req.stream and len(prompts) > 1:
        raise APIError(400, "stream: one prompt at a time", param="stream")
    if any(isinstance(x, str) for p in prompts for x in ([p] if isinstance(p, str) else p)):
        api.need_tokenizer("prompt")

    def encode(p) -> list[int]:
        if isinstance(p, str):
            ids = api.tokenizer.encode(p)  # as a text prompt: the tokenizer's BOS first
        else:  # text and token ids mixed: the text pieces tokenized where they stand
            ids = [t for i, x in enumerate(p) for t in (
                [x] if isinstance(x, int) else api.tokenizer.encode(x, add_special_tokens=i == 0))]
        api.limits.check_prompt_tokens(len(ids), "prompt")
        return ids

    encoded = await api.off_loop(lambda: [encode(p) for p in prompts])
    vocab = api.engine.vocab_size
    for ids in encoded:
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"prompt: token ids out of range [0, {vocab}): {bad[:5]}",
                           param="prompt")
    return await _serve(request, api, req, [(ids, False) for ids in encoded], (), arrival,
                        "cmpl")


async def _serve(request: Request, api: OpenAIServer, req: LlamaCppRequest,
                 prompts: list[tuple[list[int], bool]], end_ids, arrival: float, kind: str):
    """Run each (prompt ids, truncated) and answer llama.cpp's completion object (a JSON array
    of them for several prompts), or stream one prompt's as `data:` events. end_ids: more ids
    that end generation."""
    lora = api.check_model(req.model)
    api.limits.check_stop(req.stop)
    api.limits.check_logprobs(req.n_probs or None, "n_probs")
    if req.n_probs:
        api.need_tokenizer("n_probs")  # the tokens' texts
    structured, structured_field = req.structured()  # llama.cpp's grammar / json_schema too
    budget = req.budget()
    # n_predict 0 fills the prefix cache (llama.vim sends its context ahead so): the engine
    # runs one token, which the answer leaves out
    warm_only = budget == 0
    update = {"stop_token_ids": req.stop_ids_and(end_ids)}
    if req.repeat_penalty is not None and req.repetition_penalty is None:
        update["repetition_penalty"] = req.repeat_penalty
    if req.seed == -1:  # llama.cpp's "random"
        update["seed"] = None
    req = req.model_copy(update=update)
    try:
        params = [req.sampling_params(_generation_budget(api, len(ids), budget),
                                      req.n_probs or None, api.sampling_defaults, structured)
                  for ids, _ in prompts]
    except ValueError as e:
        raise sampling_error(e) from None
    slots = await api.add([ids for ids, _ in prompts], params, arrival,
                          f"{kind}-{uuid.uuid4().hex}", structured_field, req.cache_salt, lora)
    watches = [_Watch(req.n_indent, req.t_max_predict_ms, warm_only) for _ in prompts]

    def answer(i: int, out: RequestOutput) -> dict:
        ids, truncated = prompts[i]
        return _completion(api, req, ids, truncated, out, watches[i])

    if req.stream:
        ids, watch = prompts[0][0], watches[0]

        async def events():
            sent, tokens_sent = 0, 0

            def piece(comp, end):
                nonlocal sent, tokens_sent
                chunk = {"index": 0, "content": watch.text(comp)[sent:end],
                         "tokens": list(comp.token_ids[tokens_sent:]) if req.return_tokens
                         else [], "stop": False, "id_slot": -1,
                         "tokens_predicted": len(comp.token_ids), "tokens_evaluated": len(ids)}
                sent, tokens_sent = end, len(comp.token_ids)
                return sse(chunk)

            try:
                async for _, out in iterate(slots):
                    comp = out.outputs[0]
                    end = watch.visible(comp, out.finished)
                    if out.finished or watch.stopped:
                        api.abort(slots)
                        rest = len(watch.text(comp))  # with a tail held back for a stop string
                        if rest > sent or (req.return_tokens and not watch.warm_only
                                           and len(comp.token_ids) > tokens_sent):
                            yield piece(comp, rest)
                        # the last event: the whole object, its text and tokens already sent
                        last = answer(0, out)
                        if "content" in last:
                            last["content"] = ""
                        if "tokens" in last:
                            last["tokens"] = []
                        yield sse(last)
                        return
                    if end > sent:
                        yield piece(comp, end)
            except RequestError as e:
                yield sse(APIError(e.status_code, e.message).body())
        return EventStream(events(), on_close=lambda: api.abort(slots))

    finals = await api.final_outputs(request, slots,
                                     until=lambda i, o: watches[i].check(o.outputs[0]))
    answers = [answer(i, out) for i, out in enumerate(finals)]
    for i, a in enumerate(answers):
        if "index" in a:
            a["index"] = i
    return JSONResponse(answers[0] if len(answers) == 1 else answers)


def _generation_budget(api: OpenAIServer, num_prompt: int, budget: int | None) -> int:
    """What the engine generates: n_predict, capped at the context as llama.cpp caps it (the
    answer then ends "limit"); 0 (warm the cache) runs one token, which the answer leaves out.
    A prompt that leaves no room is a 400."""
    if budget == 0:
        api.check_scored_prompt(num_prompt, "prompt")
        return 1
    if budget is None or budget > api.max_model_len - num_prompt:
        return api.max_tokens(num_prompt, None, "prompt", "n_predict")
    return budget


class _Watch:
    """The route's own stop conditions over one output's growing text, and how much of the
    text stands (a stream holds back a line until it shows it is indented enough)."""

    def __init__(self, n_indent: int, t_max_predict_ms: int, warm_only: bool):
        self.n_indent, self.t_max = n_indent, t_max_predict_ms / 1000
        self.warm_only = warm_only
        self.first_token: float | None = None
        self.cut: int | None = None  # where the answer ends when a condition ended it
        self.judged = 0  # lines that start before this newline are indented enough
        self.seen = 0  # text length at the last check
        self.stopped = False

    def check(self, comp) -> bool:
        """True once a condition has ended the infill (the text is then cut at self.cut)."""
        if self.stopped:
            return True
        text = comp.text
        while self.n_indent:  # the lines not yet judged, each once
            start = text.find("\n", self.judged)
            if start < 0:
                break
            end = text.find("\n", start + 1)
            line = text[start + 1:] if end < 0 else text[start + 1:end]
            body = line.lstrip(" \t")
            if not body.strip("\r"):  # blank so far (CRLF ends count as blank)
                if end < 0:
                    break  # not yet past its indentation
                self.judged = end
                continue
            if len(line) - len(body) < self.n_indent:
                self.cut, self.stopped = start + 1, True
                return True
            self.judged = start + 1
        if comp.token_ids and self.first_token is None:
            self.first_token = time.monotonic()
        new = text[self.seen:]
        if (self.t_max and self.first_token is not None and "\n" in new
                and time.monotonic() - self.first_token > self.t_max):
            # out of time: the answer ends with the line the new text completes
            self.cut, self.stopped = self.seen + new.rindex("\n") + 1, True
        self.seen = len(text)
        return self.stopped

    def text(self, comp) -> str:
        if self.warm_only:
            return ""
        return comp.text if self.cut is None else comp.text[:self.cut]

    def visible(self, comp, finished: bool) -> int:
        """How much of the text a stream may send now."""
        self.check(comp)
        if self.warm_only:
            return 0
        end = comp.stable_text_len
        if self.cut is not None:
            return min(end, self.cut)
        if self.n_indent and not finished:
            line_start = comp.text.rfind("\n", 0, end) + 1
            if line_start and not comp.text[line_start:end].strip(" \t\r"):
                end = line_start  # a new line not yet past its indentation
        return end


def _completion(api: OpenAIServer, req: LlamaCppRequest, ids: list[int], truncated: bool,
                out: RequestOutput, watch: _Watch) -> dict:
    """llama.cpp's completion object (response_fields: only those, "a/b" read inside "a")."""
    comp = out.outputs[0]
    watch.check(comp)  # the last output may be the one that ends the infill
    generated = 0 if watch.warm_only else len(comp.token_ids)
    if watch.stopped or comp.finish_reason == "length":
        stop_type, word = "limit", ""
    elif isinstance(comp.stop_reason, str):
        stop_type, word = "word", comp.stop_reason
    else:
        stop_type, word = "eos", ""
    m = out.metrics
    first = m.first_token_time or time.monotonic()
    last = m.token_times[-1] if m.token_times else first
    prompt_ms = (first - m.arrival_time) * 1000
    computed = len(ids) - out.num_cached_tokens
    predicted_ms = (last - first) * 1000

    def rate(n, ms):
        return n / ms * 1000 if ms > 0 else 0.0

    text = watch.text(comp)
    body = {
        "index": 0, "content": text,
        "tokens": list(comp.token_ids[:generated]) if req.return_tokens else [],
        "id_slot": -1, "stop": True, "model": api.model_name,
        "tokens_predicted": generated, "tokens_evaluated": len(ids),
        "has_new_line": "\n" in text, "truncated": truncated,
        "stop_type": stop_type, "stopping_word": word,
        "tokens_cached": len(ids) + generated,
        "timings": {"prompt_n": computed, "prompt_ms": prompt_ms,
                    "prompt_per_token_ms": prompt_ms / max(computed, 1),
                    "prompt_per_second": rate(computed, prompt_ms),
                    "predicted_n": generated, "predicted_ms": predicted_ms,
                    "predicted_per_token_ms": predicted_ms / max(generated, 1),
                    "predicted_per_second": rate(generated, predicted_ms)},
    }
    if req.n_probs:
        body["completion_probabilities"] = llama_cpp_probabilities(
            api.token_str, comp.token_ids[:generated], (comp.logprobs or [])[:generated],
            req.n_probs)
    if not req.response_fields:
        return body
    picked = {}
    for path in req.response_fields:
        value = body
        for key in path.split("/"):
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            picked[path] = value
    return picked
