"""Proposer interface: guess the next tokens of running sequences cheaply."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from pagellm.sequence import Sequence


@dataclass
class Proposal:
    token_ids: list[int]  # up to k proposed tokens (may be empty)
    probs: torch.Tensor | None  # [len(token_ids), vocab] draft distribution q, None = one-hot
    # A class of proposals whose acceptance the controller learns apart from the others: the
    # n-gram proposer's match length (a 1-token match is right far less often than a 4-token
    # one), 0 for draft models.
    kind: int = 0


class Proposer(ABC):
    @abstractmethod
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        """Propose up to num_tokens[i] tokens to follow each sequence's current tokens."""

    def bind_target(self, scheduler, runner) -> None:
        """The engine's scheduler and model runner, once built (for proposers that share the
        target's cache: they take its slots through `scheduler.reserve`)."""

    def on_verified(self, seq: Sequence, num_valid: int) -> None:
        """The target verified seq's proposals: its first num_valid tokens (context and
        accepted proposals) stand; the rest of what was proposed does not."""

    def release(self, seq: Sequence) -> None:
        """seq finished or was preempted: drop any state kept for it."""

    @property
    def own_runner(self):
        """The model runner of a draft with a KV cache of its own (None: none)."""
        return None

    @property
    def has_cost(self) -> bool:
        """Whether proposing costs model forward passes (the adaptive controller times them)."""
        return False
