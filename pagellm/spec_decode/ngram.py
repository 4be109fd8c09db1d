"""N-gram (prompt lookup) proposer: copy what followed the last occurrence of the current tail.

Worked example, n from 3 down to 1, k = 3:
    tokens = [a b c d | x b c]     tail of length 3 "x b c" never occurred before;
                                   tail of length 2 "b c" occurred at positions 1..2,
    propose the tokens that followed it: [d x b] (stopping at the end of the sequence).
The most recent earlier occurrence wins: it is the likeliest to be repeated (code edits, quotes).
"""
from __future__ import annotations

import numpy as np

from pagellm.sequence import Sequence
from pagellm.spec_decode.base import Proposal, Proposer


def ngram_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The up-to-k tokens following the most recent earlier match of the longest tail n-gram."""
    length = len(tokens)
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows starting at 0 .. length-n-1: every n-gram but the tail itself.
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == arr[length - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1])  # most recent occurrence
            return tokens[start + n:start + n + k]
    return []


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        return [Proposal(ngram_lookup(s.token_ids, self.min_n, self.max_n, k) if k > 0 else [],
                         None) for s, k in zip(seqs, num_tokens)]
