"""Dense bf16 products through oneDNN with the weight reordered once, at load, on CPUs with
bf16 units (AVX-512 bf16, AMX).

`F.linear` on a bf16 CPU tensor hands oneDNN a plain row-major weight, which oneDNN reorders
into its blocked layout at every call. Reordered once (`torch.ops.mkldnn._reorder_linear_weight`,
PyTorch's own prepacking for CPU inference), the same product runs from the blocked copy:
2-core Xeon with AMX, a 3072 x 576 weight, bf16, 1 row 0.13 -> 0.06 ms, 64 rows 0.25 -> 0.15 ms,
300 rows 0.61 -> 0.47 ms, 2,048 rows level; the results are bit-identical. The blocked copy
replaces the dense weight (same bytes), which goes to the meta device.
"""
from __future__ import annotations

import os

import torch


def available() -> bool:
    """PyTorch built with oneDNN and its linear prepacking ops; PAGELLM_ONEDNN=0 turns it off."""
    return (os.environ.get("PAGELLM_ONEDNN", "1") != "0" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def bf16_runs() -> bool:
    """Whether oneDNN takes bf16 products on this CPU at all (its reorder needs AVX-512
    BW/VL/DQ or AVX-NE-CONVERT; slowly, without bf16 units): tests that emulate a CPU with
    bf16 units need it."""
    return available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class OneDNNLinear:
    """y = x W^T from W [N, K] bf16 in oneDNN's blocked layout; bf16 outputs."""

    def __init__(self, weight: torch.Tensor):
        assert weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
        self.out_features, self.in_features = weight.shape
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
        self.nbytes = weight.numel() * weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N] bf16
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.bfloat16:
            x2 = x2.to(torch.bfloat16)
        y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), self.weight, None, "none", [], "")
        return y.view(*lead, self.out_features)
