"""Random, valid GGUF blocks of every packable type, for kernel and model tests.

gguf's Python package dequantizes every type but quantizes only the 32-value ones, so K-quant
weights are made the way the file stores them: random code bytes with sane f16 scales. What
they mean is read back with gguf's reference dequantizer (gguf.quants.dequantize)."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from pagellm.layers import quant

# byte offsets of each block's f16 fields (scale d, and min / dmin where the type has one)
F16_FIELDS = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2],
              Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}


# the largest |code| a block's f16 scale multiplies (times the 6- or 8-bit sub-block scale)
_CODE_RANGE = {Q.Q8_0: 128, Q.Q4_0: 8, Q.Q4_1: 16, Q.Q5_0: 16, Q.Q5_1: 32, Q.Q4_K: 63 * 15,
               Q.Q5_K: 63 * 31, Q.Q6_K: 127 * 32}


def random_blocks(qtype, n: int, k: int, seed: int, scale: float = 0.05,
                  amplitude: float | None = None) -> quant.GGUFBlocks:
    """[n, k] of type qtype: random codes (and sub-block scales), f16 scales in (0, scale);
    amplitude instead: scales such that no weight exceeds about that (model-sized weights)."""
    if amplitude is not None:
        scale = amplitude / _CODE_RANGE[qtype]
    rng = np.random.default_rng(seed)
    values, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // values, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        field = rng.uniform(scale / 50, scale, (n, k // values)).astype(np.float16)
        raw[:, :, off:off + 2] = field.view(np.uint8).reshape(n, k // values, 2)
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
