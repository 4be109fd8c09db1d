"""LoRA adapters per request (pagellm/lora.py): PEFT folders written here over tiny random
models, against transformers holding the weights with the adapter merged (W + scale B A):
float32 logits and greedy tokens, batches that mix adapters and the base model, chunked
prefill, prefix-cache isolation between adapters, speculation, the packed GGUF path within
its tolerance, the server's --lora-modules, and the adapters that are refused."""
from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pagellm import LLM, LoRARequest, SamplingParams
from pagellm.kernels import native
from pagellm.server.api_server import OpenAIServer
from tests.helpers import assert_greedy_close, assert_no_leaks, hf_greedy, make_tiny_model
from tests.test_server import running_server, tiny_path, wait_idle  # noqa: F401

PROMPTS = [[5, 17, 33, 4, 90, 12, 7], list(range(10, 51)), [3, 3, 3, 60, 61, 62]]
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def write_adapter(folder, hf, targets, r=4, alpha=8.0, seed=0, rslora=False, **config):
    """A random PEFT adapter of `hf` at `folder`; returns transformers' model with it merged."""
    os.makedirs(folder, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    scale = alpha / r ** 0.5 if rslora else alpha / r
    tensors, merged = {}, copy.deepcopy(hf)
    for i, layer in enumerate(merged.model.layers):
        for proj in targets:
            kind = "self_attn" if proj in ATTN else "mlp"
            mod = getattr(getattr(layer, kind), proj)
            out, inp = mod.weight.shape
            a, b = torch.randn(r, inp, generator=g) * 0.3, torch.randn(out, r, generator=g) * 0.3
            tensors[f"base_model.model.model.layers.{i}.{kind}.{proj}.lora_A.weight"] = a
            tensors[f"base_model.model.model.layers.{i}.{kind}.{proj}.lora_B.weight"] = b
            with torch.no_grad():
                mod.weight += scale * b @ a
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets),
                   "bias": "none", "use_rslora": rslora, **config}, f)
    return merged


def _greedy(model, prompt):
    return hf_greedy(model, prompt, GREEDY.max_tokens)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    """The base model and two adapters: every projection (rsLoRA scale), and q/v only."""
    path = tmp_path_factory.mktemp(f"lora-{request.param}")
    hf = make_tiny_model(path, request.param)
    every = write_adapter(path / "every", hf, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                "up_proj", "down_proj"), rslora=True)
    qv = write_adapter(path / "qv", hf, ("q_proj", "v_proj"), r=2, alpha=4.0, seed=1)
    return str(path), hf, {"every": (LoRARequest("every", 1, str(path / "every")), every),
                           "qv": (LoRARequest("qv", 2, str(path / "qv")), qv)}


def test_each_request_gets_its_adapter(tiny):
    """One batch of the three (base, both adapters) on every prompt: each output is the
    merged model's, in float32; the prompt's logits too; chunks of 5 the same."""
    path, hf, adapters = tiny
    for kw in ({}, {"max_num_batched_tokens": 5}):
        llm = LLM(path, dtype="float32", kv_cache_memory=2**22, **kw)
        which = [None, "every", "qv"] * len(PROMPTS)
        prompts = [p for p in PROMPTS for _ in range(3)]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False,
                            lora_request=[adapters[w][0] if w else None for w in which])
        for prompt, w, out in zip(prompts, which, outs):
            model = adapters[w][1] if w else hf
            assert out.outputs[0].token_ids == _greedy(model, prompt), (w, prompt)
        assert_no_leaks(llm.engine)
    eng = llm.engine if not kw else LLM(path, dtype="float32", kv_cache_memory=2**22).engine
    prompt = PROMPTS[1]
    eng.add_request("r", prompt, SamplingParams(max_tokens=1), lora_request=adapters["every"][0])
    logits = eng.runner.execute(eng.scheduler.schedule(), list(range(len(prompt))))
    eng.abort_request("r")
    with torch.no_grad():
        ref = adapters["every"][1](torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4 * ref.abs().max(), rtol=1e-4)


def test_adapters_keep_their_cached_prefixes_apart(tiny):
    """The same prompt under another adapter (or none) finds nothing cached; under the same
    adapter it finds its own blocks, and the same tokens."""
    path, hf, adapters = tiny
    llm = LLM(path, dtype="float32", kv_cache_memory=2**22)
    prompt = PROMPTS[1]
    first = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=adapters["every"][0])[0]
    again = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=adapters["every"][0])[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    for other in (None, adapters["qv"][0]):
        out = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=other)[0]
        assert out.num_cached_tokens == 0
        assert out.outputs[0].token_ids == _greedy(adapters["qv"][1] if other else hf, prompt)


def test_speculation_keeps_an_adapters_output(tiny):
    path, _, adapters = tiny
    req = adapters["every"][0]
    llm = LLM(path, dtype="float32", kv_cache_memory=2**22,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    repetitive = [7, 8, 9, 10] * 6
    out = llm.generate(repetitive, GREEDY, use_tqdm=False, lora_request=req)[0]
    assert out.outputs[0].token_ids == _greedy(adapters["every"][1], repetitive)
    assert llm.engine.spec.stats.num_draft_tokens > 0


@pytest.mark.skipif(not native.available(), reason="no C compiler on this machine")
def test_the_packed_path_with_an_adapter(tmp_path):
    """A K-quant GGUF (packed bf16 path; the few-row and many-row native layers): the rows
    of an adapter run the modules with its products added, close to float32's; the others
    keep the packed path's own output."""
    from tests.test_gguf_models import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    hf = write_tiny_gguf(path, "qwen2")
    write_adapter(tmp_path / "ad", hf, ("q_proj", "v_proj", "down_proj"))
    req = LoRARequest("ad", 7, str(tmp_path / "ad"))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    f32 = LLM(str(path), dtype="float32", kv_cache_memory=2**22)
    packed = LLM(str(path), kv_cache_memory=2**22)
    assert packed.engine.model.num_packed()[0] > 0
    loras = [req, None, req]
    want = f32.generate(PROMPTS, params, use_tqdm=False, lora_request=loras)
    alone = packed.generate(PROMPTS[1], params, use_tqdm=False)[0]
    got = packed.generate(PROMPTS, params, use_tqdm=False, lora_request=loras)
    for ref, out in zip(want, got):
        assert_greedy_close(ref.outputs[0], out.outputs[0], 0.1)
    assert got[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_bad_adapters_are_refused(tiny, tmp_path):
    path, hf, adapters = tiny
    llm = LLM(path, dtype="float32", kv_cache_memory=2**22)
    cases = [("missing", {}, "does not exist"), ("dora", {"use_dora": True}, "use_dora"),
             ("bias", {"bias": "all"}, "biases")]
    for name, extra, match in cases:
        folder = tmp_path / name
        if name != "missing":
            write_adapter(folder, hf, ("q_proj",), **extra)
        with pytest.raises(ValueError, match=match):
            llm.generate(PROMPTS[0], GREEDY, use_tqdm=False,
                         lora_request=LoRARequest(name, 10 + len(name), str(folder)))
    other = make_tiny_model(tmp_path / "wider", "llama", hidden_size=128)  # shapes that do not fit
    write_adapter(tmp_path / "wide", other, ("q_proj",))
    with pytest.raises(ValueError, match=r"lora_A \(4, 128\)"):
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("wide", 40, str(tmp_path / "wide")))
    llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=adapters["qv"][0])
    with pytest.raises(ValueError, match="id 2 is already 'qv'"):
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("other", 2, adapters["every"][0].lora_path))
    with pytest.raises(ValueError, match="positive integer"):
        LoRARequest("x", 0, "/nowhere")
    assert_no_leaks(llm.engine)


def test_the_server_serves_adapters_by_model_name(tiny_path, tmp_path):  # noqa: F811
    """--lora-modules: /v1/models lists each adapter (its parent the base model); a chat
    request naming one gets what LLM.chat gives with it, the base name the base model's
    (another answer); an unknown name a 404 that lists what is served."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_path).float()
    write_adapter(tmp_path / "every", hf, ("q_proj", "v_proj", "o_proj", "down_proj"), alpha=32.0)
    req = LoRARequest("every", 1, str(tmp_path / "every"))
    llm = LLM(tiny_path, dtype="float32", kv_cache_memory=2**22)
    messages = [{"role": "user", "content": "Name a color."}]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = {name: llm.chat(messages, sp, use_tqdm=False, lora_request=r)[0].outputs[0].text
            for name, r in (("every", req), ("base", None))}
    assert want["every"] != want["base"]
    with running_server(llm, "base", lora_modules={"every": req.lora_path}) as srv:
        models = {m.id: m for m in srv.client.models.list().data}
        assert set(models) == {"base", "every"} and models["every"].parent == "base"
        for name in ("every", "base"):
            r = srv.client.chat.completions.create(model=name, messages=messages, max_tokens=12,
                                                   temperature=0, extra_body={"ignore_eos": True})
            assert r.choices[0].message.content == want[name], name
        with pytest.raises(Exception, match="`base`, `every`"):
            srv.client.completions.create(model="nope", prompt="x", max_tokens=1)
        wait_idle(srv)


def test_a_server_with_a_bad_adapter_does_not_start(tiny, tmp_path):
    path, _, _ = tiny
    llm = LLM(path, dtype="float32", kv_cache_memory=2**22)
    with pytest.raises(ValueError, match="does not exist"):
        OpenAIServer(llm.engine, "base", lora_modules={"x": str(tmp_path / "none")})


def _gguf_adapter(path, folder, arch: str, config) -> None:
    """The PEFT adapter at `folder` as llama.cpp's convert_lora_to_gguf.py writes it: lora_a
    and lora_b per projection, q/k's lora_b rows in llama.cpp's order for the llama form."""
    import gguf
    from safetensors.torch import load_file

    from tests.gguf_files import llama_cpp_permute

    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    cfg = json.load(open(os.path.join(folder, "adapter_config.json")))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, cfg["lora_alpha"])
    for name, t in sorted(load_file(os.path.join(folder, "adapter_model.safetensors")).items()):
        parts = name.split(".")
        layer, proj, kind = parts[4], parts[6], parts[7][-1].lower()
        data = t.numpy()
        if kind == "b" and arch == "llama" and proj in ("q_proj", "k_proj"):
            heads = config.num_attention_heads if proj == "q_proj" else config.num_key_value_heads
            data = llama_cpp_permute(data, heads)
        dtype = np.float16 if proj == "v_proj" else np.float32  # both kinds converters write
        writer.add_tensor(f"blk.{layer}.{names[proj]}.weight.lora_{kind}",
                          np.ascontiguousarray(data, dtype=dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_lora_file_is_its_peft_adapter(tiny, tmp_path):
    """llama.cpp's GGUF form of an adapter (lora_b of q/k permuted back for llama) gives what
    its PEFT folder gives; a file for another architecture is refused."""
    path, hf, adapters = tiny
    arch = hf.config.model_type
    req = adapters["every"][0]
    llm = LLM(path, dtype="float32", kv_cache_memory=2**22, enable_prefix_caching=False)
    cfg = json.load(open(os.path.join(req.lora_path, "adapter_config.json")))
    assert cfg["use_rslora"]  # llama.cpp's scale is alpha / r: the GGUF test adapter is plain
    plain = write_adapter(tmp_path / "plain", hf, ("q_proj", "k_proj", "v_proj", "down_proj"))
    _gguf_adapter(tmp_path / "plain.gguf", tmp_path / "plain", arch, hf.config)
    from_gguf = LoRARequest("g", 5, str(tmp_path / "plain.gguf"))
    for prompt in PROMPTS:
        out = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=from_gguf)[0]
        assert out.outputs[0].token_ids == _greedy(plain, prompt)
    other = "qwen2" if arch == "llama" else "llama"
    _gguf_adapter(tmp_path / "other.gguf", tmp_path / "plain", other, hf.config)
    with pytest.raises(ValueError, match=f"for architecture '{other}'"):
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("o", 6, str(tmp_path / "other.gguf")))
