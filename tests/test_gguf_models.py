"""Tiny random Qwen2 and Llama 3 models written to GGUF here (with the `gguf` package) in the
block types of real K-quant mixes, against transformers holding the same (dequantized) weights:
prefill logits and greedy tokens in float32, the packed bfloat16 path within its tolerance,
Llama 3 rope scaling through `rope_freqs`, and the files that are refused."""
from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from pagellm import LLM, SamplingParams
from pagellm.kernels import native
from pagellm.layers import quant
from pagellm.models.loader import load_model_files
from tests.helpers import assert_greedy_close, hf_greedy
from tests.gguf_files import finish, gguf_name, gguf_writer, llama_cpp_permute, random_blocks

PROMPTS = [[5, 17, 33, 4, 90, 12, 7], list(range(10, 51)), [3, 3, 3, 60, 61, 62]]
# A Q4_K_M-like mix per layer (layer 1 the fallbacks of narrow tensors), and the top tensors.
_LAYER_TYPES = [
    {"q_proj": Q.Q4_K, "k_proj": Q.Q4_K, "v_proj": Q.Q6_K, "o_proj": Q.Q4_K, "gate_proj": Q.Q4_K,
     "up_proj": Q.Q4_K, "down_proj": Q.Q6_K},
    {"q_proj": Q.Q5_0, "k_proj": Q.Q5_0, "v_proj": Q.Q8_0, "o_proj": Q.Q5_K, "gate_proj": Q.Q5_1,
     "up_proj": Q.Q4_1, "down_proj": Q.Q4_0},
]
_TOP_TYPES = {"model.embed_tokens.weight": Q.Q4_K, "lm_head.weight": Q.Q6_K}


def _config(arch: str, vocab_size: int = 96, rope=None, num_layers: int = 2):
    common = dict(vocab_size=vocab_size, hidden_size=256, intermediate_size=512,
                  num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, architectures=["Qwen2ForCausalLM"],
                                        **({"rope_parameters": rope} if rope else {}))
    if arch == "smollm3":  # every fourth layer without rotary, as llama.cpp reads the file;
        # the base SmolLM3's 2e6 makes these random weights ill-conditioned (transformers'
        # own float32 logits 3e-4 from float64), 1e4 leaves float32's rounding at 1e-6
        return transformers.SmolLM3Config(**common, architectures=["SmolLM3ForCausalLM"],
                                          no_rope_layer_interval=4, pad_token_id=0,
                                          rope_parameters={"rope_type": "default",
                                                           "rope_theta": 10000.0})
    # Llama 3.1-style scaling with an original context short enough that every band of the
    # frequency correction (kept, interpolated, divided by the factor) is reached
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    return transformers.LlamaConfig(**common, rope_parameters=rope,
                                    architectures=["LlamaForCausalLM"])


def _llama3_rope_factors(config) -> np.ndarray:
    """rope_freqs as llama.cpp's converter writes it: per frequency, the divisor of its angle."""
    rope = config.rope_parameters
    dim = config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old = rope["original_max_position_embeddings"]
    low, high = old / rope["low_freq_factor"], old / rope["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high:
            factors.append(1.0)
        elif wavelen > low:
            factors.append(rope["factor"])
        else:
            smooth = (old / wavelen - rope["low_freq_factor"]) / (rope["high_freq_factor"] - rope["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def write_tiny_gguf(path, arch: str, extra=None, rope_freqs: bool = True, vocab=None,
                    layer_types=None, top_types=None, rope=None):
    """A random model of `arch` in K-quant blocks at `path` (or layer_types / top_types: the
    type of each layer's projections and of the top tensors); returns transformers' model
    holding exactly the values the file means (gguf's dequantization). vocab: write_vocab's
    callback writing a tokenizer (its vocabulary size first). rope: qwen2's rope_parameters
    (yarn written as llama.cpp's converter writes it)."""
    layer_types, top_types = layer_types or _LAYER_TYPES, top_types or _TOP_TYPES
    config = _config(arch, vocab[0] if vocab else 96, rope, len(layer_types))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval().float()
    writer = gguf_writer(path, config, arch, eos_token_id=2)
    if arch in ("llama", "smollm3"):
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    if arch == "llama" and rope_freqs:
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(config))
    if rope and rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    state = {}
    g = torch.Generator().manual_seed(1)
    for seed, (name, tensor) in enumerate(model.state_dict().items()):
        parts = name.split(".")
        qtype = top_types.get(name) or (layer_types[int(parts[2])].get(parts[-2])
                                         if parts[-1] == "weight" and parts[1] == "layers" else None)
        if qtype is None:  # norms and biases: float32, random so that they matter
            value = (1 + 0.1 * torch.randn(tensor.shape, generator=g)) if "norm" in name else \
                0.05 * torch.randn(tensor.shape, generator=g)
            state[name] = value
            writer.add_tensor(gguf_name(name), value.numpy())
            continue
        blocks = random_blocks(qtype, *tensor.shape, seed=seed, amplitude=0.12)
        state[name] = blocks.dequantize()
        raw = blocks.raw.numpy()
        if arch in ("llama", "smollm3") and parts[-2] == "q_proj":
            raw = llama_cpp_permute(raw, config.num_attention_heads)
        elif arch in ("llama", "smollm3") and parts[-2] == "k_proj":
            raw = llama_cpp_permute(raw, config.num_key_value_heads)
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(raw), raw_dtype=qtype)
    if vocab:
        vocab[1](writer)
    for tensor in extra or []:
        writer.add_tensor(*tensor[:2], **(tensor[2] if len(tensor) > 2 else {}))
    model.load_state_dict(state)
    finish(writer)
    return model


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny_gguf(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "tiny.gguf"
    return str(path), write_tiny_gguf(path, request.param)


def _hf_logits(model, prompt):
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


def _prefill_logits(llm, prompt):
    eng = llm.engine
    eng.add_request("r", prompt, SamplingParams(max_tokens=1))
    try:
        return eng.runner.execute(eng.scheduler.schedule(), list(range(len(prompt))))
    finally:
        eng.abort_request("r")


def test_float32_logits_and_greedy_tokens_match_transformers(tiny_gguf):
    path, hf = tiny_gguf
    llm = LLM(path, dtype="float32", kv_cache_memory=2**22)
    if "llama" in type(hf).__name__.lower():
        assert llm.engine.hf_config.rope_freq_factors is not None
    for prompt in PROMPTS:
        ref = _hf_logits(hf, prompt)
        torch.testing.assert_close(_prefill_logits(llm, prompt), ref, atol=1e-4 * ref.abs().max(), rtol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0,
                          attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref


@pytest.mark.skipif(not native.available(), reason="no C compiler on this machine")
@pytest.mark.parametrize("int8", ["0", "1"], ids=["int16", "int8"])
def test_packed_path_keeps_the_file_blocks_and_matches(tiny_gguf, int8, monkeypatch):
    """dtype auto (bfloat16): every projection and the head run from the file's blocks on
    steps under the packed limit (40 rows). Against transformers, that path is at least as
    close as the same model dequantized to bfloat16 (quantization="none"), whose error is
    bf16's rounding of the weights and embedding (2^-9 relative each; 0.2-10% of the largest
    logit on these random models, growing with the prompt), with activations in int16 steps
    (PAGELLM_PANELS_INT8=0); int8 steps (K-quant panels, the default where AVX-512 VNNI is)
    round each activation by up to 1/254 of its block's largest, about as much again. A
    wrong block decode is off by the size of the weights."""
    monkeypatch.setenv("PAGELLM_PANELS_INT8", int8)
    path, hf = tiny_gguf
    packed = LLM(path, kv_cache_memory=2**22)
    allowance = 1.25 if int8 == "0" else 2.5
    dense = LLM(path, kv_cache_memory=2**22, dtype="bfloat16", quantization="none")
    model = packed.engine.model
    assert packed.engine.dtype == torch.bfloat16
    assert model.num_packed() == (4 * 2, 4 * 2) and model.head_packed is not None
    assert dense.engine.model.num_packed()[0] == 0
    for prompt in [PROMPTS[0], PROMPTS[2], list(range(60, 90))]:
        ref = _hf_logits(hf, prompt)
        ours = _prefill_logits(packed, prompt)
        err = (ours - ref).abs().max() / ref.abs().max()
        err_dense = (_prefill_logits(dense, prompt) - ref).abs().max() / ref.abs().max()
        assert err <= allowance * err_dense + 2e-3, (len(prompt), float(err), float(err_dense))
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * err * ref.abs().max()
        assert bool((ours.argmax(-1) == ref.argmax(-1))[clear].all())


@pytest.mark.skipif(not native.available(), reason="no C compiler on this machine")
def test_a_prompt_past_the_step_budget_with_a_packed_k_quant_head(tiny_gguf):
    """A prompt in chunks of 8 tokens: the chunks before the last compute no logits, so the
    packed Q6_K head gets no rows (its AVX-512 passes once divided by the row count: the
    process died of SIGFPE); the output follows the one-step prefill's."""
    path, _ = tiny_gguf
    prompt = list(range(60, 90))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    want = LLM(path, kv_cache_memory=2**22).generate([prompt], params, use_tqdm=False)
    llm = LLM(path, kv_cache_memory=2**22, max_num_batched_tokens=8)
    assert llm.engine.model.head_packed is not None
    got = llm.generate([prompt], params, use_tqdm=False)
    assert got[0].outputs[0].finish_reason == "length"
    # chunks attend in other tiles than one whole prompt: close, not bitwise
    assert_greedy_close(want[0].outputs[0], got[0].outputs[0], 0.05)


def test_rope_freqs_change_the_angles(tmp_path):
    """The file's rope_freqs are what matches: the same file without them (plain rope) does not."""
    path = tmp_path / "tiny.gguf"
    hf = write_tiny_gguf(path, "llama", rope_freqs=False)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=2**22)
    assert getattr(llm.engine.hf_config, "rope_freq_factors", None) is None
    ref = _hf_logits(hf, PROMPTS[1])
    assert (_prefill_logits(llm, PROMPTS[1]) - ref).abs().max() > 1e-2 * ref.abs().max()


YARN = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
        "original_max_position_embeddings": 32}


def test_yarn_rope_scaling_matches_transformers(tmp_path):
    """A Qwen2.5 file made for long contexts (rope.scaling.type yarn, its factor and the
    context trained on): the interpolated frequencies and attention factor are transformers'
    (float32 logits equal on a prompt past the original context); the same weights without
    the scaling are not."""
    path = tmp_path / "yarn.gguf"
    hf = write_tiny_gguf(path, "qwen2", rope=YARN)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=2**22)
    scaling = getattr(llm.engine.hf_config, "rope_parameters", None) or llm.engine.hf_config.rope_scaling
    assert scaling["rope_type"] == "yarn" and scaling["factor"] == 4.0
    prompt = list(range(10, 60))
    ref = _hf_logits(hf, prompt)
    torch.testing.assert_close(_prefill_logits(llm, prompt), ref, atol=1e-4 * ref.abs().max(), rtol=1e-4)
    plain = tmp_path / "plain.gguf"
    write_tiny_gguf(plain, "qwen2", rope={**YARN, "rope_type": "default"})
    unscaled = _prefill_logits(LLM(str(plain), dtype="float32", kv_cache_memory=2**22), prompt)
    assert (unscaled - ref).abs().max() > 1e-2 * ref.abs().max()


def test_yarn_settings_transformers_lacks_are_refused(tmp_path):
    bad = tmp_path / "yarn-log.gguf"
    config = _config("qwen2")
    writer = gguf_writer(bad, config, "qwen2", eos_token_id=2)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(4.0)
    writer.add_rope_scaling_orig_ctx_len(32)
    writer.add_float32("qwen2.rope.scaling.yarn_log_multiplier", 0.1)
    writer.add_tensor("token_embd.weight", np.zeros((96, 256), dtype=np.float32))
    finish(writer)
    with pytest.raises(ValueError, match="yarn_log_multiplier"):
        load_model_files(str(bad), load_tokenizer=False)


def test_types_outside_the_list_are_refused_by_name(tmp_path):
    path = tmp_path / "mxfp4.gguf"
    write_tiny_gguf(path, "qwen2", extra=[
        ("blk.0.attn_q_norm.weight", np.zeros((4, 136), dtype=np.uint8), {"raw_dtype": Q.MXFP4})])
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q_norm\.weight has ggml type MXFP4; supported: \["):
        load_model_files(str(path), load_tokenizer=False)


# An i-quant file's mix (IQ4_XS, IQ3_M, IQ2_M, ... keep some tensors in other types), every
# type pagellm requantizes to Q8_0 at least once; the head IQ4_NL (32-value blocks).
_REQUANTIZED_LAYER_TYPES = [
    {"q_proj": Q.IQ4_XS, "k_proj": Q.IQ4_XS, "v_proj": Q.IQ4_NL, "o_proj": Q.IQ3_S,
     "gate_proj": Q.IQ3_XXS, "up_proj": Q.IQ2_XXS, "down_proj": Q.Q3_K},
    {"q_proj": Q.IQ2_XS, "k_proj": Q.IQ2_S, "v_proj": Q.Q4_K, "o_proj": Q.IQ1_S,
     "gate_proj": Q.IQ1_M, "up_proj": Q.TQ1_0, "down_proj": Q.TQ2_0},
]
_REQUANTIZED_TOP_TYPES = {"model.embed_tokens.weight": Q.IQ4_XS, "lm_head.weight": Q.Q2_K}


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def iq_gguf(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"iq-{request.param}") / "tiny-iq.gguf"
    return str(path), write_tiny_gguf(path, request.param, layer_types=_REQUANTIZED_LAYER_TYPES,
                                      top_types=_REQUANTIZED_TOP_TYPES)


def test_i_quant_files_match_transformers_in_float32(iq_gguf):
    """IQ*, TQ* and the low-bit K-quants (gguf's dequantizer) load as the values the file
    means: float32 prefill logits and greedy tokens equal transformers'."""
    path, hf = iq_gguf
    llm = LLM(path, dtype="float32", kv_cache_memory=2**22)
    for prompt in PROMPTS:
        ref = _hf_logits(hf, prompt)
        torch.testing.assert_close(_prefill_logits(llm, prompt), ref, atol=1e-4 * ref.abs().max(), rtol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False)):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 16)


def test_i_quant_weights_come_packed_as_q8_0_of_the_file_values(iq_gguf):
    """Where weights stay packed, each projection, head and embedding of a requantized type
    comes as Q8_0 blocks holding gguf's Q8_0 quantization of the file's values (rows in
    transformers' order: llama's q/k permuted back), each within 1/254 of its block's
    largest (and the f16 scale's rounding: 2^-11 of 127 steps, or below 2^-14 half the
    subnormal spacing 2^-24 of each); the other types come as before. IQ4_NL / IQ4_XS
    projections come in their own blocks where the panel kernels are built (the file's
    values exactly); their embedding and head still as Q8_0."""
    from gguf import quants

    from pagellm.layers import panels

    path, _ = iq_gguf
    files = load_model_files(path, load_tokenizer=False)
    assert files.packed_linears and files.packed_head
    file_values = dict(files.weights())
    packed = dict(files.weights(keep_packed=True, keep_head=True, keep_embedding=True))
    block = {p: "self_attn" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    types = {**{f"model.layers.{i}.{block.get(p, 'mlp')}.{p}.weight": t
                for i, layer in enumerate(_REQUANTIZED_LAYER_TYPES) for p, t in layer.items()},
             **_REQUANTIZED_TOP_TYPES}
    for name, t in types.items():
        got, values = packed[name], file_values[name]
        if t == Q.Q4_K or (t in panels.LEVEL_FORMAT_OF and panels.available()
                           and name.startswith("model.layers.")):
            assert isinstance(got, quant.GGUFBlocks) and got.ggml_type == t, name
            assert torch.equal(got.dequantize(), values), name
            continue
        want = torch.from_numpy(quants.dequantize(quants.quantize(values.numpy(), Q.Q8_0), Q.Q8_0))
        if name == "lm_head.weight":  # the head's Q8_0 form: int8 codes and float32 scales
            assert isinstance(got, quant.Int8Blocks), name
        else:
            assert isinstance(got, quant.GGUFBlocks) and got.ggml_type == Q.Q8_0, name
        assert torch.equal(got.dequantize(), want), name
        amax = values.view(values.shape[0], -1, 32).abs().amax(-1, keepdim=True)
        err = (got.dequantize() - values).view(values.shape[0], -1, 32).abs()
        assert bool((err <= amax / 254 * (1 + 127 / 1024) + 127 * 2**-25).all()), name


def test_i_quant_codes_stay_for_a_draft_and_not_where_tp_cuts_their_blocks(iq_gguf, monkeypatch):
    """A draft requantized to Q4_1 (5 bits) keeps IQ4_NL / IQ4_XS projections in their own
    codes (4.5 / 4.25 bits, exact); with tensor parallelism IQ4_XS (256-value blocks a
    row-parallel split may cut) goes to Q8_0 as before, IQ4_NL (32) keeps its codes."""
    from pagellm import parallel
    from pagellm.layers import panels

    if not panels.available():
        pytest.skip("the i-quant panels need AVX-512 BW and VNNI")
    path, _ = iq_gguf
    files = load_model_files(path, load_tokenizer=False)
    names = {"model.layers.0.self_attn.q_proj.weight": Q.IQ4_XS,
             "model.layers.0.self_attn.v_proj.weight": Q.IQ4_NL}
    draft = dict(files.weights(keep_packed=True, requantize=Q.Q4_1))
    assert {draft[n].ggml_type for n in names} == {Q.IQ4_XS, Q.IQ4_NL}
    monkeypatch.setattr(parallel, "tp_size", lambda: 2)
    tp = dict(files.weights(keep_packed=True))
    assert [tp[n].ggml_type for n in names] == [Q.Q8_0, Q.IQ4_NL]


@pytest.mark.skipif(not native.available(), reason="no C compiler on this machine")
def test_the_packed_path_runs_i_quants_as_q8_0(iq_gguf):
    """dtype auto: every projection and the head stay packed (Q8_0; IQ4_NL / IQ4_XS
    projections in their own panels where the kernels are built), and the logits are about
    as close to transformers' as the model dequantized to bfloat16 (Q8_0's rounding, 1/254 of
    a block's largest, is bf16's 2^-9 of each weight in size)."""
    path, hf = iq_gguf
    packed = LLM(path, kv_cache_memory=2**22)
    dense = LLM(path, kv_cache_memory=2**22, dtype="bfloat16", quantization="none")
    model = packed.engine.model
    assert packed.engine.dtype == torch.bfloat16
    assert model.num_packed() == (4 * 2, 4 * 2) and model.head_packed is not None
    for prompt in [PROMPTS[0], PROMPTS[2], list(range(60, 90))]:
        ref = _hf_logits(hf, prompt)
        ours = _prefill_logits(packed, prompt)
        err = (ours - ref).abs().max() / ref.abs().max()
        err_dense = (_prefill_logits(dense, prompt) - ref).abs().max() / ref.abs().max()
        assert err <= 3 * err_dense + 5e-3, (len(prompt), float(err), float(err_dense))


def test_unknown_tensors_are_refused(tmp_path):
    path = tmp_path / "extra.gguf"
    write_tiny_gguf(path, "qwen2", extra=[("blk.0.attn_qkv.weight", np.zeros((8, 8), dtype=np.float32))])
    with pytest.raises(ValueError, match="attn_qkv"):
        load_model_files(str(path), load_tokenizer=False)


@pytest.mark.skipif(not native.available(), reason="no C compiler on this machine")
@pytest.mark.parametrize("int8", ["0", "1"], ids=["int16", "int8"])
def test_fused_layer_matches_the_modules_on_k_quant_parts(tiny_gguf, int8, monkeypatch):
    """The one-call decoder layer (kernels/cpu_layer.c) with GGUF-block projections, mixed
    parts (Q4_K q|k beside Q6_K v) and Qwen2's biases gives the module path's logits, with
    int16 activations and with the K-quant panels' int8 ones."""
    from pagellm.layers import linear

    monkeypatch.setenv("PAGELLM_PANELS_INT8", int8)

    # the fused layer serves CPUs without bf16 units (float32 activations): build it so here
    monkeypatch.setattr(linear, "UPCAST_BF16", True)
    path, _ = tiny_gguf
    llm = LLM(path, kv_cache_memory=2**22, enable_prefix_caching=False)
    layers = llm.engine.model.layers
    fused = [layer.fused for layer in layers]
    assert all(fused)
    assert any(isinstance(layer.self_attn.qkv_proj.packed, quant.PackedParts) for layer in layers)
    prompt = PROMPTS[0]
    with_fused = _prefill_logits(llm, prompt)
    for layer in layers:
        layer.fused = None
    modules = _prefill_logits(llm, prompt)
    for layer, f in zip(layers, fused):
        layer.fused = f
    # float32 rounding (vectorized exp, summation order) can move an activation across one
    # int16 step (1/32767 of its block's largest value) in either path: 2e-4 of the largest
    # logit after two layers and the head (int8 steps, 1/127: 1e-2; 1.2e-3 seen); a wrong
    # part, offset or bias is off by far more
    tol = 2e-4 if int8 == "0" else 1e-2
    torch.testing.assert_close(with_fused, modules, atol=tol * modules.abs().max(), rtol=0)


LLAMA3_TEMPLATE = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                   "{{ m['content'] }}<|eot_id|>{% endfor %}"
                   "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def _llama3_vocab():
    """A byte-level BPE vocabulary the way Llama 3 files store one (tokenizer.ggml.model gpt2,
    pre-tokenizer llama-bpe): the 256 byte symbols, merges that join digits, and Llama 3's
    special tokens. Llama 3's split groups digits by three ("12345" -> "123", "45"), Qwen2's
    splits each digit: the ids tell which pre-tokenizer ran."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    merges = ["1 2", "12 3", "4 5"]
    tokens = symbols + ["12", "123", "45"]
    specials = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
    tokens += specials
    types = [1] * (len(tokens) - len(specials)) + [3] * len(specials)  # 3: control

    def write(writer):
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("llama-bpe")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(tokens.index("<|begin_of_text|>"))
        writer.add_chat_template(LLAMA3_TEMPLATE)
    return len(tokens), write, tokens


def test_llama3_byte_level_tokenizer_and_template_from_the_file(tmp_path):
    """A Llama 3-style file's tokenizer: llama-bpe splitting, special tokens as single ids, the
    end token and chat template from the file; the same ids as transformers' own GGUF tokenizer."""
    size, write, tokens = _llama3_vocab()
    path = tmp_path / "llama3.gguf"
    write_tiny_gguf(path, "llama", vocab=(size, write))
    files = load_model_files(str(path))
    tok = files.tokenizer
    ids = tok("x 12345").input_ids
    assert [tokens[i] for i in ids] == ["x", "\u0120", "123", "45"]
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="llama3.gguf")
    for text in ("x 12345", "a<|eot_id|>b", "Hello, world!\n\t 99"):
        assert tok(text).input_ids == ref(text).input_ids, text
    assert tok("a<|eot_id|>b").input_ids[1] == tokens.index("<|eot_id|>")
    # the file's EOS, then the vocabulary's end of turn (it ends generation too)
    assert files.config.eos_token_id == [2, tokens.index("<|eot_id|>")]
    assert tok.chat_template == LLAMA3_TEMPLATE
    llm = LLM(str(path), dtype="float32", kv_cache_memory=2**22)
    msgs = [{"role": "user", "content": "12345"}]
    expected = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert llm.apply_chat_template(msgs) == expected
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == expected and len(out.outputs[0].token_ids) == 3


def _q4_1_roundtrip(dense: torch.Tensor) -> torch.Tensor:
    from gguf import quants
    raw = quants.quantize(dense.float().numpy(), Q.Q4_1)
    return torch.from_numpy(quants.dequantize(raw, Q.Q4_1))


def test_requantized_draft_weights_are_q4_1_blocks_of_the_file_values(tiny_gguf):
    """SpeculativeConfig.draft_quantization's loading: projections and the head stored in more
    than 5 bits a weight (Q5_0/1, Q5_K, Q6_K, Q8_0 here) become Q4_1 blocks holding gguf's
    quantization of the file's values, in transformers' row order (llama's q/k rows permuted
    back); 4-bit ones (Q4_0, Q4_1, Q4_K) and the embedding stay as they are; the dense form
    (float32 engines) holds the same values."""
    path, _ = tiny_gguf
    files = load_model_files(path, load_tokenizer=False)
    file_values = dict(files.weights())
    packed = dict(files.weights(keep_packed=True, keep_head=True, requantize=Q.Q4_1))
    dense = dict(files.weights(requantize=Q.Q4_1))
    block = {p: "self_attn" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    types = {**{f"model.layers.{i}.{block.get(p, 'mlp')}.{p}.weight": t
                for i, layer in enumerate(_LAYER_TYPES) for p, t in layer.items()},
             **_TOP_TYPES}
    changed = 0
    for name, t in types.items():
        bits = {Q.Q4_0: 4.5, Q.Q4_1: 5.0, Q.Q4_K: 4.5}.get(t, 5.5)
        if bits > 5 and name != "model.embed_tokens.weight":
            want = _q4_1_roundtrip(file_values[name])
            assert isinstance(packed[name], quant.GGUFBlocks) and packed[name].ggml_type == Q.Q4_1, name
            assert torch.equal(packed[name].dequantize(), want), name
            assert torch.equal(dense[name], want), name
            changed += 1
        else:
            assert torch.equal(dense[name], file_values[name]), name
    assert changed == 8  # layer 0: v, down; layer 1: q, k, v, o, gate; the head


def test_a_requantized_draft_keeps_the_targets_greedy_output(tiny_gguf):
    """The file as its own draft, requantized: the draft's head holds the Q4_1 values, the
    target's the file's own, and greedy output is the target's (float32)."""
    path, _ = tiny_gguf
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [PROMPTS[0], list(range(60, 90))]
    want = [o.outputs[0].token_ids for o in
            LLM(path, dtype="float32", kv_cache_memory=2**22).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(path, dtype="float32", kv_cache_memory=2**22,
              speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 3,
                                  "adaptive": False, "draft_quantization": "q4_1"})
    file_head = dict(load_model_files(path, load_tokenizer=False).weights())["lm_head.weight"]
    assert torch.equal(llm.engine.spec.proposer.model.lm_head.weight, _q4_1_roundtrip(file_head))
    assert torch.equal(llm.engine.model.lm_head.weight, file_head)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == want
    assert llm.engine.spec.stats.num_draft_tokens > 0


@pytest.mark.parametrize("cfg,match", [({"method": "draft_model", "model": "x.gguf", "draft_quantization": "q8"}, "'q4_1' or None"),
                                       ({"method": "draft_model", "draft_quantization": "q4_1"}, "draft 'model'"),
                                       ({"method": "ngram", "draft_quantization": "q4_1"}, "draft 'model'")])
def test_draft_quantization_is_checked(cfg, match):
    from pagellm.config import SpeculativeConfig
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(cfg)


def test_the_vocabularys_end_tokens_end_generation():
    """Besides the file's EOS, the vocabulary's end-of-text and repository / file separator
    tokens end generation (as llama.cpp reads a vocabulary): the default model's file names
    <|im_end|> its EOS, and the engine stops at <|endoftext|> too (the real Qwen2.5-Coder's
    case is in test_real_models.py)."""
    files = load_model_files(None)
    tok = files.tokenizer
    ends = files.config.eos_token_id
    assert ends[0] == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert {tok.convert_ids_to_tokens(i) for i in ends} == {
        "<|im_end|>", "<|endoftext|>", "<repo_name>", "<reponame>", "<file_sep>"}
    llm = LLM(None, dtype="float32", kv_cache_memory=2**24, max_model_len=256)
    assert llm.engine.eos_token_ids == set(ends)
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    # a logit bias makes the model write <|endoftext|> first: generation ends there
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8,
                                                 logit_bias={endoftext: 100.0}),
                       use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.text) == ([endoftext], "stop", "")


def test_smollm3_files_rotate_three_layers_of_four(tmp_path):
    """A SmolLM3 GGUF (llama.cpp's q/k row order; every fourth layer without rotary, the
    step llama.cpp reads such a file with): float32 logits and greedy tokens equal
    transformers'; the packed path (its fused and many-row layers rotating the NoPE layer by
    an identity) stays within its tolerance; rotating every layer is not the model."""
    path = tmp_path / "smollm3.gguf"
    hf = write_tiny_gguf(path, "smollm3", layer_types=_LAYER_TYPES * 2)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=2**22, enable_prefix_caching=False)
    assert llm.engine.hf_config.no_rope_layers == [1, 1, 1, 0]
    for prompt in PROMPTS:
        ref = _hf_logits(hf, prompt)
        torch.testing.assert_close(_prefill_logits(llm, prompt), ref, atol=1e-4 * ref.abs().max(), rtol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    want = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, want):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 16)
    if native.available():
        packed = LLM(str(path), kv_cache_memory=2**22)
        assert packed.engine.model.num_packed()[0] > 0
        for ref, got in zip(want, packed.generate(PROMPTS, params, use_tqdm=False)):
            assert_greedy_close(ref.outputs[0], got.outputs[0], 0.1)
    rotary = llm.engine.model.rotary
    for layer in llm.engine.model.layers:
        layer.self_attn.rotary = rotary
    ref = _hf_logits(hf, PROMPTS[1])
    assert (_prefill_logits(llm, PROMPTS[1]) - ref).abs().max() > 1e-3 * ref.abs().max()
