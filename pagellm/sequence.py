"""Sequence: one stream of tokens being generated, and the count of those already in the KV cache.

The engine's single invariant: each step a sequence computes `num_tokens_to_compute` more tokens
so that `num_computed_tokens` catches up with `len(token_ids)` (plus any speculative tokens).
Prefill, chunked prefill, decode and recompute after preemption are all that.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from pagellm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_id: int | None
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | tuple | None = None  # (adapter id, salt) for a LoRA request's

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on admission

    # Speculative tokens proposed for verification this step (not yet part of token_ids).
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0  # proposals verified for this sequence so far
    num_accepted_tokens: int = 0  # of those, accepted

    # Text and logprobs of the output, filled by the engine's output processing.
    text: str = ""
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # SamplingParams.prompt_logprobs: entry i for prompt token i (entry 0 None), filled as the
    # prompt's chunks run (a recompute after preemption does not compute them again)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    generator: torch.Generator | None = None  # per-sequence RNG when the request has a seed
    # Structured outputs: the grammar state (pagellm.structured.Constraint), advanced with each
    # emitted token; None when unconstrained or finished.
    constraint: object | None = None
    # An embedding request (pagellm.pooling_params.PoolingParams): it ends when its prompt has
    # run, with `embedding` pooled from the last token's hidden state; nothing is sampled.
    pooling: object | None = None
    embedding: list[float] | None = None
    # the request's adapter (pagellm.lora.LoRAAdapter): its rows get its products added
    lora: object | None = None

    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    # Detokenizer state: text of output_token_ids[prefix_offset:read_offset] is already in `text`.
    prefix_offset: int = 0
    read_offset: int = 0

    def __post_init__(self):
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed + 7919 * self.index)
        if self.params.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs = [None]  # the first prompt token has no context to score

    @property
    def token_ids(self) -> list[int]:
        """A new list of every token: O(length), so never on a per-step path."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens whose KV is still missing, speculative proposals included."""
        return self.num_tokens + len(self.spec_token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def tokens_slice(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end), speculative tail included. O(end - start): it is
        called per block when hashing and per sequence every step, so it never joins the
        whole token list (which made a long prompt's hashing and lookup quadratic)."""
        n_prompt = len(self.prompt_token_ids)
        n_real = n_prompt + len(self.output_token_ids)
        out = self.prompt_token_ids[start:end] if start < n_prompt else []
        if end > n_prompt and start < n_real:
            out += self.output_token_ids[max(start - n_prompt, 0):end - n_prompt]
        if end > n_real:
            out += self.spec_token_ids[max(start - n_real, 0):end - n_real]
        return out

    def reset_for_recompute(self) -> None:
        """Preempted: its KV is gone; it will recompute prompt and outputs from scratch."""
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # its next admission's hits, if any, count instead
        self.block_table = []
        self.spec_token_ids = []
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1
