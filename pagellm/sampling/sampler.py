"""Turns logits into tokens: logit bias, penalties, min_tokens, the grammar mask, temperature,
top-k/top-p/min-p, seeded draws.

One row of logits per position to sample. `processed_logits` is shared with the speculative
rejection sampler so that the target's p and the draft's q see the same transformations.

Everything runs on the logits' device (the model's): a GPU step sends only token ids and
logprobs to the host. Random draws come from the rows' generators (CPU, so that a seed gives
the same draws on every device) and travel to the logits.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from pagellm.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]  # tokens generated before this position
    generator: torch.Generator | None
    # One id, or every end token of the model (a config may list several; all end a sequence,
    # so min_tokens must mask all of them).
    eos_token_id: int | Collection[int] | None
    # Structured outputs: float32 [vocab], 0 where the grammar allows a token here and -inf
    # where it forbids it (None: no grammar).
    grammar_bias: torch.Tensor | None = None


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: (logprob of the sampled token, {token: logprob} of the top-N), or None.
    logprobs: list[tuple[float, dict[int, float]] | None]


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab, dev = logits.shape[-1], logits.device
    for i, row in enumerate(rows):
        p = row.params
        if not p.needs_penalties:
            continue
        out = torch.tensor(row.output_ids, dtype=torch.long, device=dev)
        counts = (torch.zeros(vocab, device=dev).index_add_(0, out, torch.ones(len(out), device=dev))
                  if len(out) else None)
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
            seen[torch.tensor(row.prompt_ids, dtype=torch.long, device=dev)] = True
            if counts is not None:
                seen |= counts > 0
            l = logits[i]
            penalized = torch.where(l > 0, l / p.repetition_penalty, l * p.repetition_penalty)
            logits[i] = torch.where(seen, penalized, l)
        if counts is not None:
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()


def _apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        if len(row.output_ids) < row.params.min_tokens:
            banned = list(row.params.stop_token_ids)
            eos = row.eos_token_id
            banned += [eos] if isinstance(eos, int) else list(eos or [])
            if banned:
                logits[i, banned] = float("-inf")


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        bias = row.params.logit_bias
        if bias:
            ids = [t for t in bias if t < vocab]
            logits[i, ids] += torch.tensor([bias[t] for t in ids], device=logits.device)


def _apply_grammar(logits: torch.Tensor, rows: list[SamplingRow], raw: torch.Tensor) -> None:
    """Tokens the grammar forbids get -inf (its bias added to all constrained rows at once).
    The grammar is a hard constraint: where it leaves only tokens that min_tokens banned (it
    allows nothing but an end token), min_tokens gives way; where it allows nothing at all, the
    row stays as it is and the engine ends the sequence (the grammar cannot be satisfied)."""
    idx = [i for i, r in enumerate(rows) if r.grammar_bias is not None]
    bias = torch.stack([rows[i].grammar_bias for i in idx]).to(logits.device)
    every = len(idx) == logits.shape[0]
    rows_t = torch.tensor(idx, device=logits.device)
    sub = logits.add_(bias) if every else logits[rows_t].add_(bias)
    dead = sub.amax(dim=1) == float("-inf")
    if bool(dead.any()):
        fixed = raw[rows_t[dead]].float() + bias[dead]
        # still nothing: the grammar allows no token (the caller ends the sequence)
        stuck = fixed.amax(dim=1) == float("-inf")
        fixed[stuck] = raw[rows_t[dead]][stuck].float()
        sub[dead] = fixed
    if not every:
        logits[rows_t] = sub


def _apply_top_k_top_p_min_p(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Mask, in place, tokens outside top-k, outside the top-p nucleus, or below min_p * p_max."""
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    vocab, dev = logits.shape[-1], logits.device
    if any(0 < k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=dev).unsqueeze(1)
        ranks = torch.arange(vocab, device=dev).unsqueeze(0)
        remove = ranks >= k
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        # Fix: only rows with top_p < 1. A float32 cumsum reaches 1.0 before the tail, which cut
        # tokens from rows with top_p = 1 (off), e.g. top_k alone or a batch mate's top_p.
        p = torch.tensor(top_p, device=dev).unsqueeze(1)
        remove |= (mass_before >= p) & (p < 1.0)
        sorted_logits.masked_fill_(remove, float("-inf"))
        logits.scatter_(1, order, sorted_logits)
    if any(p > 0 for p in min_p):
        probs = logits.softmax(dim=-1)
        threshold = (probs.max(dim=-1, keepdim=True).values
                     * torch.tensor(min_p, device=dev).unsqueeze(1))
        logits.masked_fill_(probs < threshold, float("-inf"))


def processed_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """[num_rows, vocab] raw logits -> logits after penalties, min_tokens, temperature and
    truncation. Greedy rows are left at temperature 1 (their argmax is what counts)."""
    raw = logits
    logits = logits.float().clone()
    _apply_logit_bias(logits, rows)
    _apply_penalties(logits, rows)
    _apply_min_tokens(logits, rows)
    if any(r.grammar_bias is not None for r in rows):
        _apply_grammar(logits, rows, raw)
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        idx = torch.tensor(sampled, device=logits.device)
        temps = torch.tensor([rows[i].params.temperature for i in sampled],
                             device=logits.device).unsqueeze(1)
        sub = logits[idx] / temps
        _apply_top_k_top_p_min_p(sub, [rows[i] for i in sampled])
        logits[idx] = sub
    return logits


def exponential(shape, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """Exp(1) draws from the generator (on its own device), on `device`: -log(U), U ~ U[0, 1)
    (U = 0 gives +inf, a token the Gumbel-max draw then never picks: probability 2^-24).
    Not torch's exponential_: over a 151,936-token vocabulary on a CPU that took 2.7 ms a draw
    against 0.5 ms, and a speculative round draws once per draft token and per verified
    sequence."""
    where = generator.device if generator is not None else device
    return torch.empty(shape, device=where).uniform_(generator=generator).log_().neg_().to(device)


def uniform(shape, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """U(0, 1) draws from the generator (on its own device), on `device`."""
    where = generator.device if generator is not None else device
    return torch.empty(shape, device=where).uniform_(generator=generator).to(device)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a [vocab] distribution: argmax(p / E) with E ~ Exp(1) (Gumbel-max form)."""
    return int((probs / exponential(probs.shape, generator, probs.device)).argmax())


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
    """logits: [num_rows, vocab] from the model, on its device."""
    want_logprobs = any(r.params.logprobs is not None for r in rows)
    raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if want_logprobs else None
    proc = processed_logits(logits, rows)
    greedy_ids = proc.argmax(dim=-1).tolist()
    token_ids = []
    for i, row in enumerate(rows):
        if row.params.greedy:
            token_ids.append(greedy_ids[i])
        else:
            token_ids.append(draw(proc[i].softmax(dim=-1), row.generator))
    logprobs = [None] * len(rows)
    if raw_logprobs is not None:
        for i, row in enumerate(rows):
            logprobs[i] = token_logprobs(raw_logprobs[i], token_ids[i], row.params.logprobs)
    return SampleResult(token_ids, logprobs)


def token_logprobs(row_logprobs: torch.Tensor, token_id: int,
                   num_top: int | None) -> tuple[float, dict[int, float]] | None:
    """[vocab] log-probabilities -> (sampled token's, top-N dict)."""
    if num_top is None:
        return None
    top: dict[int, float] = {}
    if num_top > 0:
        values, ids = row_logprobs.topk(num_top)
        top = dict(zip(ids.tolist(), values.tolist()))
    return float(row_logprobs[token_id]), top
