"""Phi-3 (Phi3ForCausalLM, GGUF architecture phi3): its fused qkv_proj and gate_up_proj read
as their parts, from a transformers folder and from a GGUF file (attn_qkv, and ffn_up holding
gate and up, in blocks), equal to transformers on the same weights; LongRoPE's short factors
within the trained context and its long ones past it, as transformers picks them for a
sequence of that length; Phi-4-mini's partly rotating heads (refused elsewhere)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from pagellm import LLM, SamplingParams
from pagellm.kernels import native
from tests.gguf_files import finish, gguf_name, gguf_writer, random_blocks
from tests.helpers import assert_greedy_close

HEAD_DIM = 32


def phi3_config(hidden: int = 128, ff: int = 192, **kw) -> transformers.Phi3Config:
    return transformers.Phi3Config(
        vocab_size=256, hidden_size=hidden, intermediate_size=ff, num_hidden_layers=2,
        num_attention_heads=hidden // HEAD_DIM, num_key_value_heads=hidden // HEAD_DIM // 2,
        max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, **kw)


def longrope(original: int = 64, rotated: int = HEAD_DIM) -> dict:
    half = rotated // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [1.0 + 2.0 * i for i in range(half)],
            "original_max_position_embeddings": original}


def random_phi3(config) -> transformers.Phi3ForCausalLM:
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # far from ones, so that a norm read wrongly shows
                p.copy_(1 + 0.5 * torch.rand(p.shape))
    return model


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def assert_matches(llm: LLM, hf, prompt: list[int], tol: float = 2e-4) -> None:
    """The prompt's log-probabilities and 6 greedy tokens, as transformers gives them (one
    forward over the whole sequence, as the prompt's length picks LongRoPE's factors)."""
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                prompt_logprobs=0), use_tqdm=False)[0]
    ids = prompt + out.outputs[0].token_ids
    ref = hf_logprobs(hf, ids)
    got = [entry[t] for entry, t in zip(out.prompt_logprobs[1:], prompt[1:])]
    want = [float(ref[i, t]) for i, t in enumerate(prompt[1:])]
    assert max(abs(a - b) for a, b in zip(got, want)) < tol
    for i in range(len(prompt), len(ids)):  # each greedy token is transformers' argmax
        assert ref[i - 1, ids[i]] >= ref[i - 1].max() - 1e-4


def test_a_transformers_folder_matches(tmp_path):
    hf = random_phi3(phi3_config())
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=2**22)
    assert llm.engine.hf_config.architectures == ["Phi3ForCausalLM"]
    assert_matches(llm, hf, list(range(3, 43)))


def test_longrope_short_within_the_trained_context_and_long_past_it(tmp_path):
    """max_model_len within the trained 64 positions: the short factors (transformers' for
    such a sequence); past them: the long ones, which transformers takes for a 100-token
    sequence. The two differ, so each comparison tells them apart."""
    hf = random_phi3(phi3_config(rope_parameters=longrope(), original_max_position_embeddings=64))
    hf.save_pretrained(tmp_path)
    short = LLM(str(tmp_path), dtype="float32", kv_cache_memory=2**22, max_model_len=64)
    assert_matches(short, hf, list(range(3, 43)))
    long = LLM(str(tmp_path), dtype="float32", kv_cache_memory=2**22)
    assert_matches(long, hf, [(7 * i) % 250 + 3 for i in range(100)])
    with pytest.raises(AssertionError):  # the long factors on a short sequence are not HF's
        assert_matches(long, hf, list(range(3, 43)))


@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 10000.0},
                                  longrope(rotated=24)], ids=["default", "longrope"])
def test_a_partly_rotating_head(tmp_path, rope):
    """Phi-4-mini rotates 3/4 of each head (its q / k rows laid out for a whole-head
    rotation at load): transformers' scores, short and long factors alike."""
    config = phi3_config(rope_parameters={**rope, "partial_rotary_factor": 0.75},
                         original_max_position_embeddings=64)
    hf = random_phi3(config)
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=2**22)
    assert_matches(llm, hf, [(7 * i) % 250 + 3 for i in range(100)])
    short = LLM(str(tmp_path), dtype="float32", kv_cache_memory=2**22, max_model_len=64)
    assert_matches(short, hf, list(range(3, 43)))


def test_partial_rotation_is_refused_elsewhere(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5})
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5"):
        LLM(str(tmp_path), dtype="float32", kv_cache_memory=2**22)


_TYPES = {"qkv_proj": Q.Q4_K, "o_proj": Q.Q5_0, "gate_up_proj": Q.Q4_K, "down_proj": Q.Q6_K}
_NAMES = {"self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
          "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def write_phi3_gguf(path, rope: dict | None = None, rotated: int = HEAD_DIM,
                    window: int | None = None):
    """A random Phi-3 in llama.cpp's form (fused attn_qkv and ffn_up in K-quant blocks,
    LongRoPE as two factor tensors and the trained context); returns transformers' model
    holding exactly the values the file means. window: its attention's sliding window."""
    fraction = {"partial_rotary_factor": rotated / HEAD_DIM}
    rope = {**(rope or {"rope_type": "default", "rope_theta": 10000.0}), **fraction}
    config = phi3_config(hidden=256, ff=256, rope_parameters=rope, sliding_window=window,
                         original_max_position_embeddings=rope.get(
                             "original_max_position_embeddings", 256))
    hf = random_phi3(config)
    writer = gguf_writer(path, config, "phi3", eos_token_id=2)
    writer.add_rope_dimension_count(rotated)
    if window is not None:
        writer.add_sliding_window(window)
    if rope["rope_type"] == "longrope":
        original = rope["original_max_position_embeddings"]
        scale = config.max_position_embeddings / original
        writer.add_uint32("phi3.rope.scaling.original_context_length", original)
        writer.add_float32("phi3.rope.scaling.attn_factor",
                           math.sqrt(1 + math.log(scale) / math.log(original)))
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight",
                              np.asarray(rope[f"{kind}_factor"], dtype=np.float32))
    state = {}
    for seed, (name, tensor) in enumerate(hf.state_dict().items()):
        gname = gguf_name(name, _NAMES)
        qtype = (_TYPES.get(name.split(".")[-2]) if ".layers." in name
                 else Q.Q8_0 if "embed" in name or "lm_head" in name else None)
        if qtype is None:  # norms
            state[name] = tensor
            writer.add_tensor(gname, tensor.numpy().astype(np.float32))
            continue
        blocks = random_blocks(qtype, *tensor.shape, seed=seed, amplitude=0.12)
        state[name] = blocks.dequantize()
        writer.add_tensor(gname, np.ascontiguousarray(blocks.raw.numpy()), raw_dtype=qtype)
    hf.load_state_dict(state)
    finish(writer)
    return hf


@pytest.mark.parametrize("rope, rotated", [(None, HEAD_DIM), (longrope(original=128), HEAD_DIM),
                                           (longrope(original=128, rotated=24), 24)],
                         ids=["default", "longrope", "longrope-partial"])
def test_a_gguf_file_matches(tmp_path, rope, rotated):
    path = tmp_path / "phi3.gguf"
    hf = write_phi3_gguf(path, rope, rotated)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=2**22)
    config = llm.engine.hf_config
    assert config.architectures == ["Phi3ForCausalLM"] and config.num_key_value_heads == 4
    prompt = [(7 * i) % 250 + 3 for i in range(40 if rope is None else 150)]
    assert_matches(llm, hf, prompt)
    if native.available():  # dtype auto: the parts stay in their blocks, packed
        packed = LLM(str(path), kv_cache_memory=2**22)
        assert packed.engine.model.num_packed()[0] > 0
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
        want = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert_greedy_close(want, packed.generate([prompt], params, use_tqdm=False)[0].outputs[0],
                            0.1)


def test_a_lora_adapter_on_the_fused_projections(tmp_path):
    """A PEFT adapter on Phi-3's qkv_proj and gate_up_proj (one A, B's rows split as the
    weight's; q / k's laid out for a partly rotating head): the merged model's outputs."""
    from pagellm import LoRARequest
    from tests.test_lora import write_adapter

    config = phi3_config(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "partial_rotary_factor": 0.75})
    hf = random_phi3(config)
    hf.save_pretrained(tmp_path / "base")
    merged = write_adapter(tmp_path / "lora", hf, ("qkv_proj", "o_proj", "gate_up_proj",
                                                    "down_proj"))
    llm = LLM(str(tmp_path / "base"), dtype="float32", kv_cache_memory=2**22)
    adapter = LoRARequest("phi", 1, str(tmp_path / "lora"))
    prompt = list(range(3, 43))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                prompt_logprobs=0), use_tqdm=False,
                       lora_request=adapter)[0]
    ref = hf_logprobs(merged, prompt)
    got = [entry[t] for entry, t in zip(out.prompt_logprobs[1:], prompt[1:])]
    assert max(abs(a - float(ref[i, t])) for i, (a, t) in enumerate(zip(got, prompt[1:]))) < 2e-4
    base = hf_logprobs(hf, prompt)  # the adapter changes the scores
    assert max(abs(a - float(base[i, t])) for i, (a, t) in enumerate(zip(got, prompt[1:]))) > 1e-2
