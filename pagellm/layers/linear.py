"""Linear layers that own their weight loading, sharded for tensor parallelism.

With one process they are plain linears. Column-parallel layers hold a slice of the output
features; row-parallel layers hold a slice of the input features and all-reduce their output.
Fused projections (q|k|v, gate|up) load each checkpoint tensor into their own slice of it.
Slices are given in units (heads, or single features) so that e.g. 3 KV heads split 2 + 1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import os

from pagellm import lora
from pagellm import parallel
from pagellm.kernels import native
from pagellm.layers import int8, onednn, q32, quant


# CPUs without bf16 instructions multiply bf16 matrices several times slower than float32
# (measured on AVX2, 3072 x 576 weight: 64 rows 37 ms vs 7 ms; 4 rows 1.58 vs 1.20 ms, weight
# upcast included). There, products of 2+ rows upcast the bf16 weights on the fly; single-row
# products stay in bf16, where it is faster (0.47 vs 0.59 ms).
UPCAST_BF16 = not native.cpu_has_bf16_units()
_UPCAST_MIN_ROWS = 2


def upcast(*tensors: torch.Tensor) -> bool:
    """Whether a CPU product of these bf16 tensors is faster done in float32."""
    t = tensors[0]
    return (UPCAST_BF16 and t.dtype == torch.bfloat16 and t.device.type == "cpu"
            and t.numel() // t.shape[-1] >= _UPCAST_MIN_ROWS)


# Many-row products of packed GGUF projections run in int8 (layers/int8.py) on CPUs without
# bf16 units, where a dense product computes in float32; their dense weights are then dropped.
# PAGELLM_INT8=0 keeps the dense float32 weights instead (for comparisons).
USE_INT8 = UPCAST_BF16 and os.environ.get("PAGELLM_INT8", "1") != "0"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed=None, wide=None) -> torch.Tensor:
    """F.linear; from packed block-quantized weights (quant.NativeQ4, NativeGGUF, ...) for a few
    rows when the layer has them, from their wide form for more (int8 codes against int8
    activations, or a bf16 weight in oneDNN's layout); in float32 for batched bf16 inputs on
    CPUs without bf16 units."""
    if packed is not None and quant.few_rows(x.numel() // x.shape[-1], packed.max_rows):
        y = packed(x).to(x.dtype)
        return y if bias is None else y + bias
    if packed is not None and wide is None and weight.device.type == "meta":  # packed_only
        rows = x.reshape(-1, x.shape[-1])
        y = torch.cat([packed(r) for r in rows.split(packed.max_rows - 1)]).to(x.dtype)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if bias is None else y + bias
    if wide is not None:
        y = wide(x).to(x.dtype)
        return y if bias is None else y + bias
    if weight.dtype == torch.bfloat16 and x.dtype == torch.float32 and (
            x.numel() == x.shape[-1] or not UPCAST_BF16):
        # float32 activations, bf16 weight (use_float32_activations): one row, or a CPU with
        # bf16 units, where bf16 products are several times faster than float32 ones
        y = F.linear(x.to(weight.dtype), weight).to(x.dtype)
        return y if bias is None else y + bias.to(x.dtype)
    if upcast(x) or weight.dtype != x.dtype:  # a float32 copy (keep_float32) or activations
        b = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), b).to(x.dtype)
    return F.linear(x, weight, bias)


def packed_row_limit(model: nn.Module) -> int | None:
    """The most rows a step may have and still run every packed 4-bit product in its few-row
    kernel (None: the model has no packed weights). Past it, products switch to dense
    weights, with another cost per row."""
    limits = [m.packed.max_rows - 1 for m in model.modules() if getattr(m, "packed", None) is not None]
    return min(limits) if limits else None


def float32_biases(model: nn.Module) -> int:
    """The biases of packed projections in float32, on any CPU: the fused decode layer adds
    them to its float32 outputs. Returns how many."""
    n = 0
    for m in model.modules():
        if isinstance(m, _Packed) and m.packed is not None and m.bias is not None:
            m.bias.data = m.bias.data.float()
            n += 1
    return n


def keep_float32(model: nn.Module) -> int:
    """On CPUs without bf16 units, store the dense weights of packed 4-bit projections in
    float32: those weights serve only products of MAX_ROWS+ rows, which run in float32 there,
    and upcasting every weight at every batched step cost ~12% of a batch-64 decode step.
    A projection with an integer form (int8, q32) has no dense weight (_Packed); its bias
    goes to float32 too. Returns the number of projections converted."""
    if not UPCAST_BF16:
        return 0
    n = 0
    for m in model.modules():
        if isinstance(m, _Packed) and (m.int8 is not None or m.q32 is not None):
            if m.bias is not None:
                m.bias.data = m.bias.data.float()
            n += 1
        elif isinstance(m, _Packed) and m.packed is not None and m.weight.dtype == torch.bfloat16:
            m.weight.data = m.weight.data.float()
            if m.bias is not None:  # (Qwen2's q/k/v) added to float32 outputs either way
                m.bias.data = m.bias.data.float()
            n += 1
    return n


def prepack_bf16(model: nn.Module) -> int:
    """On CPUs with bf16 units, reorder every dense bf16 projection weight into oneDNN's
    blocked layout once (layers/onednn.py) instead of at every product; the dense weight goes
    to the meta device (the blocked copy holds the same bytes). Returns how many."""
    if UPCAST_BF16 or not onednn.available() or parallel.tp_size() > 1:
        return 0
    n = 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if (isinstance(m, _Packed) and m.int8 is None and m.q32 is None and w is not None
                and w.dtype == torch.bfloat16 and w.device.type == "cpu"):
            m.onednn = onednn.OneDNNLinear(w.data)
            m.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"),
                                    requires_grad=False)
            n += 1
    return n


_BLOCKS = (quant.Int4Blocks, quant.GGUFBlocks)


def _use_q32() -> bool:
    """CPUs with AVX-512 VNNI (every 32-value block type) or AVX2 (the 4- and 5-bit ones):
    32-value block projections (and Q4_K / Q5_K ones, by their 32-value sub-blocks) multiply
    many rows in int8 (layers/q32.py), faster than the bf16 (or float32) product of a dense
    copy, which is not made. One process only, as prepack_bf16 (MLP.forward's bf16 shortcut
    has no all-reduce)."""
    return parallel.tp_size() == 1 and q32.available()


def _integer_form(part) -> bool:
    """Whether this part will have an integer many-row form (int8 / q32): its dense copy
    then waits until every part of the projection is known to have one."""
    return (q32.fits(part) and _use_q32()) or (USE_INT8 and int8.int8_form(part))


class _Packed:
    """Keeps the block-quantized form of a GGUF weight beside the dense one, for few-row
    products. load() records each part's blocks and packs them as soon as every part is there
    (a plain attribute: .to(dtype) leaves the packed codes and scales alone). Where every part
    has an int8 form (USE_INT8) the dense weight is never made: the parts' dense copies wait
    until all parts are there, and the weight goes to the meta device (its shape stays; any use
    would fail loudly)."""

    packed = None  # quant.NativeQ4 | TorchInt4 | NativePanels | NativeGGUF | PackedParts
    int8 = None  # int8.NativeInt8: the same weights for many-row products (USE_INT8)
    q32 = None  # q32.Q32Linear: 32-value blocks for many-row products (bf16 units + VNNI)
    onednn = None  # onednn.OneDNNLinear: the dense bf16 weight, prepacked (prepack_bf16)
    # Keep the packed form alone: no many-row form and no dense copy; products of more rows
    # than its kernel takes run in slices of rows. A mixture of experts' experts
    # (models/moe.py): each sees a few rows a step, and a second form of every expert would
    # take 2-3x the file's memory (a 30B model's 17 GB file: ~50 GB).
    packed_only = False

    @property
    def wide(self):
        """The form many-row products use instead of the dense weight, if any."""
        return next((f for f in (self.int8, self.q32, self.onednn) if f is not None), None)

    @property
    def bf16_wide(self):
        """A many-row form that takes bf16 activations and gives bf16 outputs (the wide
        layer's products), if any."""
        return self.q32 if self.q32 is not None else self.onednn

    def takes_wide(self, x: torch.Tensor) -> bool:
        """Whether linear() multiplies x by the wide form (not the packed few-row kernels)."""
        return self.wide is not None and not (self.packed is not None and quant.few_rows(
            x.numel() // x.shape[-1], self.packed.max_rows))
    num_parts = 1

    def _keep(self, shard: int, part: quant.Int4Blocks | quant.GGUFBlocks | None,
              write_dense) -> None:
        """part None: this shard came dense (e.g. an F16 v_proj beside Q4 q/k), so the
        fused weight cannot be packed; parts already kept are dropped. write_dense() copies
        this part's dense values into the weight, now or once it is known to be needed."""
        parts = self.__dict__.setdefault("_packed_parts", {})
        waiting = self.__dict__.setdefault("_dense_writes", [])
        if part is None or parts is None:
            self.__dict__["_packed_parts"] = None
            for write in [*waiting, write_dense]:
                write()
            waiting.clear()
            return
        parts[shard] = part
        if self.packed_only or _integer_form(part):
            waiting.append(write_dense)
        else:
            write_dense()
        if len(parts) == self.num_parts:
            del self._packed_parts, self._dense_writes
            ordered = [parts[i] for i in range(self.num_parts)]
            self.packed = quant.pack_parts(ordered)
            if self.packed_only and self.packed is not None:
                pass  # the packed form alone, for products of any number of rows
            elif self.packed is not None:
                # q32 where every part fits its tiles (Q4_K / Q5_K too: on an AVX2 Zen 3
                # core a 4480 x 1536 one at 64 / 512 rows 2.7x / 2.6x (Q4_K), 3.4x / 2.4x
                # (Q5_K) faster than its int8 form), else the K-quants' int8 codes (a Q6_K
                # part) on CPUs without bf16 units
                if _use_q32():
                    self.q32 = q32.Q32Linear.from_parts(ordered)
                if self.q32 is None and USE_INT8:
                    self.int8 = int8.NativeInt8.from_blocks(ordered)
            if (self.int8 is not None or self.q32 is not None
                    or (self.packed_only and self.packed is not None)):
                self.weight = nn.Parameter(torch.empty(self.weight.shape, device="meta"),
                                           requires_grad=False)
            else:
                for write in waiting:
                    write()


def _dense(tensor: torch.Tensor | quant.Int4Blocks | quant.GGUFBlocks) -> torch.Tensor:
    return tensor.dequantize() if isinstance(tensor, _BLOCKS) else tensor


class ColumnParallelLinear(_Packed, nn.Module):
    """y = x W^T (+ b) for this rank's rows of W. parts: for each fused part, (full output
    size, unit size): the part's units are split across ranks."""

    def __init__(self, in_features: int, parts: tuple[tuple[int, int], ...], bias: bool):
        super().__init__()
        self.ranges = []  # per part: (start row in the checkpoint tensor, local rows)
        self.in_features = in_features
        self.full_rows = [full for full, _ in parts]  # per part: the checkpoint tensor's rows
        for full, unit in parts:
            start, count = parallel.split(full // unit)
            self.ranges.append((start * unit, count * unit))
        self.num_parts = len(parts)
        out = sum(n for _, n in self.ranges)
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out), requires_grad=False) if bias else None

    def load(self, name: str, tensor: torch.Tensor, shard: int = 0) -> None:
        """name 'weight' or 'bias'; tensor holds the full (unsharded) part number `shard`."""
        want = (self.full_rows[shard],) + ((self.in_features,) if name == "weight" else ())
        if tuple(tensor.shape) != want:  # a file whose tensors are not the config's shapes
            raise ValueError(f"{name} of part {shard}: shape {tuple(tensor.shape)} does not "
                             f"match the config's {want}")
        start, size = self.ranges[shard]
        offset = sum(n for _, n in self.ranges[:shard])
        part = tensor.narrow(0, start, size)

        def write() -> None:
            getattr(self, name).data.narrow(0, offset, size).copy_(_dense(part))

        if name == "weight":
            self._keep(shard, part if isinstance(part, _BLOCKS) else None, write)
        else:
            write()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, self.packed, self.wide)
        return y if lora.STEP is None else lora.STEP.apply(self, x, y)


class RowParallelLinear(_Packed, nn.Module):
    """y = all_reduce(x_local W_local^T) (+ b); this rank holds `unit`-sized groups of the
    input features."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, unit: int = 1):
        super().__init__()
        start, count = parallel.split(in_features // unit)
        self.start, self.in_local = start * unit, count * unit
        self.in_features = in_features
        self.reduce = parallel.tp_size() > 1
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def load(self, name: str, tensor: torch.Tensor, shard: int = 0) -> None:
        want = (self.weight.shape[0],) + ((self.in_features,) if name == "weight" else ())
        if tuple(tensor.shape) != want:  # a file whose tensors are not the config's shapes
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match the "
                             f"config's {want}")
        if name == "bias":  # added once, after the reduction
            self.bias.data.copy_(tensor)
            return
        def write() -> None:
            self.weight.data.copy_(_dense(tensor).narrow(1, self.start, self.in_local))

        if not isinstance(tensor, _BLOCKS):
            self._keep(0, None, write)
            return
        try:
            local = tensor.narrow(1, self.start, self.in_local)
        except ValueError:  # this rank's inputs do not start on a group: dense only
            self._keep(0, None, write)
            return
        self._keep(0, local, write)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, packed=self.packed, wide=self.wide)
        if self.reduce:
            y = parallel.all_reduce(y)
        if lora.STEP is not None:
            y = lora.STEP.apply(self, x, y)
        return y + self.bias if self.bias is not None else y
