"""Embeddings (LLM.embed, POST /v1/embeddings): the last prompt token's final hidden state,
against transformers' on the same weights, through prefill chunks, cached prefixes,
speculative engines and batches shared with generation; `dimensions`, `normalize` and base64
as OpenAI's client reads them; bad inputs as 400s; a model whose files say another pooling
refused."""
from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch

from pagellm import LLM, PoolingParams, SamplingParams
from tests.helpers import assert_no_leaks, make_tiny_model
from tests.test_server import MODEL, srv, server, tiny_path, wait_idle  # noqa: F401

PROMPTS = [[5, 17, 33, 4, 90, 12, 7], list(range(10, 51)), [3, 3, 3, 60, 61, 62]]


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"embed-{request.param}")
    return str(path), make_tiny_model(path, request.param)


def _reference(hf, prompt, dims=None, normalize=True) -> torch.Tensor:
    with torch.no_grad():
        h = hf.model(torch.tensor([prompt])).last_hidden_state[0, -1]
    h = h[:dims] if dims else h
    return torch.nn.functional.normalize(h, dim=0) if normalize else h


def test_embeddings_are_transformers_last_hidden_state(tiny):
    """Unit-length, in float32 as transformers'; chunks of 5 tokens and a cached prefix give the
    same vector; `dimensions` keeps the first values before scaling; normalize=False the raw
    state."""
    path, hf = tiny
    llm = LLM(path, dtype="float32", kv_cache_memory=2**22)
    for prompt, out in zip(PROMPTS, llm.embed(PROMPTS, use_tqdm=False)):
        got = torch.tensor(out.outputs.embedding)
        torch.testing.assert_close(got, _reference(hf, prompt), atol=1e-5, rtol=1e-4)
        assert out.prompt_token_ids == prompt and out.finished
    raw = llm.embed(PROMPTS[1], PoolingParams(normalize=False, dimensions=16), use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(raw.outputs.embedding),
                               _reference(hf, PROMPTS[1], 16, normalize=False), atol=1e-5, rtol=1e-4)
    chunked = LLM(path, dtype="float32", kv_cache_memory=2**22, max_num_batched_tokens=5)
    want = _reference(hf, PROMPTS[1])
    for cached in (False, True):
        out = chunked.embed(PROMPTS[1], use_tqdm=False)[0]
        assert (out.num_cached_tokens > 0) == cached
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=1e-5, rtol=1e-4)
    assert_no_leaks(chunked.engine)


def test_embedding_requests_beside_generation_and_speculation(tiny):
    """Embedding and generation requests in one batch, on an n-gram speculative engine: each
    gets what it gets alone; nothing is left behind."""
    path, hf = tiny
    llm = LLM(path, dtype="float32", kv_cache_memory=2**22,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([[7, 8, 9, 7, 8, 9, 7, 8]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate([[7, 8, 9, 7, 8, 9, 7, 8], PROMPTS[0], PROMPTS[2]],
                        [greedy, PoolingParams(), PoolingParams(dimensions=8)], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone and outs[0].embedding is None
    torch.testing.assert_close(torch.tensor(outs[1].embedding), _reference(hf, PROMPTS[0]),
                               atol=1e-5, rtol=1e-4)
    assert len(outs[2].embedding) == 8 and outs[1].outputs[0].token_ids == []
    assert_no_leaks(llm.engine)


def test_bad_pooling_params_are_refused(tiny):
    path, _ = tiny
    llm = LLM(path, dtype="float32", kv_cache_memory=2**22)
    with pytest.raises(ValueError, match="dimensions: 65 is more than the model's 64"):
        llm.embed(PROMPTS[0], PoolingParams(dimensions=65), use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)
    llm.engine.hf_config.pooling_type = "mean"  # a sentence-transformers folder's own pooling
    with pytest.raises(ValueError, match="pooled by 'mean'"):
        llm.embed(PROMPTS[0], use_tqdm=False)
    assert_no_leaks(llm.engine)


def test_the_pooling_a_folder_states(tmp_path):
    make_tiny_model(tmp_path, "llama")
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True}))
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=2**22)
    assert llm.engine.hf_config.pooling_type == "last"
    assert len(llm.embed(PROMPTS[0], use_tqdm=False)[0].outputs.embedding) == 64


def test_the_server_endpoint(srv, offline_embed):  # noqa: F811
    """/v1/embeddings through the official client: strings, token ids, several inputs in
    order, base64 (the client's default: decoded to the same floats), dimensions, usage;
    bad inputs are 400s naming `input` or `dimensions`."""
    client = srv.client
    texts = ["The cat sat on the mat.", "A dog barked."]
    r = client.embeddings.create(model=MODEL, input=texts)
    assert [d.index for d in r.data] == [0, 1] and r.model == MODEL
    want = offline_embed.embed(texts, use_tqdm=False)
    for d, w in zip(r.data, want):
        np.testing.assert_allclose(d.embedding, w.outputs.embedding, rtol=1e-6, atol=1e-7)
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(w.prompt_token_ids) for w in want)
    floats = httpx.post(srv.url + "/v1/embeddings", json={"input": texts[0], "dimensions": 16,
                                                          "encoding_format": "float"}).json()
    vec = np.array(floats["data"][0]["embedding"])
    assert vec.shape == (16,) and abs(np.linalg.norm(vec) - 1) < 1e-5
    ids = client.embeddings.create(model=MODEL, input=[want[0].prompt_token_ids])
    np.testing.assert_allclose(ids.data[0].embedding, want[0].outputs.embedding, rtol=1e-6, atol=1e-7)
    for body, param in (({"input": []}, "input"), ({"input": ""}, "input"),
                        ({"input": [[1, 2], []]}, "input"), ({"input": [10**9]}, "input"),
                        ({"input": "x", "dimensions": 0}, "dimensions"),
                        ({"input": "x", "dimensions": 10**6}, "dimensions"),
                        ({"input": "x", "encoding_format": "int8"}, "encoding_format")):
        resp = httpx.post(srv.url + "/v1/embeddings", json=body)
        assert resp.status_code == 400, body
        assert resp.json()["error"]["param"] == param, (body, resp.json())
    wait_idle(srv)


@pytest.fixture(scope="module")
def offline_embed(tiny_path):  # noqa: F811
    from tests.test_server import ENGINE_KW

    return LLM(tiny_path, **ENGINE_KW)
