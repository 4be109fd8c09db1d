"""Tensor parallelism: N gloo processes on this machine give the same greedy tokens as one."""
from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.engine.tensor_parallel import WorkerDiedError
from tests.helpers import make_tiny_model

PROMPTS = [[5, 17, 33, 4, 90, 12, 7] * 3, [3, 3, 3], list(range(10, 51)), [1, 2, 1, 2, 1, 2]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _tokens(llm, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    llama = tmp_path_factory.mktemp("tp_llama")
    make_tiny_model(llama, "llama", hidden_size=96, num_attention_heads=6,
                    num_key_value_heads=3)  # 3 KV heads split 2 + 1
    qwen = tmp_path_factory.mktemp("tp_qwen2")
    make_tiny_model(qwen, "qwen2", tie_word_embeddings=True)
    return {"llama": str(llama), "qwen2": str(qwen)}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("spec", [None, "ngram", "draft_model"])
def test_tp2_matches_single_process(tiny_models, arch, spec):
    path = tiny_models[arch]
    kw = {"dtype": "float32", "kv_cache_memory": 2**20, "block_size": 4}
    if spec:
        kw["speculative_config"] = {"method": spec, "num_speculative_tokens": 3,
                                    "adaptive": False}
    want = _tokens(LLM(path, **kw))
    with LLM(path, tensor_parallel_size=2, **kw) as llm:
        assert _tokens(llm) == want
        if spec:
            assert llm.engine.spec.stats.num_draft_tokens > 0


def test_tp2_int8_pool_and_prompt_logprobs_match_single_process(tiny_models):
    """Each rank's int8 pool holds its KV heads' rows (codes and scale a row, as one process
    writes them), and rank 0's logits give the prompt log-probabilities: the same tokens and
    log-probabilities as one process."""
    path = tiny_models["llama"]
    kw = {"dtype": "float32", "kv_cache_memory": 2**20, "block_size": 4,
          "kv_cache_dtype": "int8"}
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=2)
    want = LLM(path, **kw).generate(PROMPTS, sp, use_tqdm=False)
    with LLM(path, tensor_parallel_size=2, **kw) as llm:
        got = llm.generate(PROMPTS, sp, use_tqdm=False)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.prompt_logprobs[0] is None and len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for ea, eb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert ea.keys() == eb.keys()
            assert all(abs(ea[t] - eb[t]) < 1e-4 for t in ea)


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_tp2_default_model_matches_single_process(spec):
    prompts = ["The capital of France is", "def add(a, b):"]
    kw = {"dtype": "float32", "kv_cache_memory": "32MiB"}
    if spec:  # fixed k: the adaptive controller decides from wall times and may not draft
        kw["speculative_config"] = {"method": spec, "num_speculative_tokens": 3, "adaptive": False}
    want = _tokens(LLM(**kw), prompts)
    with LLM(tensor_parallel_size=2, **kw) as llm:  # 3 KV heads over 2 ranks
        assert _tokens(llm, prompts) == want
        if spec:
            assert llm.engine.spec.stats.num_draft_tokens > 0


def test_dead_worker_fails_clearly(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32", kv_cache_memory=2**20,
              tensor_parallel_size=2)
    try:
        proc = llm.engine._tp_procs[0]
        proc.kill()
        proc.join(timeout=30)
        with pytest.raises(WorkerDiedError, match="exited"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


def test_dead_worker_server_fails_clearly(tiny_models):
    """Behind the HTTP server: the request fails with an error, /health turns 503."""
    import httpx
    import openai

    from tests.test_server import MODEL, running_server

    llm = LLM(tiny_models["llama"], dtype="float32", kv_cache_memory=2**20,
              tensor_parallel_size=2)
    try:
        with running_server(llm) as srv:
            assert httpx.get(srv.url + "/health").status_code == 200
            proc = llm.engine._tp_procs[0]
            proc.kill()
            proc.join(timeout=30)
            with pytest.raises(openai.InternalServerError, match="exited"):
                srv.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4)
            assert httpx.get(srv.url + "/health").status_code == 503
    finally:
        llm.shutdown()


def test_a_second_tp_engine_after_the_first_is_deleted(tiny_models):
    """The first engine's process group ends with it (here: garbage collection, no
    shutdown call), so a second one in the same process starts and gives the same tokens."""
    import gc

    kw = {"dtype": "float32", "kv_cache_memory": 2**20, "block_size": 4,
          "tensor_parallel_size": 2}
    llm = LLM(tiny_models["llama"], **kw)
    first = _tokens(llm)
    procs = list(llm.engine._tp_procs)
    del llm
    gc.collect()
    assert not any(p.is_alive() for p in procs)
    with LLM(tiny_models["llama"], **kw) as again:
        assert _tokens(again) == first


def test_a_worker_dying_while_starting_fails_at_once(tiny_models):
    """Not after the 120 s store timeout: rank 0 watches the workers while they join."""
    import multiprocessing
    import threading
    import time

    result = {}

    def start():
        try:
            result["llm"] = LLM(tiny_models["llama"], dtype="float32", kv_cache_memory=2**20,
                                tensor_parallel_size=2)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            result["error"] = e

    t0 = time.monotonic()
    thread = threading.Thread(target=start)
    thread.start()
    while not multiprocessing.active_children():
        assert thread.is_alive()
        time.sleep(0.005)
    multiprocessing.active_children()[0].kill()  # still importing torch: it never joins
    thread.join(timeout=60)
    assert not thread.is_alive()
    if "llm" in result:  # it had joined already: too late a kill to test anything here
        result["llm"].shutdown()
        pytest.fail("the worker joined before it could be killed")
    assert isinstance(result["error"], WorkerDiedError) and "while starting" in str(
        result["error"])
    assert time.monotonic() - t0 < 30
    with LLM(tiny_models["llama"], dtype="float32", kv_cache_memory=2**20,
             tensor_parallel_size=2) as llm:  # and the process can start one again
        assert _tokens(llm, PROMPTS[:1])


def test_tp2_phi3_partial_rotation_and_window(tmp_path):
    """Phi-3's fused projections split per rank after their rows are laid out for a partly
    rotating head, and a window in every layer: each rank's heads as one process has them."""
    from tests.test_phi3 import phi3_config, random_phi3

    config = phi3_config(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "partial_rotary_factor": 0.75}, sliding_window=12)
    random_phi3(config).save_pretrained(tmp_path)
    kw = {"dtype": "float32", "kv_cache_memory": 2**20, "block_size": 4}
    want = _tokens(LLM(str(tmp_path), **kw))
    with LLM(str(tmp_path), tensor_parallel_size=2, **kw) as llm:
        assert _tokens(llm) == want
