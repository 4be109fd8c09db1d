"""Per-sequence grammar state and the token masks computed from it.

A Constraint wraps one llguidance matcher: it advances with every token the sequence emits,
validates speculative proposals (cut at the first token the grammar forbids), and gives the
mask of allowed tokens at the next position and after a run of proposals (verification masks
the target's distribution at every verified position, the draft's alike). Masks of a whole
batch are computed in one call on llguidance's thread pool (`batch_masks`).
"""
from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured.grammar import compile_grammar

logger = logging.getLogger("pagellm")


class GrammarBackend:
    """One per engine: the tokenizer in llguidance's form (built at the first constrained
    request, ~1-2 s for a 150k vocabulary), compiled grammars (LRU) and the mask threads."""

    _CACHE = 256  # compiled grammars kept

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids):
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._grammars: OrderedDict[str, str] = OrderedDict()
        self.executor: llguidance.LLExecutor | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            import llguidance.hf

            if self.hf_tokenizer is None:
                raise ValueError("structured_outputs: this model has no tokenizer")
            self._tokenizer = llguidance.hf.from_tokenizer(
                self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
            self.executor = llguidance.LLExecutor(2)
        return self._tokenizer

    def grammar(self, params: StructuredOutputsParams) -> str:
        """The compiled grammar of params (StructuredOutputError when it is invalid)."""
        value = getattr(params, params.kind)
        key = params.kind + ":" + json.dumps(value, sort_keys=True)
        g = self._grammars.get(key)
        if g is None:
            g = compile_grammar(params, self.tokenizer)
            self._grammars[key] = g
            if len(self._grammars) > self._CACHE:
                self._grammars.popitem(last=False)
        else:
            self._grammars.move_to_end(key)
        return g

    def constraint(self, params: StructuredOutputsParams) -> Constraint:
        grammar = self.grammar(params)
        return Constraint(self, llguidance.LLMatcher(self.tokenizer, grammar, log_level=0))


class Constraint:
    def __init__(self, backend: GrammarBackend, matcher: llguidance.LLMatcher):
        self.backend = backend
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """The sequence emitted token; False if the grammar forbids it (the matcher is then
        in its error state)."""
        if token in self.backend.eos_token_ids and self.matcher.is_accepting():
            return True  # the end of the output: nothing follows it
        return self.matcher.consume_token(token)

    def allows(self, token: int) -> bool:
        """Whether the grammar allows token next (~1 us: no mask is computed)."""
        return self.matcher.validate_tokens([token]) == 1

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading tokens of a proposal the grammar allows."""
        if not tokens:
            return 0
        return self.matcher.validate_tokens(tokens)

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete: only an end token could follow."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() or None if self.matcher.is_error() else None


@dataclass
class Masks:
    """One constrained sequence's masks: bias [rows, vocab] (0 allowed, -inf forbidden), and
    per row whether it allows nothing at all (the grammar cannot go on)."""
    bias: torch.Tensor
    dead: list[bool]


def mask_rows(seqs, rows, which: list[int]) -> set[int]:
    """Give rows[i] (SamplingRows) the grammar bias of seqs[i]'s next position, for i in
    `which`; returns those whose grammar allows nothing (they get none)."""
    dead = set()
    for i, m in zip(which, batch_masks([(seqs[i].constraint, []) for i in which])):
        if m.dead[0]:
            dead.add(i)
        else:
            rows[i].grammar_bias = m.bias[0]
    return dead


def batch_masks(items: list[tuple[Constraint, list[int]]]) -> list[Masks]:
    """For each (constraint, draft tokens): float32 [len(draft) + 1, vocab], 0 where the grammar
    allows a token and -inf where it forbids it, at the next position and after each draft token
    in turn (the draft tokens must be valid: see Constraint.valid_prefix). Added to the logits,
    it masks them (an add costs a tenth of a boolean masked_fill over a 49k vocabulary here).
    A row of only -inf (Masks.dead) means the grammar cannot go on."""
    if not items:
        return []
    backend = items[0][0].backend
    vocab = backend.vocab_size
    words = (vocab + 31) // 32
    offsets = np.cumsum([0] + [len(d) + 1 for _, d in items])
    bits = np.zeros((int(offsets[-1]), words), dtype=np.int32)
    ptr, row_bytes, total = bits.ctypes.data, words * 4, bits.shape[0]
    if any(d for _, d in items):
        backend.executor.unsafe_compute_mask_ptr_with_draft_token(
            [(c.matcher, int(o), list(d)) for (c, d), o in zip(items, offsets)],
            ptr, row_bytes, total)
    else:
        backend.executor.unsafe_compute_mask_ptr(
            [(c.matcher, int(o)) for (c, _), o in zip(items, offsets)], ptr, row_bytes, total)
    allowed = torch.from_numpy(np.unpackbits(bits.view(np.uint8), axis=1,
                                             bitorder="little")[:, :vocab])
    # 1 -> 0 and 0 -> -1 -> -inf: the second multiply overflows float32 to exactly -inf (a
    # multiply by inf would turn the zeros into NaN)
    bias = allowed.float().sub_(1).mul_(3e38).mul_(10.0)
    dead = (~bits.any(axis=1)).tolist()
    return [Masks(bias[offsets[i]:offsets[i + 1]], dead[offsets[i]:offsets[i + 1]])
            for i in range(len(items))]
