"""Block-quantized few-row products (cpu_quant.c), built on first use and loaded with ctypes.

The C source is compiled once per machine with the system C compiler (`$CC`, default `cc`)
for the host CPU (-march=native) into a cache folder ($PAGELLM_CACHE_DIR, default
~/.cache/pagellm), keyed by the source, the compiler and the CPU. Without a compiler the build
fails quietly (one warning) and callers fall back to PyTorch kernels; PAGELLM_NATIVE_KERNELS=0
turns the kernels off on purpose.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_quant.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
GROUP = 32


def enabled() -> bool:
    return os.environ.get("PAGELLM_NATIVE_KERNELS", "1") != "0"


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.machine()


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([_SOURCE.read_text(), version, " ".join(_FLAGS), _cpu_id()])
                         .encode()).hexdigest()[:16]
    folder = Path(os.environ.get("PAGELLM_CACHE_DIR", Path.home() / ".cache" / "pagellm"))
    target = folder / f"cpu_quant-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: concurrent processes never load a half-written file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        subprocess.run([cc, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"], capture_output=True,
                       text=True, check=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None when they are off or cannot be built here."""
    if not enabled():
        return None
    try:
        lib = ctypes.CDLL(str(_build(os.environ.get("CC", "cc"))))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        logger.warning("native CPU kernels unavailable (%s); using PyTorch kernels", str(detail)[:500])
        return None
    args = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    for fn in (lib.q4_linear, lib.q8_linear):
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def available() -> bool:
    return library() is not None


def _run(fn, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., K] (any float dtype) -> [..., N] float32."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k).to(torch.float32).contiguous()
    n = codes.shape[0]
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    if fn(x2.data_ptr(), x2.shape[0], k, codes.data_ptr(), scales.data_ptr(), n, y.data_ptr(),
          torch.get_num_threads()) != 0:
        raise MemoryError("cpu_quant: out of memory for activation buffers")
    return y.view(*x.shape[:-1], n)


def q4_linear(x: torch.Tensor, codes: torch.Tensor, scale_min: torch.Tensor) -> torch.Tensor:
    """codes [N, K / 2] uint8 (GGUF nibble order), scale_min [N, K / 32, 2] float32 (w = scale * q
    + min) -> x W^T in float32."""
    return _run(library().q4_linear, x, codes, scale_min)


def q8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes [N, K] int8, scale [N, K / 32] float32 (w = scale * q) -> x W^T in float32."""
    return _run(library().q8_linear, x, codes, scale)
