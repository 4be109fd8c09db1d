"""Gemma 2, Gemma 3 and Qwen3 on tiny random models built here, against transformers holding
the same weights: Hugging Face folders and GGUF files (K-quant and legacy blocks, llama.cpp's
names, Gemma's norms stored as 1 + weight), float32 logits and greedy tokens past Gemma's
sliding window (prompts, decode, chunked prefill, cached prefixes, speculative verification
rows), Gemma 2's soft-capped scores and logits, the packed bfloat16 path within its
tolerance, the fused few-row layer against the module path, and what is refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from pagellm import LLM, SamplingParams
from pagellm.kernels import native
from pagellm.models.gemma import Gemma3ForCausalLM
from tests.gguf_files import finish, gguf_name, gguf_writer, random_blocks
from tests.helpers import assert_greedy_close, fused_layer_diffs
from tests.test_gguf_models import _hf_logits, _prefill_logits

WINDOW = 8
# prompts longer than the window, one shorter; every decode step past it
PROMPTS = [[5, 17, 33, 4, 90, 12, 7], list(range(10, 51)), [3, 3, 3, 60, 61, 62, 9, 9, 70, 71, 72, 3]]
NEW = 20


_SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=256, eos_token_id=2,
              bos_token_id=1)
# a GGUF file's K-quant rows are 256 values
_GGUF_SIZES = dict(hidden_size=256, intermediate_size=512, head_dim=64)


def _gemma3_config(layer_types, linear: bool = False, **kw):
    """linear: the global layers' rotary scaled (factor 8, as Gemma 3 4B-27B's)."""
    kw = {**_SIZES, "query_pre_attn_scalar": 24, **kw}
    full = ({"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6} if linear
            else {"rope_type": "default", "rope_theta": 1e6})
    return transformers.Gemma3TextConfig(
        num_hidden_layers=len(layer_types), sliding_window=WINDOW, layer_types=layer_types,
        architectures=["Gemma3ForCausalLM"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": full}, **kw)


def _gemma2_config(layer_types, **kw):
    """Caps small enough to bend a tiny model's scores, which are ~0.03 (Gemma 2's own: 50, 30);
    transformers' eager attention, the one that applies the cap."""
    kw = {**_SIZES, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 0.02,
          "final_logit_softcapping": 3.0, **kw}
    return transformers.Gemma2Config(
        num_hidden_layers=len(layer_types), sliding_window=WINDOW, layer_types=layer_types,
        architectures=["Gemma2ForCausalLM"], attn_implementation="eager",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **kw)


def _qwen3_config(**kw):
    return transformers.Qwen3Config(num_hidden_layers=2, architectures=["Qwen3ForCausalLM"],
                                    tie_word_embeddings=False, **{**_SIZES, **kw})


def _random_model(config):
    """transformers' model of config with random weights, its norms far from their initial
    values (Gemma's zeros, Qwen's ones), so that a norm read wrongly shows."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval().float()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


def _folder(tmp_path_factory, arch: str):
    config = (_gemma3_config(["sliding_attention", "sliding_attention", "full_attention",
                              "sliding_attention"], linear=True) if arch == "gemma3"
              else _gemma2_config(["sliding_attention", "full_attention"] * 2) if arch == "gemma2"
              else _qwen3_config())
    model = _random_model(config)
    path = tmp_path_factory.mktemp(arch)
    model.save_pretrained(path)
    return str(path), model


@pytest.fixture(scope="module", params=["gemma3", "qwen3", "gemma2"])
def hf_folder(request, tmp_path_factory):
    return _folder(tmp_path_factory, request.param)


@pytest.fixture(scope="module", params=["gemma3", "gemma2"])
def gemma_folder(request, tmp_path_factory):
    return _folder(tmp_path_factory, request.param)


def _greedy_reference(model, prompt, n=NEW):
    ids = torch.tensor([prompt])
    return model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                          attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist()


def _assert_matches(llm, hf) -> None:
    """Prefill logits within float32 rounding of transformers', and its greedy tokens."""
    for prompt in PROMPTS:
        ref = _hf_logits(hf, prompt)
        torch.testing.assert_close(_prefill_logits(llm, prompt), ref, atol=1e-4 * ref.abs().max(),
                                   rtol=1e-4)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == _greedy_reference(hf, prompt)


def test_float32_logits_and_greedy_tokens_match_transformers(hf_folder):
    path, hf = hf_folder
    llm = LLM(path, dtype="float32", kv_cache_memory=2**22)
    if isinstance(llm.engine.model, Gemma3ForCausalLM):  # the window does not cap the context
        assert llm.engine.max_model_len == 256
    _assert_matches(llm, hf)


def test_gemmas_window_matters_and_holds_in_chunks_and_cached_prefixes(gemma_folder, monkeypatch):
    """The same model attending over everything gives other tokens (the test sees the window);
    a prompt prefilled in chunks of 5 (chunks after cached keys, rows whose windows start at
    different keys), then again over its cached prefix, then with n-gram verification rows:
    the reference's tokens each time."""
    path, hf = gemma_folder
    prompt = PROMPTS[1]
    want = _greedy_reference(hf, prompt, 30)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    chunked = LLM(path, dtype="float32", kv_cache_memory=2**22, max_num_batched_tokens=5)
    for cached in (False, True):  # the second over the first's cached blocks
        out = chunked.generate([prompt], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want and (out.num_cached_tokens > 0) == cached
    spec = LLM(path, dtype="float32", kv_cache_memory=2**22,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    repetitive = [7, 8, 9, 10] * 6
    assert (spec.generate([repetitive], params, use_tqdm=False)[0].outputs[0].token_ids
            == _greedy_reference(hf, repetitive, 30))
    for layer in chunked.engine.model.layers:
        monkeypatch.setattr(layer.self_attn, "window", None)
    assert chunked.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids != want


def test_gemma2s_soft_caps_matter(tmp_path_factory, monkeypatch):
    """Gemma 2's caps are what matches transformers: without either the log-probabilities
    differ (without the logits' cap the greedy tokens do not: it keeps each row's order)."""
    path, hf = _folder(tmp_path_factory, "gemma2")
    llm = LLM(path, dtype="float32", kv_cache_memory=2**22, enable_prefix_caching=False)
    prompt = PROMPTS[1]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=1)
    capped = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert capped.token_ids == _greedy_reference(hf, prompt)
    monkeypatch.setattr(llm.engine.model, "final_softcap", None)
    uncapped = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert uncapped.token_ids == capped.token_ids
    lp = lambda out: [d[t] for d, t in zip(out.logprobs, out.token_ids)]  # noqa: E731
    assert max(abs(a - b) for a, b in zip(lp(capped), lp(uncapped))) > 1e-2
    for layer in llm.engine.model.layers:
        monkeypatch.setattr(layer.self_attn, "softcap", None)
    scores_uncapped = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    # a draft's limited vocabulary: ids past it stay -inf through the cap (never drawn)
    model = llm.engine.model
    monkeypatch.setattr(model, "final_softcap", 3.0)
    model.limit_vocab(16)
    logits = model.compute_logits(torch.randn(2, model.config.hidden_size))
    model.limit_vocab(None)
    assert torch.isinf(logits[:, 16:]).all() and torch.isfinite(logits[:, :16]).all()
    # (the attention moves a tiny random model's logits little: 6e-3 here, float32's noise 1e-5)
    assert max(abs(a - b) for a, b in zip(lp(uncapped), lp(scores_uncapped))) > 1e-3


# GGUF: llama.cpp's names, in block types of a Q4_K_M file's mix
_TYPES = {"q_proj": Q.Q5_0, "k_proj": Q.Q5_0, "v_proj": Q.Q8_0, "o_proj": Q.Q4_K,
          "gate_proj": Q.Q4_K, "up_proj": Q.Q5_0, "down_proj": Q.Q6_K}
_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_GEMMA_NAMES = {**_NAMES, "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
_QWEN_NAMES = {**_NAMES, "post_attention_layernorm": "ffn_norm"}


def write_gguf(path, arch: str, key_length: int | None = None):
    """A random model of `arch` (gemma3: four layers, every second one global as the file's
    sliding_window_pattern says; the scores scaled by head_dim ** -0.5 as llama.cpp reads
    Gemma) in blocks; returns transformers' model holding exactly the values the file means.
    key_length: the head width the header states (default: the tensors')."""
    if arch == "gemma3":
        config = _gemma3_config(["sliding_attention", "full_attention"] * 2,
                                **_GGUF_SIZES, query_pre_attn_scalar=64)
    elif arch == "gemma2":  # every other layer local, the first too, as llama.cpp reads it
        config = _gemma2_config(["sliding_attention", "full_attention"] * 2,
                                **_GGUF_SIZES, query_pre_attn_scalar=64)
    else:
        config = _qwen3_config(**_GGUF_SIZES)
    model = _random_model(config)
    writer = gguf_writer(path, config, arch, eos_token_id=2)
    writer.add_key_length(key_length or config.head_dim)
    writer.add_value_length(key_length or config.head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(WINDOW)
        writer.add_sliding_window_pattern([True, False] * 2)  # true: a local layer
    if arch == "gemma2":
        writer.add_sliding_window(WINDOW)
        writer.add_float32("gemma2.attn_logit_softcapping", config.attn_logit_softcapping)
        writer.add_float32("gemma2.final_logit_softcapping", config.final_logit_softcapping)
    gemma = arch in ("gemma3", "gemma2")
    names = _GEMMA_NAMES if gemma else _QWEN_NAMES
    state = {}
    for seed, (name, tensor) in enumerate(model.state_dict().items()):
        if name == "lm_head.weight" and config.tie_word_embeddings:  # the embedding is the head
            continue
        gname = gguf_name(name, names)
        part = name.split(".")[-2]
        qtype = (_TYPES.get(part) if ".layers." in name
                 else Q.Q8_0 if name == "model.embed_tokens.weight" else Q.Q6_K if name == "lm_head.weight"
                 else None)
        if qtype is None:  # norms: float32, as the model holds them (Gemma's file: 1 + weight)
            state[name] = tensor
            stored = tensor.numpy() + (np.float32(1) if gemma else np.float32(0))
            writer.add_tensor(gname, stored.astype(np.float32))
            continue
        blocks = random_blocks(qtype, *tensor.shape, seed=seed, amplitude=0.12)
        state[name] = blocks.dequantize()
        writer.add_tensor(gname, np.ascontiguousarray(blocks.raw.numpy()), raw_dtype=qtype)
    model.load_state_dict(state, strict=False)  # a tied head: the embedding
    finish(writer)
    # transformers' model as the file means it: the norms' weights as read back (1 + w - 1)
    if gemma:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(torch.from_numpy((p.numpy() + np.float32(1)) - np.float32(1)))
    return model


@pytest.fixture(scope="module", params=["gemma3", "qwen3", "gemma2"])
def tiny_gguf(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param + "gguf") / "tiny.gguf"
    return str(path), write_gguf(path, request.param)


def test_gguf_config_and_float32_match_transformers(tiny_gguf):
    path, hf = tiny_gguf
    llm = LLM(path, dtype="float32", kv_cache_memory=2**22)
    config = llm.engine.hf_config
    assert config.head_dim == 64 and config.architectures == hf.config.architectures
    if config.model_type in ("gemma3_text", "gemma2"):
        assert config.layer_types == ["sliding_attention", "full_attention"] * 2
        assert config.sliding_window == WINDOW and config.query_pre_attn_scalar == 64
    if config.model_type == "gemma2":
        assert (config.attn_logit_softcapping, config.final_logit_softcapping) == pytest.approx((0.02, 3.0))
    _assert_matches(llm, hf)


@pytest.mark.skipif(not native.available(), reason="no C compiler on this machine")
def test_packed_default_path_is_close(tiny_gguf):
    """dtype auto: the projections from the file's blocks (bfloat16 activations' products),
    greedy tokens as float32's up to near ties, log-probabilities within bf16's error."""
    path, _ = tiny_gguf
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=2)
    packed = LLM(path, kv_cache_memory=2**22)
    assert packed.engine.dtype == torch.bfloat16 and packed.engine.model.num_packed()[0] > 0
    want = LLM(path, dtype="float32", kv_cache_memory=2**22).generate(PROMPTS, params, use_tqdm=False)
    for ref, got in zip(want, packed.generate(PROMPTS, params, use_tqdm=False)):
        assert_greedy_close(ref.outputs[0], got.outputs[0], 0.1)


def test_logit_soft_capping_is_refused(tmp_path):
    config = _gemma3_config(["full_attention"], final_logit_softcapping=30.0)
    _random_model(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="soft-capping"):
        LLM(str(tmp_path), dtype="float32", kv_cache_memory=2**22)


@pytest.mark.skipif(not native.available(), reason="no C compiler on this machine")
def test_the_fused_layer_equals_the_module_path(tiny_gguf, monkeypatch):
    """Decode and verification steps of a few rows run each layer in one native call
    (kernels/cpu_layer.c with its layer_ext_t: q/k norms, Gemma's four norms, GELU, the
    window, Gemma 2's capped scores). Every layer of every decode step, from the same input and KV cache: its output
    and the K/V it writes are the module path's within float32 rounding moved across an int16
    activation step (1e-4 of the largest; a wrong formula is off by more than 1e-2); prompts
    past the window, so that decode rows attend over it. K-quant parts in int16 panels (with
    int8 activations one step is 1/127 of a row's largest, as large as a wrong formula's)."""
    monkeypatch.setenv("PAGELLM_PANELS_INT8", "0")
    path, _ = tiny_gguf
    llm = LLM(path, kv_cache_memory=2**22, block_size=4)
    layers = llm.engine.model.layers
    assert all(layer.fused is not None for layer in layers)
    diffs, kv_diffs = fused_layer_diffs(llm, PROMPTS)
    assert len(diffs) >= 5 * len(layers) and max(diffs) < 1e-4, diffs
    assert max(kv_diffs) < 1e-2, kv_diffs  # bf16 pool: one rounding step at most


def test_tensors_that_are_not_the_headers_shapes_are_refused(tmp_path):
    """A header whose head width does not fit its tensors (q: 4 heads of 64 rows, the header
    saying 32): refused at load, naming the tensor, not cut to the config's rows."""
    path = tmp_path / "bad.gguf"
    write_gguf(path, "qwen3", key_length=32)
    with pytest.raises(ValueError, match=r"weight layers\.0\.self_attn\.q_proj\.weight: "
                       r"weight of part 0: shape \(256, 256\) does not match the config's \(128, 256\)"):
        LLM(str(path), kv_cache_memory=2**22)
