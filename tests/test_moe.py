"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) on tiny random models built here,
against transformers holding the same weights: Hugging Face folders and GGUF files (3-D expert
tensors in a Q4_K_M file's block types, a Mixtral file's one tensor an expert, the shared
expert and its gate), float32 logits and greedy tokens through batches, chunked prefill,
cached prefixes and speculative verification, the packed bfloat16 path within its
tolerance, tensor parallelism, and what is refused."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from pagellm import LLM, SamplingParams
from pagellm.kernels import native
from pagellm.lora import LoRARequest
from pagellm.models.moe import SparseMoE
from tests.gguf_files import finish, gguf_name, gguf_writer, llama_cpp_permute, random_blocks
from tests.helpers import assert_greedy_close, fused_layer_diffs, hf_greedy
from tests.test_gguf_models import _hf_logits, _prefill_logits

PROMPTS = [[5, 17, 33, 4, 90, 12, 7], list(range(10, 51)), [3, 3, 3, 60, 61, 62, 9, 9, 70, 71, 72, 3]]
NEW = 16
_SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              eos_token_id=2, bos_token_id=1)
# a GGUF file's K-quant rows are 256 values
_GGUF_SIZES = dict(hidden_size=256, intermediate_size=512)


def _config(arch: str, **kw):
    """qwen3_moe: 8 experts, 2 a row, renormalized, a head width of its own; mixtral: 4
    experts as wide as a dense MLP; qwen2_moe: 3 of 8 experts plus the shared one, the second
    layer dense (mlp_only_layers)."""
    kw = {**_SIZES, **kw}
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **kw, head_dim=kw["hidden_size"] // 2, moe_intermediate_size=kw["intermediate_size"] // 2,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
            architectures=["Qwen3MoeForCausalLM"])
    if arch == "mixtral":
        return transformers.MixtralConfig(**kw, num_local_experts=4, num_experts_per_tok=2,
                                          architectures=["MixtralForCausalLM"])
    only = kw.pop("mlp_only_layers", [1])
    return transformers.Qwen2MoeConfig(
        **kw, moe_intermediate_size=kw["intermediate_size"] // 2,
        shared_expert_intermediate_size=kw["intermediate_size"], num_experts=8,
        num_experts_per_tok=3, architectures=["Qwen2MoeForCausalLM"],
        mlp_only_layers=only)


def _random_model(config):
    """transformers' model of config with random weights; the routers' scores scaled up so
    that each row's experts are chosen by clear margins (random init gives near-uniform
    probabilities, where any rounding would reorder the experts)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(30)
    return model


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "qwen2_moe"])
def hf_folder(request, tmp_path_factory):
    model = _random_model(_config(request.param))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return str(path), model


def _assert_matches(llm, hf, prompts=PROMPTS) -> None:
    """Prefill logits within float32 rounding of transformers', and its greedy tokens for a
    batch of the prompts."""
    for prompt in prompts:
        ref = _hf_logits(hf, prompt)
        torch.testing.assert_close(_prefill_logits(llm, prompt), ref, atol=1e-4 * ref.abs().max(),
                                   rtol=1e-4)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NEW)


def test_float32_logits_and_greedy_tokens_match_transformers(hf_folder):
    path, hf = hf_folder
    llm = LLM(path, dtype="float32", kv_cache_memory=2**22)
    model = llm.engine.model
    sparse = [isinstance(layer.mlp, SparseMoE) for layer in model.layers]
    assert sparse == ([True, False] if hf.config.model_type == "qwen2_moe" else [True, True])
    _assert_matches(llm, hf)


def test_rows_take_different_experts_and_only_theirs_run(hf_folder, monkeypatch):
    """A step's rows spread over the experts (the test model routes), and an expert no row
    chose is never called."""
    path, _ = hf_folder
    llm = LLM(path, dtype="float32", kv_cache_memory=2**22)
    moe = next(layer.mlp for layer in llm.engine.model.layers if isinstance(layer.mlp, SparseMoE))
    chosen, called = [], []
    routing = moe.routing

    def spy_routing(x):
        weights, experts = routing(x)
        chosen.append(set(experts.reshape(-1).tolist()))
        return weights, experts

    monkeypatch.setattr(moe, "routing", spy_routing)
    for e, expert in enumerate(moe.experts):
        monkeypatch.setattr(expert, "forward", lambda x, e=e, f=expert.forward: (called.append(e), f(x))[1])
    llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    assert len(chosen[0]) > moe.top_k  # the prompt's rows do not all pick the same experts
    assert sorted(called) == sorted(e for step in chosen for e in step)


def test_chunks_cached_prefixes_and_speculation_match(tmp_path_factory):
    """A prompt prefilled in chunks of 5, again over its cached prefix, and with n-gram
    verification rows (several rows of one sequence routed in one step): transformers' tokens."""
    model = _random_model(_config("qwen3_moe"))
    path = tmp_path_factory.mktemp("moe_chunks")
    model.save_pretrained(path)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = PROMPTS[1]
    want = hf_greedy(model, prompt, 24)
    chunked = LLM(str(path), dtype="float32", kv_cache_memory=2**22, max_num_batched_tokens=5)
    for cached in (False, True):
        out = chunked.generate([prompt], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want and (out.num_cached_tokens > 0) == cached
    spec = LLM(str(path), dtype="float32", kv_cache_memory=2**22,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    repetitive = [7, 8, 9, 10] * 6
    assert spec.generate([repetitive], params, use_tqdm=False)[0].outputs[0].token_ids == \
        hf_greedy(model, repetitive, 24)
    assert spec.engine.spec.stats.num_draft_tokens > 0


def test_tensor_parallel_matches_one_process(tmp_path_factory):
    """Two gloo ranks, each holding half of every expert's rows, one reduction a block."""
    model = _random_model(_config("qwen2_moe", mlp_only_layers=[]))
    path = tmp_path_factory.mktemp("moe_tp")
    model.save_pretrained(path)
    kw = {"dtype": "float32", "kv_cache_memory": 2**20, "block_size": 4}
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(path), **kw).generate(PROMPTS, params, use_tqdm=False)]
    assert want[0] == hf_greedy(model, PROMPTS[0], NEW)
    with LLM(str(path), tensor_parallel_size=2, **kw) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == want


# GGUF: llama.cpp's names and a Q4_K_M file's block types (experts' gate|up Q4_K, down Q6_K)
_TYPES = {"q_proj": Q.Q5_0, "k_proj": Q.Q5_0, "v_proj": Q.Q8_0, "o_proj": Q.Q4_K,
          "gate_proj": Q.Q4_K, "up_proj": Q.Q4_K, "down_proj": Q.Q6_K}
_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
          "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
          "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp"}
_GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}


def _experts_state(model) -> dict[str, torch.Tensor]:
    """Each layer's experts as the checkpoint names them: layer -> {(expert, proj): [rows, cols]}."""
    out = {}
    for name, p in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):  # [experts, 2 * width, hidden]: gate, then up
            layer = int(name.split(".")[2])
            gate, up = p.chunk(2, dim=1)
            for e in range(p.shape[0]):
                out.setdefault(layer, {})[(e, "gate_proj")] = gate[e]
                out[layer][(e, "up_proj")] = up[e]
        elif name.endswith("experts.down_proj"):  # [experts, hidden, width]
            layer = int(name.split(".")[2])
            for e, d in enumerate(p):
                out.setdefault(layer, {})[(e, "down_proj")] = d
    return out


def write_gguf(path, arch: str, gating: int | None = None, widths: bool = True,
               expert_types: dict | None = None):
    """A random MoE model of `arch` in blocks (qwen3moe, qwen2moe: one [experts, rows, cols]
    tensor a projection; mixtral as a `llama` file of one tensor an expert, q/k rows in
    llama.cpp's order); returns transformers' model holding exactly the values the file means.
    expert_types: the experts' block type of each projection (default: _TYPES')."""
    expert_types = {**_TYPES, **(expert_types or {})}
    config = _config(arch, **_GGUF_SIZES, **({"mlp_only_layers": []} if arch == "qwen2_moe" else {}))
    model = _random_model(config)
    writer = gguf_writer(path, config, _GGUF_ARCH[arch], eos_token_id=2)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_expert_count(getattr(config, "num_experts", None) or config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if arch != "mixtral" and widths:  # (older files state no widths)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "qwen2_moe" and widths:
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if gating is not None:
        writer.add_uint32(f"{_GGUF_ARCH[arch]}.expert_gating_func", gating)
    state, seed = {}, 0

    def blocks(qtype, tensor):
        nonlocal seed
        seed += 1
        b = random_blocks(qtype, *tensor.shape, seed=seed, amplitude=0.12)
        return b, b.dequantize()

    for name, tensor in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        gname = gguf_name(name, _NAMES)
        part = name.split(".")[-2]
        qtype = (_TYPES.get(part) if ".layers." in name and name.endswith(".weight")
                 else Q.Q8_0 if name == "model.embed_tokens.weight" else Q.Q6_K if name == "lm_head.weight"
                 else None)
        if qtype is None:  # norms, biases, routers: float32, as llama.cpp keeps ffn_gate_inp
            state[name] = tensor
            writer.add_tensor(gname, tensor.numpy().astype(np.float32))
            continue
        b, values = blocks(qtype, tensor)
        state[name] = values
        raw = b.raw.numpy()
        if arch == "mixtral" and part in ("q_proj", "k_proj"):  # llama.cpp's q/k row order
            heads = config.num_attention_heads if part == "q_proj" else config.num_key_value_heads
            raw = llama_cpp_permute(raw, heads)
        writer.add_tensor(gname, np.ascontiguousarray(raw), raw_dtype=qtype)
    for layer, experts in _experts_state(model).items():
        n = 1 + max(e for e, _ in experts)
        values = {}
        for proj, gguf_part in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
            made = [blocks(expert_types[proj], experts[(e, proj)]) for e in range(n)]
            values[proj] = torch.stack([v for _, v in made])
            if arch == "mixtral":  # an older Mixtral file: one tensor an expert
                for e, (b, _) in enumerate(made):
                    writer.add_tensor(f"blk.{layer}.{gguf_part}.{e}.weight",
                                      np.ascontiguousarray(b.raw.numpy()), raw_dtype=expert_types[proj])
            else:
                raw = np.stack([b.raw.numpy() for b, _ in made])  # [experts, rows, row bytes]
                writer.add_tensor(f"blk.{layer}.{gguf_part}_exps.weight", raw,
                                  raw_dtype=expert_types[proj])
        prefix = f"model.layers.{layer}.mlp.experts."
        state[prefix + "gate_up_proj"] = torch.cat([values["gate_proj"], values["up_proj"]], dim=1)
        state[prefix + "down_proj"] = values["down_proj"]
    model.load_state_dict(state, strict=False)
    finish(writer)
    return model


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe", "mixtral"])
def tiny_gguf(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param + "_gguf") / "tiny.gguf"
    return str(path), write_gguf(path, request.param)


def test_gguf_config_and_float32_match_transformers(tiny_gguf):
    path, hf = tiny_gguf
    llm = LLM(path, dtype="float32", kv_cache_memory=2**22)
    config = llm.engine.hf_config
    assert config.architectures == hf.config.architectures
    assert config.num_experts_per_tok == hf.config.num_experts_per_tok
    if config.model_type != "mixtral":
        assert config.moe_intermediate_size == hf.config.moe_intermediate_size
        assert config.norm_topk_prob == hf.config.norm_topk_prob
    _assert_matches(llm, hf)


@pytest.mark.skipif(not native.available(), reason="no C compiler on this machine")
def test_packed_default_path_is_close(tiny_gguf):
    """dtype auto: every expert's projections from the file's blocks, greedy tokens as
    float32's up to near ties, log-probabilities within the packed kernels' error (each
    expert's product ~1e-2 of its largest, as a dense model's; a row sums k experts' and its
    routing may break a near tie otherwise: 0.2 here, where a wrong expert is off by ~1)."""
    path, _ = tiny_gguf
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=2)
    packed = LLM(path, kv_cache_memory=2**22)
    n_packed, total = packed.engine.model.num_packed()
    assert packed.engine.dtype == torch.bfloat16 and n_packed == total
    want = LLM(path, dtype="float32", kv_cache_memory=2**22).generate(PROMPTS, params, use_tqdm=False)
    for ref, got in zip(want, packed.generate(PROMPTS, params, use_tqdm=False)):
        assert_greedy_close(ref.outputs[0], got.outputs[0], 0.2)


@pytest.mark.skipif(not native.available(), reason="no C compiler on this machine")
def test_experts_keep_the_files_blocks_alone(tmp_path):
    """dtype auto: each expert holds the file's blocks and nothing else (no dense or many-row
    copy: its packed bytes are the file's), and a product of more rows than its kernel takes
    runs in slices of rows, each row with the bits a one-row product gives it. A prompt long
    enough that experts get more rows than that matches float32's tokens."""
    from pagellm.models.gguf_loader import read_gguf

    path = tmp_path / "mixtral.gguf"
    write_gguf(path, "mixtral")
    file_bytes = sum(t.nbytes for t in read_gguf(str(path)).tensors if ".experts." in t.hf_name)
    llm = LLM(str(path), kv_cache_memory=2**22)
    experts = [m for layer in llm.engine.model.layers for e in layer.mlp.experts
               for m in (e.gate_up_proj, e.down_proj)]
    assert all(m.weight.device.type == "meta" and m.wide is None for m in experts)
    assert sum(m.packed.nbytes for m in experts) == file_bytes
    proj = experts[0]
    x = torch.randn(3 * proj.packed.max_rows, proj.in_features, generator=torch.Generator().manual_seed(0))
    assert torch.equal(proj(x), torch.cat([proj(row) for row in x.split(1)]))
    long_prompt = [(7 * i + 3) % 250 + 3 for i in range(150)]  # ~75 rows an expert
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    want = LLM(str(path), dtype="float32", kv_cache_memory=2**22).generate([long_prompt], params,
                                                                            use_tqdm=False)
    got = llm.generate([long_prompt], params, use_tqdm=False)
    assert_greedy_close(want[0].outputs[0], got[0].outputs[0], 0.2)


@pytest.mark.skipif(not native.available(), reason="no C compiler on this machine")
def test_native_experts_and_the_fused_attention_equal_the_module_path(tiny_gguf, monkeypatch):
    """dtype auto: each block's routed experts run in one native call (moe_experts), at any
    number of rows, and each layer's attention in the one-call layer, which stops before the
    MLP. The experts' sum equals the module path's (each expert's rows gathered, multiplied,
    added back in PyTorch) within float32 rounding; every layer of every decode step equals
    the module path from the same input and cache (int16 panels: 1e-4 of the largest, as a
    dense layer's)."""
    monkeypatch.setenv("PAGELLM_PANELS_INT8", "0")
    path, _ = tiny_gguf
    llm = LLM(path, kv_cache_memory=2**22, block_size=4)
    layers = llm.engine.model.layers
    assert all(layer.fused is not None and layer.mlp.native is not None for layer in layers)
    g = torch.Generator().manual_seed(0)
    for moe in (layer.mlp for layer in layers):
        for rows in (1, 3, 100):
            x = torch.randn(rows, moe.gate.shape[1], generator=g)
            got = moe(x)
            monkeypatch.setattr(moe, "native", None)
            want = moe(x)
            monkeypatch.undo()
            torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max(), rtol=0)
    diffs, kv_diffs = fused_layer_diffs(llm, PROMPTS)
    assert len(diffs) >= 5 * len(layers) and max(diffs) < 1e-4, diffs
    assert max(kv_diffs) < 1e-2, kv_diffs


@pytest.mark.skipif(not native.available(), reason="no C compiler on this machine")
@pytest.mark.parametrize("renormalize", [False, True])
def test_the_native_routing_is_the_top_k_by_softmax(renormalize):
    """moe_route: each row's k highest scores in descending order (a tie: the lower index
    first), and their softmax probabilities (over all experts, or renormalized over the k)
    as torch computes them."""
    lib = native.library()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 16, generator=g) * 3
    logits[0, 3] = logits[0, 9] = logits[0].max() + 1  # a tie for the top
    k = 4
    experts, rows = torch.empty(50, k, dtype=torch.int64), torch.empty(50, k, dtype=torch.int64)
    weights = torch.empty(50, k)
    assert lib.moe_route(logits.data_ptr(), 50, 16, k, int(renormalize), experts.data_ptr(),
                         weights.data_ptr(), rows.data_ptr()) == 0
    probs = logits.softmax(-1)
    want_w, want_e = probs.topk(k, dim=-1)
    if renormalize:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert experts[0, :2].tolist() == [3, 9]
    assert torch.equal(experts[1:], want_e[1:]) and torch.equal(rows, torch.arange(50)[:, None].expand(50, k))
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-7)
    assert lib.moe_route(logits.data_ptr(), 50, 16, 17, 0, experts.data_ptr(),
                         weights.data_ptr(), rows.data_ptr()) == -2


def test_a_file_stating_no_expert_widths_takes_them_from_its_tensors(tmp_path):
    """qwen2moe files converted before the width keys existed: the experts' and the shared
    expert's rows are their widths, as llama.cpp reads them."""
    path = tmp_path / "old.gguf"
    hf = write_gguf(path, "qwen2_moe", widths=False)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=2**22)
    config = llm.engine.hf_config
    assert (config.moe_intermediate_size, config.shared_expert_intermediate_size) == (
        hf.config.moe_intermediate_size, hf.config.shared_expert_intermediate_size)
    _assert_matches(llm, hf, PROMPTS[:1])


def test_a_router_or_expert_the_config_does_not_have_is_refused(tmp_path):
    """A transposed router (as many values, the wrong shape) and an expert past the config's
    count are refused at load, naming the tensor, not read as something else."""
    from safetensors.torch import load_file, save_file

    model = _random_model(_config("mixtral"))
    model.save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    state = load_file(str(file))
    name = "model.layers.0.block_sparse_moe.gate.weight"
    good = state[name]
    state[name] = good.t().contiguous()
    save_file(state, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.gate\.weight: weight: shape \(64, 4\)"):
        LLM(str(tmp_path), dtype="float32", kv_cache_memory=2**22)
    state[name] = good
    state["model.layers.1.block_sparse_moe.experts.4.w1.weight"] = state[
        "model.layers.1.block_sparse_moe.experts.0.w1.weight"].clone()
    save_file(state, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="layer 1 has 4 experts"):
        LLM(str(tmp_path), dtype="float32", kv_cache_memory=2**22)


@pytest.mark.skipif(not native.available(), reason="no C compiler on this machine")
def test_i_quant_experts_keep_their_codes(tmp_path):
    """Experts in IQ4_XS / IQ4_NL (i-quant MoE files) keep the file's 4-bit codes where the
    panel kernels are built (the panels: within 2% of the file's bytes), match transformers in
    float32, and the packed path stays within its tolerance."""
    from pagellm.layers import panels
    from pagellm.models.gguf_loader import read_gguf

    path = tmp_path / "iq4.gguf"
    hf = write_gguf(path, "qwen3_moe", expert_types={"gate_proj": Q.IQ4_XS, "up_proj": Q.IQ4_XS,
                                                     "down_proj": Q.IQ4_NL})
    _assert_matches(LLM(str(path), dtype="float32", kv_cache_memory=2**22), hf, PROMPTS[:1])
    llm = LLM(str(path), kv_cache_memory=2**22)
    experts = [m for layer in llm.engine.model.layers for e in layer.mlp.experts
               for m in (e.gate_up_proj, e.down_proj)]
    file_bytes = sum(t.nbytes for t in read_gguf(str(path)).tensors if ".experts." in t.hf_name)
    if panels.available():
        assert {m.packed.fmt for m in experts} == {panels.IQ4_XS8, panels.IQ4_NL8}
        assert sum(m.packed.nbytes for m in experts) <= 1.02 * file_bytes
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=2)
    want = LLM(str(path), dtype="float32", kv_cache_memory=2**22).generate(PROMPTS, params,
                                                                            use_tqdm=False)
    for ref, got in zip(want, llm.generate(PROMPTS, params, use_tqdm=False)):
        assert_greedy_close(ref.outputs[0], got.outputs[0], 0.2)


def test_other_gating_is_refused(tmp_path):
    """A file routing by another function (llama.cpp's sigmoid gating) is refused, named."""
    path = tmp_path / "sigmoid.gguf"
    write_gguf(path, "qwen3_moe", gating=2)
    with pytest.raises(ValueError, match="qwen3moe.expert_gating_func = 2 is not supported"):
        LLM(str(path), kv_cache_memory=2**22)


def test_attention_adapters_run_and_one_on_the_experts_is_refused(tmp_path):
    """LoRA on an MoE model's attention, as a PEFT folder and as llama.cpp's GGUF form (a
    Mixtral file is a `llama` one: lora_b of q/k permuted), gives transformers' tokens with the
    adapter merged; an adapter on the experts' MLP is refused, naming the layer."""
    from safetensors.torch import save_file

    from tests.test_lora import _gguf_adapter, write_adapter

    hf = _random_model(_config("mixtral"))
    hf.save_pretrained(tmp_path / "base")
    merged = write_adapter(tmp_path / "attn", hf, ("q_proj", "k_proj", "v_proj", "o_proj"))
    _gguf_adapter(tmp_path / "attn.gguf", tmp_path / "attn", "llama", hf.config)
    llm = LLM(str(tmp_path / "base"), dtype="float32", kv_cache_memory=2**22)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    for i, path in enumerate(("attn", "attn.gguf")):
        out = llm.generate([PROMPTS[0]], params, use_tqdm=False,
                           lora_request=LoRARequest(path, i + 1, str(tmp_path / path)))
        assert out[0].outputs[0].token_ids == hf_greedy(merged, PROMPTS[0], NEW)
    base = hf_greedy(hf, PROMPTS[0], NEW)
    assert base != hf_greedy(merged, PROMPTS[0], NEW)  # the adapter changes the tokens
    assert llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids == base
    folder = tmp_path / "mlp"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["gate_proj"]}))
    save_file({"base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight": torch.zeros(2, 64),
               "base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight": torch.zeros(96, 2)},
              str(folder / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="layer 0 gate_proj: adapters on a mixture of experts"):
        llm.generate([PROMPTS[0]], params, lora_request=LoRARequest("mlp", 3, str(folder)),
                     use_tqdm=False)


@pytest.mark.skipif(not native.available(), reason="no C compiler on this machine")
def test_tensor_parallel_packed_experts_from_a_gguf_file(tmp_path):
    """dtype auto over two gloo ranks: each rank keeps its share of every expert's file blocks
    (gate|up by outputs, down by whole blocks of inputs: Q8_0 here, as a 256-value K-quant
    row cut in half would go dense), and the greedy tokens and log-probabilities stay within
    the packed path's error of float32's in one process."""
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "qwen3_moe", expert_types={"down_proj": Q.Q8_0})
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=2)
    want = LLM(str(path), dtype="float32", kv_cache_memory=2**22).generate(
        PROMPTS, params, use_tqdm=False)
    with LLM(str(path), tensor_parallel_size=2, kv_cache_memory=2**22) as llm:
        assert llm.engine.dtype == torch.bfloat16
        n_packed, total = llm.engine.model.num_packed()  # rank 0's share, in this process
        assert n_packed == total
        got = llm.generate(PROMPTS, params, use_tqdm=False)
    for ref, out in zip(want, got):
        assert_greedy_close(ref.outputs[0], out.outputs[0], 0.2)
