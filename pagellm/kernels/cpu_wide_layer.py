"""A decoder layer for steps of many rows on CPUs with bf16 units: its four products from
oneDNN's prepacked bf16 weights (layers/onednn.py), the steps between them native
(cpu_wide_layer.c) and the attention from the layer's backend. The module path gives the same
values with ~40 PyTorch ops a layer (conversions around every product, the rotary's ops, a
bias add); at 64 rows of the default model those ops and their dispatch were ~8 ms of a
~47 ms decode step. Where all four products are q32 ones (32-value block types on CPUs with
AVX-512 VNNI), the whole layer is one native call (wide_layer_q32), which also quantizes each
product's activations where they are made instead of in a pass of their own: the default
model's forward over 64 decode rows took 45.6 ms instead of 58.0 (two Zen 4 cores; prefill
steps, compute-bound, unchanged). On CPUs without bf16 units (AVX2) only that one-call form
exists (the q32 products of the 4- and 5-bit types; no oneDNN bf16): it gives the module
path's values there too, whose q32 quantizers round to bf16 where the layer does, and made
the default model's 64-request run 1.23x faster than the module path (two Zen 3 cores)."""
from __future__ import annotations

import ctypes
import weakref

import torch

from pagellm.attention.base import AttentionMetadata
from pagellm.attention.torch_paged import native_seqs
from pagellm.kernels import cpu_attention, native
from pagellm.kernels.cpu_layer import gate_up_silu_bf16


class _Q32(ctypes.Structure):  # cpu_wide_layer.c q32_t
    _fields_ = [("codes", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p),
                ("zeros", ctypes.c_void_p), ("nibbles", ctypes.c_int64), ("n", ctypes.c_int64),
                ("block", ctypes.c_int64), ("inv", ctypes.c_void_p)]


class _WideQ32(ctypes.Structure):  # cpu_wide_layer.c wide_q32_t
    _fields_ = [("D", ctypes.c_int64), ("H", ctypes.c_int64), ("KVH", ctypes.c_int64),
                ("hd", ctypes.c_int64), ("I", ctypes.c_int64), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("norm_in", ctypes.c_void_p),
                ("norm_post", ctypes.c_void_p), ("qkv_bias", ctypes.c_void_p),
                ("cos", ctypes.c_void_p), ("ssin", ctypes.c_void_p), ("qkv", _Q32), ("o", _Q32),
                ("gate_up", _Q32), ("down", _Q32), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p)]


def _out_rows_args(out_rows: torch.Tensor | None) -> tuple:
    """(pointer, count) of the rows the native layer carries past its attention (None: all)."""
    if out_rows is None:
        return None, -1
    assert out_rows.dtype == torch.int64 and out_rows.is_contiguous() and out_rows.device.type == "cpu"
    return out_rows.data_ptr(), out_rows.numel()


class WideLayer:
    """Runs one DecoderLayer's many-row steps (prefill chunks, large decode batches) where
    every projection has a prepacked bf16 form (Qwen3's per-head q/k norms included). x is
    updated in place, like the fused decode layer's."""

    def __init__(self, layer):
        attn, mlp = layer.self_attn, layer.mlp
        self.layer = layer
        self._tables = attn.rotary.float32_tables()  # shared by every layer
        self.eps = layer.input_layernorm.eps
        # the per-head norms' weights (float32, contiguous: supports()), or None
        self._qk = ((attn.q_norm.scale(), attn.k_norm.scale()) if attn.q_norm is not None
                    else (None, None))
        self._projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        self._q32 = self._q32_layer()

    def _q32_layer(self):
        """The layer as wide_layer_q32 takes it, where every product is a q32 one (the gate|up
        one gated) and the shapes are a decoder layer's, else None. The struct holds pointers
        taken once, as the fused decode layer's does (the forms and norms are made at load and
        never replaced); the tensors behind them are kept alive here (`_q32_tensors`)."""
        attn, mlp = self.layer.self_attn, self.layer.mlp
        qkv, o, gu, down = forms = [m.q32 for m in self._projections]
        if any(f is None for f in forms) or not gu.gates:
            return None
        norms = (self.layer.input_layernorm.weight, self.layer.post_attention_layernorm.weight)
        d, nq, i = norms[0].shape[0], attn.num_heads * attn.head_dim, down.in_features
        if (qkv.in_features != d or qkv.out_features != nq + 2 * attn.num_kv_heads * attn.head_dim
                or o.in_features != nq or o.out_features != d or gu.in_features != d
                or gu.out_features != 2 * i or down.out_features != d or norms[1].shape[0] != d
                or any(f.in_features % f.block for f in forms)):
            return None
        bias = attn.qkv_proj.bias
        if any(not t.is_contiguous() for t in (*norms, *self._tables)) or (
                bias is not None and (not bias.is_contiguous() or bias.shape[0] != qkv.out_features)):
            return None
        self._q32_tensors = (*forms, *norms, bias, *self._tables, *self._qk)
        return _WideQ32(
            d, attn.num_heads, attn.num_kv_heads, attn.head_dim, i, self.eps, attn.scale,
            norms[0].data_ptr(), norms[1].data_ptr(), None if bias is None else bias.data_ptr(),
            self._tables[0].data_ptr(), self._tables[1].data_ptr(),
            *(_Q32(f.codes.data_ptr(), f.d.data_ptr(), f.m.data_ptr(), f.zeros_ptr(), f.nibbles,
                   f.out_features, f.block, f.inv_ptr()) for f in forms),
            *(None if t is None else t.data_ptr() for t in self._qk))

    @staticmethod
    def supports(layer) -> bool:
        from pagellm import parallel
        from pagellm.attention.torch_paged import TorchPagedAttention

        attn, mlp = layer.self_attn, layer.mlp
        if not hasattr(mlp, "gate_up_proj"):  # a mixture of experts (models/moe.py): modules
            return False
        qkv, o, gu, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
        qk_ok = attn.q_norm is None or all(
            n.weight.dtype == torch.float32 and n.weight.is_contiguous()
            and n.eps == layer.input_layernorm.eps for n in (attn.q_norm, attn.k_norm))
        # the K/V writes go straight into the CPU backend's head-major pool: only there
        return (native.available() and parallel.tp_size() == 1
                and getattr(layer, "llama_form", False) and qk_ok
                and attn.window is None  # its attention sees every key (a window: modules)
                and isinstance(attn.backend, TorchPagedAttention)
                and all(m.bf16_wide is not None and m.int8 is None for m in (qkv, o, gu, down))
                and (qkv.bias is None or qkv.bias.dtype == torch.float32)
                and o.bias is None and gu.bias is None and down.bias is None
                and all(n.weight.dtype == torch.float32 for n in (
                    layer.input_layernorm, layer.post_attention_layernorm)))

    def usable(self, x: torch.Tensor, md: AttentionMetadata) -> bool:
        attn = self.layer.self_attn
        return (x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous()
                and all(m.takes_wide(x) for m in self._projections)
                and attn.k_cache is not None
                and attn.k_cache.dtype in cpu_attention.POOL_DTYPES
                and attn.k_cache.permute(2, 0, 1, 3).is_contiguous()
                and attn.v_cache.permute(2, 0, 1, 3).is_contiguous()
                and md.slot_mapping.dtype == torch.int64 and md.slot_mapping.is_contiguous())

    def positions_ok(self, positions: torch.Tensor, md: AttentionMetadata) -> bool:
        """The native rotation indexes its tables by position without bounds checks (decided
        once per step)."""
        ok = md.cache.get("wide_positions_ok")
        if ok is None:
            ok = md.cache["wide_positions_ok"] = (
                positions.dtype == torch.int64 and positions.is_contiguous()
                and positions.device.type == "cpu"
                and (positions.numel() == 0
                     or 0 <= int(positions.min()) <= int(positions.max()) < self._tables[0].shape[0]))
        return ok

    def __call__(self, positions: torch.Tensor, x: torch.Tensor, md: AttentionMetadata,
                 out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, D] -> the layer's output (x itself, updated in place, where every row goes
        on); with out_rows (strictly increasing int64 rows), every row's K and V are written
        but only those rows go past the attention: [len(out_rows), D]."""
        layer = self.layer
        attn, mlp = layer.self_attn, layer.mlp
        lib, threads = native.library(), torch.get_num_threads()
        if self._q32 is not None:
            # the attention in C exactly where the backend would attend natively
            seqs = native_seqs(attn.k_cache, attn.v_cache, md)
            if seqs is not None:
                return self._call_q32(lib, positions, x, md, seqs, threads, out_rows)
        T, D = x.shape
        h = torch.empty(T, D, dtype=torch.bfloat16, device="cpu")
        self._norm(lib, x, None, layer.input_layernorm, h, threads)
        qkv = attn.qkv_proj.bf16_wide(h)  # [T, (H + 2 KVH) hd] bf16
        q = torch.empty(T, attn.num_heads, attn.head_dim, dtype=torch.float32, device="cpu")
        kvh, nb, bs, _ = attn.k_cache.permute(2, 0, 1, 3).shape
        bias = attn.qkv_proj.bias
        if lib.rope_qkv_norm_bf16(
                qkv.data_ptr(), None if bias is None else bias.data_ptr(), T, attn.num_heads,
                kvh, attn.head_dim, self._tables[0].data_ptr(), self._tables[1].data_ptr(),
                positions.data_ptr(), q.data_ptr(), attn.k_cache.data_ptr(),
                attn.v_cache.data_ptr(), nb, bs, md.slot_mapping.data_ptr(),
                cpu_attention.kv_kind(attn.k_cache),
                *(None if t is None else t.data_ptr() for t in self._qk), self.eps,
                threads) != 0:
            raise MemoryError("rope_qkv_norm_bf16: out of memory for its buffers")
        a = attn.backend.forward(q, attn.k_cache, attn.v_cache, md, attn.scale).view(T, -1)
        if out_rows is not None:
            a, x = a.index_select(0, out_rows), x.index_select(0, out_rows)
            h = h[:len(out_rows)]
        o = attn.o_proj.bf16_wide(a)  # [T, D] bf16
        self._norm(lib, x, o, layer.post_attention_layernorm, h, threads)  # x += o
        d = mlp.down_proj.bf16_wide(gate_up_silu_bf16(mlp.gate_up_proj, h))
        return x.add_(d)

    def _call_q32(self, lib, positions, x, md, seqs, threads, out_rows) -> torch.Tensor:
        attn = self.layer.self_attn
        _, nb, bs, _ = attn.k_cache.permute(2, 0, 1, 3).shape
        if lib.wide_layer_q32(
                ctypes.byref(self._q32), x.data_ptr(), x.shape[0], positions.data_ptr(),
                attn.k_cache.data_ptr(), attn.v_cache.data_ptr(), nb, bs,
                md.slot_mapping.data_ptr(), md.block_tables.data_ptr(), md.block_tables.shape[1],
                md.seq_lens.data_ptr(), md.query_start_loc.data_ptr(), seqs.data_ptr(),
                seqs.numel(), cpu_attention.kv_kind(attn.k_cache),
                *_out_rows_args(out_rows), threads) != 0:
            raise MemoryError("wide_layer_q32: out of memory for its buffers")
        return x if out_rows is None else x[:out_rows.numel()]

    def _norm(self, lib, x, add, norm, out, threads) -> None:
        add = None if add is None else add.contiguous()  # held until the call returns
        if lib.rms_norm_bf16(x.data_ptr(), None if add is None else add.data_ptr(),
                             norm.weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1],
                             self.eps, threads) != 0:
            raise MemoryError("rms_norm_bf16: out of memory for its buffers")


class WideStack:
    """Every layer's many-row step in one native call (wide_layers_q32) where all layers are
    alike one-call q32 layers: the checks and ctypes arguments of 30 layers cost ~2.3 ms of a
    ~46 ms 64-row decode step of the default model (two Zen 4 cores), paid once a step here.
    The values are the per-layer calls' (the same C function, layer by layer). A layer whose
    wide_layer was replaced (tests wrap it) sends the step down the per-layer path."""

    def __init__(self, layers, wides: list[WideLayer]):
        self.layers, self.wides = list(layers), wides
        self._structs = (ctypes.POINTER(_WideQ32) * len(wides))(
            *[ctypes.pointer(w._q32) for w in wides])
        # (weak references to the k and v caches, their pointer arrays), made at first use:
        # weak, so that a pool the runner lets go (the profiling pass's) is freed at once
        self._pools = None

    @classmethod
    def of(cls, layers) -> WideStack | None:
        """A stack over these layers, or None unless every layer has a one-call form and
        all take the same rows to it (projections of the same forms and row limits)."""
        wides = [getattr(layer, "wide_layer", None) for layer in layers]
        if not wides or any(w is None or w._q32 is None for w in wides):
            return None

        def kind(w):
            return tuple((type(m.packed), getattr(m.packed, "max_rows", None), type(m.wide))
                         for m in w._projections)

        return cls(layers, wides) if len({kind(w) for w in wides}) == 1 else None

    def usable(self, positions: torch.Tensor, x: torch.Tensor, md: AttentionMetadata) -> bool:
        """Where every layer would take its one native call this step (the first layer's
        checks stand for all: they are alike, over pools of one kind)."""
        first = self.wides[0]
        layer = first.layer
        return (positions.dtype == torch.int64
                and all(lay.wide_layer is w for lay, w in zip(self.layers, self.wides))
                and not (layer.fused is not None and layer.fused.usable(x, md))
                and first.usable(x, md) and first.positions_ok(positions, md)
                and native_seqs(layer.self_attn.k_cache, layer.self_attn.v_cache, md) is not None
                and self._pool_pointers() is not None)

    def _pool_pointers(self):
        """Each layer's K and V pool pointers, remade if a pool was replaced; None unless all
        pools are alike (dtype, shape, head-major)."""
        ks = [lay.self_attn.k_cache for lay in self.layers]
        vs = [lay.self_attn.v_cache for lay in self.layers]
        if self._pools is not None and all(r() is t for r, t in zip(self._pools[0], ks + vs)):
            return self._pools
        first = ks[0]
        if any(t is None or t.dtype != first.dtype or t.shape != first.shape
               or not t.permute(2, 0, 1, 3).is_contiguous() for t in ks + vs):
            self._pools = None
            return None
        n = len(ks)
        self._pools = ([weakref.ref(t) for t in ks + vs],
                       (ctypes.c_void_p * n)(*[t.data_ptr() for t in ks]),
                       (ctypes.c_void_p * n)(*[t.data_ptr() for t in vs]))
        return self._pools

    def __call__(self, positions: torch.Tensor, x: torch.Tensor, md: AttentionMetadata,
                 out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, D] -> the last layer's output rows (out_rows: as WideLayer's, for the last
        layer), x updated in place."""
        attn = self.layers[0].self_attn
        seqs = native_seqs(attn.k_cache, attn.v_cache, md)
        _, kcs, vcs = self._pools
        _, nb, bs, _ = attn.k_cache.permute(2, 0, 1, 3).shape
        if native.library().wide_layers_q32(
                self._structs, len(self.wides), x.data_ptr(), x.shape[0], positions.data_ptr(),
                kcs, vcs, nb, bs, md.slot_mapping.data_ptr(), md.block_tables.data_ptr(),
                md.block_tables.shape[1], md.seq_lens.data_ptr(), md.query_start_loc.data_ptr(),
                seqs.data_ptr(), seqs.numel(), cpu_attention.kv_kind(attn.k_cache),
                *_out_rows_args(out_rows), torch.get_num_threads()) != 0:
            raise MemoryError("wide_layers_q32: out of memory for its buffers")
        return x if out_rows is None else x[:out_rows.numel()]
