"""Writing GGUF files in tests: llama.cpp's tensor names, the header of a transformers
config, and random, valid blocks of every packable type.

gguf's Python package dequantizes every type but quantizes only the 32-value ones, so K-quant
weights are made the way the file stores them: random code bytes with sane f16 scales. What
they mean is read back with gguf's reference dequantizer (gguf.quants.dequantize)."""
from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from pagellm.layers import quant

# byte offsets of each block's f16 fields (scale d, and min / dmin where the type has one)
F16_FIELDS = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2],
              Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}


# the types pagellm requantizes to Q8_0 (no native kernel): where their f16 fields lie
# (IQ1_M has none: its scale's 16 bits are the top nibbles of the 4 uint16 at byte 48)
REQUANTIZED_F16_FIELDS = {Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.IQ4_NL: [0], Q.IQ4_XS: [0],
                          Q.IQ3_S: [0], Q.IQ3_XXS: [0], Q.IQ2_XXS: [0], Q.IQ2_XS: [0],
                          Q.IQ2_S: [0], Q.IQ1_S: [0], Q.IQ1_M: [], Q.TQ1_0: [52], Q.TQ2_0: [64]}

# the largest |code| a block's f16 scale multiplies (times the 6- or 8-bit sub-block scale)
_CODE_RANGE = {Q.Q8_0: 128, Q.Q4_0: 8, Q.Q4_1: 16, Q.Q5_0: 16, Q.Q5_1: 32, Q.Q4_K: 63 * 15,
               Q.Q5_K: 63 * 31, Q.Q6_K: 127 * 32}


def random_blocks(qtype, n: int, k: int, seed: int, scale: float = 0.05,
                  amplitude: float | None = None) -> quant.GGUFBlocks:
    """[n, k] of type qtype: random codes (and sub-block scales), f16 scales in (0, scale);
    amplitude instead: scales such that no weight exceeds about that (model-sized weights;
    for the requantized types measured on the codes drawn, whose range has no simple bound)."""
    if qtype in REQUANTIZED_F16_FIELDS:
        if amplitude is not None:
            unit = np.abs(random_blocks(qtype, n, k, seed, scale=1.0).dequantize().numpy()).max()
            scale = amplitude / float(unit)
        fields = REQUANTIZED_F16_FIELDS[qtype]
    else:
        if amplitude is not None:
            scale = amplitude / _CODE_RANGE[qtype]
        fields = F16_FIELDS[qtype]
    rng = np.random.default_rng(seed)
    values, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // values, nbytes), dtype=np.uint8)
    for off in fields:
        field = rng.uniform(scale / 50, scale, (n, k // values)).astype(np.float16)
        raw[:, :, off:off + 2] = field.view(np.uint8).reshape(n, k // values, 2)
    if qtype == Q.IQ1_M:
        bits = rng.uniform(scale / 50, scale, (n, k // values)).astype(np.float16).view(np.uint16)
        words = raw[:, :, 48:56].copy().view(np.uint16)  # [n, blocks, 4]
        for i in range(4):
            words[:, :, i] = (words[:, :, i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
        raw[:, :, 48:56] = words.view(np.uint8)
    return quant.GGUFBlocks(torch.from_numpy(raw.reshape(n, -1)), qtype, k)


def sub_block_mins(blocks: quant.GGUFBlocks) -> np.ndarray:
    """[N, K / 32] the additive part m of each 32-value sub-block (w = s * c + m), decoded
    here from the block layout (ggml-quants.c), independently of the C kernel."""
    n, k = blocks.shape
    values, nbytes = blocks.unit
    raw = blocks.raw.numpy().reshape(n, k // values, nbytes)
    t = blocks.ggml_type
    if t in (Q.Q4_1, Q.Q5_1):
        return raw[:, :, 2:4].copy().view(np.float16).astype(np.float64).reshape(n, -1)
    if t in (Q.Q4_K, Q.Q5_K):
        dmin = raw[:, :, 2:4].copy().view(np.float16).astype(np.float64)  # [n, B, 1]
        sc = raw[:, :, 4:16].astype(np.int64)
        mins = np.concatenate([sc[:, :, 4:8] & 63,
                               (sc[:, :, 8:12] >> 4) | ((sc[:, :, 4:8] >> 6) << 4)], axis=-1)
        return (-dmin * mins).reshape(n, -1)
    return np.zeros((n, k // 32))


_BLOCK_NAMES = {  # transformers module -> llama.cpp name
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str, names: dict[str, str] | None = None) -> str:
    """llama.cpp's name of a transformers parameter; names: a layer's module -> llama.cpp's
    part, where an architecture's differ from Llama's."""
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{(names or _BLOCK_NAMES)[module]}.{kind}"


def llama_cpp_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for the llama architecture (rotate-half -> interleaved pairs
    per head), as its converter writes it; works on rows of block bytes too."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def gguf_writer(path, config, arch: str, eos_token_id: int) -> gguf.GGUFWriter:
    """A writer with the header a transformers config implies (tensors still to add)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    rope = config.rope_parameters  # Gemma 3: one entry a layer type, the global layers' in the file
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_eos_token_id(eos_token_id)
    return writer


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
