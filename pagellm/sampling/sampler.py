"""Turns logits into tokens: logit bias, penalties, min_tokens, the grammar mask, temperature,
top-k/top-p/min-p, seeded draws.

One row of logits per position to sample. `processed_logits` is shared with the speculative
rejection sampler so that the target's p and the draft's q see the same transformations.

Everything runs on the logits' device (the model's): a GPU step sends only token ids and
logprobs to the host, in a fixed number of reads a step. Random draws come from the rows'
generators: a seeded request's on the CPU (a seed gives the same draws on every device), whose
noise travels to the logits in one copy; the engine's own, for the other requests, on the
model's device.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from pagellm.kernels import native
from pagellm.outputs import Logprob
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


def _leaves_logits(params: SamplingParams, num_output_tokens: int, constrained: bool) -> bool:
    """Whether processed_logits leaves a row's logits as they are: greedy, no logit bias, no
    penalties, min_tokens met, no grammar."""
    return (params.greedy and not params.logit_bias and not params.needs_penalties
            and num_output_tokens >= params.min_tokens and not constrained)


def reads_argmax_only(params: SamplingParams, num_output_tokens: int, constrained: bool) -> bool:
    """Whether sampling a row reads nothing of its logits but their argmax: a row whose logits
    processed_logits leaves as they are, without logprobs. The model may then give logits
    right only at their argmax (`LlamaModel.compute_logits`)."""
    return (params.logprobs is None and params.prompt_logprobs is None
            and _leaves_logits(params, num_output_tokens, constrained))


def _changes(row: SamplingRow) -> bool:
    """Whether processed_logits may change this row's logits."""
    return not _leaves_logits(row.params, len(row.output_ids), row.grammar_bias is not None)


def processed_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """[num_rows, vocab] raw logits -> logits after penalties, min_tokens, temperature and
    truncation. Greedy rows are left at temperature 1 (their argmax is what counts). Where no
    row changes, the raw float32 logits themselves (callers only read them)."""
    raw = logits
    if not any(_changes(r) for r in rows):
        return logits.float()
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


def uniform_rows(generators: list[torch.Generator | None], n: int,
                 device: torch.device) -> torch.Tensor:
    """[len(generators), n] U(0, 1) draws, row i from generators[i] (None: the device's
    default generator), reaching `device` in one copy per generator device: seeded generators
    live on the CPU (a seed draws the same on every device), the engine's own on the model's
    device; one transfer a row was one synchronisation a row on a GPU. Draws are made on the
    generator's device, so a seed gives the same values everywhere."""
    groups: dict[torch.device, list[int]] = {}
    for i, g in enumerate(generators):
        groups.setdefault(g.device if g is not None else device, []).append(i)
    out = None
    for where, idx in groups.items():
        u = torch.stack([torch.empty(n, device=where).uniform_(generator=generators[i])
                         for i in idx]).to(device)
        if len(idx) == len(generators):
            return u
        if out is None:
            out = torch.empty(len(generators), n, device=device)
        out[torch.tensor(idx, device=device)] = u
    return out


def exponential_rows(generators: list[torch.Generator | None], n: int,
                     device: torch.device) -> torch.Tensor:
    """[len(generators), n] Exp(1) draws, row i from generators[i]: -log(U), U ~ U[0, 1)
    (U = 0 gives +inf, a token the Gumbel-max draw then never picks: probability 2^-24).
    Not torch's exponential_: over a 151,936-token vocabulary on a CPU that took 2.7 ms a
    draw against 0.5 ms, and a speculative round draws once per draft token and per verified
    sequence. See uniform_rows."""
    return uniform_rows(generators, n, device).log_().neg_()


def draw_rows(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One draw per row of [rows, vocab] distributions (row i with generators[i]), as a
    [rows] tensor on the probabilities' device: argmax(p / E), E ~ Exp(1) (the Gumbel-max
    form)."""
    return (probs / exponential_rows(generators, probs.shape[-1], probs.device)).argmax(dim=-1)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) of [rows, vocab] logits: natively for float32 rows on the CPU
    (kernels/cpu_sample.c: ~0.1 ms against torch's 1.9 ms for 64 rows of 49,152 ids)."""
    lib = native.library() if logits.device.type == "cpu" else None
    if (lib is None or logits.dtype != torch.float32 or logits.dim() != 2
            or not logits.is_contiguous() or logits.shape[1] == 0):
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr(),
                    torch.get_num_threads())
    return out


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
    """logits: [num_rows, vocab] from the model, on its device. The tokens reach the host in
    one transfer, the log-probabilities in at most three, whatever the number of rows."""
    want_logprobs = any(r.params.logprobs is not None for r in rows)
    raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if want_logprobs else None
    proc = processed_logits(logits, rows)
    ids = argmax_rows(proc)  # the greedy rows' tokens
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    if sampled:
        idx = torch.tensor(sampled, device=ids.device)
        ids[idx] = draw_rows(proc[idx].softmax(dim=-1), [rows[i].generator for i in sampled])
    token_ids = ids.tolist()
    logprobs = [None] * len(rows)
    if raw_logprobs is not None:
        logprobs = logprobs_of(raw_logprobs, token_ids, [r.params.logprobs for r in rows])
    return SampleResult(token_ids, logprobs)


def logprobs_of(row_logprobs: torch.Tensor, token_ids: list[int], num_tops: list[int | None]
                ) -> list[tuple[Logprob, dict[int, Logprob]] | None]:
    """[rows, vocab] log-probabilities -> per row (its token's, its top-N dict), or None where
    num_tops[i] is None, each with its rank (1: the most likely); all rows in at most three
    host transfers."""
    want = [i for i, n in enumerate(num_tops) if n is not None]
    result: list[tuple[Logprob, dict[int, Logprob]] | None] = [None] * len(token_ids)
    if not want:
        return result
    dev = row_logprobs.device
    # every row wanted (a prompt's rows, a batch of logprobs requests): no [rows, vocab] copy
    rows = (row_logprobs if len(want) == row_logprobs.shape[0]
            else row_logprobs[torch.tensor(want, device=dev)])
    chosen_t = rows.gather(1, torch.tensor([[token_ids[i]] for i in want], device=dev))
    # each value and its rank in one read (float64 holds both exactly)
    pairs = torch.cat((chosen_t.double(), (rows > chosen_t).sum(dim=1, keepdim=True).double()),
                      dim=1).tolist()
    chosen, ranks = [v for v, _ in pairs], [int(r) + 1 for _, r in pairs]
    most = max(num_tops[i] for i in want)
    top_values = top_ids = None
    if most > 0:
        values, ids = rows.topk(most, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    for j, i in enumerate(want):
        n = num_tops[i]
        top = ({t: Logprob(v, r) for r, (t, v) in enumerate(
            zip(top_ids[j][:n], top_values[j][:n]), start=1)} if n else {})
        result[i] = (Logprob(chosen[j], ranks[j]), top)
    return result
