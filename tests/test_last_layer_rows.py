"""The model's last layer carries only the rows the step samples past its attention
(model_runner._prunable, LlamaForCausalLM.forward's out_rows): the same tokens and
log-probabilities as carrying every row (bit for bit through the native q32 layers), on each
layer path (the one-call stack, the q32 and oneDNN wide layers, the fused few-row layer, the
module path). Every row's K and V are still written: the decode steps after each prompt
attend over them."""
from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.engine import model_runner
from pagellm.kernels import native
from pagellm.layers import onednn, q32
from pagellm.models.llama import LlamaForCausalLM

# 9 prompts of 3-130 words over 64-token steps, the longest first: whole prompts, prompts
# split into chunks (a step of only a chunk that ends mid-prompt samples nothing), and decode
# rows beside prefill rows
_WORDS = ("river town morning boats water children school bank sun fishermen market bread "
          "lamp window road").split()
PROMPTS = [" ".join(_WORDS[(i * 5 + j) % len(_WORDS)] for j in range(n))
           for i, n in enumerate((130, 3, 40, 7, 12, 65, 5, 90, 20))]


def _run(llm, monkeypatch, prune: bool, prompts):
    """Outputs of the prompts, and for each forward its (rows, rows carried past the last
    layer's attention)."""
    steps = []
    orig = LlamaForCausalLM.forward

    def forward(self, input_ids, positions, md, num_layers=None, out_rows=None):
        hidden = orig(self, input_ids, positions, md, num_layers, out_rows)
        steps.append((input_ids.shape[0], hidden.shape[0]))
        assert hidden.shape[0] == (input_ids.shape[0] if out_rows is None else out_rows.numel())
        return hidden

    with monkeypatch.context() as m:
        m.setattr(LlamaForCausalLM, "forward", forward)
        if not prune:
            m.setattr(model_runner, "_prunable", lambda rows, n: False)
        sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=3)
        outs = llm.generate(prompts, sp, use_tqdm=False)
    return outs, steps


def _same_outputs_and_fewer_rows(llm, monkeypatch, prompts=PROMPTS, exact: bool = True):
    """exact: the same bits (the native q32 products compute each row alike whatever the
    rows beside it); else within float32 rounding (PyTorch's and oneDNN's float products may
    sum a row in another order for another number of rows)."""
    pruned, steps = _run(llm, monkeypatch, True, prompts)
    full, full_steps = _run(llm, monkeypatch, False, prompts)
    assert all(n == kept for n, kept in full_steps)
    # prefill steps carried only their sampled rows (a chunk ending mid-prompt: none of them)
    assert any(kept < n for n, kept in steps) and any(kept == 0 for n, kept in steps), steps
    for a, b in zip(pruned, full):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        if exact:
            assert a.outputs[0].logprobs == b.outputs[0].logprobs
            continue
        for got, ref in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert got.keys() == ref.keys()
            assert all(abs(got[t] - ref[t]) < 1e-4 for t in ref), (got, ref)
    return steps


def _default_engine():
    # no prefix cache: the two runs must compute the same steps
    return LLM(dtype="auto", kv_cache_memory="64MiB", block_size=8, max_num_seqs=16,
               max_num_batched_tokens=64, enable_prefix_caching=False)


@pytest.mark.skipif(not q32.available(), reason="needs the q32 products (AVX-512 VNNI, bf16 units)")
def test_one_call_stack_and_its_layers_carry_only_the_sampled_rows(monkeypatch):
    """The default model's layers are all one-call q32 layers: the stack (wide_layers_q32)
    and then the per-layer calls (wide_layer_q32) move the sampled rows to the front."""
    from pagellm.kernels import cpu_wide_layer

    llm = _default_engine()
    model = llm.engine.model
    calls = []
    lib = native.library()
    for name in ("wide_layers_q32", "wide_layer_q32"):
        def spy(*args, _f=getattr(lib, name), _name=name):
            calls.append((_name, args[-2]))  # the rows carried (-1: all)
            return _f(*args)
        monkeypatch.setattr(lib, name, spy, raising=False)
    try:
        assert isinstance(model.wide_stack, cpu_wide_layer.WideStack)
        steps = _same_outputs_and_fewer_rows(llm, monkeypatch)
        stack_calls = list(calls)
        model.wide_stack, stack = None, model.wide_stack
        calls.clear()
        _same_outputs_and_fewer_rows(llm, monkeypatch)
        model.wide_stack = stack
    finally:
        llm.shutdown()
    assert {n for n, _ in stack_calls} == {"wide_layers_q32"}
    assert any(kept > 0 for _, kept in stack_calls) and any(kept == 0 for _, kept in stack_calls)
    # layer by layer: only the last layer was asked to carry fewer rows, once a pruned step
    assert {n for n, _ in calls} == {"wide_layer_q32"} and any(kept > 0 for _, kept in calls)
    n_layers = len(model.layers)
    assert len(calls) % n_layers == 0
    for i in range(0, len(calls), n_layers):
        assert all(kept == -1 for _, kept in calls[i:i + n_layers - 1])


@pytest.mark.skipif(not (native.available() and onednn.bf16_runs()),
                    reason="no C compiler, or no oneDNN bf16 on this CPU")
def test_onednn_wide_layer_carries_only_the_sampled_rows(monkeypatch):
    """The wide layer of oneDNN bf16 products (layers without q32 forms)."""
    from pagellm.layers import linear

    monkeypatch.setattr(linear, "UPCAST_BF16", False)
    monkeypatch.setattr(linear, "USE_INT8", False)
    llm = LLM(dtype="bfloat16", kv_cache_memory="64MiB", block_size=8, max_num_seqs=16,
              max_num_batched_tokens=64, enable_prefix_caching=False)
    model = llm.engine.model
    model.wide_stack = None
    for layer in model.layers:
        assert layer.wide_layer is not None
        layer.wide_layer._q32 = None
    from pagellm.kernels import cpu_wide_layer

    mlp_rows, last = [], model.layers[-1].mlp.gate_up_proj
    gated = cpu_wide_layer.gate_up_silu_bf16

    def spy(proj, h):
        if proj is last:
            mlp_rows.append(h.shape[0])
        return gated(proj, h)

    monkeypatch.setattr(cpu_wide_layer, "gate_up_silu_bf16", spy)
    try:
        steps = _same_outputs_and_fewer_rows(llm, monkeypatch, exact=False)
    finally:
        llm.shutdown()
    assert any(kept < n and kept in mlp_rows for n, kept in steps), (steps, mlp_rows)


def test_module_path_carries_only_the_sampled_rows(tiny_llama, monkeypatch):
    """A float32 model on the module path (no native layer forms): the last layer's o
    projection and MLP see only the sampled rows."""
    path, _ = tiny_llama
    llm = LLM(path, dtype="float32", kv_cache_memory=2**22, block_size=8, max_num_seqs=16,
              max_num_batched_tokens=64, enable_prefix_caching=False)
    model = llm.engine.model
    model.wide_stack = None
    for layer in model.layers:
        layer.fused = layer.wide_layer = None
    mlp_rows = []
    last = model.layers[-1]
    monkeypatch.setattr(last.mlp, "forward",
                        lambda x, _f=last.mlp.forward: mlp_rows.append(x.shape[0]) or _f(x))
    vocab = llm.engine.vocab_size
    prompts = [[(i * 7 + j * 3) % vocab for j in range(len(p.split()))]
               for i, p in enumerate(PROMPTS)]  # the tiny model has no tokenizer
    try:
        steps = _same_outputs_and_fewer_rows(llm, monkeypatch, prompts, exact=False)
    finally:
        llm.shutdown()
    assert any(kept < n and kept in mlp_rows for n, kept in steps), (steps, mlp_rows)
    assert max(mlp_rows) == 64  # the unpruned run's


def test_only_strictly_increasing_rows_of_one_process_are_pruned(monkeypatch):
    assert model_runner._prunable([3, 9], 10)
    assert not model_runner._prunable(list(range(10)), 10)  # every row: nothing to leave out
    assert not model_runner._prunable([9, 3], 10) and not model_runner._prunable([3, 3], 10)
    from pagellm import parallel

    monkeypatch.setattr(parallel, "tp_size", lambda: 2)
    assert not model_runner._prunable([3, 9], 10)
