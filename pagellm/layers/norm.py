"""RMSNorm, computed in float32 like the reference implementation."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels import native


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def scale(self) -> torch.Tensor:
        """What the normalized rows are multiplied by."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        if self._native(x):
            return self._run_native(x, None)[1]
        # One fused op (float32 inside) instead of six: same values in float32; in bf16 the
        # weight is applied before the final rounding rather than after.
        w = self.scale()
        if w.dtype != x.dtype:  # a float32 scale (OffsetRMSNorm): float32 inside, rounded once
            return F.rms_norm(x.float(), w.shape, w, self.eps).to(x.dtype)
        return F.rms_norm(x, w.shape, w, self.eps)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)): the residual add fused with the norm after it."""
        if self._native(x) and delta.dtype == torch.float32:
            return self._run_native(x, delta)
        x = x + delta
        return x, self(x)

    def _native(self, x: torch.Tensor) -> bool:
        # float32 rows on the CPU (a float32 model, or a bf16 one with float32 activations)
        return (x.dtype == torch.float32 and self.scale().dtype == torch.float32
                and x.device.type == "cpu" and native.available())

    def _run_native(self, x: torch.Tensor, delta: torch.Tensor | None):
        x = x.contiguous()
        out = torch.empty_like(x)
        if delta is None:
            x_new, add = x, None
        else:
            delta = delta.contiguous()
            x_new, add = torch.empty_like(x), delta.data_ptr()
        native.library().rms_norm(x.data_ptr(), add, x_new.data_ptr() if add else None,
                                  self.scale().data_ptr(), out.data_ptr(), x.numel() // x.shape[-1],
                                  x.shape[-1], self.eps)
        return x_new, out


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: rows times (1 + weight), the sum in float32 whatever the weight's
    dtype (as transformers computes it: a bf16 checkpoint's weight, not 1 + weight, is what
    bf16 rounds). The weight is the checkpoint's (0 is the identity)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__(hidden_size, eps)
        self.weight.data.zero_()

    _scale: tuple[tuple, torch.Tensor] | None = None

    def forget_scale(self) -> None:
        """After the weight is written in place (`.data.copy_` leaves its version as it was)."""
        self._scale = None

    def scale(self) -> torch.Tensor:
        w = self.weight  # made again when the weight is loaded or converted
        key = (w.data_ptr(), w.dtype, w.device, w._version)
        if self._scale is None or self._scale[0] != key:
            self._scale = (key, (1.0 + w.detach().float()).contiguous())
        return self._scale[1]
