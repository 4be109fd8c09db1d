"""A whole decoder layer in one native call (cpu_layer.c) for steps of a few rows."""
from __future__ import annotations

import ctypes

import torch

from pagellm.attention.base import AttentionMetadata
from pagellm.kernels import cpu_attention, native
from pagellm.layers.quant import NativeGGUF, NativePanels, NativeQ4, PackedParts, few_rows

_MAX_PARTS = 3  # cpu_layer.c MAX_PARTS
_PANELS = 1000  # cpu_layer.c PART_PANELS: + the panel format


class _Part(ctypes.Structure):  # cpu_layer.c part_t
    _fields_ = [("rows", ctypes.c_int64), ("type", ctypes.c_int64), ("w", ctypes.c_void_p),
                ("sm", ctypes.c_void_p), ("row_bytes", ctypes.c_int64)]


class _Projection(ctypes.Structure):  # cpu_layer.c proj_t
    _fields_ = [("nparts", ctypes.c_int64), ("parts", _Part * _MAX_PARTS), ("bias", ctypes.c_void_p)]


class _Ext(ctypes.Structure):  # cpu_layer.c layer_ext_t
    _fields_ = [("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("attn_out_norm", ctypes.c_void_p), ("mlp_out_norm", ctypes.c_void_p),
                ("gelu", ctypes.c_int64), ("window", ctypes.c_int64), ("softcap", ctypes.c_double),
                ("normed_out", ctypes.c_void_p)]


def _norms(layer) -> tuple:
    """The layer's norms as the C layer takes them: (before the attention, before the MLP,
    the attention's output, the MLP's output; the last two None in the Llama form)."""
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 2 / 3: four a layer
        return (layer.input_layernorm, layer.pre_feedforward_layernorm,
                layer.post_attention_layernorm, layer.post_feedforward_layernorm)
    return layer.input_layernorm, layer.post_attention_layernorm, None, None


def _parts(packed) -> list | None:
    """The packed form's parts as the C layer takes them (None: a form it does not take)."""
    forms = packed.parts if isinstance(packed, PackedParts) else [packed]
    if len(forms) > _MAX_PARTS:
        return None
    parts = []
    for f in forms:
        if isinstance(f, (NativeQ4, NativePanels)) and f.panels is not None:
            parts.append(_Part(f.out_features, _PANELS + f.fmt, f.panels.data_ptr(), None, 0))
        elif isinstance(f, NativeQ4):
            parts.append(_Part(f.codes.shape[0], 0, f.codes.data_ptr(), f.scale_min.data_ptr(), 0))
        elif isinstance(f, NativeGGUF):
            parts.append(_Part(f.raw.shape[0], f.ggml_type, f.raw.data_ptr(), None, f.raw.shape[1]))
        else:
            return None
    return parts


class FusedDecodeLayer:
    """Holds one decoder layer's weights as the C function wants them (models/llama.py's
    DecoderLayer, with or without per-head q/k norms, and models/gemma.py's layer). Built
    only for layers whose projections are all packed natively (NativeQ4, NativePanels,
    NativeGGUF, or parts of those), with float32 norms and biases, on one process."""

    def __init__(self, layer):
        attn, mlp = layer.self_attn, layer.mlp
        rot = attn.rotary
        self._keep = list(rot.float32_tables())  # one float32 copy for all layers
        self.layer = layer
        self.eps = layer.input_layernorm.eps
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale = attn.scale
        # a mixture of experts (models/moe.py): the call stops after the attention, and the
        # block's own native call (moe.NativeExperts) multiplies the experts
        self.experts = getattr(mlp, "native", None)
        self.intermediate = 0 if self.experts is not None else mlp.down_proj.weight.shape[1]
        linears = [attn.qkv_proj, attn.o_proj]
        if self.experts is None:
            linears += [mlp.gate_up_proj, mlp.down_proj]
        self._projs = (_Projection * 4)()
        for proj, m in zip(self._projs, linears):
            parts = _parts(m.packed)
            proj.nparts = len(parts)
            for i, part in enumerate(parts):
                proj.parts[i] = part
            proj.bias = None if m.bias is None else m.bias.data_ptr()
        self.max_rows = min(m.packed.max_rows for m in linears)
        scales = [None if n is None else n.scale() for n in _norms(layer)]
        qk = [None if n is None else n.scale() for n in (attn.q_norm, attn.k_norm)]
        self._keep += [t for t in scales + qk if t is not None]  # what the pointers point at
        self._norms = tuple(t.data_ptr() for t in scales[:2])
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        self._ext = _Ext(ptr(qk[0]), ptr(qk[1]), ptr(scales[2]), ptr(scales[3]),
                         int(hasattr(mlp, "gelu")), attn.window or 0, attn.softcap or 0.0)

    @staticmethod
    def supports(layer) -> bool:
        from pagellm import parallel
        from pagellm.attention.torch_paged import TorchPagedAttention

        attn, mlp = layer.self_attn, layer.mlp
        linears = [attn.qkv_proj, attn.o_proj]
        if hasattr(mlp, "gate_up_proj"):
            linears += [mlp.gate_up_proj, mlp.down_proj]
        elif getattr(mlp, "native", None) is None:  # a mixture of experts without its native form
            return False
        norms = [n for n in (*_norms(layer), attn.q_norm, attn.k_norm) if n is not None]
        # the C layer attends itself over the CPU backend's head-major pool: only there
        return (native.available() and parallel.tp_size() == 1
                and isinstance(attn.backend, TorchPagedAttention)
                and all(m.packed is not None and _parts(m.packed) is not None
                        and (m.bias is None or m.bias.dtype == torch.float32) for m in linears)
                and all(n.scale().dtype == torch.float32 for n in norms))

    def usable(self, x: torch.Tensor, md: AttentionMetadata) -> bool:
        attn = self.layer.self_attn
        # the packed kernels' few-row regime; larger steps (prefill, big batches) take modules
        return (x.dtype == torch.float32 and few_rows(x.shape[0], self.max_rows)
                and x.is_contiguous()
                and attn.k_cache is not None
                and attn.k_cache.dtype in cpu_attention.POOL_DTYPES
                and attn.k_cache.permute(2, 0, 1, 3).is_contiguous()
                and attn.v_cache.permute(2, 0, 1, 3).is_contiguous() and _step_ok(md))

    def __call__(self, positions: torch.Tensor, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        attn = self.layer.self_attn
        kvh, nb, bs, _ = attn.k_cache.permute(2, 0, 1, 3).shape
        seqs = md.cache["fused_seqs"]
        h = None
        if self.experts is not None:  # norm(x + attention) comes out for the experts
            h = torch.empty_like(x)
            self._ext.normed_out = h.data_ptr()
        rc = native.library().decode_layer_ext(
            x.data_ptr(), x.shape[0], x.shape[1], self.eps, *self._norms, ctypes.addressof(self._projs),
            self.intermediate, self.heads, self.kv_heads, self.head_dim,
            self._keep[0].data_ptr(), self._keep[1].data_ptr(), positions.data_ptr(),
            attn.k_cache.data_ptr(), attn.v_cache.data_ptr(), nb, bs,
            md.slot_mapping.data_ptr(), md.block_tables.data_ptr(), md.block_tables.shape[1],
            md.seq_lens.data_ptr(), md.query_start_loc.data_ptr(), seqs.data_ptr(), seqs.numel(),
            self.scale, torch.get_num_threads(), cpu_attention.kv_kind(attn.k_cache),
            ctypes.addressof(self._ext))
        if rc != 0:
            raise MemoryError("decode_layer: out of memory for its buffers")
        if self.experts is not None:
            return x + self.layer.mlp(h)
        return x


def _step_ok(md: AttentionMetadata) -> bool:
    """Whether the step's metadata has the dtypes and layout the kernel reads (decided once
    per step; the sequence list is made then too)."""
    ok = md.cache.get("fused_ok")
    if ok is None:
        ok = (md.slot_mapping.dtype == torch.int64 and md.slot_mapping.is_contiguous()
              and all(t.dtype == torch.int32 and t.is_contiguous()
                      for t in (md.block_tables, md.seq_lens, md.query_start_loc)))
        md.cache["fused_ok"] = ok
        md.cache["fused_seqs"] = torch.arange(md.num_seqs, dtype=torch.int32)
    return ok


def gate_up_silu_bf16(gate_up_proj, x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up [..., I] bf16 of x through a gate | up projection's bf16 many-row form:
    gated inside an int8 product where it has one (q32.Q32Linear.gated, the same bits),
    else its bf16 output through silu_mul_bf16."""
    q = gate_up_proj.q32
    if q is not None and q.gates:
        return q.gated(x)
    return silu_mul_bf16(gate_up_proj.bf16_wide(x))


def silu_mul_bf16(gu: torch.Tensor) -> torch.Tensor:
    """gu [..., 2I] bf16 (gate | up) -> silu(gate) * up [..., I] bf16, computed in float32 and
    rounded once (cpu_layer.c); PyTorch's bf16 ops without the native kernels."""
    if not native.available():
        gate, up = gu.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    two_i = gu.shape[-1]
    flat = gu.reshape(-1, two_i).contiguous()
    out = torch.empty(flat.shape[0], two_i // 2, dtype=torch.bfloat16)
    native.library().silu_mul_bf16(flat.data_ptr(), out.data_ptr(), flat.shape[0], two_i // 2,
                                   torch.get_num_threads())
    return out.view(*gu.shape[:-1], two_i // 2)
