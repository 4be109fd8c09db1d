"""Golden test: the real default model (GGUF), greedy, against transformers on the same file."""
from __future__ import annotations

import os

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.models.loader import default_model_path

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n"]
N = 16


@pytest.fixture(scope="module")
def reference():
    path = default_model_path()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    outs = []
    for p in PROMPTS:
        ids = torch.tensor([tok.encode(p)])
        gen = model.generate(ids, max_new_tokens=N, do_sample=False,
                             attention_mask=torch.ones_like(ids), eos_token_id=None,
                             pad_token_id=tok.eos_token_id)
        outs.append(gen[0, ids.shape[1]:].tolist())
    return outs


def test_default_model_greedy_matches_transformers(reference):
    llm = LLM(dtype="float32", kv_cache_memory="64MiB")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True),
                        use_tqdm=False)
    for out, ref in zip(outs, reference):
        assert out.outputs[0].token_ids == ref
    assert "Paris" in outs[0].outputs[0].text


def test_default_model_with_ngram_speculation_is_identical(reference):
    llm = LLM(dtype="float32", kv_cache_memory="64MiB",
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
