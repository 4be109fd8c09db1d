"""Helpers the test modules share: tiny random models, the leak assertion, thread runs.

A plain module (conftest.py is loaded by pytest itself; importing it from a test module made
a second copy that wrapped LLMEngine.__init__ a second time)."""
from __future__ import annotations

import torch


def assert_no_leaks(engine) -> None:
    """Every block is back in the pool (free or reusable-cached) and no request is left."""
    bm = engine.block_manager
    assert not engine.requests, f"requests left: {list(engine.requests)}"
    assert bm.num_free_blocks == bm.num_blocks, (
        f"leaked {bm.num_blocks - bm.num_free_blocks} of {bm.num_blocks} blocks")
    assert all(b.ref_cnt == 0 for b in bm.blocks)
    draft_bm = getattr(getattr(engine.spec, "proposer", None), "block_manager", None)
    if draft_bm is not None:
        assert draft_bm.num_free_blocks == draft_bm.num_blocks, "draft cache leaked blocks"


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)


def outputs_on_one_and_two_threads(fn, *args):
    """fn(*args) computed with 1 and with 2 torch threads (the kernels split outputs between
    threads; callers assert both are bit-identical)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fn(*args)
        torch.set_num_threads(2)
        two = fn(*args)
    finally:
        torch.set_num_threads(before)
    return one, two


def layer_path_and_module_path(layer, attr: str, path, positions, x, md, out_rows=None):
    """A native form of a decoder layer (`path`, kept as layer.<attr>) and the module path on
    the same input and KV cache: (path's output, the module path's, path's K and V caches).
    The native form runs first, on the cache as the step found it (run second, the module
    path's own writes would hide one that wrote none); the module path then runs from that
    cache with layer.<attr> off, and leaves its own K/V in the layer's caches. With out_rows
    (the last layer's rows carried past its attention), path's output is compared with those
    rows of the module path's over every row: the values they have without out_rows (the
    module path's own pruning would multiply fewer rows, which may take a few-row kernel)."""
    attn = layer.self_attn
    before = attn.k_cache.clone(), attn.v_cache.clone()
    inp = x.clone()
    out = (path(positions, x, md) if out_rows is None
           else path(positions, x, md, out_rows)).clone()
    path_kv = attn.k_cache.clone(), attn.v_cache.clone()
    attn.k_cache.copy_(before[0])
    attn.v_cache.copy_(before[1])
    kept = getattr(layer, attr)
    setattr(layer, attr, None)
    try:
        ref = layer(positions, inp, md)
        if out_rows is not None:
            ref = ref.index_select(0, out_rows)
    finally:
        setattr(layer, attr, kept)
    return out, ref, path_kv


def make_tiny_model(path, arch: str = "llama", **overrides):
    """Write a tiny random model of the given architecture to `path`; return the HF model."""
    import transformers

    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM),
    }[arch]
    kwargs = {**TINY, "eos_token_id": 2, "bos_token_id": 1, **overrides}
    if arch == "smollm3":  # its default pad id (128004) is past a tiny vocabulary
        kwargs.setdefault("pad_token_id", 0)
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**kwargs)).eval().float()
    model.save_pretrained(path)
    return model


def hf_greedy(model, prompt, n):
    """transformers' greedy continuation of `prompt`: n tokens, EOS ignored."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt):].tolist()


def assert_greedy_close(ref, got, tol: float) -> None:
    """Two greedy CompletionOutputs (with logprobs=2 or more): at every position the chosen
    token's log-probability agrees within tol, and the tokens are equal, except from a
    position where the reference's choice led its runner-up by less than 2 * tol (a near-tie
    either run may break; the continuations may differ from there on)."""
    for i, (a, b) in enumerate(zip(ref.logprobs, got.logprobs)):
        tok = ref.token_ids[i]
        if got.token_ids[i] != tok:
            margin = a[tok] - max(v for t, v in a.items() if t != tok)
            assert margin < 2 * tol, (i, margin, ref.token_ids, got.token_ids)
            return
        assert abs(a[tok] - b[tok]) < tol, (i, a, b)
    assert list(got.token_ids) == list(ref.token_ids)


def fused_layer_diffs(llm, prompts, max_tokens: int = 6) -> tuple[list[float], list[float]]:
    """Generate greedily with every layer's one-call form (layer.fused) checked against the
    module path on each step (layer_path_and_module_path): (each call's output difference,
    and its K/V's, relative to the module path's largest value)."""
    from pagellm import SamplingParams

    diffs, kv_diffs = [], []

    class Compare:
        def __init__(self, layer):
            self.layer, self.fused = layer, layer.fused

        def usable(self, x, md):
            return self.fused.usable(x, md)

        def __call__(self, positions, x, md):
            attn = self.layer.self_attn
            out, ref, kv = layer_path_and_module_path(self.layer, "fused", self.fused, positions,
                                                      x, md)
            diffs.append(((out - ref).abs().max() / ref.abs().max()).item())
            slots = md.slot_mapping.long()
            for got, cache in zip(kv, (attn.k_cache, attn.v_cache)):
                want = cache.flatten(0, 1)[slots].float()
                kv_diffs.append(((got.flatten(0, 1)[slots].float() - want).abs().max()
                                 / want.abs().max()).item())
            return out

    layers = [layer for layer in llm.engine.model.layers if layer.fused is not None]
    for layer in layers:
        layer.fused = Compare(layer)
    try:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                     use_tqdm=False)
    finally:
        for layer in layers:
            layer.fused = layer.fused.fused
    return diffs, kv_diffs
