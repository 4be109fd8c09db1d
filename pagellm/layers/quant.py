"""Block-quantized weights kept packed: GGUF projections and LM heads multiplied without
dequantizing them (Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K).

A decode step at small batch reads every weight once, so it is bound by how fast weights stream
through the core. A GGUF Q4 tensor is 32-element blocks of 4-bit codes with one scale (and for
Q4_1 one offset) per block:

    Q4_0: w = d * (q - 8)        Q4_1: w = d * q + m        (q in 0..15)

kept here (Int4Blocks) in PyTorch's grouped int4 convention `w = (q - 8) * scale + zero`,
scale = d and zero = 0 (Q4_0) or m + 8 d (Q4_1). Two kernels take such weights for few-row
products: pagellm's own (pagellm/kernels/cpu_quant.c, NativeQ4; needs a C compiler at first
use) and, where it cannot be built, `torch.ops.aten._weight_int4pack_mm_for_cpu` (TorchInt4).
Past ~40 rows (NativeQ4) or ~16 (TorchInt4) a dense float32 product is as fast, so a linear
keeps both its dense weight and, when available, the packed one. Q8_0 (w = d * q, int8 q) serves the LM head (NativeQ8).

Every other packable type (GGUFBlocks: the file's own bytes, one row of blocks per output
feature) is multiplied by pagellm/kernels/cpu_gguf.c (NativeGGUF), which decodes the blocks
itself; on CPUs with AVX-512 BW and VNNI, Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K projections (and
NativeQ4) go in panels of 16 outputs instead (NativePanels, layers/panels.py); a fused projection whose parts have different types (a Q4_K_M file's Q4_K q/k beside a
Q6_K v) keeps one packed form per run of parts (PackedParts).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from pagellm.kernels import cpu_quant, native
from pagellm.layers import panels

GROUP = 32
# Products with fewer rows than this use the packed weights. Measured on AVX2 for a
# 3072 x 576 weight (ms): rows 1: 0.36 packed / 0.47 bf16 / 0.59 upcast to float32;
# 4: 0.40 / 1.58 / 1.20; 16: 1.58 / 6.46 / 1.92; 32: 3.38 / 12.6 / 2.70.
MAX_ROWS = 17


_step = threading.local()


@contextmanager
def dense_from(rows: int | None):
    """Within the block, products of `rows` rows or more skip the packed kernels for the
    dense weights (None: each packed form's own max_rows). The engine's PackedRowChoice picks
    it per decode step: the packed kernel is compute-bound per row, and which side wins at a
    given row count depends on the CPU and its load (see kernels/packed_rows.py)."""
    prev = getattr(_step, "rows", None)
    _step.rows = rows
    try:
        yield
    finally:
        _step.rows = prev


def few_rows(rows: int, max_rows: int) -> bool:
    """Whether a product of `rows` rows takes a packed kernel whose limit is max_rows."""
    limit = getattr(_step, "rows", None)
    return rows < (max_rows if limit is None else min(limit, max_rows))


@dataclass
class Int4Blocks:
    """A weight [N, K] as 4-bit codes with a scale and zero per GROUP inputs of each row."""

    q: torch.Tensor  # [N, K] uint8, values 0..15
    scale: torch.Tensor  # [N, K // GROUP] float32
    zero: torch.Tensor  # [N, K // GROUP] float32

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:  # [N, K] float32, the same values as the GGUF file
        n, k = self.q.shape
        w = self.q.view(n, k // GROUP, GROUP).float() - 8
        w = w * self.scale.unsqueeze(-1) + self.zero.unsqueeze(-1)
        return w.view(n, k)

    def narrow(self, dim: int, start: int, length: int) -> Int4Blocks:
        if dim == 0:
            return Int4Blocks(self.q.narrow(0, start, length), self.scale.narrow(0, start, length),
                              self.zero.narrow(0, start, length))
        if start % GROUP or length % GROUP:
            raise ValueError(f"a 4-bit weight splits along its inputs only at multiples of {GROUP}")
        return Int4Blocks(self.q.narrow(1, start, length),
                          self.scale.narrow(1, start // GROUP, length // GROUP),
                          self.zero.narrow(1, start // GROUP, length // GROUP))


def cat_rows(parts: list[Int4Blocks]) -> Int4Blocks:
    return Int4Blocks(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                      torch.cat([p.zero for p in parts]))


def packable(n: int, k: int) -> bool:
    """Shapes a packed kernel takes: inputs a multiple of the group (and, for PyTorch's
    kernel, outputs a multiple of 16)."""
    if k % GROUP:
        return False
    return native.available() or (n % 16 == 0 and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"))


class NativeQ4:
    """Codes with float32 (scale, min) per block, multiplied by pagellm/kernels/cpu_quant.c:
    float32 activations (int16 per block inside), 1.5-2x faster than PyTorch's packed kernel
    for 1-5 rows on AVX2 (benchmarks: `latency`). On CPUs with AVX-512 BW and VNNI the codes
    go in panels of 16 outputs instead (layers/panels.py, kernels/cpu_panels.c: the same
    integer block sums, ~4x fewer instructions per byte of weights)."""

    # Measured on AVX2 (ms, 3072 x 576): rows 1: 0.12 / torch packed 0.25; 5: 0.32 / 0.60;
    # 16: 0.99 / dense float32 1.11 (weights hot in cache); 24: 1.63 / 1.55. A whole step
    # streams the weights from memory, where the 8x smaller codes win more: default model,
    # one thread, ms per decode step with these products (and the fused layer) up to 16 rows
    # / up to 40 rows: 20 rows 270 / 137; 24: 324 / 185; 32: 335 / 291; 40: 422 / 351; 48:
    # 464 / 451 (speculative verification at batch 8-16 lands there).
    max_rows = 41

    def __init__(self, w: Int4Blocks):
        self.out_features, self.in_features = w.shape
        self.panels = None
        if panels.available():
            # fp16 scales and mins where they hold the values exactly (a GGUF file's do)
            scale, low = w.scale.float(), (w.zero - 8 * w.scale).float()
            exact = all(torch.equal(t.half().float(), t) for t in (scale, low))
            self.fmt = panels.Q4_F16 if exact else panels.Q4_F32
            dt = np.float16 if exact else np.float32
            self.panels = panels.pack(self.fmt, w.q.numpy(), scale=scale.numpy().astype(dt),
                                      low=low.numpy().astype(dt))
        else:
            self.codes, self.scale_min = self.row_form(w)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            return panels.linear(x, self.panels, self.fmt, self.out_features,
                                 self.in_features).to(x.dtype)
        return cpu_quant.q4_linear(x, self.codes, self.scale_min).to(x.dtype)

    @property
    def nbytes(self) -> int:
        if self.panels is not None:
            return self.panels.numel()
        return self.codes.numel() + self.scale_min.numel() * 4

    @staticmethod
    def row_form(w: Int4Blocks) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [N, K / 2] uint8 in GGUF nibble order, scale_min [N, K / 32, 2] float32):
        cpu_quant.c's q4_linear layout."""
        n, k = w.shape
        q = w.q.view(n, k // GROUP, 2, GROUP // 2)
        codes = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
        low = (w.zero - 8 * w.scale).float()
        return codes, torch.stack([w.scale.float(), low], dim=-1).contiguous()


class TorchInt4:
    """PyTorch's packed int4 CPU kernel (bf16 activations), where the native one is off."""

    max_rows = MAX_ROWS

    def __init__(self, w: Int4Blocks):
        """packed codes [N, K / 2] uint8, scales_and_zeros [K / GROUP, N, 2] bfloat16."""
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            w.q.to(torch.int32).contiguous(), 2)
        self.scales_zeros = torch.stack([w.scale.t(), w.zero.t()], dim=-1).to(torch.bfloat16).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> x W^T [..., N] in x's dtype, computed with bf16 activations."""
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, shape[-1]).to(torch.bfloat16), self.packed, GROUP, self.scales_zeros)
        return y.view(*shape[:-1], y.shape[-1]).to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2


def pack(w: Int4Blocks) -> NativeQ4 | TorchInt4:
    """The fastest packed form this machine can multiply."""
    return NativeQ4(w) if native.available() else TorchInt4(w)


@dataclass
class Int8Blocks:
    """A GGUF Q8_0 weight [N, K]: int8 codes with one float32 scale per GROUP inputs."""

    q: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N, K // GROUP] float32

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:  # [N, K] float32, the same values as the GGUF file
        n, k = self.q.shape
        return (self.q.view(n, k // GROUP, GROUP).float() * self.scale.unsqueeze(-1)).view(n, k)


class NativeQ8:
    """An LM head kept as Q8_0 (the default model stores its tied embedding so): 2.5x faster
    than a bf16 product for 1 row, 5-6x than float32 for 2-16 rows (AVX2, 49152 x 576)."""

    # 64 rows: 55 ms vs 74 dense float32 (hot); more rows come only from batched verification.
    # (Where bf16 products run natively the model takes it for fewer rows: head_max_rows.)
    max_rows = 65

    def __init__(self, w: Int8Blocks):
        self.codes, self.scale = w.q.contiguous(), w.scale.float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # -> float32 logits
        return cpu_quant.q8_linear(x, self.codes, self.scale)

    def first_rows(self, n: int) -> NativeQ8:
        """The same head over its first n outputs (views: no copy)."""
        sub = object.__new__(NativeQ8)
        sub.codes, sub.scale = self.codes[:n], self.scale[:n]
        return sub

    def rows(self, ids: torch.Tensor) -> NativeQ8:
        """The same head over outputs `ids` (a copy of those rows)."""
        sub = object.__new__(NativeQ8)
        sub.codes, sub.scale = self.codes.index_select(0, ids), self.scale.index_select(0, ids)
        return sub

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scale.numel() * 4


# Types cpu_gguf.c multiplies in place (Q4_0 / Q4_1 projections take NativeQ4 instead).
GGUF_PACKED_TYPES = frozenset({GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0,
                               GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
                               GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q4_K,
                               GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K})


@dataclass
class GGUFBlocks:
    """A weight [N, K] as the GGUF file stores it: row n is K / unit blocks of ggml_type."""

    raw: torch.Tensor  # [N, row_bytes] uint8
    ggml_type: GGMLQuantizationType
    cols: int  # K

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.raw.shape[0], self.cols))

    @property
    def unit(self) -> tuple[int, int]:
        """(values, bytes) of one block."""
        return GGML_QUANT_SIZES[self.ggml_type]

    def dequantize(self) -> torch.Tensor:  # [N, K] float32, gguf's reference arithmetic
        return torch.from_numpy(gguf_dequantize(self.raw.numpy(), self.ggml_type).astype(np.float32))

    def narrow(self, dim: int, start: int, length: int) -> GGUFBlocks:
        if dim == 0:
            return GGUFBlocks(self.raw.narrow(0, start, length), self.ggml_type, self.cols)
        values, nbytes = self.unit
        if start % values or length % values:
            raise ValueError(f"a {self.ggml_type.name} weight splits along its inputs only at "
                             f"multiples of {values}")
        return GGUFBlocks(self.raw.narrow(1, start // values * nbytes, length // values * nbytes),
                          self.ggml_type, length)


class NativeGGUF:
    """GGUF blocks multiplied in their file form by pagellm/kernels/cpu_gguf.c."""

    max_rows = NativeQ4.max_rows

    def __init__(self, w: GGUFBlocks):
        self.raw, self.ggml_type, self.cols = w.raw.contiguous(), int(w.ggml_type), w.cols

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # -> float32
        return cpu_quant.gguf_linear(x, self.raw, self.ggml_type, self.cols)

    def first_rows(self, n: int) -> NativeGGUF:
        """The same weights over their first n outputs (a view: no copy)."""
        sub = object.__new__(NativeGGUF)
        sub.raw, sub.ggml_type, sub.cols = self.raw[:n], self.ggml_type, self.cols
        return sub

    def rows(self, ids: torch.Tensor) -> NativeGGUF:
        """The same weights over outputs `ids` (a copy of those rows' blocks)."""
        sub = object.__new__(NativeGGUF)
        sub.raw, sub.ggml_type, sub.cols = self.raw.index_select(0, ids), self.ggml_type, self.cols
        return sub

    @property
    def nbytes(self) -> int:
        return self.raw.numel()


class NativePanels:
    """A GGUF projection (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q6_K / IQ4_NL / IQ4_XS) in panels of 16 outputs for
    kernels/cpu_panels.c, on CPUs with AVX-512 BW and VNNI: the file's values, the file's bytes
    (Q4_0 / Q5_0: +11% / +9%, their min stored), 1.0-2x the speed of the row kernels from 1 to
    40 rows (1.0-1.1x: the 1.5B's Q4_K at one row). It replaces NativeGGUF there; an LM head
    takes it where head_form says so (Q4_K / Q6_K with int8 activations)."""

    max_rows = NativeQ4.max_rows

    def __init__(self, w: GGUFBlocks):
        self.out_features, self.in_features = w.shape
        self.fmt, u, params = panels.decode(w.raw.numpy(), w.ggml_type, w.cols)
        self.panels = panels.pack(self.fmt, u, **params)

    @classmethod
    def of(cls, w: GGUFBlocks) -> NativePanels | None:
        """The panel form of w, or None where there is none (no kernel here, another type,
        or values no format holds exactly)."""
        if not (panels.format_of(w.ggml_type) is not None and panels.available()
                and w.cols % w.unit[0] == 0):
            return None
        try:
            return cls(w)
        except ValueError:
            return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # -> float32
        return panels.linear(x, self.panels, self.fmt, self.out_features, self.in_features)

    def first_rows(self, n: int) -> NativePanels:
        """The same weights over their first n outputs (a view of their panels: no copy)."""
        sub = object.__new__(NativePanels)
        sub.fmt, sub.out_features, sub.in_features = self.fmt, n, self.in_features
        sub.panels = self.panels[: -(-n // panels.OUT)]
        return sub

    def rows(self, ids: torch.Tensor) -> NativePanels:
        """The same weights over outputs `ids` (their bytes gathered into new panels; formats
        in panels.GATHERABLE). The latest gather is kept: a draft asks each round for its
        requests' own ids, which change only as their text grows (a gather of 300 ids of a
        1,536-wide Q6_K head: 2.7 ms, a quarter of a draft round)."""
        kept = getattr(self, "_rows", None)
        if kept is not None and torch.equal(kept[0], ids.cpu()):  # (False for another shape)
            return kept[1]
        sub = object.__new__(NativePanels)
        sub.fmt, sub.out_features, sub.in_features = self.fmt, len(ids), self.in_features
        sub.panels = panels.gather(self.panels, self.fmt, ids)
        self._rows = (ids.cpu().clone(), sub)
        return sub

    @property
    def nbytes(self) -> int:
        return self.panels.numel()


def head_form(w: GGUFBlocks) -> NativePanels | NativeGGUF:
    """A GGUF LM head's packed form: panels where the format can serve a draft's vocabulary
    limit and gathered ids (first_rows, rows; a Q6_K head in Q6_K8: at 1-5 rows 6.1-7.2 ms
    against the rows' 6.8-11.7 for Qwen2.5-1.5B's 151,936 x 1,536), else the file's rows."""
    form = NativePanels.of(w)
    if form is not None and form.fmt in panels.GATHERABLE:
        return form
    if w.ggml_type not in GGUF_PACKED_TYPES:  # (the loader gives i-quant heads as Q8_0)
        raise ValueError(f"no packed LM head form for {w.ggml_type.name}")
    return NativeGGUF(w)


class PackedParts:
    """Fused parts with different packed forms: each multiplies its own rows, outputs are
    concatenated (a copy of a few rows, nothing next to the products)."""

    def __init__(self, parts: list):
        self.parts = parts
        self.max_rows = min(p.max_rows for p in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def packable_types() -> frozenset:
    """The GGUF types this machine can keep packed: all of GGUF_PACKED_TYPES with the native
    kernels, else only Q4_0 / Q4_1 (PyTorch's int4 kernel)."""
    if native.available():
        return GGUF_PACKED_TYPES
    return frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1})


def gguf_packable(w: GGUFBlocks) -> bool:
    values, _ = w.unit
    return native.available() and w.ggml_type in GGUF_PACKED_TYPES and w.cols % values == 0


def pack_parts(parts: list[Int4Blocks | GGUFBlocks]):
    """One packed form for a fused projection's parts (in order), or None if some part cannot
    be packed. Runs of parts of one kind and type are concatenated into one product."""
    runs: list[list] = []
    for part in parts:
        key = "int4" if isinstance(part, Int4Blocks) else part.ggml_type
        if runs and runs[-1][0] == key:
            runs[-1][1].append(part)
        else:
            runs.append([key, [part]])
    forms = []
    for key, run in runs:
        if key == "int4":
            blocks = cat_rows(run)
            if not packable(*blocks.shape):
                return None
            forms.append(pack(blocks))
        else:
            blocks = GGUFBlocks(torch.cat([p.raw for p in run]), run[0].ggml_type, run[0].cols)
            if blocks.ggml_type in panels.LEVEL_FORMAT_OF:  # 4-bit i-quants: panels or nothing
                form = NativePanels.of(blocks)
                if form is None:
                    return None
                forms.append(form)
                continue
            if not gguf_packable(blocks):
                return None
            forms.append(NativePanels.of(blocks) or NativeGGUF(blocks))
    return forms[0] if len(forms) == 1 else PackedParts(forms)
