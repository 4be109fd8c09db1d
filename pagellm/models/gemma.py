"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's differences.

- The embedding's rows are multiplied by sqrt(hidden_size).
- Four norms a layer: before and after the attention, before and after the MLP; every norm
  multiplies by 1 + its weight (layers/norm.py's OffsetRMSNorm; a GGUF file, whose converter
  added the 1, is read back into the checkpoint's weights by the loader).
- The scores scaled by query_pre_attn_scalar ** -0.5.
- Local layers attend over a sliding window of the last `sliding_window` positions
  (config.layer_types): Gemma 3's five of every six, with their own rotary base (10,000);
  Gemma 2's every other one.
- Gemma 3 normalizes q and k per head before the rotation. Gemma 2 instead soft-caps the
  attention scores (softcap * tanh(s / softcap), attn_logit_softcapping) and the final logits
  (final_logit_softcapping); an argmax, which the cap keeps, skips it.
- The MLP gates with GELU (tanh approximation), not SiLU.

Steps of a few rows run each layer as one native call (kernels/cpu_layer.py, as the Llama
form does); larger ones run the modules, whose products, norms and attention are the same
native kernels (the many-row one-call layers, kernels/cpu_wide_layer.py, are the Llama form's
only).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm import lora
from pagellm.attention.base import AttentionBackend
from pagellm.layers.attention import PagedSelfAttention
from pagellm.layers.norm import OffsetRMSNorm
from pagellm.layers.rotary import RotaryEmbedding
from pagellm.models.llama import MLP, LlamaForCausalLM

SLIDING, FULL = "sliding_attention", "full_attention"


class GeluMLP(MLP):
    gelu = True  # the fused layer gates with GELU too (kernels/cpu_layer.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    llama_form = False  # no many-row one-call form (kernels/cpu_wide_layer.py)
    fused = wide_layer = None  # the few-row one (kernels/cpu_layer.py) once enabled

    def __init__(self, config, rotary: RotaryEmbedding, backend: AttentionBackend,
                 window: int | None, qk_norm: bool = True):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(h, eps)
        self.self_attn = PagedSelfAttention(
            h, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            bool(getattr(config, "attention_bias", False)), rotary, backend,
            qk_norm_eps=eps if qk_norm else None, window=window,
            scale=config.query_pre_attn_scalar ** -0.5,
            softcap=getattr(config, "attn_logit_softcapping", None))
        hd = config.head_dim
        if qk_norm:
            self.self_attn.q_norm, self.self_attn.k_norm = OffsetRMSNorm(hd, eps), OffsetRMSNorm(hd, eps)
        self.post_attention_layernorm = OffsetRMSNorm(h, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(h, eps)
        self.mlp = GeluMLP(h, config.intermediate_size, False)
        self.post_feedforward_layernorm = OffsetRMSNorm(h, eps)

    def forward(self, positions, x, md, out_rows=None):
        """As DecoderLayer.forward: out_rows, the rows whose output is wanted."""
        if (self.fused is not None and positions.dtype == torch.int64 and lora.STEP is None
                and self.fused.usable(x, md)):  # few rows: all of them
            x = self.fused(positions, x, md)
            return x if out_rows is None else x.index_select(0, out_rows)
        a = self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), md,
                                                          out_rows))
        x, h = self.pre_feedforward_layernorm.add_forward(
            x if out_rows is None else x.index_select(0, out_rows), a)
        return x + self.post_feedforward_layernorm(self.mlp(h))


class _RopeOf:
    """A config's view for one layer type's rotary: that type's rope parameters as the whole
    config's (transformers' rope initialisers read `rope_parameters`, or `rope_scaling` before
    transformers 5), the rest the config's own."""

    def __init__(self, config, params: dict):
        self._config = config
        self.rope_parameters = self.rope_scaling = params
        self.rope_theta = params.get("rope_theta", 10000.0)

    def standardize_rope_params(self) -> None:
        """Already one layer type's parameters (transformers 5 calls this on the config)."""

    def __getattr__(self, name):
        return getattr(self._config, name)


def _rope_parameters(config, layer_type: str) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type in params:  # transformers 5 (and a GGUF file's config): one entry a type
        return params[layer_type]
    # before transformers 5: the local layers' base apart, the global layers' scaling
    if layer_type == SLIDING:
        return {"rope_type": "default",
                "rope_theta": getattr(config, "rope_local_base_freq", 10000.0)}
    return {"rope_type": "default", **(getattr(config, "rope_scaling", None) or {}),
            "rope_theta": getattr(config, "rope_theta", 1e6)}


class Gemma3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

    def __init__(self, config, backend: AttentionBackend, max_position: int):
        if self.qk_norm:  # Gemma 3's configs carry the fields, unset
            for name in ("final_logit_softcapping", "attn_logit_softcapping"):
                if getattr(config, name, None) is not None:
                    raise ValueError(f"config.{name} is {getattr(config, name)}: Gemma 3 has no "
                                     "logit soft-capping (Gemma 2's config does)")
        super().__init__(config, backend, max_position)
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm.requires_grad_(False)
        self.embed_scale = config.hidden_size ** 0.5

    def _make_layers(self, config, backend, max_position, qkv_bias):
        types = list(getattr(config, "layer_types", None) or [FULL] * config.num_hidden_layers)
        rotaries = {t: RotaryEmbedding(_RopeOf(config, _rope_parameters(config, t)),
                                       config.head_dim, max_position) for t in set(types)}
        self.rotary = rotaries.get(FULL, next(iter(rotaries.values())))
        self.local_rotary = rotaries.get(SLIDING)
        return [Gemma3DecoderLayer(config, rotaries[t], backend,
                                   config.sliding_window if t == SLIDING else None)
                for t in types]

    def load_weights(self, weights) -> None:
        super().load_weights(weights)
        for m in self.modules():  # the weights were written in place: 1 + w made again
            if isinstance(m, OffsetRMSNorm):
                m.forget_scale()



class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2: Gemma 3's layers without q/k norms, one rotary for all layers, and the
    attention scores and final logits soft-capped."""
    qk_norm = False

    def __init__(self, config, backend: AttentionBackend, max_position: int):
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        super().__init__(config, backend, max_position)

    def _make_layers(self, config, backend, max_position, qkv_bias):
        types = list(getattr(config, "layer_types", None) or [FULL] * config.num_hidden_layers)
        self.rotary = RotaryEmbedding(config, config.head_dim, max_position)
        self.local_rotary = None
        return [Gemma3DecoderLayer(config, self.rotary, backend,
                                   config.sliding_window if t == SLIDING else None, qk_norm=False)
                for t in types]

    def compute_logits(self, hidden: torch.Tensor, argmax_only: bool = False) -> torch.Tensor:
        logits = super().compute_logits(hidden, argmax_only)
        if self.final_softcap and not argmax_only:  # monotone: an argmax needs none
            capped = torch.tanh(logits / self.final_softcap) * self.final_softcap
            # -inf stays -inf (a draft's ids past its vocabulary limit must never be drawn)
            logits = torch.where(torch.isinf(logits), logits, capped)
        return logits
