"""Incremental detokenization and stop-string matching.

Decoding a short window instead of the whole output each step keeps this O(1) per token; the
window starts a few tokens back so that multi-token characters and leading-space merges decode
as they would in the full text. Text ending in U+FFFD is an incomplete character: wait.
"""
from __future__ import annotations

from pagellm.sequence import Sequence


def _decode_fn(tokenizer):
    """tokenizer.decode, or its Rust backend's decode where that gives the same text (a fast
    tokenizer that cleans up no spaces): ~0.8 us a call against ~3.3, twice a token of every
    running sequence."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return backend.decode
    return tokenizer.decode


def append_text(tokenizer, seq: Sequence) -> str:
    """Decode the sequence's newest tokens into seq.text; return the new text."""
    ids = seq.output_token_ids
    skip = seq.params.skip_special_tokens
    decode = _decode_fn(tokenizer)
    prefix = decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip)
    full = decode(ids[seq.prefix_offset:], skip_special_tokens=skip)
    if len(full) <= len(prefix) or full.endswith("\ufffd"):
        return ""
    delta = full[len(prefix):]
    seq.text += delta
    seq.prefix_offset = seq.read_offset
    seq.read_offset = len(ids)
    return delta


def find_stop_string(seq: Sequence, delta_len: int) -> str | None:
    """If a stop string appeared in the newest text, cut the text there and return it."""
    stops = seq.params.stop_strings
    if not stops or not delta_len:
        return None
    best: tuple[int, str] | None = None
    for s in stops:
        # Fix: each string's own window (it must end inside the new text). One window for the
        # longest string also found, after min_tokens, a short one that lay wholly in old text.
        pos = seq.text.find(s, max(0, len(seq.text) - delta_len - len(s) + 1))
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, s)
    if best is None:
        return None
    pos, s = best
    seq.text = seq.text[: pos + len(s)] if seq.params.include_stop_str_in_output else seq.text[:pos]
    return s


def stable_len(text: str, stop_strings, finished: bool) -> int:
    """How much of `text` can be shown while streaming: hold back a tail that could still
    grow into a stop string (stop strings must never leak into the text)."""
    if finished or not stop_strings:
        return len(text)
    hold = 0
    for s in stop_strings:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return len(text) - hold
