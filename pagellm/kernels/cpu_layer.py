"""A whole decoder layer in one native call (cpu_layer.c) for steps of a few rows."""
from __future__ import annotations

import torch

from pagellm.attention.base import AttentionMetadata
from pagellm.kernels import native
from pagellm.layers.quant import NativeQ4, few_rows

class FusedDecodeLayer:
    """Holds one DecoderLayer's weights as the C function wants them. Built only for layers
    whose projections are all NativeQ4 without biases, with float32 norms, on one process."""

    def __init__(self, layer):
        attn, mlp = layer.self_attn, layer.mlp
        rot = attn.rotary
        # float32 copies of the rotary tables: the values the module path multiplies by
        self._keep = [rot.cos.float().contiguous(), rot.signed_sin.float().contiguous()]
        self.layer = layer
        self.eps = layer.input_layernorm.eps
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale = attn.scale
        self.intermediate = mlp.down_proj.weight.shape[1]
        w = [attn.qkv_proj.packed, attn.o_proj.packed, mlp.gate_up_proj.packed, mlp.down_proj.packed]
        self._weights = tuple(p for q in w for p in (q.codes.data_ptr(), q.scale_min.data_ptr()))
        self._norms = (layer.input_layernorm.weight.data_ptr(),
                       layer.post_attention_layernorm.weight.data_ptr())

    @staticmethod
    def supports(layer) -> bool:
        from pagellm import parallel
        from pagellm.attention.torch_paged import TorchPagedAttention

        attn, mlp = layer.self_attn, layer.mlp
        linears = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        # the C layer attends itself over the CPU backend's head-major pool: only there
        return (native.available() and parallel.tp_size() == 1
                and isinstance(attn.backend, TorchPagedAttention)
                and all(isinstance(m.packed, NativeQ4) and m.bias is None for m in linears)
                and all(n.weight.dtype == torch.float32 for n in (
                    layer.input_layernorm, layer.post_attention_layernorm)))

    def usable(self, x: torch.Tensor, md: AttentionMetadata) -> bool:
        attn = self.layer.self_attn
        # the packed kernels' few-row regime; larger steps (prefill, big batches) take modules
        return (x.dtype == torch.float32 and few_rows(x.shape[0], NativeQ4.max_rows)
                and x.is_contiguous()
                and attn.k_cache is not None and attn.k_cache.dtype == torch.float32
                and attn.k_cache.permute(2, 0, 1, 3).is_contiguous()
                and attn.v_cache.permute(2, 0, 1, 3).is_contiguous() and _step_ok(md))

    def __call__(self, positions: torch.Tensor, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        attn = self.layer.self_attn
        kvh, nb, bs, _ = attn.k_cache.permute(2, 0, 1, 3).shape
        seqs = md.cache["fused_seqs"]
        rc = native.library().decode_layer(
            x.data_ptr(), x.shape[0], x.shape[1], self.eps, *self._norms, *self._weights,
            self.intermediate, self.heads, self.kv_heads, self.head_dim,
            self._keep[0].data_ptr(), self._keep[1].data_ptr(), positions.data_ptr(),
            attn.k_cache.data_ptr(), attn.v_cache.data_ptr(), nb, bs,
            md.slot_mapping.data_ptr(), md.block_tables.data_ptr(), md.block_tables.shape[1],
            md.seq_lens.data_ptr(), md.query_start_loc.data_ptr(), seqs.data_ptr(), seqs.numel(),
            self.scale, torch.get_num_threads())
        if rc != 0:
            raise MemoryError("decode_layer: out of memory for its buffers")
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
