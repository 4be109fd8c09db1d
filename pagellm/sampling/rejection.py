"""Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

For proposal x_j drawn from the draft distribution q_j, the target distribution p_j accepts it
with probability min(1, p_j(x_j) / q_j(x_j)). At the first rejection the emitted token is drawn
from the residual normalize(max(0, p_j - q_j)); if all k proposals are accepted, a bonus token is
drawn from p_k. The emitted tokens are distributed exactly as if drawn from p one at a time.

A proposer without probabilities (n-gram) is a draft with q = one-hot(x_j): acceptance is then
p_j(x_j) and the residual is p_j with x_j removed. Greedy requests use p = one-hot(argmax p):
a proposal is accepted iff it is the argmax, and the emitted token is always the argmax.

Randomness is passed in (uniforms and exponential noise), so the batched version and the plain
reference in tests/test_spec_decode.py can be compared draw for draw.
"""
from __future__ import annotations

import torch


def rejection_sample(
    target_probs: torch.Tensor,  # [batch, k + 1, vocab] p at each proposal position + bonus
    draft_token_ids: torch.Tensor,  # [batch, k] int64 proposals (padding past num_draft ignored)
    num_draft: torch.Tensor,  # [batch] int64: proposals per row, 0..k
    draft_probs: torch.Tensor | None,  # [batch, k, vocab] q, or None for one-hot proposals
    uniforms: torch.Tensor,  # [batch, k] U(0, 1) draws for the accept tests
    noise: torch.Tensor,  # [batch, vocab] Exp(1) draws for the one final token
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (num_accepted [batch], final_token [batch]): row b emits
    draft_token_ids[b, :num_accepted[b]] followed by final_token[b]."""
    batch, k1, vocab = target_probs.shape
    k = k1 - 1
    dev = target_probs.device
    positions = torch.arange(k, device=dev).unsqueeze(0)  # [1, k]
    ids = draft_token_ids.clamp(min=0)
    p_x = target_probs[:, :k].gather(2, ids.unsqueeze(-1)).squeeze(-1)  # [batch, k]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.gather(2, ids.unsqueeze(-1)).squeeze(-1)
    # Accept iff u < p/q, i.e. u * q < p (no division by a zero q).
    accepted = (uniforms * q_x < p_x) & (positions < num_draft.unsqueeze(1))
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # leading run of accepts

    rows = torch.arange(batch, device=dev)
    p_final = target_probs[rows, num_accepted]  # [batch, vocab]
    rejected = num_accepted < num_draft
    if rejected.any():
        j = num_accepted.clamp(max=max(k - 1, 0))
        if draft_probs is None:
            q_final = torch.zeros(batch, vocab, dtype=p_final.dtype, device=dev)
            q_final[rows, ids[rows, j]] = 1.0
        else:
            q_final = draft_probs[rows, j]
        residual = (p_final - q_final).clamp(min=0)
        mass = residual.sum(dim=1, keepdim=True)
        # p == q exactly leaves no residual (and no rejection is then possible): keep p.
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_final)
        p_final = torch.where(rejected.unsqueeze(1), residual, p_final)
    final = (p_final / noise).argmax(dim=1)  # one draw per row: argmax(p / Exp(1))
    return num_accepted, final
