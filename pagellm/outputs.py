"""What generate() returns: vLLM-shaped RequestOutput / CompletionOutput."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagellm.engine.detokenizer import stable_len


class Prefix(Sequence):
    """The first len() items of a list that only ever grows (a running sequence's tokens,
    logprobs or token times): what an unfinished output holds, so making one each step costs
    O(1) instead of a copy of everything so far (O(length^2) over a generation). Slices are
    lists; finished outputs hold plain lists."""

    __slots__ = ("_items", "_n")

    def __init__(self, items: list):
        self._items, self._n = items, len(items)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n)
            if step == 1:
                return self._items[start:stop]
            return [self._items[j] for j in range(start, stop, step)]
        j = i + self._n if i < 0 else i
        if not 0 <= j < self._n:
            raise IndexError("index out of range")
        return self._items[j]

    def __iter__(self):
        return itertools.islice(self._items, self._n)

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, tuple, Prefix)):
            return len(other) == self._n and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return repr(list(self))


class Logprob(float):
    """One token's log-probability in a logprobs dict: the float it always was (arithmetic,
    comparisons, JSON) that also reads as vLLM's Logprob: .logprob, .rank (1: the most likely
    token of its position) and .decoded_token (the token's text; None without a tokenizer)."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None,
                decoded_token: str | None = None) -> Logprob:
        obj = super().__new__(cls, logprob)
        obj.rank, obj.decoded_token = rank, decoded_token
        return obj

    def __reduce__(self):  # copy and pickle (every protocol) keep the attributes
        return Logprob, (float(self), self.rank, self.decoded_token)

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return (f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, "
                f"decoded_token={self.decoded_token!r})")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    # per token: {token_id: Logprob}, the sampled token first, then its position's top-N
    logprobs: list[dict[int, Logprob]] | None = None
    # The request's stop strings: a stream holds back a tail of `text` that could still grow
    # into one (stable_text_len).
    stop_strings: Sequence[str] = ()

    @property
    def stable_text_len(self) -> int:
        """How much of `text` a stream may show now (all of it once finished). Computed when
        read: only for the outputs a consumer takes, not for every request every step."""
        return stable_len(self.text, self.stop_strings, self.finished)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    token_times: list[float] = field(default_factory=list)
    num_draft_tokens: int = 0  # speculative proposals verified for this request
    num_accepted_tokens: int = 0  # of those, accepted

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean seconds between output tokens after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then for each
    # token {token_id: logprob, ...its position's top-N} (the token first), as vLLM's
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # an embedding request's (PoolingParams) vector, once finished; its outputs hold no tokens
    embedding: list[float] | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """What LLM.embed returns for one prompt (vLLM's shape: outputs.embedding)."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    num_cached_tokens: int = 0
