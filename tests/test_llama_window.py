"""Llama-form models whose every layer attends over a sliding window (Mistral 7B v0.1's 4,096,
Phi-3-mini-4k's 2,047): served past the window, each row over its last `sliding_window`
positions as transformers' attention sees them, in prompts, decode steps, chunks and from a
GGUF file's phi3.attention.sliding_window (the packed default path's one-call layers too)."""
from __future__ import annotations

import pytest
import torch
import transformers

from pagellm import LLM, SamplingParams
from pagellm.kernels import native
from tests.helpers import assert_greedy_close
from tests.test_phi3 import hf_logprobs, random_phi3, phi3_config, write_phi3_gguf

WINDOW = 12
PROMPT = [(7 * i) % 250 + 3 for i in range(40)]  # past the window more than three times


def mistral(window: int) -> transformers.MistralForCausalLM:
    config = transformers.MistralConfig(
        vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        sliding_window=window, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(config).eval().float()


def assert_windowed(llm: LLM, hf) -> None:
    """The prompt's log-probabilities and greedy tokens as transformers gives them (one
    forward over the whole sequence: the window is its mask's)."""
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                prompt_logprobs=0), use_tqdm=False)[0]
    ids = PROMPT + out.outputs[0].token_ids
    ref = hf_logprobs(hf, ids)
    got = [entry[t] for entry, t in zip(out.prompt_logprobs[1:], PROMPT[1:])]
    assert max(abs(a - float(ref[i, t])) for i, (a, t) in enumerate(zip(got, PROMPT[1:]))) < 2e-4
    for i in range(len(PROMPT), len(ids)):
        assert ref[i - 1, ids[i]] >= ref[i - 1].max() - 1e-4


@pytest.mark.parametrize("kind", ["mistral", "phi3"])
def test_a_folder_attends_over_its_window(tmp_path, kind):
    hf = mistral(WINDOW) if kind == "mistral" else random_phi3(phi3_config(sliding_window=WINDOW))
    hf.save_pretrained(tmp_path)
    for kw in ({}, {"max_num_batched_tokens": 7}):  # chunks of a prompt past the window
        llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=2**22, **kw)
        assert llm.engine.max_model_len == 256  # not capped at the window
        assert_windowed(llm, hf)
    # built for no more positions than the window: full attention, the window's paths not
    # taken (the many-row one-call layers stay open to it)
    within = LLM(str(tmp_path), dtype="float32", kv_cache_memory=2**22, max_model_len=WINDOW)
    assert all(layer.self_attn.window is None for layer in within.engine.model.layers)
    # the window matters here: transformers without it scores the prompt otherwise
    hf.config.sliding_window = None
    full = hf_logprobs(hf, PROMPT)
    hf.config.sliding_window = WINDOW
    assert (full - hf_logprobs(hf, PROMPT)).abs().max() > 1e-2


def test_a_gguf_file_attends_over_its_window(tmp_path):
    path = tmp_path / "phi3.gguf"
    hf = write_phi3_gguf(path, window=WINDOW)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=2**22)
    assert llm.engine.hf_config.sliding_window == WINDOW
    assert_windowed(llm, hf)
    if native.available():  # the packed path: decode steps in the one-call layer
        packed = LLM(str(path), kv_cache_memory=2**22)
        assert all(layer.fused is not None for layer in packed.engine.model.layers)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
        want = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
        assert_greedy_close(want, packed.generate([PROMPT], params, use_tqdm=False)[0].outputs[0],
                            0.1)
