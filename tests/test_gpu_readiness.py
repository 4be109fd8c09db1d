"""The parts of the GPU path that run the same on the CPU: weights built in their own dtype, one
host buffer per step's index tensors, sampling and verification with a fixed number of host
transfers a step, the KV budget read once every model is loaded (after a profiling forward),
and the warm-up forwards. A CUDA run exercises the same code (tools/gpu_check.sh)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.sampling import sampler
from pagellm.sampling.sampler import SamplingRow
from tests.helpers import make_tiny_model

PROMPTS = [[5, 17, 33, 4, 90, 12, 7], [3, 3, 3], list(range(10, 51))]

_BUILD_PEAK = textwrap.dedent("""
    import json, resource, sys
    import torch, transformers
    from pagellm.models.loader import ModelFiles
    from pagellm.models.registry import build_model

    cfg = transformers.LlamaConfig(hidden_size=1024, intermediate_size=4096,
                                   num_hidden_layers=8, num_attention_heads=16,
                                   num_key_value_heads=16, vocab_size=32000,
                                   tie_word_embeddings=True, max_position_embeddings=512)
    cfg.architectures = ["LlamaForCausalLM"]
    dtype = getattr(torch, sys.argv[1])

    def weights():
        # one checkpoint tensor at a time, as the loaders hand them out (touched pages)
        h, i = cfg.hidden_size, cfg.intermediate_size
        yield "model.embed_tokens.weight", torch.full((cfg.vocab_size, h), 0.01, dtype=dtype)
        for n in range(cfg.num_hidden_layers):
            p = f"model.layers.{n}."
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                yield p + "self_attn." + name + ".weight", torch.full((h, h), 0.01, dtype=dtype)
            for name, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                yield p + "mlp." + name + ".weight", torch.full(shape, 0.01, dtype=dtype)
            for name in ("input_layernorm", "post_attention_layernorm"):
                yield p + name + ".weight", torch.ones(h, dtype=dtype)
        yield "model.norm.weight", torch.ones(cfg.hidden_size, dtype=dtype)

    files = ModelFiles(config=cfg, tokenizer=None, weights=weights, path="random")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model = build_model(files, dtype, torch.device("cpu"), 512, "none")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"growth": peak - before, "params": params,
                      "dtypes": sorted({str(p.dtype) for p in model.parameters()})}))
""")


def test_weights_are_built_in_the_target_dtype():
    """Building a float16 model never holds a float32 copy of it: the process's peak memory
    grows by the float16 weights and one checkpoint tensor, not by 4 bytes a parameter (the
    model used to be made in float32 and converted: 2x the float16 bytes at the peak)."""
    run = subprocess.run([sys.executable, "-c", _BUILD_PEAK, "float16"], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["dtypes"] == ["torch.float16"]
    params = got["params"]  # ~334 MB; a float32 build peaks at twice that
    assert got["growth"] < 1.35 * params, (got["growth"] / 2**20, params / 2**20)


def test_step_tensors_come_from_two_host_buffers(tiny_llama):
    """A step's six index tensors are views of two buffers (int64: ids, positions, slots;
    int32: query starts, lengths, block tables), so a GPU step uploads them in two copies;
    the slots are each token's place in its sequence's blocks."""
    path, _ = tiny_llama
    llm = LLM(path, dtype="float32", kv_cache_memory=2**20, block_size=4)
    eng = llm.engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, SamplingParams(max_tokens=3, temperature=0))
    eng.step()  # prefill; the next step decodes
    out = eng.scheduler.schedule()
    ids, pos, md = eng.runner.prepare(out)
    storage = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    assert storage(ids) == storage(pos) == storage(md.slot_mapping)
    assert storage(md.query_start_loc) == storage(md.seq_lens) == storage(md.block_tables)
    assert ids.dtype == pos.dtype == md.slot_mapping.dtype == torch.long
    assert md.block_tables.dtype == md.seq_lens.dtype == md.query_start_loc.dtype == torch.int32
    slots = []
    for i, (seq, n) in enumerate(zip(out.seqs, out.num_tokens)):
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            slots.append(seq.block_table[p // 4] * 4 + p % 4)
        assert md.block_tables[i, : len(seq.block_table)].tolist() == seq.block_table
    assert md.slot_mapping.tolist() == slots
    assert md.query_start_loc.tolist() == [0, *torch.tensor(out.num_tokens).cumsum(0).tolist()]
    assert md.seq_lens.tolist() == [s.num_computed_tokens + n
                                    for s, n in zip(out.seqs, out.num_tokens)]
    for i in range(len(PROMPTS)):  # the step is left unrun
        eng.abort_request(str(i))


class _HostReads:
    """Counts the tensor-to-Python reads (tolist, item, int, float): on a GPU each one waits
    for the device."""

    def __init__(self, monkeypatch):
        self.count = 0
        for name in ("tolist", "item", "__int__", "__float__"):
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counted(original))

    def _counted(self, fn):
        def wrapper(t, *args, **kwargs):
            self.count += 1
            return fn(t, *args, **kwargs)
        return wrapper


def _rows(n: int, vocab: int) -> list[SamplingRow]:
    kinds = [dict(temperature=0), dict(temperature=0.9, top_p=0.8, logprobs=3),
             dict(temperature=1.2, top_k=5), dict(temperature=0, logprobs=0),
             dict(temperature=0.7, min_p=0.1, seed=5, logprobs=1)]
    rows = []
    for i in range(n):
        params = SamplingParams(**kinds[i % len(kinds)])
        gen = torch.Generator().manual_seed(100 + i)
        rows.append(SamplingRow(params, [1, 2], [3], gen, 0))
    return rows


@pytest.mark.parametrize("n", [1, 5, 20])
def test_sampling_reads_the_host_a_fixed_number_of_times(monkeypatch, n):
    """Tokens and logprobs of any number of rows reach the host in at most four reads (one
    per row before: each sampled row's draw and each logprobs row's values waited for the
    device), and the batched draws are the row-by-row draws: the same generators give the
    same tokens and logprobs as sampling each row alone."""
    vocab = 300
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(n)) * 3
    alone = [sampler.sample(logits[i:i + 1], _rows(n, vocab)[i:i + 1]) for i in range(n)]
    reads = _HostReads(monkeypatch)
    together = sampler.sample(logits, _rows(n, vocab))
    assert reads.count <= 4, reads.count
    assert together.token_ids == [a.token_ids[0] for a in alone]
    assert together.logprobs == [a.logprobs[0] for a in alone]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_verification_reads_the_host_a_fixed_number_of_times(tiny_llama, monkeypatch,
                                                             temperature):
    """Verifying a step of many sequences (greedy or sampled, with logprobs) reads the host a
    fixed number of times, not once per sequence."""
    path, _ = tiny_llama
    llm = LLM(path, dtype="float32", kv_cache_memory=2**21, block_size=4,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_min": 1, "adaptive": False})
    spec = llm.engine.spec
    verify, calls = spec.verify, []

    def counted(seqs, logits, rng):
        before = reads.count
        result = verify(seqs, logits, rng)
        calls.append((len(seqs), reads.count - before))
        return result

    reads = _HostReads(monkeypatch)
    monkeypatch.setattr(spec, "verify", counted)
    prompts = [[7, 8, 9] * 6 + [i] for i in range(8)]
    llm.generate(prompts, SamplingParams(temperature=temperature, max_tokens=12, logprobs=2,
                                         seed=1, ignore_eos=True), use_tqdm=False)
    assert max(n for n, _ in calls) >= 4, calls
    assert max(r for _, r in calls) <= 5, calls


def test_budget_is_read_after_every_model_and_the_profiling_forward(tiny_llama, monkeypatch):
    """With warm-up on: the target and the draft model are built, then the largest step is
    profiled (one prompt of the token budget through each model), and only then is available
    memory read for the KV budget; the warm-up forwards (decode and each verification length,
    the draft's decode) follow on the engine's own pool. Output is what an engine without
    warm-up gives."""
    from pagellm.engine import llm_engine, memory, model_runner
    from pagellm.spec_decode import setup

    path, _ = tiny_llama
    events = []

    def record(name, fn, what=lambda *a, **k: None):
        def wrapper(*args, **kwargs):
            events.append((name, what(*args, **kwargs)))
            return fn(*args, **kwargs)
        return wrapper

    for module in (llm_engine, setup):
        monkeypatch.setattr(module, "build_model", record("build", module.build_model))
    monkeypatch.setattr(memory, "available_memory", record("available", memory.available_memory))
    monkeypatch.setattr(llm_engine, "profile_forward",
                        record("profile", llm_engine.profile_forward, lambda m, n, *a: n))
    monkeypatch.setattr(model_runner.ModelRunner, "forward",
                        record("forward", model_runner.ModelRunner.forward,
                               lambda self, ids, *a, **k: ids.shape[0]))
    kw = dict(dtype="float32", block_size=4, max_num_batched_tokens=40, max_num_seqs=6,
              speculative_config={"method": "draft_model", "model": path,
                                  "num_speculative_tokens": 3, "adaptive": False})
    llm = LLM(path, kv_cache_fraction=0.001, warmup=True, **kw)
    names = [e[0] for e in events]
    first_read = names.index("available")
    assert names[:first_read].count("build") == 2  # target and draft
    assert [e for e in events[:first_read] if e[0] == "profile"] == [("profile", 40)] * 2
    assert "build" not in names[first_read:]
    warm = [n for name, n in events[first_read:] if name == "forward"]
    assert warm == [6 * 1, 6 * 2, 6 * 3, 6 * 4, 6]  # decode, verification 2..4, the draft
    assert llm.engine.warmup_shapes == [(6, 1), (6, 2), (6, 3), (6, 4), (6, 1)]

    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    cold = LLM(path, kv_cache_memory=2**20, warmup=False, **kw)
    assert not hasattr(cold.engine, "warmup_shapes")
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in cold.generate(PROMPTS, sp, use_tqdm=False)]


def test_warmup_defaults_to_the_gpu_only(tiny_llama):
    path, _ = tiny_llama
    assert LLM(path, dtype="float32", kv_cache_memory=2**20).engine.warmup is False
    with pytest.raises(ValueError, match="warmup"):
        LLM(path, dtype="float32", kv_cache_memory=2**20, warmup="yes")


def test_a_budget_without_room_names_what_set_it(tiny_llama):
    path, _ = tiny_llama
    with pytest.raises(ValueError, match="kv_cache_fraction 1e-12 of available memory"):
        LLM(path, dtype="float32", kv_cache_fraction=1e-12)
    with pytest.raises(ValueError, match="kv_cache_memory 64 bytes holds no block"):
        LLM(path, dtype="float32", kv_cache_memory=64)


@pytest.mark.parametrize("flag, expected", [([], True), (["--warmup", "off"], False),
                                            (["--warmup", "on"], True)])
def test_the_server_warms_up_on_every_device_unless_told_not_to(monkeypatch, flag, expected):
    from pagellm import cli
    from pagellm.server import api_server

    seen = {}
    monkeypatch.setattr(api_server, "serve", lambda args, kwargs: seen.update(kwargs) or 0)
    assert cli.main(["serve", "model.gguf", *flag]) == 0
    assert seen["warmup"] is expected
    assert cli.engine_kwargs(cli_args(["generate", "hi"]))["warmup"] is None  # offline: auto


def cli_args(argv):
    import argparse

    from pagellm import cli

    p = argparse.ArgumentParser()
    cli.add_engine_args(p)
    p.add_argument("cmd")
    p.add_argument("prompt")
    return p.parse_args(argv)
