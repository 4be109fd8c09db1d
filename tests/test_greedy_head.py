"""The greedy LM head (kernels/cpu_greedy_head.c, layers/greedy_head.py): the argmax of its
logits is the exact (float64) product's for every row, equal maxima going to the first index
as torch.argmax sends them; every other logit stays within the int8 activations' bound; one
and two threads give the same bits; the engine takes it for steps whose every row reads only
its argmax (`sampler.reads_argmax_only`), and for no other step."""
from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.layers import greedy_head, quant
from pagellm.sampling.sampler import reads_argmax_only
from tests.helpers import outputs_on_one_and_two_threads

needs_kernel = pytest.mark.skipif(not greedy_head.available(),
                                  reason="needs AVX-512 VNNI and bf16 units (and a C compiler)")


def _q8_head(n: int, k: int, seed: int) -> quant.NativeQ8:
    """A random Q8_0 head: codes in [-127, 127], fp16 scales of a few magnitudes."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, k // 32, generator=g) * 0.004 + 1e-4).half().float()
    return quant.NativeQ8(quant.Int8Blocks(q, scale))


def _exact(h: torch.Tensor, head: quant.NativeQ8) -> torch.Tensor:
    n, k = head.codes.shape
    w = (head.codes.double().view(n, k // 32, 32) * head.scale.double()[..., None]).view(n, k)
    return h.double() @ w.t()


def _hidden(rows: int, k: int, seed: int) -> torch.Tensor:
    """Normal values with a few large channels, as hidden states have."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, k, generator=g)
    h[:, 5] *= 30
    h[:, k // 2] *= -12
    return h


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 6, 13, 64])
@pytest.mark.parametrize("n", [96, 1000])  # 1000: a last panel of 8 outputs
def test_the_argmax_is_the_exact_products(rows, n):
    head = _q8_head(n, 128, seed=rows + n)
    h = _hidden(rows, 128, seed=rows)
    greedy = greedy_head.GreedyHeadQ8(head)
    logits = greedy(h)
    exact = _exact(h, head)
    assert logits.shape == (rows, n) and logits.dtype == torch.float32
    assert torch.equal(logits.argmax(dim=1), exact.argmax(dim=1))
    assert torch.equal(greedy.last_ids, exact.argmax(dim=1))
    assert bool((greedy.last_counts >= 1).all())  # the largest y itself is always computed


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows,n", [(1, 96), (7, 1000), (64, 1000), (13, 4096)])
def test_ids_only_gives_the_same_argmax_and_counts_without_logits(rows, n, threads):
    """ids_only recomputes the few panels each row's search reads instead of keeping [R, N]
    logits: the same ids and the same outputs computed exactly, row for row."""
    head = _q8_head(n, 128, seed=7 * rows + n)
    h = _hidden(rows, 128, seed=rows + 1)
    greedy = greedy_head.GreedyHeadQ8(head)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        logits = greedy(h)
        ids_full, counts_full = greedy.last_ids.clone(), greedy.last_counts.clone()
        ids = greedy(h, ids_only=True)
    finally:
        torch.set_num_threads(before)
    assert ids.shape == (rows,) and ids.dtype == torch.int64
    assert torch.equal(ids, ids_full) and torch.equal(ids, logits.argmax(dim=1))
    assert torch.equal(ids, _exact(h, head).argmax(dim=1))
    assert torch.equal(greedy.last_counts, counts_full)


@needs_kernel
def test_equal_maxima_go_to_the_first_index_and_near_ties_to_the_larger():
    head = _q8_head(300, 64, seed=3)
    codes, scale = head.codes.clone(), torch.full((300, 2), 0.002).half().float()
    codes[250] = codes[40]  # 40 and 250: the same output
    codes[260] = codes[41]  # 41 and 260: one code apart
    codes[41, 0], codes[260, 0] = 20, 21
    head = quant.NativeQ8(quant.Int8Blocks(codes, scale))
    w = head.codes.float() * scale[0, 0]
    # row 0 points at output 250 (its twin 40 comes first); row 1 at 260, whose one larger
    # code puts it 21 * 0.002^2 above 41: far inside the int8 values' error
    h = torch.stack([w[250], w[260]])
    greedy = greedy_head.GreedyHeadQ8(head)
    logits = greedy(h)
    exact = _exact(h, head)
    assert exact[0, 40] == exact[0, 250] == exact[0].max()
    assert int(exact[1].argmax()) == 260 and 0 < float(exact[1, 260] - exact[1, 41]) < 1e-4
    assert logits.argmax(dim=1).tolist() == [40, 260]
    assert int(greedy.last_counts[1]) >= 2
    assert greedy(h, ids_only=True).tolist() == [40, 260]  # its tie check without logits


@needs_kernel
def test_the_other_logits_stay_within_the_int8_bound():
    head = _q8_head(700, 256, seed=5)
    h = _hidden(20, 256, seed=6)
    logits = greedy_head.GreedyHeadQ8(head)(h).double()
    exact = _exact(h, head)
    n, k = head.codes.shape
    a = (head.codes.double().abs().view(n, k // 32, 32).sum(-1) * head.scale.double())  # [N, G]
    step = h.double().abs().view(20, k // 32, 32).amax(-1) / 127  # [R, G]
    bound = 0.5002 * step @ a.t() + 1e-6 * exact.abs() + 1e-9  # and float32's rounding
    assert bool(((logits - exact).abs() <= bound).all())
    assert float((logits - exact).abs().max()) > 0  # the int8 values, not exact ones


@needs_kernel
def test_one_and_two_threads_give_the_same_bits():
    head = greedy_head.GreedyHeadQ8(_q8_head(1000, 128, seed=7))
    h = _hidden(30, 128, seed=8)
    one, two = outputs_on_one_and_two_threads(head, h)
    assert torch.equal(one, two)


@needs_kernel
def test_a_hidden_value_that_is_not_finite_leaves_it_to_the_other_head():
    head = greedy_head.GreedyHeadQ8(_q8_head(96, 64, seed=9))
    h = _hidden(8, 64, seed=10)
    h[3, 7] = float("nan")
    assert head(h) is None
    h[3, 7] = float("inf")
    assert head(h) is None


@needs_kernel
def test_rows_where_no_bound_holds_leave_it_to_the_other_head():
    """A block of subnormal values, or of normal ones below 127 / FLT_MAX (~3.7e-37: 127 / its
    largest overflows either way), and finite values whose products overflow float32 give no
    bound on the int8 products: the other head runs. A head with a non-finite scale gets no
    greedy form (the model loads without one)."""
    head = greedy_head.GreedyHeadQ8(_q8_head(96, 64, seed=11))
    for tiny in (1e-39, 1e-37):  # subnormal; normal (above FLT_MIN ~1.2e-38) but too small
        h = _hidden(4, 64, seed=12)
        h[2, :32] = tiny
        assert head(h) is None, tiny
    h = _hidden(4, 64, seed=12)
    h[1] = 3e38  # finite, but its products overflow
    assert head(h) is None
    ok, q8 = _hidden(4, 64, seed=12), _q8_head(96, 64, seed=11)
    assert torch.equal(head(ok).argmax(-1), _exact(ok, q8).argmax(-1))
    assert greedy_head.GreedyHeadQ8.supports(q8)
    q8.scale[5, 1] = float("inf")
    assert not greedy_head.GreedyHeadQ8.supports(q8)


def test_only_rows_that_read_their_argmax_alone_qualify():
    greedy = SamplingParams(temperature=0.0)
    assert reads_argmax_only(greedy, 0, constrained=False)
    assert not reads_argmax_only(SamplingParams(temperature=0.7), 0, False)
    assert not reads_argmax_only(SamplingParams(temperature=0.0, logprobs=2), 0, False)
    assert not reads_argmax_only(SamplingParams(temperature=0.0, logit_bias={3: 5.0}), 0, False)
    assert not reads_argmax_only(SamplingParams(temperature=0.0, repetition_penalty=1.2), 0, False)
    assert not reads_argmax_only(SamplingParams(temperature=0.0, presence_penalty=0.5), 0, False)
    assert not reads_argmax_only(greedy, 0, constrained=True)
    at_least = SamplingParams(temperature=0.0, min_tokens=3)
    assert not reads_argmax_only(at_least, 2, False)  # its end tokens are still masked
    assert reads_argmax_only(at_least, 3, False)


@needs_kernel
def test_the_engine_takes_it_for_argmax_only_steps_and_gets_the_exact_argmax():
    """The default model (its Q8_0 head): 12 greedy requests decode through the greedy head,
    each step's tokens the exact product's argmax of the step's hidden states; a step with one
    request asking for logprobs does not take it."""
    llm = LLM(kv_cache_memory="64MiB")
    model = llm.engine.model
    assert model.head_greedy is not None
    calls = []
    real = model.head_greedy

    class Spy:
        def __call__(self, hidden, ids_only=False):
            out = real(hidden, ids_only=ids_only)
            calls.append((hidden.clone(), out if ids_only else out.argmax(dim=1)))
            return out

        nbytes = real.nbytes

    model.head_greedy = Spy()
    prompts = [[1, 2 + i, 30 + 3 * i, 7, 400 + i] for i in range(12)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    assert len(calls) >= 4  # the decode steps (12 rows each); the prefill's too
    for hidden, ids in calls:
        assert torch.equal(ids, _exact(hidden, model.head_packed).argmax(dim=1))
    decode_ids = [ids for hidden, ids in calls if hidden.shape[0] == 12]
    assert [o.outputs[0].token_ids[-1] for o in outs] == decode_ids[-1].tolist()
    calls.clear()
    params = [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                             logprobs=1 if i == 0 else None)
              for i in range(12)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert calls == [] and outs[0].outputs[0].logprobs is not None


@pytest.mark.parametrize("model", ["tiny", "default"])
def test_all_greedy_steps_get_their_tokens_not_logits(model, tmp_path, monkeypatch):
    """The engine asks each step for its tokens (ModelRunner.execute(ids=True)): a step whose
    every row reads only its argmax returns them, [rows] int64, through the greedy head where
    the model has one (the default model) or the argmax of the logits (a tiny float32 model);
    a step with a row that reads more (a sampled row, logprobs) gets logits. The tokens are
    those of the logits path, for a mix of such requests."""
    from pagellm.engine.model_runner import ModelRunner
    from tests.helpers import make_tiny_model

    if model == "tiny":
        make_tiny_model(tmp_path)
        llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory="16MiB")
    else:
        llm = LLM(kv_cache_memory="64MiB")
    llm.engine.runner.packed_rows = None  # no path chosen by timing: runs comparable
    prompts = [[1, 2 + i, 30 + 3 * i, 7, 40 + i] for i in range(12)]  # 12: the greedy head's
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    mixed = [greedy] * 11 + [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                           logprobs=1)]

    def run(params, ids_allowed: bool):
        kinds = []
        real = ModelRunner.execute

        def execute(self, out, rows, *, constrained=None, ids=False):
            res = real(self, out, rows, constrained=constrained, ids=ids and ids_allowed)
            kinds.append(res.dim())
            return res

        with monkeypatch.context() as m:
            m.setattr(ModelRunner, "execute", execute)
            outs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], kinds

    head_calls = []
    if model == "default" and greedy_head.available():  # its ids, with no logits made
        real_head = greedy_head.GreedyHeadQ8.__call__

        def spy(self, hidden, ids_only=False):
            head_calls.append(ids_only)
            return real_head(self, hidden, ids_only=ids_only)

        monkeypatch.setattr(greedy_head.GreedyHeadQ8, "__call__", spy)
    tokens, kinds = run(greedy, True)
    assert set(kinds) == {1} and len(kinds) >= 6
    if head_calls:
        assert set(head_calls) == {True} and len(head_calls) >= 6
    assert tokens == run(greedy, False)[0]
    assert model == "tiny" or not greedy_head.available() or False in head_calls
    tokens, kinds = run(mixed, True)
    assert set(kinds) == {2}  # the logprobs row reads more than its argmax
    assert tokens == run(mixed, False)[0]
