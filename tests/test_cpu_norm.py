"""The native RMSNorm (pagellm/kernels/cpu_norm.c), alone and fused with the residual add,
against PyTorch's float32 rms_norm; bf16 inputs keep PyTorch's path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.kernels import native
from pagellm.layers.norm import RMSNorm

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler on this machine")


def _norm(d=96, seed=0):
    norm = RMSNorm(d, 1e-5)
    norm.weight.data = torch.rand(d, generator=torch.Generator().manual_seed(seed)) + 0.5
    return norm


@pytest.mark.parametrize("rows", [1, 7])
def test_native_norm_matches_torch(rows):
    norm = _norm()
    x = torch.randn(rows, 96) * 4
    ref = F.rms_norm(x, (96,), norm.weight, 1e-5)
    assert norm._native(x)
    assert torch.allclose(norm(x), ref, rtol=1e-5, atol=1e-6)
    delta = torch.randn(rows, 96)
    x_before, delta_before = x.clone(), delta.clone()
    x_new, h = norm.add_forward(x, delta)
    assert torch.equal(x, x_before) and torch.equal(delta, delta_before)  # inputs untouched
    assert torch.equal(x_new, x + delta)  # the residual stream is exact
    assert torch.allclose(h, F.rms_norm(x + delta, (96,), norm.weight, 1e-5), rtol=1e-5, atol=1e-6)


def test_non_contiguous_and_bf16_inputs():
    norm = _norm(seed=1)
    x = torch.randn(96, 5).t()  # non-contiguous rows
    assert torch.allclose(norm(x), F.rms_norm(x, (96,), norm.weight, 1e-5), rtol=1e-5, atol=1e-6)
    xb = torch.randn(3, 96).bfloat16()
    assert not norm._native(xb)
    nb = _norm(seed=2).to(torch.bfloat16)
    out = nb(xb)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), F.rms_norm(xb.float(), (96,), nb.weight.float(), 1e-5),
                          rtol=0.02, atol=0.02)
