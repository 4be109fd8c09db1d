"""Shared fixtures: tiny random models written to disk, and the leak check after every test."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from pagellm.engine import llm_engine

_ENGINES: list[weakref.ref] = []  # engines made since the last leak check
_LIVE: weakref.WeakSet = weakref.WeakSet()  # every engine still alive (module fixtures too)
_original_init = llm_engine.LLMEngine.__init__


def _tracking_init(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    _ENGINES.append(weakref.ref(self))
    _LIVE.add(self)


llm_engine.LLMEngine.__init__ = _tracking_init

# Tiny test models run much faster on one thread than with OpenMP spread over busy cores.
torch.set_num_threads(1)
# Everything imported so far lives for the whole run: keep it out of the collector's scans,
# so the leak check's gc.collect() stays cheap.
gc.freeze()


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


@pytest.fixture(autouse=True)
def leak_check():
    """After every test, every engine still alive is checked: those the test made and those a
    module- or session-scoped fixture made before it (and that this test used)."""
    yield
    created = bool(_ENGINES)
    for engine in list(_LIVE):
        assert_no_leaks(engine)
    _ENGINES.clear()
    if created:
        gc.collect()  # free the engine's KV pool before the next test allocates its own


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


def make_tiny_model(path, arch: str = "llama", **overrides):
    """Write a tiny random model of the given architecture to `path`; return the HF model."""
    import transformers

    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    kwargs = {**TINY, "eos_token_id": 2, "bos_token_id": 1, **overrides}
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**kwargs)).eval().float()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    return str(path), make_tiny_model(path, "llama")
