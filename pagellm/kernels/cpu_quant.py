"""Block-quantized few-row products (cpu_quant.c, cpu_gguf.c): PyTorch tensors in, float32
tensors out."""
from __future__ import annotations

import torch

from pagellm.kernels import native


def _run(name: str, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., K] (any float dtype) -> [..., N] float32."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k).to(torch.float32).contiguous()
    n = codes.shape[0]
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    fn = getattr(native.library(), name)
    rc = fn(x2.data_ptr(), x2.shape[0], k, codes.data_ptr(), scales.data_ptr(), n, y.data_ptr(),
            torch.get_num_threads())
    if rc == -2:
        raise ValueError(f"{name}: {k} inputs is not a positive multiple of 32")
    if rc != 0:
        raise MemoryError(f"{name}: out of memory for activation buffers")
    return y.view(*x.shape[:-1], n)


def q4_linear(x: torch.Tensor, codes: torch.Tensor, scale_min: torch.Tensor) -> torch.Tensor:
    """codes [N, K / 2] uint8 (GGUF nibble order), scale_min [N, K / 32, 2] float32 (w = scale * q
    + min) -> x W^T in float32."""
    return _run("q4_linear", x, codes, scale_min)


def q8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes [N, K] int8, scale [N, K / 32] float32 (w = scale * q) -> x W^T in float32."""
    return _run("q8_linear", x, codes, scale)


def gguf_linear(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """blocks [N, row_bytes] uint8: each row the GGUF file's blocks of type `ggml_type` for K
    inputs -> x W^T [..., N] in float32."""
    x2 = x.reshape(-1, k).to(torch.float32).contiguous()
    n, row_bytes = blocks.shape
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    rc = native.library().gguf_linear(x2.data_ptr(), x2.shape[0], k, blocks.data_ptr(), row_bytes,
                                       ggml_type, n, y.data_ptr(), torch.get_num_threads())
    if rc == -1:
        raise MemoryError("gguf_linear: out of memory for activation buffers")
    if rc != 0:
        raise ValueError(f"gguf_linear: ggml type {ggml_type} with {k} inputs and {row_bytes} "
                         "bytes per row is not a layout the kernel takes")
    return y.view(*x.shape[:-1], n)
