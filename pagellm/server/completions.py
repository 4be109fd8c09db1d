"""POST /v1/completions."""
from __future__ import annotations

import dataclasses
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse

from pagellm.server.errors import APIError, parse_request, sampling_error
from pagellm.server.protocol import CompletionRequest
from pagellm.server.responses import completion_logprobs, joined_logprobs, usage
from pagellm.server.state import OpenAIServer
from pagellm.server.streaming import ChoiceStream, EventStream, chunk_of, finish, stream_events


async def create_completion(request: Request):
    api: OpenAIServer = request.app.state.api
    arrival = time.monotonic()
    req = parse_request(CompletionRequest, await request.body())
    lora = api.check_model(req.model)
    if req.best_of not in (None, req.n):
        raise APIError(400, "best_of: must equal n (best-of selection is not supported)",
                       param="best_of")
    # max_tokens 0 with echo: the legacy API's way to score a prompt (its logprobs with
    # "logprobs"), nothing generated. The engine runs one token, which the response leaves out.
    score_only = req.max_tokens == 0
    if score_only and not req.echo:
        raise APIError(400, "max_tokens: must be at least 1 (0 only with echo: the prompt "
                       "returned, nothing generated)", param="max_tokens")
    if score_only:  # nothing is generated: a min_tokens has nothing to hold back
        req = req.model_copy(update={"min_tokens": 0})
    prompts = req.prompts()
    api.limits.check_sequences(len(prompts), req.n)
    api.limits.check_stop(req.stop)
    api.limits.check_logprobs(req.logprobs, "logprobs")
    if req.logprobs is not None:
        api.need_tokenizer("logprobs")  # the tokens' texts
    if req.suffix:  # fill-in-the-middle: each prompt is the text before the gap
        if req.echo:
            raise APIError(400, "echo: not supported with suffix (an infill returns only the "
                           "inserted text)", param="echo")
        # the vocabulary's end tokens end the infill whatever the model's EOS
        req = req.model_copy(update={
            "stop_token_ids": req.stop_ids_and(api.infill_tokens("suffix").ends)})
        encoded = await api.off_loop(lambda: [api.encode_infill(p, req.suffix) for p in prompts])
    else:
        encoded = await api.off_loop(lambda: [api.encode_prompt(p) for p in prompts])
    structured, structured_field = req.structured()
    try:
        # echo with logprobs: the prompt's tokens' log-probabilities too (what evaluation
        # harnesses score a continuation by)
        echo_lps = req.logprobs if req.echo else None
        if score_only:  # a whole context window may be scored: the engine's one token
            for _, ids in encoded:  # comes from its last position and is left out
                api.check_scored_prompt(len(ids), "prompt")
        params = [req.sampling_params(
            1 if score_only else api.max_tokens(len(ids), req.max_tokens, "prompt"),
            req.logprobs, api.sampling_defaults, structured, echo_lps) for _, ids in encoded]
    except ValueError as e:
        raise sampling_error(e) from None
    if req.echo:
        api.need_tokenizer("echo")
    prefixes = [(text if text is not None else api.tokenizer.decode(ids)) if req.echo else ""
                for text, ids in encoded]
    rid = f"cmpl-{uuid.uuid4().hex}"
    slots = await api.add([ids for _, ids in encoded], params, arrival, rid, structured_field,
                          req.cache_salt, lora)
    token_str = api.token_str if req.logprobs is not None else None
    choices = [ChoiceStream(i * req.n + j, params[i], prefixes[i], token_str)
               for i in range(len(slots)) for j in range(req.n)]
    if echo_lps is not None:
        # echo with logprobs: text_offset runs over the prompt's tokens from 0 and goes on over
        # the generated ones (one running sum of token texts, as vLLM reports it; a prompt's
        # BOS token or a tokenizer's decoding can make it differ from the echoed text's length)
        for ch in choices:
            ch.text_offset = ch.delta_offset = sum(
                len(api.token_str(t)) for t in encoded[ch.index // req.n][1])
    base = {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": api.model_name}
    num_prompt = sum(len(ids) for _, ids in encoded)

    def logprobs(offset: int, ids, lps):
        if req.logprobs is None:
            return None
        return completion_logprobs(api.token_str, ids, lps, req.logprobs, offset)

    def echoed(i: int, prompt_lps):
        """The prompt's part of an echoed choice's logprobs (None without echo + logprobs)."""
        if echo_lps is None or prompt_lps is None:
            return None
        return completion_logprobs(api.token_str, encoded[i][1], prompt_lps, echo_lps, 0)

    if req.stream:
        def choice_chunk(ch, comp, text, ids, lps):
            if score_only:  # the prompt alone (one chunk: the engine ran a single token)
                text, ids, lps = prefixes[ch.index // req.n], [], []
                comp = _scored(comp)
            lp = logprobs(ch.delta_offset, ids, lps)
            if ch.prompt_logprobs is not None:  # echo: the first chunk carries the prompt's
                lp = joined_logprobs(echoed(ch.index // req.n, ch.prompt_logprobs), lp)
                ch.prompt_logprobs = None
            return chunk_of(base, {"index": ch.index, "text": text, "logprobs": lp,
                                   **finish(comp)},
                            req.include_usage)

        def usage_chunk(num_generated, num_cached):
            num_generated = 0 if score_only else num_generated
            return ({**base, "choices": [], "usage": usage(num_prompt, num_generated, num_cached)}
                    if req.include_usage else None)

        running = ((lambda num_generated: usage(num_prompt, 0 if score_only else num_generated))
                   if req.continuous_usage else None)
        events = stream_events(slots, choices, req.n, req.logprobs is not None, choice_chunk,
                               usage_chunk, every_token=api.tokenizer is None,
                               running_usage=running)
        return EventStream(events, on_close=lambda: api.abort(slots))

    finals = await api.final_outputs(request, slots)
    out_choices = []
    for i, out in enumerate(finals):
        for comp in out.outputs:
            ch = choices[i * req.n + comp.index]
            if score_only:
                comp = _scored(comp)
            lp = logprobs(ch.text_offset, comp.token_ids, comp.logprobs or [])
            out_choices.append({"index": ch.index, "text": ch.prefix + comp.text,
                                "logprobs": joined_logprobs(echoed(i, out.prompt_logprobs), lp),
                                **finish(comp)})
    num_generated = 0 if score_only else sum(len(c.token_ids) for out in finals
                                             for c in out.outputs)
    return JSONResponse({**base, "choices": out_choices,
                         "usage": usage(num_prompt, num_generated,
                                        sum(out.num_cached_tokens for out in finals))})


def _scored(comp):
    """max_tokens 0: the output without its one generated token (finish_reason "length")."""
    return dataclasses.replace(comp, text="", token_ids=[], logprobs=[] if comp.logprobs is not None
                               else None, cumulative_logprob=None, finish_reason="length",
                               stop_reason=None)
