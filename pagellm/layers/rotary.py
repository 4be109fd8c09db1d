"""Rotary position embedding (the rotate-half layout of Hugging Face Llama checkpoints).

Frequencies come from transformers' rope initialisers, so llama3/linear/yarn scaling in a
config give the same angles as the reference implementation; a Llama 3 GGUF carries the same
scaling as per-frequency divisors (rope_freqs, config.rope_freq_factors).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn


def rotary_fraction(config) -> float:
    """The share of each head's dimensions that rotates (Phi-4-mini: 0.75), transformers'
    partial_rotary_factor (an attribute, or in rope_parameters since transformers 5)."""
    rope = getattr(config, "rope_parameters", None) or {}
    return float(getattr(config, "partial_rotary_factor", None)
                 or (rope.get("partial_rotary_factor") if isinstance(rope, dict) else None) or 1.0)


def rotated_dims(head_dim: int, fraction: float) -> int:
    """transformers' int(head_dim * partial_rotary_factor), robust to a factor a GGUF's
    rotated count divided out (30 / 44 * 44 = 29.999...)."""
    return int(head_dim * fraction + 1e-6)


def partial_rotary_order(heads: int, head_dim: int, rotary_dim: int) -> np.ndarray:
    """Rows of q or k (heads x head_dim) in the order that makes a head rotating only its
    first rotary_dim dimensions (transformers' pairs i, i + rotary_dim / 2) a whole-head
    rotation (pairs i, i + head_dim / 2): each half of the head holds half of the rotated
    pairs and then half of the dimensions that pass through, which the tables leave alone
    (cos 1, sin 0). Dot products of q and k are the same in any common order, so every
    path (modules, the one-call layers) rotates whole heads and gives transformers' scores."""
    r, half = rotary_dim // 2, head_dim // 2
    rest = (head_dim - rotary_dim) // 2
    one = np.concatenate([np.arange(r), rotary_dim + np.arange(rest),
                          r + np.arange(r), rotary_dim + rest + np.arange(rest)])
    assert len(one) == head_dim and half == r + rest
    return (np.arange(heads)[:, None] * head_dim + one[None, :]).reshape(-1)


def _inv_freq(config, head_dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        # LongRoPE (Phi-3): the short factors for contexts within the trained one, the long
        # ones past it. transformers picks by the sequence's length at each forward, llama.cpp
        # by the context it is given; here by the longest sequence this model serves
        # (max_model_len), for every sequence alike (the tables are shared).
        kw = {"seq_len": max_position} if rope_type == "longrope" else {}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kw)
        return inv_freq.float(), float(scaling)
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    dim = rotated_dims(head_dim, rotary_fraction(config))
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factors = getattr(config, "rope_freq_factors", None)
    if factors is not None:  # a Llama 3 GGUF's rope_freqs: llama.cpp divides each angle by one
        if len(factors) != inv_freq.numel():
            raise ValueError(f"rope_freqs has {len(factors)} values; head_dim {head_dim} needs "
                             f"{inv_freq.numel()}")
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int, max_position: int):
        super().__init__()
        # The angles in float32 on the host whatever the model is built in (registry builds
        # it in its own dtype, on its device), then placed where the model's tensors go.
        device, dtype = torch.get_default_device(), torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            with torch.device("cpu"):
                inv_freq, scaling = _inv_freq(config, head_dim, max_position)
                t = torch.arange(max_position, dtype=torch.float32)
                freqs = torch.outer(t, inv_freq.float())  # [max_position, rotated / 2]
                cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
                pad = head_dim // 2 - inv_freq.numel()
                if pad:  # a partial rotation: the rest passes through (partial_rotary_order)
                    cos = torch.cat((cos, torch.ones(max_position, pad)), dim=-1)
                    sin = torch.cat((sin, torch.zeros(max_position, pad)), dim=-1)
                cos = torch.cat((cos, cos), dim=-1)  # [max_position, head_dim]
        finally:
            torch.set_default_dtype(dtype)
        self.register_buffer("cos", cos.to(device), persistent=False)
        # rotate_half(x) * sin == roll(x, half) * [-sin, sin]: one roll instead of slices,
        # a negation and a cat, with the same products (a sign flip is exact).
        self.register_buffer("signed_sin", torch.cat((-sin, sin), dim=-1).to(device),
                             persistent=False)
        self._step_key: torch.Tensor | None = None

    _float32: tuple[torch.Tensor, torch.Tensor] | None = None

    def float32_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed_sin as float32 (the values the module path multiplies by), made
        once for every layer that shares this rotary (the fused layer's native code reads
        them): a copy per layer cost a 28-layer Qwen2.5 with 32,768 positions 896 MB."""
        if self._float32 is None:
            self._float32 = (self.cos.float().contiguous(), self.signed_sin.float().contiguous())
        return self._float32

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        x: torch.Tensor,  # [num_tokens, heads, head_dim]: q and k heads side by side
    ) -> torch.Tensor:  # [num_tokens, heads, head_dim]
        if self._step_key is not positions:  # every layer of a step shares one lookup
            self._step_key = positions
            self._step_cos = self.cos[positions].unsqueeze(1).to(x.dtype)  # [tokens, 1, hd]
            self._step_sin = self.signed_sin[positions].unsqueeze(1).to(x.dtype)
        half = x.shape[-1] // 2
        return x * self._step_cos + x.roll(half, dims=-1) * self._step_sin


class NoRotation(RotaryEmbedding):
    """A layer that rotates nothing (SmolLM3's every fourth layer, "NoPE"), in every path that
    rotates: tables of cos 1 and sin 0, so x * 1 + roll(x) * 0 gives x exactly (the module
    path, the fused layers' native rotation and the many-row layer's alike)."""

    def __init__(self, head_dim: int, max_position: int):
        nn.Module.__init__(self)
        device = torch.get_default_device()
        with torch.device("cpu"):
            cos = torch.ones(max_position, head_dim, dtype=torch.float32)
            sin = torch.zeros(max_position, head_dim, dtype=torch.float32)
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("signed_sin", sin.to(device), persistent=False)
        self._step_key = None
