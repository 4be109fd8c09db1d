"""Speculative decoding: the rejection sampler's maths, and the engine's output never changing."""
from __future__ import annotations

import json

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.config import SpeculativeConfig
from pagellm.sampling.rejection import rejection_sample
from pagellm.sequence import Sequence
from pagellm.spec_decode.adaptive import _PRIOR_BATCH_ROW_COST, _PRIOR_ROW_COST, AdaptiveK
from pagellm.spec_decode.measure import StepWalls
from tests.helpers import make_tiny_model


def _random_case(batch, k, vocab, one_hot_q, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(batch, k + 1, vocab, generator=g) * 2, -1)
    q = None if one_hot_q else torch.softmax(torch.randn(batch, k, vocab, generator=g) * 2, -1)
    if q is None:
        draft = torch.randint(0, vocab, (batch, k), generator=g)
    else:
        draft = torch.stack([torch.multinomial(q[b], 1, generator=g).squeeze(-1)
                             for b in range(batch)])
    num_draft = torch.randint(0, k + 1, (batch,), generator=g)
    uniforms = torch.rand(batch, k, generator=g)
    noise = torch.empty(batch, vocab).exponential_(generator=g)
    return p, draft, num_draft, q, uniforms, noise


def reference_rejection_sample(p, draft, num_draft, q, uniforms, noise):
    """Speculative rejection sampling written plainly from its definition (Leviathan et al.
    2023), one row and one position at a time: accept x_j when u_j < p_j(x_j) / q_j(x_j); at
    the first rejection draw from normalize(max(0, p_j - q_j)); after k accepts, from p_k.
    q None: one-hot proposals. A draw from a distribution d is argmax(d / Exp(1) noise)."""
    batch, _, vocab = p.shape
    num_accepted, final = [], []
    for b in range(batch):
        for j in range(int(num_draft[b])):
            x = int(draft[b, j])
            qj = torch.nn.functional.one_hot(torch.tensor(x), vocab).to(p.dtype) if q is None \
                else q[b, j]
            if float(uniforms[b, j]) < float(p[b, j, x]) / float(qj[x]):
                continue
            residual = (p[b, j] - qj).clamp(min=0)
            d = residual / residual.sum() if residual.sum() > 0 else p[b, j]
            num_accepted.append(j)
            final.append(int((d / noise[b]).argmax()))
            break
        else:
            j = int(num_draft[b])
            num_accepted.append(j)
            final.append(int((p[b, j] / noise[b]).argmax()))
    return torch.tensor(num_accepted), torch.tensor(final)


@pytest.mark.parametrize("one_hot_q", [False, True])
def test_batched_equals_reference(one_hot_q):
    for seed in range(5):
        case = _random_case(batch=64, k=4, vocab=12, one_hot_q=one_hot_q, seed=seed)
        got = rejection_sample(*case)
        want = reference_rejection_sample(*case)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _emitted_histograms(p_rows, q_rows, n, vocab, one_hot_q, seed):
    """Repeat one case n times with fresh randomness: a distinct target p_j and draft q_j at
    each of k = 2 positions (+ the bonus p_2); histograms of the first and second emitted
    token. p_j does not depend on the tokens before it here, so emitted token j ~ p_j: a
    sampler reading another position's p or q gets another law."""
    g = torch.Generator().manual_seed(seed)
    k = 2
    p = p_rows.expand(n, k + 1, vocab).contiguous()
    draft = torch.stack([torch.multinomial(q_rows[j], n, replacement=True, generator=g)
                         for j in range(k)], dim=1)
    q = None if one_hot_q else q_rows.expand(n, k, vocab).contiguous()
    uniforms = torch.rand(n, k, generator=g)
    noise = torch.empty(n, vocab).exponential_(generator=g)
    acc, final = rejection_sample(p, draft, torch.full((n,), k), q, uniforms, noise)
    first = torch.where(acc > 0, draft[:, 0], final)
    second_rows = acc >= 1
    second = torch.where(acc[second_rows] > 1, draft[second_rows, 1], final[second_rows])
    return ((torch.bincount(first, minlength=vocab).float() / n, n),
            (torch.bincount(second, minlength=vocab).float() / max(len(second), 1), len(second)))


@pytest.mark.parametrize("one_hot_q", [False, True])
def test_emitted_tokens_follow_target_distribution(one_hot_q):
    vocab = 8
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(3, vocab, generator=g) * 1.5, -1)  # p_0, p_1, bonus p_2
    # The draft guesses from quite different distributions (for one-hot q: its proposals).
    q = torch.softmax(torch.randn(2, vocab, generator=g) * 1.5, -1)
    tv = lambda a, b: 0.5 * float((a - b).abs().sum())
    small = _emitted_histograms(p, q, 500, vocab, one_hot_q, seed=1)
    large = _emitted_histograms(p, q, 100_000, vocab, one_hot_q, seed=2)
    for j, ((hist_small, _), (hist_large, n)) in enumerate(zip(small, large)):
        # Sampling noise alone gives a total variation of about sqrt(vocab / n) / 2.
        assert tv(hist_large, p[j]) < (vocab / n) ** 0.5, j
        assert tv(hist_large, p[j]) < tv(hist_small, p[j])  # converges as samples grow
        assert tv(hist_large, q[j]) > 0.1  # and not to the draft's distribution
        assert tv(hist_large, p[1 - j]) > 0.1  # nor to the other position's target
    assert min(tv(p[j], q[j]) for j in range(2)) > 0.15 and tv(p[0], p[1]) > 0.2


def test_one_hot_acceptance_has_the_emission_probability():
    """The basis of scoring unverified n-gram proposals: with q one-hot at x the sampler
    accepts x with probability p(x), the probability that plain sampling emits x; so counting
    matches with emitted tokens estimates acceptance without verifying."""
    vocab, n = 6, 40_000
    g = torch.Generator().manual_seed(7)
    p_row = torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)
    p = p_row.expand(n, 2, vocab).contiguous()
    draft = torch.arange(n).remainder(vocab).view(n, 1)  # every token proposed equally often
    acc, _ = rejection_sample(p, draft, torch.ones(n, dtype=torch.long), None,
                              torch.rand(n, 1, generator=g),
                              torch.empty(n, vocab).exponential_(generator=g))
    rate = torch.zeros(vocab).index_add_(0, draft[:, 0], acc.float()) / (n / vocab)
    sigma = (p_row * (1 - p_row) / (n / vocab)).sqrt()
    assert ((rate - p_row).abs() < 4 * sigma + 1e-6).all(), (rate, p_row)


def ngram_scan(tokens: list[int], min_n: int, max_n: int, k: int,
               cursor: tuple[int, int] | None = None):
    """Reference, by a plain scan of every window: the up-to-k tokens following an occurrence
    of the longest tail n-gram (other than the tail), that n (0: none), and the new cursor.
    The occurrence: the first, or with a cursor (continuation of the last match, the length
    then) the one whose continuation is nearest to where that one's continues now (the
    earlier on a tie)."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = tokens[length - n:]
        hits = [i for i in range(length - n) if tokens[i:i + n] == tail]
        if hits:
            start = hits[0]
            if cursor is not None:
                want = cursor[0] + length - cursor[1]
                start = min(hits, key=lambda i: abs(i + n - want))
            return tokens[start + n:start + n + k], n, (start + n, length)
    return [], 0, cursor


def test_ngram_index_equals_the_scan():
    import random

    from pagellm.spec_decode.ngram import NgramIndex

    assert ngram_scan([1, 2, 3, 4, 9, 2, 3], 1, 3, 3)[:2] == ([4, 9, 2], 2)  # the docstring's
    first = NgramIndex(2, 2)  # "1 2" occurs twice before the tail: the first one counts
    assert first.lookup([1, 2, 7, 1, 2, 8, 1], [2], 2) == ([7, 1], 2) == \
        ngram_scan([1, 2, 7, 1, 2, 8, 1, 2], 2, 2, 2)[:2]
    # Copying the prompt from its "8": "1 2" occurs twice, and the copy continues after the
    # second ([4 8]), not after the first ([3 8]).
    prompt = [9, 1, 2, 3, 8, 1, 2, 4]
    walk = NgramIndex(2, 2)
    assert walk.lookup(prompt, [8, 1], 2) == ([2, 4], 2)
    assert walk.lookup(prompt, [8, 1, 2], 2) == ([4, 8], 2)
    rng = random.Random(0)
    for _ in range(300):
        vocab, length = rng.choice([2, 4, 30]), rng.randrange(2, 60)
        tokens = [rng.randrange(vocab) for _ in range(length)]
        num_prompt = rng.randrange(1, length)
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        index, cursor = NgramIndex(lo, hi), None
        output: list[int] = []
        for end in range(num_prompt, length + 1):  # the output grows, sometimes by several
            output.extend(tokens[num_prompt + len(output):end])
            if rng.random() < 0.3 and end < length:
                continue
            k = rng.randint(1, 5)
            want, n, cursor = ngram_scan(tokens[:num_prompt] + output, lo, hi, k, cursor)
            assert index.lookup(tokens[:num_prompt], output, k) == (want, n)


def test_unverified_ngram_proposals_are_scored_against_emitted_tokens():
    """Speculation held back: the proposal is kept and, once the target's tokens show how
    many of its leading tokens verification would have accepted, scored as acceptance."""
    from pagellm.spec_decode.decoder import SpecDecoder
    from pagellm.spec_decode.ngram import NgramProposer

    dec = SpecDecoder(NgramProposer(1, 3), max_k=3, adaptive=True, max_model_len=100,
                      eos_token_id=None)
    seen, avail = [], []
    dec.controller.choose = lambda seqs, av=None, kinds=None: (avail.append((av, kinds)),
                                                               [0] * len(seqs))[1]
    dec.controller.observe_acceptance = lambda seq, n, a, kind: seen.append((seq.seq_id, n, a, kind))
    seq = Sequence(0, "r", 0, [5, 6, 7, 8, 5, 6], SamplingParams(max_tokens=50), None)
    seq.output_token_ids.append(7)  # tail "5 6 7" follows with "8 5 6"
    seq.num_computed_tokens = seq.num_tokens - 1
    dec.propose([seq])
    assert avail[-1] == ([3], [3]) and seq.spec_token_ids == []  # proposed, but held back
    # 8 and 5 match, 9 does not; the proposal came from a 3-token match
    for token, scored in [(8, []), (5, []), (9, [(0, 3, 2, 3)])]:
        seq.output_token_ids.append(token)
        seq.num_computed_tokens += 1
        dec.propose([seq])
        assert seen == scored
    assert dec.num_unverified == 1
    dec.release(seq)
    assert not dec._unverified and not dec.proposer.indexes


def test_held_back_proposal_is_scored_while_another_is_verified():
    """A proposal held back is still scored when the next step verifies a new one: dropping
    it then counted only the proposals rejected at once (speculation resumes when a run is
    being accepted), and one-token matches looked useless on copy prompts."""
    from pagellm.spec_decode.decoder import SpecDecoder
    from pagellm.spec_decode.ngram import NgramProposer

    dec = SpecDecoder(NgramProposer(1, 3), max_k=3, adaptive=True, max_model_len=100,
                      eos_token_id=None)
    seen, ks = [], iter([0, 1, 0])
    dec.controller.choose = lambda seqs, av=None, kinds=None: [min(next(ks), av[0])]
    dec.controller.observe_acceptance = lambda seq, n, a, kind: seen.append((n, a, kind))
    seq = Sequence(0, "r", 0, [5, 6, 7, 8, 5, 6], SamplingParams(max_tokens=50), None)
    seq.output_token_ids.append(7)
    seq.num_computed_tokens = seq.num_tokens - 1
    dec.propose([seq])  # [8 5 6] held back
    seq.output_token_ids.append(8)
    seq.num_computed_tokens += 1
    dec.propose([seq])  # the next proposal is verified: one accepted, then 9
    assert seq.spec_token_ids == [5]
    seq.spec_token_ids = []
    seq.output_token_ids.extend([5, 9])
    seq.num_computed_tokens = seq.num_tokens - 1
    dec.propose([seq])
    assert seen == [(3, 2, 3)]  # the held-back one: 8 and 5 right, 9 not
    dec.release(seq)


def test_unmeasured_k_costs_what_measured_rows_cost():
    """A k not measured at a batch size is priced per verified row at what the measured k's
    rows cost there (their extra time over a plain step, draft rounds aside), plus its draft
    rounds; with nothing measured, at the prior row cost (a draft's at batch > 1: a whole
    plain-step row). A measured k's extra time scales with the rows verified."""
    ctl = AdaptiveK(max_k=4, draft_cost=True)
    ctl.observe_draft(2, 0.004)  # 2 ms a round
    for _ in range(3):
        ctl.observe_decode_step(4, 0.040, 0, 4, 0)
    assert ctl.step_wall(4, 2, 8) == pytest.approx(0.040 + _PRIOR_BATCH_ROW_COST * 8 * 0.010 + 0.004)
    for _ in range(3):
        ctl.observe_decode_step(4, 0.040 + 0.002 + 4 * 0.005, 1, 6, 4)  # 5 ms a row
    assert ctl.step_wall(4, 3, 12) == pytest.approx(0.040 + 12 * 0.005 + 3 * 0.002)
    assert ctl.step_wall(4, 1, 2) == pytest.approx(0.040 + (0.002 + 4 * 0.005) / 2)
    assert ctl.step_wall(4, 0, 0) == pytest.approx(0.040)


def simulate(ctl, batch: int, steps: int, forward, accept: float, draft_round: float = 0.0,
             overhead: float = 0.0, first_id: int = 0, spec_steps: list | None = None) -> float:
    """Run the controller against a synthetic engine; seconds per emitted token. forward(n):
    forward time of n tokens; each proposal is accepted with probability `accept`; overhead:
    seconds per verified row beyond the forward (sampling); first_id: sequence ids start here
    (new ids: requests the controller has not seen); spec_steps collects each step's k. A
    controller that scores unverified proposals (n-gram) gets a held-back proposal of max_k
    scored every other step for each sequence that had none (their average resolution)."""
    import random

    rnd = random.Random(0)
    seqs = [Sequence(first_id + i, str(i), 0, [1, 2], SamplingParams(), None) for i in range(batch)]
    total_s = total_tok = 0.0
    for step in range(steps):
        ks = ctl.choose(seqs, [ctl.max_k] * batch if ctl.scores_unverified else None)
        n = sum(k + 1 for k in ks)
        t = forward(n) + max(ks) * draft_round + overhead * (n - batch)
        if draft_round and max(ks):
            ctl.observe_draft(max(ks), max(ks) * draft_round)
        tokens = 0
        for seq, k in zip(seqs, ks):
            acc = _leading(rnd, accept, k)
            ctl.observe_acceptance(seq, k, acc)
            tokens += acc + 1
            if not k and ctl.scores_unverified and step % 2:  # held back, scored on emission
                ctl.observe_acceptance(seq, ctl.max_k, _leading(rnd, accept, ctl.max_k))
        ctl.observe_decode_step(batch, t, max(ks), tokens)
        if spec_steps is not None:
            spec_steps.append(max(ks))
        total_s, total_tok = total_s + t, total_tok + tokens
    return total_s / total_tok


def _leading(rnd, accept: float, k: int) -> int:
    """Proposals accepted of k, each with probability `accept` until the first rejection."""
    acc = 0
    while acc < k and rnd.random() < accept:
        acc += 1
    return acc


MEMORY_BOUND = lambda n: 0.050 + 0.0005 * n  # noqa: E731  batch-1 CPU: weights dominate
KERNEL_SWITCH = lambda n: 0.050 if n <= 16 else 0.25 + 0.004 * n  # noqa: E731  packed -> dense


def test_draft_probe_at_batch_uses_one_sequence():
    """While off, a draft-model probe catches up one sequence (the shortest), not the batch."""
    ctl = AdaptiveK(max_k=4, draft_cost=True)
    seqs = [Sequence(i, str(i), 0, [1] * (40 - i), SamplingParams(), None) for i in range(8)]
    ctl.observe_decode_step(8, 0.05, 0, 8)
    for _ in range(200):  # plain steps until the first probe
        ks = ctl.choose(seqs)
        if any(ks):
            break
        ctl.observe_decode_step(8, 0.05, 0, 8)
    assert sorted(ks) == [0] * 7 + [ks[7]] and ks[7] >= 1  # seq 7 has the fewest tokens
    ctl.observe_decode_step(8, 5.0, max(ks), 8)  # its catch-up: not the batch's step time
    assert list(ctl.walls[8].steps) == [0] and ctl.walls[8].wall(0) == 0.05


def test_a_draft_that_does_not_pay_probes_less_often_when_resuming_costs_a_catch_up():
    """Each probe of an idle draft first catches it up on the tokens emitted while it was off
    (a prefill of the draft, timed apart from the step): the dearer that is, the rarer the
    probes, so that they still cost about the share of time they are allowed."""
    def probes(catchup: float) -> int:
        ctl = AdaptiveK(max_k=4, draft_cost=True)
        seq = Sequence(0, "0", 0, [1, 2], SamplingParams(), None)
        count = 0
        for _ in range(3000):
            (k,) = ctl.choose([seq])
            if k:  # a losing draft: twice a plain step's time, nothing accepted
                count += 1
                ctl.observe_draft(k, 0.02 * k)
                ctl.observe_acceptance(seq, k, 0)
                if catchup:
                    ctl.observe_catchup(catchup)
            ctl.observe_decode_step(1, 0.1 if k else 0.05, k, 1)
        return count

    free, dear = probes(0.0), probes(0.5)  # a catch-up of 10 plain steps
    assert 0 < dear < free / 2


def test_draft_needs_a_clear_predicted_gain_before_a_whole_batch_step():
    """Batch 16, draft model, only plain steps measured (at 16 and 12: a row ~0.3 plain-step
    rows): a modest predicted gain (the step time of a k is only modelled there) is no
    reason for a whole-batch draft step; at most one sequence probes."""
    ctl = AdaptiveK(max_k=4, draft_cost=True)
    ctl.prior_alpha = ctl.alpha = 0.6
    ctl.observe_draft(1, 0.01)
    ctl.observe_decode_step(12, 0.0648, 0, 12)
    ctl.observe_decode_step(16, 0.07, 0, 16)
    assert ctl._row_cost(16, 0.01) == pytest.approx(0.297, abs=1e-3)
    seqs = [Sequence(i, str(i), 0, [1, 2], SamplingParams(), None) for i in range(16)]
    alphas = [ctl.seq_estimate(s) for s in seqs]
    rates = [ctl._plan(16, k, alphas, [4] * 16, [0] * 16)[1] for k in range(5)]
    assert 1.02 < max(rates[1:]) / rates[0] < 1.25
    for _ in range(20):
        ks = ctl.choose(seqs)
        assert sum(k > 0 for k in ks) <= 1, ks
        ctl.observe_decode_step(16, 0.07, max(ks), 16)


def test_acceptance_is_learnt_per_kind_of_proposal():
    """One request whose 4-token n-gram matches are always right and 1-token matches never:
    it speculates on the former and holds the latter back (one acceptance for both would
    do the same for each)."""
    ctl = AdaptiveK(max_k=4, scores_unverified=True)
    for _ in range(3):
        ctl.observe_decode_step(1, 0.026, 4, 5, 4)  # k=4: 1.3x a plain step
    for _ in range(3):
        ctl.observe_decode_step(1, 0.020, 0, 1, 0)
    seq = Sequence(0, "0", 0, [1, 2], SamplingParams(), None)
    for _ in range(10):
        ctl.observe_acceptance(seq, 4, 0, kind=1)
        ctl.observe_acceptance(seq, 4, 4, kind=4)
    assert ctl.kind_alpha(1) < 0.3 and ctl.kind_alpha(4) > 0.8  # pooled, prior: overall
    assert ctl.seq_estimate(seq, 1) < 0.2 and ctl.seq_estimate(seq, 4) > 0.8
    assert ctl.choose([seq], [4], [4]) == [4]
    assert ctl.choose([seq], [4], [1]) == [0]
    other = Sequence(1, "1", 0, [1, 2], SamplingParams(), None)
    assert ctl.seq_estimate(other, 4) == ctl.kind_alpha(4)  # a new request starts pooled
    ctl.forget(seq)
    assert not ctl.seq_alpha


def test_step_walls_are_medians_and_a_gain_must_beat_their_noise():
    """A slow step now and then (a shared machine) does not move a measured wall; a
    predicted gain of 6% is taken when the walls are steady, not when they scatter by 15%."""
    walls = StepWalls()
    for seconds in (0.020, 0.021, 0.019, 0.060, 0.020):
        walls.observe(0, seconds, 0, 1)
    assert walls.wall(0) == pytest.approx(0.020, rel=0.02) and walls.spread(0) < 0.05

    def controller(scatter: float) -> AdaptiveK:
        ctl = AdaptiveK(max_k=1, scores_unverified=True)
        seq = Sequence(0, "0", 0, [1, 2], SamplingParams(), None)
        for i in range(20):  # acceptance 0.5: a k=1 step emits 1.5 tokens
            ctl.observe_acceptance(seq, 1, i % 2)
        wall = 0.020 * 1.5 / 1.06  # 6% more tokens per second than plain decoding
        first, second = ((1, wall), (0, 0.020)) if scatter == 0 else ((0, 0.020), (1, wall))
        spread = (-1, -0.5, 0, 0.5, 1, -0.8, 0.8, -0.3, 0.3)  # median 0, deviations 0-1
        for k, w in (first, second):  # the side not in use was measured last (no probe due)
            for d in spread:
                ctl.observe_decode_step(1, w * (1 + scatter * d) if k else w, k, 1 + k, k)
        return ctl, seq

    steady, seq = controller(0.0)
    assert steady.choose([seq], [1]) == [1]
    noisy, seq = controller(0.15)
    ratio = lambda c: c.walls[1].wall(1) / c.walls[1].wall(0)  # noqa: E731
    assert ratio(noisy) <= ratio(steady) * 1.001  # promises at least the steady gain
    assert noisy.walls[1].spread(1) > 0.03
    assert noisy.choose([seq], [1]) == [0]


def test_step_walls_follow_the_machine_speed():
    """Plain steps measured at one moment, k=4 steps later while the machine slowed by 30%:
    the walls keep k=4 at 1.3x a plain step (the raw medians would say 1.7x), and a plain
    step at the new speed agrees with them."""
    walls = StepWalls()
    for _ in range(5):
        walls.observe(0, 0.020, 0, 1)
    for _ in range(9):
        walls.observe(4, 0.026, 4, 4)
    for _ in range(12):
        walls.observe(4, 0.026 * 1.3, 4, 4)
    assert walls.wall(4) / walls.wall(0) == pytest.approx(1.3, rel=0.1)
    walls.observe(0, 0.020 * 1.3, 0, 1)
    assert walls.wall(4) / walls.wall(0) == pytest.approx(1.3, rel=0.1)
    assert walls.speed == pytest.approx(1.3, rel=0.1)


def test_step_walls_do_not_drift_over_thousands_of_plain_steps():
    """Speculation off for 8,000 steps of a noisy machine (8% jitter, 1% of steps 3x slow):
    the stale k=1 wall keeps its ratio to a plain step (2.0x), and the plain step its real
    time. (The speed once followed each step's ratio by its mean while the walls are medians:
    every slow outlier pushed it up for good, and k=1 looked 1,000x a plain step, so the
    controller never probed it again.)"""
    import math
    import random

    rng = random.Random(0)
    walls = StepWalls()
    for _ in range(5):
        walls.observe(1, 0.050, 2, 1.8)
    for _ in range(5):
        walls.observe(0, 0.025, 0, 1)
    for _ in range(8000):
        seconds = 0.025 * math.exp(rng.gauss(0, 0.08)) * (3 if rng.random() < 0.01 else 1)
        walls.observe(0, seconds, 0, 1)
        assert 1 / 1.5 < walls.speed < 1.5
    assert walls.wall(1) / walls.wall(0) == pytest.approx(2.0, rel=0.15)
    assert walls.wall(0) * walls.speed == pytest.approx(0.025, rel=0.1)


def test_a_measured_step_never_costs_more_than_one_with_more_rows():
    """Batch 1: k=3 measured in a slow moment (39 ms) above k=4 (29 ms) counts as 29 ms (its
    median would otherwise stand for good: only the k in use and the runner-up are
    re-measured). At batch 16 a k=2 step whose requests verified fewer rows than a k=1
    step's does not cap the k=1 step."""
    ctl = AdaptiveK(max_k=4, scores_unverified=True)
    for k, wall in ((0, 0.019), (1, 0.0226), (2, 0.0239), (3, 0.0394), (4, 0.0289)):
        for _ in range(3):
            ctl.observe_decode_step(1, wall, k, 1 + k, k)
    walls = ctl.walls[1]
    assert walls.wall(3) == pytest.approx(0.0394)
    assert ctl.step_wall(1, 3, 3) == pytest.approx(0.0289)
    assert ctl.step_wall(1, 2, 2) == pytest.approx(0.0239)
    b16 = AdaptiveK(max_k=2, scores_unverified=True)
    for k, wall, rows in ((0, 0.08, 0), (1, 0.20, 16), (2, 0.12, 4)):
        b16.observe_decode_step(16, wall, k, 16 + rows, rows)
    assert b16.step_wall(16, 1, 16) == pytest.approx(0.20)


def test_no_step_past_the_few_row_kernels_at_the_measured_row_cost():
    """Batch 16, n-gram, copy-like acceptance: k=1 (32 rows) and k=2 (36 rows) measured. Their
    row cost calls a k=4 step (80 rows) cheap; past the packed kernels' 40 rows it took 7x a
    plain step. With the engine's row limit known, the controller assumes a row there costs
    twice what a row of a plain step does and never tries it."""
    def controller(row_limit):
        ctl = AdaptiveK(max_k=4, scores_unverified=True)
        ctl.row_limit = row_limit
        for k, wall, proposals in ((1, 0.131, 16), (2, 0.140, 20), (0, 0.08, 0)):
            for _ in range(3):
                ctl.observe_decode_step(16, wall, k, 16 + proposals, proposals)
        seqs = [Sequence(i, str(i), 0, [1, 2], SamplingParams(), None) for i in range(16)]
        for seq in seqs:
            for _ in range(5):
                ctl.observe_acceptance(seq, 4, 4, kind=4)
        return ctl, seqs

    ctl, seqs = controller(None)
    row = ((0.131 - 0.08) / 16 + (0.140 - 0.08) / 20) / 2  # the measured rows' mean cost
    assert ctl.step_wall(16, 4, 64) == pytest.approx(0.08 + 64 * row)  # what rows alone say
    assert ctl._plan(16, 4, [1.0] * 16, [4] * 16, [4] * 16)[1] > 16 / 0.08 * 1.25
    ctl, seqs = controller(40)
    assert ctl.step_wall(16, 4, 64) == pytest.approx(2 * 0.08 * 80 / 16)
    assert ctl.step_wall(16, 1, 16) == pytest.approx(0.131)  # measured
    assert max(ctl.choose(seqs, [4] * 16, [4] * 16)) <= 1


def test_step_time_scales_with_the_rows_verified():
    """n-gram at batch 16: a k=1 step where 2 sequences had a proposal took 120 ms (plain: 80);
    one where all 16 have one verifies 8x the extra rows, and must not be predicted at 120 ms
    (chat requests at batch 16 kept speculating on that estimate)."""
    ctl = AdaptiveK(max_k=4, scores_unverified=True)
    for _ in range(2):
        ctl.observe_decode_step(16, 0.08, 0, 16, 0)
    ctl.observe_decode_step(16, 0.12, 1, 17, 2)
    assert ctl.step_wall(16, 1, 2) == pytest.approx(0.12)
    assert ctl.step_wall(16, 1, 16) == pytest.approx(0.08 + 0.04 * 8)
    seqs = [Sequence(i, str(i), 0, [1, 2], SamplingParams(), None) for i in range(16)]
    for seq in seqs:  # acceptance ~0.7: pays for 2 extra rows at 20 ms each, not for 16
        for _ in range(4):
            ctl.observe_acceptance(seq, 1, 1)
            ctl.observe_acceptance(seq, 2, 1)
    assert ctl.choose(seqs, [1] * 16) == [0] * 16


def test_walls_are_kept_per_batch_size():
    """A batch of 16 draining to 9 halves its plain step: walls shared across those sizes
    made a batch-9 verification step look cheap next to a batch-16 plain one."""
    ctl = AdaptiveK(max_k=4, scores_unverified=True)
    for _ in range(3):
        ctl.observe_decode_step(16, 0.096, 0, 16, 0)
        ctl.observe_decode_step(16, 0.150, 1, 28, 12)
    assert 9 not in ctl.walls and 12 not in ctl.walls
    seqs = [Sequence(i, str(i), 0, [1, 2], SamplingParams(), None) for i in range(9)]
    assert ctl.choose(seqs, [4] * 9, [4] * 9) == [0] * 9  # a new size: plain decoding first
    ctl.observe_decode_step(9, 0.053, 0, 9, 0)
    assert list(ctl.walls[9].steps) == [0] and ctl.walls[9].wall(0) == 0.053
    assert ctl.walls[16].wall(0) == 0.096


def test_unmeasured_k_costs_rows_like_the_nearest_smaller_batch():
    """Batch 8 measured a verified row at 0.8 plain-step rows ((0.09 - 0.05) / 8 over
    0.05 / 8). At batch 12, k=1 not measured yet, a row costs that much (not the prior's
    cheap rows): with acceptance 0.7 per proposal, a k=1 step there is then not worth even
    a probe soon."""
    ctl = AdaptiveK(max_k=4, scores_unverified=True)
    for _ in range(3):
        ctl.observe_decode_step(8, 0.05, 0, 8, 0)
        ctl.observe_decode_step(8, 0.09, 1, 14, 8)
        ctl.observe_decode_step(12, 0.07, 0, 12, 0)
    assert ctl._row_cost(12, 0.0) == pytest.approx(0.8)
    assert ctl._row_cost(7, 0.0) == _PRIOR_ROW_COST  # nothing measured at or below 7
    assert ctl.step_wall(12, 1, 12) == pytest.approx(0.07 + 0.8 * 12 * 0.07 / 12)
    assert ctl.step_wall(12, 1, 3) == pytest.approx(0.07 + 0.8 * 3 * 0.07 / 12)
    seqs = [Sequence(i, str(i), 0, [1, 2], SamplingParams(), None) for i in range(12)]
    for seq in seqs:
        for _ in range(4):
            ctl.observe_acceptance(seq, 1, 1)
            ctl.observe_acceptance(seq, 2, 1)
    assert all(ctl.choose(seqs, [1] * 12) == [0] * 12 for _ in range(20))


def test_a_free_proposers_probe_at_batch_16_verifies_one_sequence():
    """n-gram at batch 16, a k=1 row costing two plain rows: speculation never pays, and a
    probe only re-measures the step time (held-back proposals keep acceptance fresh), so it
    goes to the likeliest sequence alone, not to every one with a proposal (2.4x a plain
    step on chat prompts)."""
    ctl = AdaptiveK(max_k=4, scores_unverified=True)
    for _ in range(3):
        ctl.observe_decode_step(16, 0.08, 0, 16, 0)
        ctl.observe_decode_step(16, 0.20, 1, 24, 12)
    seqs = [Sequence(i, str(i), 0, [1, 2], SamplingParams(), None) for i in range(16)]
    for i, seq in enumerate(seqs):
        for _ in range(4):
            ctl.observe_acceptance(seq, 1, 1 if i != 5 else 1, kind=4)
            ctl.observe_acceptance(seq, 2, 1 if i != 5 else 2, kind=4)
    probes = []
    for _ in range(3000):
        ks = ctl.choose(seqs, [4] * 16, [4] * 16)
        if any(ks):
            probes.append(ks)
        ctl.observe_decode_step(16, 0.08 + 0.01 * sum(ks), max(ks), 16, sum(ks))
    assert probes and all(sum(k > 0 for k in ks) == 1 and ks[5] for ks in probes)


def test_unmeasured_k_is_not_cheaper_than_the_measured_rows():
    """Batch 16: plain steps 80 ms, k=1 250 ms (rows past the packed kernels' sweet spot).
    An unmeasured k=4 costs what its rows cost at k=1: 0.08 + 4 * 0.17. With copy-like
    acceptance k=4 must not look like a gain (a cold start used to try each unmeasured k
    once, ~300 ms extra each)."""
    ctl = AdaptiveK(max_k=4, scores_unverified=True)
    for _ in range(2):
        ctl.observe_decode_step(16, 0.08, 0, 16)
    ctl.observe_decode_step(16, 0.25, 1, 30)
    assert ctl.step_wall(16, 4, 64) == pytest.approx(0.08 + 4 * 0.17)
    assert ctl.step_wall(16, 1, 16) == 0.25
    seqs = [Sequence(i, str(i), 0, [1, 2], SamplingParams(), None) for i in range(16)]
    for seq in seqs:
        for _ in range(3):
            ctl.observe_acceptance(seq, 4, 4)
    assert ctl.choose(seqs, [4] * 16) == [0] * 16
    ctl.observe_decode_step(16, 0.50, 3, 40)  # k=2 then costs the mean row of k=1 and k=3
    row = ((0.25 - 0.08) / 16 + (0.50 - 0.08) / 48) / 2
    assert ctl.step_wall(16, 2, 32) == pytest.approx(0.08 + 32 * row)


@pytest.mark.parametrize("case,unverified", [
    ("useless draft b1", False),  # a draft model's proposals are never free: always verified
    ("kernel switch b16", False), ("kernel switch b16", True),
    ("hidden cost b4", False), ("hidden cost b4", True)])
def test_adaptive_never_much_slower_than_off(case, unverified):
    """Synthetic engines where speculation cannot pay: the controller costs < 5% over 400 steps
    (and much less where unverified proposals teach it acceptance: only timing probes)."""
    if case == "useless draft b1":
        ctl, kw = AdaptiveK(max_k=4, draft_cost=True), dict(
            batch=1, forward=MEMORY_BOUND, accept=0.02, draft_round=0.015)
    elif case == "kernel switch b16":  # a step model a + b n would keep speculating here
        ctl, kw = AdaptiveK(max_k=4, scores_unverified=unverified), dict(
            batch=16, forward=KERNEL_SWITCH, accept=0.5)
    else:  # the model predicts a gain; per-row sampling costs (not in T) eat it: measured off
        ctl, kw = AdaptiveK(max_k=4, scores_unverified=unverified), dict(
            batch=4, forward=MEMORY_BOUND, accept=0.5, overhead=0.01)
    off = kw["forward"](kw["batch"]) / kw["batch"]  # plain decoding, seconds per token
    ks = []
    got = simulate(ctl, steps=400, spec_steps=ks, **kw)
    assert got < off / 0.95, (got, off)
    if unverified:
        assert got < off / 0.98, (got, off)
    if case == "useless draft b1":
        # each failed probe spaces the next one further apart
        at = [i for i, k in enumerate(ks) if k]
        gaps = [b - a for a, b in zip(at, at[1:])]
        assert len(at) <= 6 and gaps == sorted(gaps) and gaps[-1] >= 4 * gaps[0], at


@pytest.mark.parametrize("unverified", [False, True], ids=["verified only", "scores unverified"])
def test_workload_switch_to_low_acceptance_turns_speculation_off_fast(unverified):
    """Batch 16: copy-like requests (high acceptance), then new chat-like requests whose
    proposals mostly fail. The per-request estimates start from the pooled acceptance; the
    measured tokens per second of speculating steps (or the scored unverified proposals) must
    turn it off within a few steps."""
    ctl = AdaptiveK(max_k=4, scores_unverified=unverified)
    forward = lambda n: 0.05 + 0.002 * n  # noqa: E731  verification rows cost
    simulate(ctl, batch=16, steps=150, forward=forward, accept=0.9)
    off = forward(16) / 16
    ks = []
    got = simulate(ctl, batch=16, steps=200, forward=forward, accept=0.05, first_id=100,
                   spec_steps=ks)
    assert got < off / 0.95, (got, off)
    assert sum(k > 0 for k in ks[:20]) <= 6, ks[:20]
    # and back to copy-like requests: speculation resumes at the next probe
    again = simulate(ctl, batch=16, steps=200, forward=forward, accept=0.9, first_id=200)
    assert again < off / 1.5, (again, off)


@pytest.mark.parametrize("unverified", [False, True], ids=["verified only", "scores unverified"])
def test_adaptive_speculates_when_it_pays_and_resumes(unverified):
    ctl = AdaptiveK(max_k=4, scores_unverified=unverified)
    off = MEMORY_BOUND(1)
    fast = simulate(ctl, batch=1, steps=200, forward=MEMORY_BOUND, accept=0.9)
    assert fast < off / 2.5  # copy-like acceptance at batch 1: most of k=4's gain
    slow = simulate(ctl, batch=1, steps=300, forward=MEMORY_BOUND, accept=0.0)
    assert slow < off / 0.95  # acceptance collapses: back off quickly
    again = simulate(ctl, batch=1, steps=300, forward=MEMORY_BOUND, accept=0.9)
    assert again < off / 2  # and resumes within a probe interval
    fresh = AdaptiveK(max_k=4)  # nothing observed: independent tries, 1 + a + a^2
    assert fresh.expected(0.5, 2) == pytest.approx(1.75)
    for _ in range(50):  # runs: the first proposal fails half the time, the rest never
        fresh.observe_acceptance(Sequence(0, "0", 0, [1], SamplingParams(), None), 4, 0)
        fresh.observe_acceptance(Sequence(0, "0", 0, [1], SamplingParams(), None), 4, 4)
    assert fresh.expected(0.5, 4) == pytest.approx(1 + 0.5 * 4, rel=0.05)
    for _ in range(50):  # chat-like: later positions rejected
        fresh.observe_acceptance(Sequence(0, "0", 0, [1], SamplingParams(), None), 4, 1)
    # a request accepting 90% is not held to the low pooled rates of later positions
    assert fresh.expected(0.9, 4) >= 1 + 0.9 + 0.81 + 0.729 + 0.6561 - 1e-9


PROMPTS = [[5, 17, 33, 4, 90, 12, 7] * 3, [3, 3, 3], list(range(10, 51)),
           [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [9, 8, 7]]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    target = tmp_path_factory.mktemp("spec_target")
    make_tiny_model(target, "llama")
    other_vocab = tmp_path_factory.mktemp("spec_other_vocab")
    make_tiny_model(other_vocab, "llama", vocab_size=300)
    return str(target), str(other_vocab)


def _greedy(llm, n=24):
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    "draft_self": {"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False},
    "draft_1layer": {"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 1,
                     "adaptive": False},
    "adaptive": {"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 1},
    # a draft from files ("model"): its own weights and paged cache, not the target's layers
    "draft_files": {"method": "draft_model", "model": "<target>", "num_speculative_tokens": 3,
                    "draft_num_layers": 1, "adaptive": False},
    # n-gram lookup first, that draft where it finds nothing
    "lookup_first": {"method": "draft_model", "model": "<target>", "num_speculative_tokens": 3,
                     "draft_num_layers": 1, "adaptive": False, "prompt_lookup_first": True},
}


def _spec(name: str, path: str) -> dict:
    return {k: path if v == "<target>" else v for k, v in SPECS[name].items()}


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("setting", ["plain", "preempt", "chunked", "no_prefix_cache"])
def test_greedy_identical_with_speculation(tiny_pair, spec, setting):
    path, _ = tiny_pair
    kw = {"dtype": "float32", "kv_cache_memory": 2**20, "block_size": 4}
    if setting == "preempt":
        kw.update(kv_cache_memory=2048 * 20 if spec == "ngram" else 4096 * 20)
    if setting == "chunked":
        kw.update(max_num_batched_tokens=6)
    if setting == "no_prefix_cache":
        kw.update(enable_prefix_caching=False)
    base = _greedy(LLM(path, **kw))
    llm = LLM(path, speculative_config=_spec(spec, path), **kw)
    shares = spec.startswith("draft") and spec != "draft_files" or spec == "adaptive"
    assert (getattr(llm.engine.spec.proposer, "scheduler", None) is not None) == shares
    if spec == "adaptive":
        # A confident prior, and step costs from a fixed model instead of this machine's wall
        # clock (a slow or loaded machine could otherwise make it never draft, and this test
        # would then exercise nothing): its choices are the same on every machine.
        ctl = llm.engine.spec.controller
        ctl.prior_alpha = ctl.alpha = 0.95
        fixed_costs(ctl)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == base
    stats = llm.engine.spec.stats
    # Per-request counts in the offline results add up to the engine's.
    assert sum(o.metrics.num_draft_tokens for o in outs) == stats.num_draft_tokens
    assert sum(o.metrics.num_accepted_tokens for o in outs) == stats.num_accepted_tokens
    assert stats.num_draft_tokens > 0
    if spec == "draft_self":  # a draft equal to the target accepts everything
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    if setting == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0


class _Recorder:
    """Stands in for the engine's SpecDecoder and records which of its members are used."""

    def __init__(self, inner):
        self.inner, self.used = inner, set()

    def __getattr__(self, name):
        self.used.add(name)
        return getattr(self.inner, name)


@pytest.mark.parametrize("spec", ["ngram", "draft_1layer", "draft_files"])
def test_the_engine_speaks_to_speculation_through_one_seam(tiny_pair, spec, monkeypatch):
    """Each step the engine calls propose (before scheduling), verify (after the forward) and
    observe (the step's times), and reads stats; a sequence that leaves or is preempted is
    released through the scheduler's on_release. Nothing else: the slots of proposals and the
    rollback after verification are the scheduler's. Sampling and verification run on the
    logits' device: no step copies a tensor to the host (Tensor.cpu)."""
    path, _ = tiny_pair
    llm = LLM(path, dtype="float32", kv_cache_memory=4096 * 20, block_size=4,
              speculative_config=_spec(spec, path))
    engine = llm.engine
    rec = _Recorder(engine.spec)
    engine.spec = rec
    engine.scheduler.on_release = rec.release
    copies = []
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: copies.append(t.shape) or t)
    sps = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
           SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=3, logprobs=2)]
    outs = llm.generate(PROMPTS * 2, sps * len(PROMPTS), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    assert engine.spec_stats.num_draft_tokens > 0
    assert engine.scheduler.num_preemptions > 0  # the pool is small: release on preemption too
    assert rec.used <= {"propose", "verify", "observe", "release", "stats"}, rec.used
    assert {"propose", "verify", "observe", "release"} <= rec.used
    assert copies == []
    inner = rec.inner.proposer
    assert not getattr(inner, "shadows", {})  # every draft shadow released


def test_early_exit_draft_reads_copied_blocks_of_parallel_samples(tiny_pair):
    """n = 3 samples share their prompt's partly filled last block; each one's first draft
    round writes into it, so the block is copied for it first (copy-on-write) and the copy
    must hold the prompt's KV before the draft reads it: a draft equal to the target then
    still accepts everything."""
    path, _ = tiny_pair
    kw = {"dtype": "float32", "kv_cache_memory": 2**20, "block_size": 4}
    sp = SamplingParams(n=3, temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [p for p in PROMPTS if len(p) % 4]
    base = LLM(path, **kw).generate(prompts, sp, use_tqdm=False)
    llm = LLM(path, speculative_config=SPECS["draft_self"], **kw)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == \
        [[c.token_ids for c in o.outputs] for o in base]
    stats = llm.engine.spec.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


def test_early_exit_lookahead_blocks_follow_the_token_budget(tiny_pair):
    """The early-exit draft takes its verification slots before the scheduler runs; when the
    token budget then verifies fewer proposals, the blocks past what is computed go back:
    after every step each request holds exactly the blocks its computed tokens need."""
    path, _ = tiny_pair
    # budget 5: the first request verifies 3 proposals (4 tokens), the next fits 1 token,
    # its proposals are all dropped and it decodes plainly
    llm = LLM(path, dtype="float32", kv_cache_memory=2**20, block_size=2,
              max_num_batched_tokens=5, speculative_config=SPECS["draft_self"])
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=16,
                                                          ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            if not seq.spec_token_ids and seq.num_computed_tokens:
                assert len(seq.block_table) == -(-seq.num_computed_tokens // 2), seq.seq_id
    stats = engine.spec.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


def test_speculation_respects_max_tokens_stop_and_seed(tiny_pair):
    path, _ = tiny_pair
    llm = LLM(path, dtype="float32", kv_cache_memory=2**20,
              speculative_config=SPECS["draft_self"])
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
                        use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 7 for o in outs)
    # Stop token in the middle of an accepted run: nothing after it is emitted.
    ref = outs[2].outputs[0].token_ids
    stop = SamplingParams(temperature=0, max_tokens=7, stop_token_ids=[ref[3]], ignore_eos=True)
    got = llm.generate([PROMPTS[2]], stop, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == ref[: ref.index(ref[3]) + 1] and got.finish_reason == "stop"
    sampled = SamplingParams(temperature=1.0, seed=42, max_tokens=12, ignore_eos=True, logprobs=2)
    a = llm.generate(PROMPTS, sampled, use_tqdm=False)
    b = llm.generate(PROMPTS, sampled, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert all(len(o.outputs[0].logprobs) == 12 for o in a)


def test_cli_flags_build_the_early_exit_draft(tiny_pair):
    import argparse

    from pagellm.cli import add_engine_args, engine_kwargs
    from pagellm.spec_decode.draft_model import EarlyExitProposer

    path, _ = tiny_pair
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--model", path, "--dtype", "float32", "--kv-cache-memory", "1MiB",
                         "--speculative-method", "draft_model", "--num-speculative-tokens", "2",
                         "--speculative-draft-num-layers", "1", "--speculative-fixed-k"])
    kw = engine_kwargs(args)
    assert kw["speculative_config"]["draft_num_layers"] == 1
    assert kw["speculative_config"].get("draft_vocab_size") is None
    sub = p.parse_args(["--model", path, "--speculative-method", "draft_model",
                        "--speculative-model", path, "--speculative-draft-vocab-size", "100"])
    assert engine_kwargs(sub)["speculative_config"]["draft_vocab_size"] == 100
    assert kw["speculative_config"]["adaptive"] is False
    kw["model"] = path
    llm = LLM(**kw)
    proposer = llm.engine.spec.proposer
    assert isinstance(proposer, EarlyExitProposer) and len(proposer.model.layers) == 1
    assert proposer.model.layers[0] is llm.engine.model.layers[0]  # the same module, in place
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=6),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6 and llm.engine.spec.stats.num_drafts > 0


def fixed_costs(ctl) -> None:
    """Feed the controller step costs from a fixed model (10 ms + 0.5 ms a row per target
    step, 1 ms a draft round) whatever the wall clock said."""
    draft, decode = ctl.observe_draft, ctl.observe_decode_step
    ctl.observe_draft = lambda rounds, seconds: draft(rounds, 0.001 * rounds)
    ctl.observe_decode_step = lambda batch, seconds, k, tokens, rows=None, timed=True: decode(
        batch, 0.010 + 0.0005 * (rows or batch) + 0.001 * k, k, tokens, rows, timed)


def test_lookup_first_drafts_only_where_the_lookup_finds_nothing(tiny_pair):
    """prompt_lookup_first: a request whose tail matches earlier text (3+ tokens) gets the
    lookup's proposal, and the draft runs only where it finds nothing (both happen on these
    prompts); output unchanged, alone and in a batch; a draft-less step is not timed as one
    with a draft; proposals never pass max_tokens or a request's own cap; no draft block is
    left after the requests."""

    path, _ = tiny_pair
    llm = LLM(path, dtype="float32", kv_cache_memory=2**20, block_size=4,
              speculative_config=_spec("lookup_first", path))
    spec = llm.engine.spec
    proposer = spec.proposer
    assert proposer.ngram.min_n == 3  # shorter matches are the draft's to propose
    asked, drafted, timed = [], [], []
    propose, draft = proposer.propose, proposer.draft.propose

    def record_propose(seqs, ks):
        out = propose(seqs, ks)
        asked.extend((p.kind, len(p.token_ids)) for p in out)
        return out

    def record_draft(seqs, ks):
        drafted.extend(ks)
        return draft(seqs, ks)

    observe = spec.controller.observe_decode_step

    def record_step(*a, **kw):
        timed.append((proposer.last_free, kw.get("timed", True)))
        return observe(*a, **kw)

    proposer.propose, proposer.draft.propose = record_propose, record_draft
    spec.controller.observe_decode_step = record_step
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(path, dtype="float32", kv_cache_memory=2**20, block_size=4)
    for prompt in PROMPTS:  # one at a time: the lookup proposes at batch 1 only
        want = plain.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
        assert llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids == want
    assert _greedy(llm) == _greedy(plain)  # a batch: the draft alone
    kinds = {kind for kind, n in asked if n}
    assert 0 in kinds and kinds - {0} and min(kinds - {0}) >= 3
    assert drafted and len(drafted) < len(asked)
    assert timed and all(free != t for free, t in timed)
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 5 for o in out)
    # a request's own cap holds for the lookup's free proposals too (0: none)
    capped = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, num_speculative_tokens=0)
    for prompt in PROMPTS:  # one at a time, where the lookup proposes
        (off,) = llm.generate([prompt], capped, use_tqdm=False)
        assert off.metrics.num_draft_tokens == 0
    draft_blocks = proposer.draft.block_manager
    assert draft_blocks.num_free_blocks == draft_blocks.num_blocks
    with pytest.raises(ValueError, match="prompt_lookup_first"):
        SpeculativeConfig(method="ngram", prompt_lookup_first=True)
    import argparse

    from pagellm.cli import add_engine_args, engine_kwargs
    p = argparse.ArgumentParser()
    add_engine_args(p)
    for flags, want in (([], False), (["--speculative-prompt-lookup-first"], True)):
        args = p.parse_args(["--speculative-method", "draft_model", "--speculative-model", path,
                             *flags])
        assert engine_kwargs(args)["speculative_config"]["prompt_lookup_first"] is want


def test_lookup_first_proposes_past_a_held_back_draft_only_at_batch_one():
    """At batch 1 the lookup proposes first, up to max_k even where the controller's k = 0
    holds the draft back; in a batch the draft alone proposes, with the controller's ks."""
    from pagellm.spec_decode.base import Proposal
    from pagellm.spec_decode.combined import LookupThenDraft
    from pagellm.spec_decode.ngram import NgramProposer

    class Draft:
        last_rounds, last_seconds, last_catchup_seconds = 0, 0.0, 0.0

        def __init__(self):
            self.asked = []

        def propose(self, seqs, ks):
            self.asked.append(list(ks))
            return [Proposal([1] * k, None) for k in ks]

    def seq(i):
        s = Sequence(i, str(i), 0, [4, 5, 6, 7, 8, 9] * 3, SamplingParams(), None)
        s.output_token_ids = [4, 5, 6]
        return s

    draft = Draft()
    both = LookupThenDraft(NgramProposer(3, 4), draft, max_k=4)
    (one,) = both.propose([seq(0)], [0])
    assert one.token_ids == [7, 8, 9, 4] and one.kind == 4 and both.last_free and not draft.asked
    two = both.propose([seq(1), seq(2)], [0, 2])
    assert [p.token_ids for p in two] == [[], [1, 1]] and draft.asked == [[0, 2]]
    assert not both.last_free
    lone = Sequence(3, "3", 0, [1, 2, 3], SamplingParams(), None)
    lone.output_token_ids = [10]
    (drafted,) = both.propose([lone], [2])
    assert drafted.token_ids == [1, 1] and draft.asked[-1] == [2] and not both.last_free
    assert both.propose([lone], [0]) == [Proposal([], None)]
    assert not both.last_free  # a plain step is timed (it is what k = 0 costs)


def test_mismatched_vocab_refused(tiny_pair):
    path, other = tiny_pair
    with pytest.raises(ValueError, match="vocab"):
        LLM(path, dtype="float32", kv_cache_memory=2**20,
            speculative_config={"method": "draft_model", "model": other})


def test_bad_speculative_config():
    with pytest.raises(ValueError, match="method"):
        LLM(speculative_config={"method": "medusa"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 0})


def test_the_vllm_forms_of_the_speculative_config(monkeypatch, capsys):
    """A draft model and no method is a draft model (vLLM's reading), never n-gram lookup with
    the model silently unused; `--speculative-config JSON` is vLLM's flag; a --speculative-*
    flag that would be ignored is an error."""
    assert SpeculativeConfig.from_dict({"model": "d.gguf"}).method == "draft_model"
    assert SpeculativeConfig.from_dict({"draft_num_layers": 2}).method == "draft_model"
    for name, value in (("model", "d.gguf"), ("draft_dtype", "bfloat16"),
                        ("draft_num_layers", 2), ("draft_vocab_size", 100)):
        with pytest.raises(ValueError, match=f"speculative_config.{name}: n-gram lookup"):
            SpeculativeConfig.from_dict({"method": "ngram", name: value})
    from pagellm import cli
    from pagellm.server import api_server

    seen = {}
    monkeypatch.setattr(api_server, "serve", lambda args, kwargs: seen.update(kwargs) or 0)

    def spec(*flags):
        seen.clear()
        assert cli.main(["serve", "m.gguf", *flags]) == 0
        return seen["speculative_config"]

    assert spec() is None
    given = {"model": "d.gguf", "num_speculative_tokens": 5}
    assert spec("--speculative-config", json.dumps(given)) == given
    assert spec("--speculative-model", "d.gguf", "--num-speculative-tokens", "3") == {
        "method": "draft_model", "model": "d.gguf", "num_speculative_tokens": 3,
        "adaptive": True, "prompt_lookup_first": False}
    assert spec("--speculative-draft-num-layers", "2")["method"] == "draft_model"
    assert spec("--speculative-method", "ngram", "--speculative-fixed-k") == {
        "method": "ngram", "adaptive": False, "prompt_lookup_first": False}
    for flags, message in ((["--num-speculative-tokens", "3"], "needs --speculative-method"),
                           (["--num-speculative-tokens", "0"], "needs --speculative-method"),
                           (["--speculative-config", "{"], "not JSON"),
                           (["--speculative-config", "[1]"], "a JSON object"),
                           (["--speculative-config", "{}", "--speculative-model", "d"],
                            "not both")):
        assert cli.main(["serve", "m.gguf", *flags]) == 2
        assert message in capsys.readouterr().err


def test_packed_row_limit_is_the_smallest_few_row_kernel_limit():
    from types import SimpleNamespace

    from pagellm.layers.linear import packed_row_limit

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert packed_row_limit(model) is None  # no packed weights: no limit
    model[0].packed, model[1].packed = SimpleNamespace(max_rows=41), SimpleNamespace(max_rows=17)
    assert packed_row_limit(model) == 16  # products take the packed path below max_rows


def test_a_draft_that_pays_a_little_is_used_at_batch_1():
    """The 1.5B / 0.5B pair's costs on a CPU (plain step 23 ms, +5.3 ms a verified row, a
    draft round 10.6 ms) at 0.9 acceptance a token: k = 2-4 gain 7-9% over plain decoding, and
    the controller takes most of it. (A request's acceptance as a mean of each step's accepted
    / tried was biased low for k > 1 and kept it on plain decoding: 23.0 ms a token.)"""
    ctl = AdaptiveK(max_k=4, draft_cost=True)
    spec_steps = []
    per_token = simulate(ctl, 1, 400, lambda n: 0.023 + 0.0053 * (n - 1), accept=0.9,
                         draft_round=0.0106, spec_steps=spec_steps)
    assert per_token < 0.023 / 1.05
    assert sum(k > 0 for k in spec_steps[100:]) > 150


def test_one_unlucky_probe_after_a_pause_does_not_veto_k():
    """A draft's measured tokens/s overrules per-request estimates only once its tokens
    average two steps in a row: after a pause (tokens restart), one probe whose proposal was
    rejected does not keep a paying draft off until the next probe. (k = 1 only, so that no
    other k, unmeasured, stands in for the vetoed one.)"""
    from pagellm.spec_decode.measure import STALE_AFTER

    ctl = AdaptiveK(max_k=1, draft_cost=True)
    seq = Sequence(0, "0", 0, [1, 2], SamplingParams(), None)
    ctl.observe_draft(1, 0.0106)
    for _ in range(5):
        ctl.observe_decode_step(1, 0.023, 0, 1)
    for _ in range(6):  # k = 1 pays: 1.9 tokens in 0.039 s against 1 in 0.023
        ctl.observe_acceptance(seq, 1, 1)
        ctl.observe_decode_step(1, 0.039, 1, 1.9)
    for _ in range(STALE_AFTER + 1):
        ctl.observe_decode_step(1, 0.023, 0, 1)
    ctl.observe_acceptance(seq, 1, 0)  # the probe: its proposal rejected
    ctl.observe_decode_step(1, 0.039, 1, 1)
    walls = ctl.walls[1]
    assert walls.tokens[1] == 1 and walls.rate(1) == pytest.approx(1 / 0.039)
    assert walls.rate(1, 2) is None
    assert ctl.choose([seq]) == [1]  # still speculating
    ctl.observe_acceptance(seq, 1, 1)
    ctl.observe_decode_step(1, 0.039, 1, 2)
    assert walls.rate(1, 2) == pytest.approx((1 + 0.2 * 1) / 0.039)  # two steps: it counts


def test_rows_cost_what_plain_rows_cost_between_batch_sizes():
    """A draft with high acceptance at batch 8, no k measured at any batch size, rows
    compute-bound (a 1.5B's K-quant kernels: every row 10 ms, decoding or verified). Plain
    steps at 7 and 8 (a draining batch) say a row costs a whole plain-step row, and the
    controller never puts proposals on more than the one sequence of a probe. (With the
    prior's rows at a quarter of that, it verified k = 3 for all 8: measured at 9x a plain
    step on the real pair.)"""
    ctl = AdaptiveK(max_k=4, draft_cost=True)
    ctl.observe_draft(1, 0.02)
    for _ in range(3):
        ctl.observe_decode_step(7, 0.07, 0, 7, 0)
        ctl.observe_decode_step(8, 0.08, 0, 8, 0)
    assert ctl._row_cost(8, 0.02) == pytest.approx(1.0)
    assert ctl._row_cost(7, 0.02) == pytest.approx(1.0)  # the size above, where none below
    seqs = [Sequence(i, str(i), 0, [1, 2], SamplingParams(), None) for i in range(8)]
    for seq in seqs:
        for _ in range(5):
            ctl.observe_acceptance(seq, 4, 4)
    probes = 0
    for _ in range(200):
        ks = ctl.choose(seqs)
        assert sum(k > 0 for k in ks) <= 1
        probes += any(ks)
        ctl.observe_decode_step(8, 0.08 + 0.01 * sum(ks) + 0.02 * max(ks), max(ks), 8 + sum(ks),
                                sum(ks))
    assert probes  # it still probes (one sequence)


def test_plain_rows_never_price_a_row_below_the_prior():
    """Batch 1 keeps the cheap prior whatever plain steps say (its probes are timed, so a k
    gets tried, then measured). At batch 3, rows the plain steps call cheap cost the prior,
    a slope from noise (a larger batch measured faster) prices a draft's rows as plain-step
    rows, and a slow spell between two medians prices a row at 2 plain-step rows at most."""
    ctl = AdaptiveK(max_k=4, draft_cost=True)
    for _ in range(3):
        ctl.observe_decode_step(1, 0.025, 0, 1, 0)
        ctl.observe_decode_step(2, 0.030, 0, 2, 0)
    assert ctl._plain_row_cost(1) == pytest.approx(0.2)
    assert ctl._row_cost(1, 0.0) == _PRIOR_ROW_COST
    ctl.observe_decode_step(3, 0.0315, 0, 3, 0)  # 1.5 ms a row: 0.14 plain-step rows at 3
    assert ctl._row_cost(3, 0.0) == _PRIOR_ROW_COST
    slow, fast = AdaptiveK(max_k=4, draft_cost=True), AdaptiveK(max_k=4, draft_cost=True)
    for _ in range(3):
        slow.observe_decode_step(7, 0.050, 0, 7, 0)
        slow.observe_decode_step(8, 0.080, 0, 8, 0)  # 30 ms for one row: 3 plain-step rows
        fast.observe_decode_step(7, 0.085, 0, 7, 0)
        fast.observe_decode_step(8, 0.080, 0, 8, 0)
    assert slow._row_cost(8, 0.0) == 2.0
    assert fast._row_cost(8, 0.0) == _PRIOR_BATCH_ROW_COST


def test_a_draft_at_one_batch_size_prices_rows_as_plain_rows():
    """A batch of 8 that never drained: plain steps measured at 8 only, every proposal
    accepted. A draft's probes there verify one sequence untimed, so nothing would correct
    cheap rows: a row is priced as a plain-step row, and no step puts proposals on more than
    one sequence (with the prior's quarter-row, k = 3 for all 8 came at once). n-gram
    proposals keep the cheap prior: their probes are timed."""
    ctl = AdaptiveK(max_k=4, draft_cost=True)
    ctl.observe_draft(1, 0.011)
    for _ in range(3):
        ctl.observe_decode_step(8, 0.08, 0, 8, 0)
    assert ctl._row_cost(8, 0.011) == _PRIOR_BATCH_ROW_COST
    seqs = [Sequence(i, str(i), 0, [1, 2], SamplingParams(), None) for i in range(8)]
    for seq in seqs:
        for _ in range(5):
            ctl.observe_acceptance(seq, 4, 4)
    for _ in range(200):
        ks = ctl.choose(seqs)
        assert sum(k > 0 for k in ks) <= 1
        ctl.observe_decode_step(8, 0.08, max(ks), 8 + sum(ks), sum(ks))
    ngram = AdaptiveK(max_k=4, scores_unverified=True)
    ngram.observe_decode_step(8, 0.08, 0, 8, 0)
    assert ngram._row_cost(8, 0.0) == _PRIOR_ROW_COST


def test_draft_rounds_in_seconds_meet_walls_in_units_of_the_speed():
    """Walls are kept in units of the machine's speed, a draft round in seconds now. Measured
    at speed 1: a plain step 50 ms, k = 2 100 ms (two 20 ms rounds, two rows of 5 ms). The
    machine then runs at half speed (speed 2) and a round takes 40 ms: still 20 ms of the
    walls' units, so a row still costs 0.1 plain-step rows, and an unmeasured k adds its
    rounds at 20 ms of units each (seconds taken as units: no row cost left, 40 ms rounds)."""
    ctl = AdaptiveK(max_k=4, draft_cost=True)
    for _ in range(3):
        ctl.observe_decode_step(1, 0.050, 0, 1, 0)
        ctl.observe_decode_step(1, 0.100, 2, 2, 2)
    walls = ctl.walls[1]
    walls.speed, ctl.draft_round_s = 2.0, 0.040
    assert walls.row_cost(1, 0.040) == pytest.approx(0.1)
    assert ctl.step_wall(1, 3, 3) == pytest.approx(0.050 + 0.1 * 3 * 0.050 + 3 * 0.020)


def test_turning_a_drafts_sequences_on_in_a_batch_pays_their_catch_ups():
    """Batch 4, a draft whose k = 1 steps pay (measured): a step that turns sequences on is
    charged each one's catch-up on its context (the draft's shadow of a sequence it skipped
    first prefills what was emitted meanwhile); sequences already on are not. With a dear
    catch-up the batch stays off rather than flip sequences on and off."""
    def controller(catchup: float) -> AdaptiveK:
        ctl = AdaptiveK(max_k=1, draft_cost=True)
        ctl.prior_alpha = ctl.alpha = 0.9
        ctl.observe_draft(1, 0.002)
        for _ in range(5):
            ctl.observe_decode_step(4, 0.040, 0, 4, 0)
            ctl.observe_decode_step(4, 0.046, 1, 7.6, 4)  # +15% time, +90% tokens
        if catchup:
            ctl.observe_catchup(catchup)
        return ctl

    seqs = [Sequence(i, str(i), 0, [1, 2], SamplingParams(), None) for i in range(4)]
    ctl = controller(0.5)
    alphas = [0.9] * 4
    _, _, off_now = ctl._plan(4, 1, alphas, [1] * 4, [0] * 4, [True] * 4)
    _, _, on_now = ctl._plan(4, 1, alphas, [1] * 4, [0] * 4, [False] * 4)
    assert off_now == pytest.approx(on_now + 4 * 0.5 / ctl.walls[4].speed)
    assert ctl.choose(seqs) == [0] * 4  # 2 s of catch-ups for a 6 ms gain
    cheap = controller(0.0)
    assert cheap.choose(seqs) == [1] * 4
    cheap.observe_catchup(0.5)  # now dear, but every sequence is already on: it stays on
    assert cheap.choose(seqs) == [1] * 4
