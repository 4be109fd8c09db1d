"""Builds pagellm's C kernels (pagellm/kernels/*.c) on first use and loads them with ctypes.

The sources (with their shared header) are compiled once per machine with the system C compiler (`$CC`, default `cc`)
for the host CPU (-march=native) into one shared library in a cache folder
($PAGELLM_CACHE_DIR, default ~/.cache/pagellm), keyed by the sources, the compiler and the CPU.
Without a compiler the build fails quietly (one warning) and callers fall back to PyTorch ops;
PAGELLM_NATIVE_KERNELS=0 turns the kernels off on purpose.
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

logger = logging.getLogger(__name__)

SOURCES = sorted(Path(__file__).parent.glob("*.c"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))  # part of the build key, not compiled
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# C function -> (argument types, return type)
SIGNATURES = {
    "q4_linear": ([_P, _I64, _I64, _P, _P, _I64, _P, _I32], ctypes.c_int),
    "panels_available": ([], ctypes.c_int),
    "panel_linear": ([_P, _I64, _I64, _P, _I32, _I64, _P, _I32], ctypes.c_int),
    "q8_linear": ([_P, _I64, _I64, _P, _P, _I64, _P, _I32], ctypes.c_int),
    "gguf_linear": ([_P, _I64, _I64, _P, _I64, _I32, _I64, _P, _I32], ctypes.c_int),
    "gguf_act_group": ([_I32, _I64], ctypes.c_int),
    "gguf_dequantize_rows": ([_P, _I64, _I32, _I64, _P, _I64, _P], ctypes.c_int),
    "paged_attention": ([_P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _P, _I64, _P, _P, _P, _I64,
                         _F32, _I32, _I32], ctypes.c_int),
    "paged_attention_window": ([_P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _P, _I64, _P, _P,
                                _P, _I64, _F32, _I32, _I32, _I64, _F32], ctypes.c_int),
    "write_kv": ([_P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I32], None),
    "quantize_i8": ([_P, _I64, _I64, _P, _P, _P, _P], None),
    "i8_linear": ([_P, _P, _P, _I64, _I64, _P, _P, _P, _I64, _P, _I64, _I32], None),
    "q32_max_code": ([], ctypes.c_int),
    "q32_quantize": ([_P, _I64, _I64, _I64, _P, _P, _P, _P, _I32], None),
    "q32_linear": ([_P, _P, _P, _I64, _I64, _I64, _P, _P, _P, _P, _I32, _I64, _P, _I32],
                   ctypes.c_int),
    "q32_linear_gated": ([_P, _P, _P, _I64, _I64, _I64, _P, _P, _P, _P, _I32, _I64, _P, _I32],
                         ctypes.c_int),
    "q32_quantize_f32": ([_P, _I64, _I64, _I64, _P, _P, _P, _P, _I32], None),
    "q32_linear_gated_q": ([_P, _P, _P, _I64, _I64, _I64, _P, _P, _P, _P, _I32, _I64, _P, _P,
                            _P, _I64, _P, _I32], ctypes.c_int),
    "wide_layer_q32": ([_P, _P, _I64, _P, _P, _P, _I64, _I64, _P, _P, _I64, _P, _P, _P, _I64,
                        _I32, _P, _I64, _I32], ctypes.c_int),
    "wide_layers_q32": ([_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _P, _P, _I64, _P, _P, _P,
                         _I64, _I32, _P, _I64, _I32], ctypes.c_int),
    "argmax_rows": ([_P, _I64, _I64, _P, _I32], None),
    "greedy_head_available": ([], ctypes.c_int),
    "greedy_head_q8": ([_P, _I64, _I64, _P, _P, _P, _P, _P, _P, _P, _I64, _P, _P, _P, _I32],
                       ctypes.c_int),
    "rms_norm": ([_P, _P, _P, _P, _P, _I64, _I64, _F32], None),
    "silu_mul_bf16": ([_P, _P, _I64, _I64, _I32], None),
    "rms_norm_bf16": ([_P, _P, _P, _P, _I64, _I64, _F32, _I32], ctypes.c_int),
    "rope_qkv_bf16": ([_P, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _I64, _I64, _P,
                       _I32, _I32], ctypes.c_int),
    "decode_layer": ([_P, _I64, _I64, _F32, _P, _P, _P, _I64, _I64,
                      _I64, _I64, _P, _P, _P, _P, _P, _I64, _I64, _P, _P, _I64, _P, _P, _P, _I64,
                      _F32, _I32, _I32], ctypes.c_int),
    "rope_qkv_norm_bf16": ([_P, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _I64, _I64,
                            _P, _I32, _P, _P, _F32, _I32], ctypes.c_int),
    "decode_layer_ext": ([_P, _I64, _I64, _F32, _P, _P, _P, _I64, _I64, _I64, _I64, _P, _P, _P,
                          _P, _P, _I64, _I64, _P, _P, _I64, _P, _P, _P, _I64, _F32, _I32, _I32,
                          _P], ctypes.c_int),
    "moe_experts": ([_P, _I64, _I64, _P, _P, _I64, _P, _P, _P, _I64, _P, _I32, _I32], ctypes.c_int),
    "moe_route": ([_P, _I64, _I64, _I64, _I32, _P, _P, _P], ctypes.c_int),
}


def enabled() -> bool:
    return os.environ.get("PAGELLM_NATIVE_KERNELS", "1") != "0"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def cpu_has_bf16_units() -> bool:
    """AVX-512 bf16 or AMX: bf16 matrix products run natively (oneDNN), many times faster per
    row than float32 ones or block-quantized kernels once a product has more than a few rows."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.machine()


def build(cc: str, flags: list[str] | None = None) -> Path:
    """Compile the sources (unless this exact build is cached) -> the shared library's path."""
    flags = FLAGS if flags is None else flags
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    parts = [s.read_text() for s in SOURCES + HEADERS] + [version, " ".join(flags), _cpu_id()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    folder = Path(os.environ.get("PAGELLM_CACHE_DIR", Path.home() / ".cache" / "pagellm"))
    target = folder / f"kernels-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: concurrent processes never load a half-written file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True,
                       text=True, check=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, (args, ret) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ret
    return lib


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None when they are off or cannot be built here."""
    if not enabled():
        return None
    try:
        return load(build(os.environ.get("CC", "cc")))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        # no compiler, a failed build, an unwritable cache, no home folder (RuntimeError
        # from Path.home()): run on PyTorch ops instead
        detail = getattr(e, "stderr", "") or e
        logger.warning("native CPU kernels unavailable (%s); using PyTorch ops", str(detail)[:500])
        return None


def available() -> bool:
    return library() is not None
