"""Reading a llama.cpp GGUF file into transformers' names, shapes and config.

We parse the header ourselves instead of using `gguf.GGUFReader`: that reader slices a numpy
memmap once per vocabulary string and takes ~8 s on the default model's 49k-token vocabulary
(transformers' own GGUF config/model path uses it too and takes 10-35 s). Walking the header with
`struct` takes ~0.1 s. Block dequantization is a few in-place numpy ops (dequantize_blocks).
"""

from __future__ import annotations

import dataclasses
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quant_shape_to_byte_shape
from gguf.quants import quantize as gguf_quantize

from pagellm.layers import panels
from pagellm.layers.quant import (GGUF_PACKED_TYPES, GGUFBlocks, Int4Blocks, Int8Blocks,
                                  packable_types)
from pagellm.layers.rotary import partial_rotary_order

_Q = GGMLQuantizationType
# Stored as plain floats: handed out in their own dtype, no dequantization needed.
# numpy has no bfloat16, so its bits travel as uint16 until the final torch view.
_FLOAT_TYPES = {_Q.F32: (np.float32, torch.float32), _Q.F16: (np.float16, torch.float16),
                _Q.BF16: (np.uint16, torch.bfloat16)}
# Block formats: dequantized to float32 (Q8_0 / Q4_0 / Q4_1 by dequantize_blocks, the rest by
# gguf's reference code), or kept packed (quant.GGUF_PACKED_TYPES). Types with no native kernel
# (REQUANTIZED_TYPES: the low-bit K-quants, the i-quants of IQ* files, ternary TQ*) are read by
# gguf's dequantizer and, where a file's weights stay packed, quantized again to Q8_0 at load:
# the native kernels' type that holds their values most closely (rounding each to 1/254 of its
# 32-value block's largest), at half of bf16's memory. (IQ4_NL / IQ4_XS projections keep their
# codes where the panel kernels are built: _level_panels.) Others are refused, not mis-read.
_FAST_BLOCK_TYPES = {_Q.Q8_0, _Q.Q4_0, _Q.Q4_1}
REQUANTIZED_TYPES = frozenset({
    _Q.Q2_K, _Q.Q3_K, _Q.IQ1_S, _Q.IQ1_M, _Q.IQ2_XXS, _Q.IQ2_XS, _Q.IQ2_S, _Q.IQ3_XXS, _Q.IQ3_S,
    _Q.IQ4_NL, _Q.IQ4_XS, _Q.TQ1_0, _Q.TQ2_0})
_BLOCK_TYPES = _FAST_BLOCK_TYPES | {_Q.Q5_0, _Q.Q5_1, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K} | REQUANTIZED_TYPES

# GGUF metadata value types (gguf spec): fixed-size scalars, 8 = string, 9 = array.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

# GGUF architecture -> (transformers config class name, HF architecture name).
_ARCHITECTURES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                  "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
                  "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                  "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
                  "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
                  "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
                  "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
                  "phi3": ("Phi3Config", "Phi3ForCausalLM"),
                  "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}
# a `llama` file with experts is Mixtral's form (llama.cpp reads both as one architecture)
_LLAMA_MOE = ("MixtralConfig", "MixtralForCausalLM")

# config/tokenizer attribute prefix -> GGUF key `tokenizer.ggml.<name>_token_id`
_SPECIAL_TOKENS = {"bos": "bos", "eos": "eos", "pad": "padding", "unk": "unknown"}

# Tokens that end generation besides the file's EOS, where the vocabulary has them as special
# tokens (as llama.cpp reads a vocabulary): an instruct model's end of text or of turn (a Qwen2.5
# instruct file names <|im_end|> its EOS, yet ends a plain completion with <|endoftext|>), and a
# code model's fill-in-the-middle pad and file / repository separators (an infill is over there).
END_TOKEN_NAMES = frozenset((
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
    "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<fim_pad>", "<file_sep>", "<repo_name>",
    "<reponame>", "<EOT>", "\u2581<EOT>", "<\uff5cend\u2581of\u2581sentence\uff5c>"))
_END_BYTES = frozenset(n.encode() for n in END_TOKEN_NAMES)
_END_LENGTHS = frozenset(len(b) for b in _END_BYTES)
_END_TOKENS_FOUND = "pagellm.end_tokens"  # metadata key: the ids of END_TOKEN_NAMES in the file
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values of special tokens

_TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    # mixtures of experts (models/moe.py): the router, the shared expert and its gate
    "ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# an MoE layer's experts: one [experts, rows, cols] tensor a projection (each expert's rows lie
# together, so each becomes a 2-D tensor of its own over its slice of the bytes), or in older
# Mixtral files one tensor an expert (blk.N.ffn_gate.E.weight)
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_LEGACY_EXPERT = re.compile(r"blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight")
# Gemma's four norms a layer: its ffn_norm is the one before the MLP (Gemma 2 has no q/k norms)
_ARCH_BLOCK_NAMES = {"gemma3": {**_BLOCK_NAMES, "ffn_norm": "pre_feedforward_layernorm"}}
_ARCH_BLOCK_NAMES["gemma2"] = {k: v for k, v in _ARCH_BLOCK_NAMES["gemma3"].items()
                               if k not in ("attn_q_norm", "attn_k_norm")}
# Gemma's norms multiply by 1 + weight; llama.cpp's converter stores 1 + weight, which the
# loader gives back as the checkpoint's weight (as transformers reads such a file)
_NORM_SHIFTED = frozenset({"gemma3", "gemma2"})
# architectures whose q/k rows llama.cpp's converter permutes (LlamaModel's undo_permute)
PERMUTED_ARCHITECTURES = frozenset({"llama", "smollm3"})
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class _StringArray(NamedTuple):
    count: int
    end_tokens: list[int]  # indices of END_TOKEN_NAMES


@dataclass(frozen=True)
class GGUFTensor:
    gguf_name: str
    hf_name: str
    hf_shape: tuple[int, ...]  # torch order: ggml's dims reversed
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int  # bytes stored in the file
    rope_heads: int | None  # undo llama.cpp's q/k row permutation with this many heads
    minus_one: bool = False  # a Gemma norm: the file holds 1 + the checkpoint's weight
    # (heads, rotated dimensions of a head): q / k rows of a model that rotates part of each
    # head, laid out for a whole-head rotation (layers/rotary.partial_rotary_order)
    partial_rotary: tuple[int, int] | None = None


@dataclass(frozen=True)
class GGUFFile:
    path: str
    metadata: dict  # string arrays (vocabulary, merges) are kept as their length only
    tensors: list[GGUFTensor]

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]


def read_gguf(path: str) -> GGUFFile:
    """Parse header and tensor table; fail early (ValueError) on anything we cannot load."""
    blob = np.asarray(np.memmap(path, dtype=np.uint8, mode="r"))  # plain view: fast slicing
    if bytes(blob[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic bytes)")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", blob, 4)
    if version not in (2, 3):
        raise ValueError(f"{path} is GGUF version {version}; only versions 2 and 3 are supported")
    pos, metadata = 24, {}
    for _ in range(kv_count):
        key, pos = _read_string(blob, pos)
        (value_type,) = struct.unpack_from("<I", blob, pos)
        metadata[key], pos = _read_value(blob, pos + 4, value_type)
        if isinstance(metadata[key], _StringArray):  # kept as its length
            metadata[key], found = metadata[key]
            if key == "tokenizer.ggml.tokens":
                metadata[_END_TOKENS_FOUND] = found
    raw_tensors = []
    for _ in range(tensor_count):
        name, pos = _read_string(blob, pos)
        (n_dims,) = struct.unpack_from("<I", blob, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", blob, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        raw_tensors.append((name, tuple(reversed(dims)), ggml_type, offset))
    alignment = metadata.get("general.alignment", 32)
    data_start = (pos + alignment - 1) // alignment * alignment  # tensor data is aligned
    arch = metadata.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported "
                         f"(supported: {sorted(_ARCHITECTURES)})")
    tensors = [planned for name, shape, t, off in raw_tensors
               for planned in _plan_tensors(path, metadata, name, shape, t, data_start + off)]
    truncated = [t.gguf_name for t in tensors if t.offset + t.nbytes > blob.size]
    if truncated:
        raise ValueError(f"{path} is truncated: tensor data of {truncated[:3]} lies past its end")
    return GGUFFile(os.path.abspath(path), metadata, tensors)


def _read_string(blob: np.ndarray, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    return bytes(blob[pos + 8:pos + 8 + length]).decode("utf-8"), pos + 8 + length


def _read_value(blob: np.ndarray, pos: int, value_type: int):
    """One metadata value and the offset after it."""
    if value_type in _SCALAR_FORMATS:
        fmt = _SCALAR_FORMATS[value_type]
        return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)
    if value_type == _STRING:
        return _read_string(blob, pos)
    if value_type != _ARRAY:
        raise ValueError(f"unknown GGUF metadata value type {value_type}")
    item_type, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if item_type in _SCALAR_FORMATS:
        fmt = _SCALAR_FORMATS[item_type]
        return list(struct.unpack_from(f"<{count}{fmt[1]}", blob, pos)), pos + count * struct.calcsize(fmt)
    if item_type != _STRING:
        raise ValueError(f"GGUF metadata arrays of type {item_type} are not supported")
    # The tokenizer reads the vocabulary itself; here we only step over it (decoding 49k strings
    # would cost ~0.5 s for nothing) and keep its length, noting where END_TOKEN_NAMES are.
    found = []
    for i in range(count):
        (length,) = struct.unpack_from("<Q", blob, pos)
        if length in _END_LENGTHS and bytes(blob[pos + 8:pos + 8 + length]) in _END_BYTES:
            found.append(i)
        pos += 8 + length
    return _StringArray(count, found), pos


def _plan_tensors(path, metadata, name, shape, ggml_type, offset) -> list[GGUFTensor]:
    """The file's tensor as the checkpoint's: one, an MoE layer's [experts, rows, cols]
    projection as one 2-D tensor an expert (mlp.experts.E.<proj>.weight), or a fused
    projection (Phi-3's attn_qkv, and its ffn_up holding gate and up) as its parts."""
    match = _BLOCK_TENSOR.fullmatch(name)
    if match is not None and metadata.get("general.architecture") == "phi3":
        parts = _phi3_parts(metadata, match.group(2), shape)
        if parts:
            return _split_rows(path, metadata, match, shape, ggml_type, offset, parts)
    if match is None or match.group(2) not in _EXPERT_NAMES:
        return [_plan_tensor(path, metadata, name, shape, ggml_type, offset)]
    if len(shape) != 3:
        raise ValueError(f"{path}: tensor {name} has shape {shape}; experts' tensors are 3-D")
    layer, part, kind = match.groups()
    _check_type(path, name, ggml_type)
    one = _plan_tensor(path, metadata, f"blk.{layer}.ffn_gate.weight", shape[1:], ggml_type, offset)
    return [dataclasses.replace(
        one, gguf_name=name, offset=offset + e * one.nbytes,
        hf_name=f"model.layers.{layer}.mlp.experts.{e}.{_EXPERT_NAMES[part]}.{kind}")
        for e in range(shape[0])]


def _phi3_parts(md: dict, part: str, shape) -> list[tuple[str, int]]:
    """Phi-3's fused projections as (the unfused part's llama.cpp name, its rows): q, k, v of
    attn_qkv; gate, then up, of ffn_up (llama.cpp's SwiGLU takes the first half as the gate,
    as transformers' Phi3MLP does). Other tensors: []."""
    if part == "attn_qkv":
        heads = md["phi3.attention.head_count"]
        head_dim = md["phi3.embedding_length"] // heads
        kv_rows = md.get("phi3.attention.head_count_kv", heads) * head_dim
        return [("attn_q", heads * head_dim), ("attn_k", kv_rows), ("attn_v", kv_rows)]
    if part == "ffn_up" and shape[0] == 2 * md["phi3.feed_forward_length"]:
        return [("ffn_gate", shape[0] // 2), ("ffn_up", shape[0] // 2)]
    return []


def _split_rows(path, metadata, match, shape, ggml_type, offset,
                parts: list[tuple[str, int]]) -> list[GGUFTensor]:
    """A fused tensor's rows as one tensor a part: blocks run along a row, so each part is
    its rows' bytes, whatever the type."""
    layer, fused, kind = match.groups()
    if len(shape) != 2 or sum(rows for _, rows in parts) != shape[0]:
        raise ValueError(f"{path}: tensor {match.group(0)} has shape {list(shape)}; its parts "
                         f"{[p for p, _ in parts]} need {sum(rows for _, rows in parts)} rows")
    _check_type(path, match.group(0), ggml_type)
    planned, start = [], 0
    for part, rows in parts:
        one = _plan_tensor(path, metadata, f"blk.{layer}.{part}.{kind}", (rows, shape[1]),
                           ggml_type, offset)
        planned.append(dataclasses.replace(one, gguf_name=match.group(0),
                                           offset=offset + start * (one.nbytes // rows)))
        start += rows
    return planned


def _check_type(path, name, ggml_type) -> None:
    if ggml_type not in _FLOAT_TYPES and ggml_type not in _BLOCK_TYPES:
        type_name = _Q(ggml_type).name if ggml_type in _Q._value2member_map_ else str(ggml_type)
        supported = sorted(t.name for t in (*_FLOAT_TYPES, *_BLOCK_TYPES))
        raise ValueError(f"{path}: tensor {name} has ggml type {type_name}; supported: {supported}")


def _plan_tensor(path, metadata, name, shape, ggml_type, offset) -> GGUFTensor:
    _check_type(path, name, ggml_type)
    arch, rope_heads = metadata["general.architecture"], None
    hf_name = _hf_name(path, name, arch)
    # llama.cpp's convert_hf_to_gguf.py permutes q/k rows (weights and biases) for the llama
    # architecture and those converted as it (smollm3); qwen2 is written in HF order.
    if arch in PERMUTED_ARCHITECTURES and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        rope_heads = metadata[f"{arch}.attention.head_count"]
    elif arch in PERMUTED_ARCHITECTURES and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        rope_heads = metadata.get(f"{arch}.attention.head_count_kv",
                                  metadata[f"{arch}.attention.head_count"])
    if ggml_type in _FLOAT_TYPES:
        nbytes = int(np.prod(shape)) * np.dtype(_FLOAT_TYPES[ggml_type][0]).itemsize
    else:
        nbytes = int(np.prod(quant_shape_to_byte_shape(shape, _Q(ggml_type))))
    minus_one = arch in _NORM_SHIFTED and hf_name.endswith("norm.weight")
    partial = None
    if arch == "phi3" and hf_name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight",
                                            "k_proj.bias")):
        heads = metadata["phi3.attention.head_count"]
        head_dim = metadata["phi3.embedding_length"] // heads
        rotated = metadata.get("phi3.rope.dimension_count", head_dim)
        if rotated != head_dim:
            partial = (shape[0] // head_dim, rotated)
    return GGUFTensor(name, hf_name, shape, _Q(ggml_type), offset, nbytes, rope_heads, minus_one,
                      partial)


def _model_rows(array, tensor: GGUFTensor):
    """A tensor's rows (or its blocks', codes' or scales' rows) in the order the model holds
    them: llama.cpp's q / k permutation undone; a partly rotating head laid out for a
    whole-head rotation."""
    if tensor.rope_heads is not None:
        array = undo_rope_permute(array, tensor.rope_heads)
    if tensor.partial_rotary is not None:
        heads, rotated = tensor.partial_rotary
        array = array[partial_rotary_order(heads, array.shape[0] // heads, rotated)]
    return array


def _yarn(path: str, md: dict, arch: str, key) -> dict:
    """YaRN rope scaling (Qwen2.5 / Qwen3 files made for 128k contexts) as transformers'
    `rope_scaling`: the factor, the context trained on, and the ramp's bounds where the file
    has its own; llama.cpp's defaults (ext_factor 1, attn_factor 1: the attention scaled by
    0.1 ln(factor) + 1) are transformers' too. A file that changes what transformers cannot
    express is refused."""
    rope = {"rope_type": "yarn", "factor": float(key("rope.scaling.factor")),
            "original_max_position_embeddings": int(key("rope.scaling.original_context_length"))}
    for gguf_name, hf_name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if f"{arch}.rope.scaling.{gguf_name}" in md:
            rope[hf_name] = float(md[f"{arch}.rope.scaling.{gguf_name}"])
    for gguf_name, default in (("yarn_ext_factor", (-1.0, 1.0)), ("attn_factor", (1.0,)),
                               ("yarn_attn_factor", (1.0,)), ("yarn_log_multiplier", (0.0,))):
        value = md.get(f"{arch}.rope.scaling.{gguf_name}")
        if value is not None and float(value) not in default:
            raise ValueError(f"{path}: {arch}.rope.scaling.{gguf_name} = {value} is not supported "
                             f"with yarn rope scaling (supported: {list(default)})")
    return rope


# Llama 3 rope scaling: per-frequency divisors of the rotary angles, read into the config.
ROPE_FREQS = "rope_freqs"
# Phi-3's LongRoPE: one divisor a frequency for contexts past the trained one, and one within
ROPE_FACTORS = {"rope_factors_long.weight": "rope_factors_long",
                "rope_factors_short.weight": "rope_factors_short"}


def _hf_name(path: str, gguf_name: str, arch: str = "llama") -> str:
    if gguf_name == "rope_freqs.weight":
        return ROPE_FREQS
    if gguf_name in ROPE_FACTORS:
        return ROPE_FACTORS[gguf_name]
    base, _, kind = gguf_name.rpartition(".")
    if base in _TOP_LEVEL_NAMES and kind == "weight":
        return f"{_TOP_LEVEL_NAMES[base]}.weight"
    legacy = _LEGACY_EXPERT.fullmatch(gguf_name)
    if legacy:
        layer, part, expert = legacy.groups()
        proj = _EXPERT_NAMES[part + "_exps"]
        return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    names = _ARCH_BLOCK_NAMES.get(arch, _BLOCK_NAMES)
    if match and match.group(2) in names:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{names[part]}.{kind}"
    # a tensor we would not use: refusing beats silently wrong outputs
    raise ValueError(f"{path}: GGUF tensor {gguf_name!r} has no transformers counterpart we support")


_LINEAR = re.compile(r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight")
_INT4_TYPES = {_Q.Q4_0, _Q.Q4_1}
_HEADS = {"model.embed_tokens.weight", "lm_head.weight"}


def has_packed_linears(gguf_file: GGUFFile) -> bool:
    """Whether any projection weight is stored in a block type this machine can keep packed
    (without a C compiler only Q4_0 / Q4_1: a K-quant file then runs dense, in float32 where
    dtype auto decides, instead of dense bf16 on CPUs without bf16 units)."""
    types = _packable_or_requantized()
    return any(t.ggml_type in types and _LINEAR.fullmatch(t.hf_name) for t in gguf_file.tensors)


def _packable_or_requantized() -> frozenset:
    """The types whose weights can stay packed here: packable_types(), and with the native
    kernels (Q8_0 among them) the types requantized to Q8_0."""
    types = packable_types()
    return types | REQUANTIZED_TYPES if _Q.Q8_0 in types else types


def _head(gguf_file: GGUFFile) -> GGUFTensor:
    """The LM head: the output tensor, or the embedding when there is none (tied)."""
    heads = {t.hf_name: t for t in gguf_file.tensors if t.hf_name in _HEADS}
    return heads.get("lm_head.weight", heads.get("model.embed_tokens.weight"))


def has_packed_head(gguf_file: GGUFFile) -> bool:
    """Whether the LM head is stored in a block type that can stay packed."""
    head = _head(gguf_file)
    return head is not None and head.ggml_type in GGUF_PACKED_TYPES | REQUANTIZED_TYPES


def iter_gguf_weights(gguf_file: GGUFFile, keep_packed: bool = False, keep_head: bool = False,
                      requantize: GGMLQuantizationType | None = None, keep_embedding: bool = False,
                      ) -> Iterator[tuple[str, torch.Tensor | Int4Blocks | Int8Blocks | GGUFBlocks]]:
    """Yield (HF name, tensor) one at a time, so peak memory is one dequantized tensor.
    keep_packed: projection weights of packable types come packed: Q4_0 / Q4_1 as Int4Blocks
    (codes, scales, zeros), the other types as GGUFBlocks (the file's bytes);
    keep_head: the LM head (a tied embedding too) likewise, Q8_0 as Int8Blocks.
    keep_embedding: an untied embedding of a packable type as GGUFBlocks (layers/embedding.py
    decodes the rows a step looks up).
    requantize: projections and the head stored in more bits a weight than this packed type
    are requantized to it first (packed or not, the same values: a draft model's cheaper form,
    SpeculativeConfig.draft_quantization). Whatever is to come packed in a REQUANTIZED_TYPES
    type comes as Q8_0 (the draft's requantize type instead where it has one)."""
    # np.asarray drops the memmap subclass: its per-slice bookkeeping is slow; pages stay mapped.
    blob = np.asarray(np.memmap(gguf_file.path, dtype=np.uint8, mode="r"))
    head = _head(gguf_file)
    for tensor in gguf_file.tensors:
        if tensor.hf_name == ROPE_FREQS or tensor.hf_name in ROPE_FACTORS.values():
            continue  # in the config (gguf_config)
        is_head, source, requantized = tensor is head, blob, False
        if (requantize is not None and (is_head or _LINEAR.fullmatch(tensor.hf_name))
                and tensor.ggml_type in GGUF_PACKED_TYPES
                and _BITS[tensor.ggml_type] > _BITS[requantize]):
            source, tensor = _requantize(blob, tensor, requantize)
            requantized = True
        linear = keep_packed and _LINEAR.fullmatch(tensor.hf_name)
        embedding = keep_embedding and not is_head and tensor.hf_name == "model.embed_tokens.weight"
        levels = bool(linear) and _level_panels(tensor, requantize)
        if tensor.ggml_type in REQUANTIZED_TYPES and not levels and (
                linear or embedding or (keep_head and is_head)):
            into = requantize if requantize is not None and (linear or is_head) else _Q.Q8_0
            source, tensor = _requantize(blob, tensor, into)
            requantized = True
        # requantized blocks stay GGUF blocks (Q4_1: 5 bits a weight; as Int4Blocks, float32
        # scales and zeros make it 6)
        if linear and tensor.ggml_type in _INT4_TYPES and not requantized:
            yield tensor.hf_name, _load_int4(source, tensor)
        elif keep_head and is_head and tensor.ggml_type == _Q.Q8_0:
            yield tensor.hf_name, _load_int8(source, tensor)
        elif levels:  # IQ4_NL / IQ4_XS projections: their own panels (layers/panels.py)
            yield tensor.hf_name, _load_blocks(source, tensor)
        elif (linear or (keep_head and is_head) or embedding) and tensor.ggml_type in GGUF_PACKED_TYPES:
            yield tensor.hf_name, _load_blocks(source, tensor)
        else:
            yield tensor.hf_name, _load_tensor(source, tensor)


def _level_panels(tensor: GGUFTensor, requantize: GGMLQuantizationType | None = None) -> bool:
    """Whether this IQ4_NL / IQ4_XS projection stays in its 4-bit codes (panels with the
    levels looked up in the kernel: AVX-512 BW + VNNI) instead of being requantized: also for
    a draft requantized to a type of as many bits or more (its codes are smaller and exact),
    not where tensor parallelism would cut IQ4_XS's 256-value blocks (a row-parallel half of
    8,960 inputs: 4,480, no whole blocks; such a part would go dense, Q8_0 cuts at 32)."""
    from pagellm import parallel

    t = tensor.ggml_type
    if t not in panels.LEVEL_FORMAT_OF or not panels.available():
        return False
    values, nbytes = GGML_QUANT_SIZES[t]
    if requantize is not None and nbytes * 8 / values > _BITS[requantize]:
        return False
    return (tensor.hf_shape[1] % values == 0
            and (parallel.tp_size() == 1 or values == 32))


# Bits a weight of each packed type (block bytes * 8 / block values).
_BITS = {t: GGML_QUANT_SIZES[t][1] * 8 / GGML_QUANT_SIZES[t][0] for t in GGUF_PACKED_TYPES}


def _requantize(blob: np.ndarray, tensor: GGUFTensor,
                ggml_type: GGMLQuantizationType) -> tuple[np.ndarray, GGUFTensor]:
    """The tensor's blocks dequantized and quantized again to ggml_type (gguf's own
    quantizer, rows in the file's order): (its bytes, the tensor described over them)."""
    rows, cols = tensor.hf_shape
    raw = blob[tensor.offset:tensor.offset + tensor.nbytes].reshape(rows, -1)
    block, size = GGML_QUANT_SIZES[ggml_type]
    out = np.empty((rows, cols // block * size), dtype=np.uint8)
    step = max(1, (1 << 22) // cols)  # ~16 MB of float32 at a time (a 262k-token embedding)
    for r in range(0, rows, step):
        dense = gguf_dequantize(raw[r:r + step], tensor.ggml_type).astype(np.float32, copy=False)
        out[r:r + step] = gguf_quantize(dense, ggml_type)
    out = out.reshape(-1)
    return out, dataclasses.replace(tensor, ggml_type=ggml_type, offset=0, nbytes=out.size)


def _load_blocks(blob: np.ndarray, tensor: GGUFTensor) -> GGUFBlocks:
    """The tensor's bytes, one row of blocks per output feature (rows in HF order)."""
    rows, cols = tensor.hf_shape
    raw = np.array(blob[tensor.offset:tensor.offset + tensor.nbytes]).reshape(rows, -1)
    return GGUFBlocks(torch.from_numpy(np.ascontiguousarray(_model_rows(raw, tensor))),
                      tensor.ggml_type, cols)


def _load_int8(blob: np.ndarray, tensor: GGUFTensor) -> Int8Blocks:
    """A Q8_0 matrix as int8 codes and float32 scales (w = scale * q, as in the file)."""
    block_size, type_size = GGML_QUANT_SIZES[tensor.ggml_type]
    rows, cols = tensor.hf_shape
    blocks = blob[tensor.offset:tensor.offset + tensor.nbytes].reshape(-1, type_size)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(rows, cols // block_size)
    codes = blocks[:, 2:].copy().view(np.int8).reshape(rows, cols)
    return Int8Blocks(torch.from_numpy(codes), torch.from_numpy(scale))


def _load_int4(blob: np.ndarray, tensor: GGUFTensor) -> Int4Blocks:
    """A Q4_0 / Q4_1 matrix as codes, scales and zeros in PyTorch's grouped int4 convention,
    w = (q - 8) * scale + zero: Q4_0 -> zero = 0; Q4_1 (w = d q + m) -> zero = m + 8 d."""
    block_size, type_size = GGML_QUANT_SIZES[tensor.ggml_type]
    rows, cols = tensor.hf_shape
    blocks = blob[tensor.offset:tensor.offset + tensor.nbytes].reshape(-1, type_size)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(rows, cols // block_size)
    if tensor.ggml_type == _Q.Q4_0:
        zero = np.zeros_like(scale)
    else:
        zero = blocks[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(scale.shape)
        zero += 8 * scale
    codes = _unpack_nibbles(blocks, np.empty((blocks.shape[0], block_size), dtype=np.uint8))
    codes = codes.reshape(rows, cols)
    # the same row order as the dequantized path
    codes, scale, zero = (np.ascontiguousarray(_model_rows(a, tensor))
                          for a in (codes, scale, zero))
    return Int4Blocks(torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(zero))


def _load_tensor(blob: np.ndarray, tensor: GGUFTensor) -> torch.Tensor:
    # numpy, not torch, for the copies and the permute: torch's intra-op threads made these
    # small ops several times slower whenever the 2 cores were busy.
    raw = blob[tensor.offset:tensor.offset + tensor.nbytes]
    if tensor.ggml_type in _FLOAT_TYPES:
        np_dtype, torch_dtype = _FLOAT_TYPES[tensor.ggml_type]
        array = np.array(raw).view(np_dtype)  # copy: own writable memory, not the file mapping
    elif tensor.ggml_type in _FAST_BLOCK_TYPES:
        torch_dtype = torch.float32
        array = dequantize_blocks(raw, tensor.ggml_type)
    else:
        torch_dtype = torch.float32
        array = gguf_dequantize(raw, tensor.ggml_type).astype(np.float32, copy=False)
    array = _model_rows(array.reshape(tensor.hf_shape), tensor)
    if tensor.minus_one:
        array = array.astype(np.float32) - np.float32(1)
        torch_dtype = torch.float32
    return torch.from_numpy(array).view(torch_dtype)


def dequantize_blocks(raw: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """Same arithmetic as gguf.quants.dequantize, so bit-identical (the tests check it), but
    whole-tensor numpy ops written in place: ~3x faster than gguf's 16-rows-at-a-time loop.
    (Not torch: its two intra-op threads slowed this ~5x when the machine was busy.)
    raw: [num_bytes] uint8 -> [num_blocks * 32] float32. Each 32-element block is
      Q8_0: f16 d, 32 x int8 q          -> d * q
      Q4_0: f16 d, 16 bytes of nibbles  -> d * (q - 8)
      Q4_1: f16 d, f16 m, 16 bytes      -> d * q + m
    where nibble byte j holds element j in its low half and element j + 16 in its high half."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    blocks = raw.reshape(-1, type_size)  # [num_blocks, type_size]
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [num_blocks, 1]
    if ggml_type == _Q.Q8_0:
        out = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
        out *= d
        return out.reshape(-1)
    out = _unpack_nibbles(blocks, np.empty((blocks.shape[0], block_size), dtype=np.float32))
    if ggml_type == _Q.Q4_0:
        out -= 8
        out *= d
    else:  # Q4_1
        out *= d
        out += blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    return out.reshape(-1)


def _unpack_nibbles(blocks: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Q4 blocks [num_blocks, type_size] -> their 32 codes (0..15) in `out` [num_blocks, 32]:
    the last 16 bytes hold element j in the low nibble of byte j and element j + 16 in its
    high nibble."""
    half = out.shape[1] // 2
    packed = blocks[:, blocks.shape[1] - half:]
    np.bitwise_and(packed, 0x0F, out=out[:, :half], casting="unsafe")
    np.right_shift(packed, 4, out=out[:, half:], casting="unsafe")
    return out


def undo_rope_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`, which reorders each head's rows from HF's rotate-half
    layout (all first halves, then all second halves) to interleaved pairs:
        gguf = hf.reshape(heads, 2, head_dim // 2, ...).swapaxes(1, 2)
    so hf = gguf.reshape(heads, head_dim // 2, 2, ...).swapaxes(1, 2). Works for biases too."""
    rows = weight.shape[0]
    unpermuted = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2)
    return np.ascontiguousarray(unpermuted).reshape(weight.shape)


def gguf_config(gguf_file: GGUFFile):
    """The transformers config transformers itself would build from this file's metadata."""
    import transformers

    md, arch = gguf_file.metadata, gguf_file.architecture
    config_class_name, hf_architecture = _ARCHITECTURES[arch]
    if arch == "llama" and md.get("llama.expert_count", 0):
        config_class_name, hf_architecture = _LLAMA_MOE

    def key(name, default=None):
        value = md.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"{gguf_file.path}: GGUF metadata lacks {arch}.{name}")
        return value

    scaling = md.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear", "yarn"):
        raise ValueError(f"{gguf_file.path}: rope scaling {scaling!r} is not supported "
                         "(supported: none, linear, yarn, and Llama 3's rope_freqs)")
    num_heads = key("attention.head_count")
    names = {t.hf_name: t for t in gguf_file.tensors}
    if "model.embed_tokens.weight" not in names:
        raise ValueError(f"{gguf_file.path} has no token_embd.weight tensor")
    kwargs = dict(
        architectures=[hf_architecture],
        hidden_size=key("embedding_length"),
        intermediate_size=key("feed_forward_length"),
        num_hidden_layers=key("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=key("attention.head_count_kv", num_heads),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
        rope_theta=key("rope.freq_base", 10000.0),
        max_position_embeddings=key("context_length"),
        # the embedding matrix is the truth; llama.vocab_size is optional metadata
        vocab_size=names["model.embed_tokens.weight"].hf_shape[0],
        tie_word_embeddings="lm_head.weight" not in names,
    )
    if scaling == "linear":
        kwargs["rope_scaling"] = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
    elif scaling == "yarn":
        kwargs["rope_scaling"] = _yarn(gguf_file.path, md, arch, key)
    if arch in PERMUTED_ARCHITECTURES:  # as transformers does: rope dimension == head_dim for llama only
        kwargs["head_dim"] = key("rope.dimension_count", kwargs["hidden_size"] // num_heads)
    if md.get(f"{arch}.expert_count", 0):
        kwargs.update(_moe_kwargs(gguf_file.path, md, arch, key, names))
    if arch in ("qwen2", "qwen3", "gemma3", "gemma2", "qwen2moe", "qwen3moe"):
        # a head's width need not be hidden / heads
        kwargs["head_dim"] = key("attention.key_length", kwargs["hidden_size"] // num_heads)
    if arch == "gemma3":
        kwargs.update(_gemma3_kwargs(md, kwargs, key))
    if arch == "gemma2":
        kwargs.update(_gemma2_kwargs(md, kwargs, key))
    if arch == "phi3":
        kwargs.update(_phi3_kwargs(gguf_file, kwargs, key, names))
    for token, gguf_key in _SPECIAL_TOKENS.items():
        if f"tokenizer.ggml.{gguf_key}_token_id" in md:
            kwargs[f"{token}_token_id"] = md[f"tokenizer.ggml.{gguf_key}_token_id"]
    ends = end_token_ids(md)
    if len(ends) > 1:  # as a Hub model lists them (generation_config.json's eos_token_id)
        kwargs["eos_token_id"] = ends
    config = getattr(transformers, config_class_name)(**kwargs)
    if ROPE_FREQS in names:  # Llama 3.x: the rotary embedding divides its frequencies by these
        tensor = names[ROPE_FREQS]
        blob = np.asarray(np.memmap(gguf_file.path, dtype=np.uint8, mode="r"))
        config.rope_freq_factors = _load_tensor(blob, tensor).float().reshape(-1).tolist()
    config._name_or_path = gguf_file.path  # as AutoConfig does for a folder: where it came from
    if f"{arch}.pooling_type" in md:  # an embedding model's (llama.cpp's enum)
        config.pooling_type = _POOLING_TYPES.get(md[f"{arch}.pooling_type"], "unknown")
    return config


def _phi3_kwargs(gguf_file: GGUFFile, kwargs: dict, key, names: dict) -> dict:
    """Phi-3's settings as llama.cpp reads them: the rotated share of a head (Phi-4-mini
    rotates 3/4 of it), the attention window, and LongRoPE from the file's two factor tensors
    (the trained context, and the cos / sin scale the file states)."""
    head_dim = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    out = {"partial_rotary_factor": key("rope.dimension_count", head_dim) / head_dim,
           "sliding_window": gguf_file.metadata.get("phi3.attention.sliding_window")}
    if "rope_factors_long" in names:
        blob = np.asarray(np.memmap(gguf_file.path, dtype=np.uint8, mode="r"))
        factors = {name: _load_tensor(blob, names[name]).float().reshape(-1).tolist()
                   for name in ROPE_FACTORS.values()}
        original = int(key("rope.scaling.original_context_length"))
        out["original_max_position_embeddings"] = original
        out["rope_scaling"] = {
            "rope_type": "longrope", "long_factor": factors["rope_factors_long"],
            "short_factor": factors["rope_factors_short"],
            "original_max_position_embeddings": original,
            "attention_factor": float(key("rope.scaling.attn_factor", 1.0)),
            "rope_theta": kwargs["rope_theta"],
            "partial_rotary_factor": out["partial_rotary_factor"]}
    return out


# llama.cpp's pooling types (an embedding model's GGUF states its own)
_POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


def _moe_kwargs(path: str, md: dict, arch: str, key, names: dict) -> dict:
    """A mixture of experts' settings as llama.cpp reads them (models/moe.py): every layer
    sparse, softmax routing over the top `expert_used_count`, renormalized over them for
    Mixtral and Qwen3-MoE, not for Qwen2-MoE, which adds its shared expert. A gating or
    weighting llama.cpp has for other MoE families is refused, naming the key."""
    gating = md.get(f"{arch}.expert_gating_func", 1)  # llama.cpp: 1 softmax, 2 sigmoid
    if gating != 1:
        raise ValueError(f"{path}: {arch}.expert_gating_func = {gating} is not supported "
                         "(supported: 1, softmax)")
    scale = md.get(f"{arch}.expert_weights_scale", 1.0)
    if float(scale) != 1.0:
        raise ValueError(f"{path}: {arch}.expert_weights_scale = {scale} is not supported "
                         "(supported: 1.0)")
    experts, used = int(key("expert_count")), int(key("expert_used_count"))
    if arch == "llama":  # Mixtral: the experts are as wide as feed_forward_length says
        return dict(num_local_experts=experts, num_experts_per_tok=used)
    # (older files state no widths, or 0: the tensors' rows are them, as llama.cpp reads them)
    routed = names.get("model.layers.0.mlp.experts.0.gate_proj.weight")
    shared = names.get("model.layers.0.mlp.shared_expert.gate_proj.weight")
    out = dict(num_experts=experts, num_experts_per_tok=used, decoder_sparse_step=1,
               mlp_only_layers=[], norm_topk_prob=arch == "qwen3moe",
               moe_intermediate_size=int(md.get(f"{arch}.expert_feed_forward_length", 0)
                                         or (routed.hf_shape[0] if routed else 0)))
    if arch == "qwen2moe":
        out["shared_expert_intermediate_size"] = int(
            md.get(f"{arch}.expert_shared_feed_forward_length", 0)
            or (shared.hf_shape[0] if shared else 0))
    return out


def _gemma2_kwargs(md: dict, kwargs: dict, key) -> dict:
    """Gemma 2's settings as llama.cpp reads them: every other layer local (the first one
    too) over the sliding window, one rotary base, soft-capped scores (50 unless the file
    says) and logits (30), the scores scaled as Gemma 3's (hidden / heads for the 46-layer
    27B)."""
    layers = kwargs["num_hidden_layers"]
    return dict(
        sliding_window=key("attention.sliding_window"),
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        query_pre_attn_scalar=(kwargs["hidden_size"] // kwargs["num_attention_heads"]
                               if layers == 46 else kwargs["head_dim"]),
        attn_logit_softcapping=float(md.get("gemma2.attn_logit_softcapping", 50.0)),
        final_logit_softcapping=float(md.get("gemma2.final_logit_softcapping", 30.0)))


def _gemma3_kwargs(md: dict, kwargs: dict, key) -> dict:
    """Gemma 3's settings as llama.cpp reads them: every sixth layer global (or the file's
    pattern), local layers over the sliding window with rotary base 10,000 and no scaling, the
    scores scaled by head_dim ** -0.5 (hidden / heads for the 62-layer 27B)."""
    layers, pattern = kwargs["num_hidden_layers"], md.get("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, (list, tuple)):  # one flag a layer: whether it is local
        if len(pattern) != layers:
            raise ValueError(f"gemma3.attention.sliding_window_pattern has {len(pattern)} flags "
                             f"for {layers} layers")
        types = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        if pattern < 1:
            raise ValueError(f"gemma3.attention.sliding_window_pattern is {pattern}; must be >= 1")
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(layers)]
    full = {"rope_type": "default", "rope_theta": kwargs.pop("rope_theta")}
    scaling = kwargs.pop("rope_scaling", None)
    if scaling:
        full.update(scaling)
    return dict(
        sliding_window=key("attention.sliding_window"), layer_types=types,
        query_pre_attn_scalar=(kwargs["hidden_size"] // kwargs["num_attention_heads"]
                               if layers == 62 else kwargs["head_dim"]),
        rope_parameters={"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": md.get("gemma3.rope.freq_base_swa", 10000.0)}},
        final_logit_softcapping=None, attn_logit_softcapping=None)


def end_token_ids(md: dict) -> list[int]:
    """The ids that end generation: the file's EOS first, then its end-of-turn / end-of-message
    ids and the special tokens named in END_TOKEN_NAMES."""
    ids = [md[f"tokenizer.ggml.{k}_token_id"] for k in ("eos", "eot", "eom")
           if f"tokenizer.ggml.{k}_token_id" in md]
    types = md.get("tokenizer.ggml.token_type")
    ids += [i for i in md.get(_END_TOKENS_FOUND, ())
            if types is None or types[i] in (_CONTROL, _USER_DEFINED)]
    return list(dict.fromkeys(int(i) for i in ids))


def gguf_tokenizer(gguf_file: GGUFFile):
    """transformers' conversion of the GGUF vocabulary, with special tokens checked against the
    file (the chat template comes from tokenizer.chat_template); None if the file has no vocabulary."""
    from transformers import PreTrainedTokenizerFast

    md = gguf_file.metadata
    if "tokenizer.ggml.model" not in md:
        return None
    # PreTrainedTokenizerFast, not AutoTokenizer: AutoTokenizer first builds the config through
    # transformers' slow GGUF reader (~9 s); this path reads only the vocabulary (~1.5 s).
    folder, name = os.path.split(gguf_file.path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
    for attr, gguf_key in _SPECIAL_TOKENS.items():
        token_id = md.get(f"tokenizer.ggml.{gguf_key}_token_id")
        if token_id is not None and getattr(tokenizer, f"{attr}_token_id") != token_id:
            setattr(tokenizer, f"{attr}_token", tokenizer.convert_ids_to_tokens(token_id))
    if tokenizer.chat_template is None and "tokenizer.chat_template" in md:
        tokenizer.chat_template = md["tokenizer.chat_template"]
    return tokenizer
