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

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        if self._native(x):
            return self._run_native(x, None)[1]
        # One fused op (float32 inside) instead of six: same values in float32; in bf16 the
        # weight is applied before the final rounding rather than after.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)): the residual add fused with the norm after it."""
        if self._native(x) and delta.dtype == torch.float32:
            return self._run_native(x, delta)
        x = x + delta
        return x, self(x)

    def _native(self, x: torch.Tensor) -> bool:
        # float32 rows on the CPU (a float32 model, or a bf16 one with float32 activations)
        return (x.dtype == torch.float32 and self.weight.dtype == torch.float32
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
                                  self.weight.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1],
                                  x.shape[-1], self.eps)
        return x_new, out
