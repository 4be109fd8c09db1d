"""Pieces of responses: usage, and logprobs in the completions and chat formats (and
llama.cpp's completion_probabilities)."""
from __future__ import annotations

import math


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; prompt_tokens_details.cached_tokens: the prompt tokens whose KV
    came from the prefix cache (not computed again)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _finite(lp: float) -> float:
    """JSON has no -inf: a token with zero probability (filtered by top-k/p) reports -9999."""
    return lp if math.isfinite(lp) else -9999.0


def _top(entries: dict[int, float], num: int) -> list[tuple[int, float]]:
    """The engine gives {sampled: lp, top...}; the top `num` by logprob."""
    return sorted(entries.items(), key=lambda kv: -kv[1])[:num]


def completion_logprobs(token_str, token_ids: list[int],
                        logprobs: list[dict[int, float] | None], num: int,
                        text_offset: int) -> dict:
    """OpenAI completions format: tokens, token_logprobs, top_logprobs, text_offset. An entry
    None (a prompt's first token, echoed: nothing comes before it) gives null logprob and
    top_logprobs."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entries in zip(token_ids, logprobs):
        s = token_str(tid)
        tokens.append(s)
        token_lps.append(None if entries is None else _finite(entries[tid]))
        tops.append(None if entries is None
                    else {token_str(t): _finite(lp) for t, lp in _top(entries, num)})
        offsets.append(text_offset)
        text_offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def joined_logprobs(first: dict | None, then: dict | None) -> dict | None:
    """Two completions-format logprobs objects, one after the other."""
    if first is None or then is None:
        return then if first is None else first
    return {k: first[k] + then[k] for k in first}


def chat_logprobs(token_str, token_ids: list[int], logprobs: list[dict[int, float]],
                  num: int) -> dict:
    """OpenAI chat format: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(tid: int, lp: float) -> dict:
        s = token_str(tid)
        return {"token": s, "logprob": _finite(lp), "bytes": list(s.encode("utf-8"))}

    content = [{**entry(tid, entries[tid]),
                "top_logprobs": [entry(t, lp) for t, lp in _top(entries, num)]}
               for tid, entries in zip(token_ids, logprobs)]
    return {"content": content}


def llama_cpp_probabilities(token_str, token_ids: list[int], logprobs: list[dict[int, float]],
                            num: int) -> list[dict]:
    """llama.cpp's completion_probabilities: each token with its log-probability and the
    `num` most likely at its position."""
    def entry(tid: int, lp: float) -> dict:
        s = token_str(tid)
        return {"id": tid, "token": s, "bytes": list(s.encode("utf-8")), "logprob": _finite(lp)}

    return [{**entry(tid, entries[tid]),
             "top_logprobs": [entry(t, lp) for t, lp in _top(entries, num)]}
            for tid, entries in zip(token_ids, logprobs)]
