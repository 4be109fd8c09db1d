"""pagellm fetch's assembly: parts from wheels joined in numeric order (not file order), size
and sha256 checked, nothing left behind on a mismatch; unknown names refused."""
from __future__ import annotations

import hashlib
import zipfile

import pytest

from pagellm.models import fetch


def _wheels(tmp_path, parts: list[bytes]) -> list:
    paths = []
    for i, data in enumerate(parts, start=1):
        path = tmp_path / f"model_part{i}-0.1.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as z:
            z.writestr(f"model_part{i}/__init__.py", "")
            z.writestr(f"model_part{i}/data/part{i:02d}.bin", data)
        paths.append(path)
    return paths[::-1]  # listed out of order: the part numbers decide


def test_parts_are_joined_in_numeric_order_and_checked(tmp_path):
    parts = [bytes([i]) * (1000 + i) for i in range(1, 12)]  # 11 parts: part10 sorts before part2 as text
    whole = b"".join(parts)
    model = fetch.PartedModel("m.gguf", "model_part", len(parts), "0.1.0", len(whole),
                              hashlib.sha256(whole).hexdigest(), "test")
    target = tmp_path / "m.gguf"
    fetch._assemble(model, _wheels(tmp_path, parts), target, progress=False)
    assert target.read_bytes() == whole

    bad = fetch.PartedModel("m2.gguf", "model_part", len(parts), "0.1.0", len(whole), "0" * 64, "test")
    with pytest.raises(RuntimeError, match="sha256"):
        fetch._assemble(bad, _wheels(tmp_path, parts), tmp_path / "m2.gguf", progress=False)
    assert not list(tmp_path.glob("m2*"))  # no partial file left


def test_missing_part_and_unknown_name(tmp_path):
    parts = [b"a" * 10, b"b" * 10, b"c" * 10]
    model = fetch.PartedModel("m.gguf", "model_part", 4, "0.1.0", 40, "0" * 64, "test")
    with pytest.raises(RuntimeError, match="expected parts 1..4"):
        fetch._assemble(model, _wheels(tmp_path, parts), tmp_path / "m.gguf", progress=False)
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        fetch.model_path("nope")


def test_parts_named_after_the_file_from_zero(tmp_path):
    """Wheels holding `<module>/data/<file>.partNN`, numbered from 00 (the Gemma 3 parts)."""
    parts = [bytes([i]) * (500 + i) for i in range(12)]
    whole = b"".join(parts)
    wheels = []
    for i, data in enumerate(parts):
        path = tmp_path / f"g_part{i + 1}-1.0.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as z:
            z.writestr(f"g_part{i + 1}/data/g.gguf.part{i:02d}", data)
        wheels.append(path)
    model = fetch.PartedModel("g.gguf", "g-part", len(parts), "1.0.0", len(whole),
                              hashlib.sha256(whole).hexdigest(), "test", first_part=0)
    fetch._assemble(model, wheels[::-1], tmp_path / "g.gguf", progress=False)
    assert (tmp_path / "g.gguf").read_bytes() == whole
    short = fetch.PartedModel("h.gguf", "g-part", len(parts) + 1, "1.0.0", len(whole), "0" * 64,
                              "test", first_part=0)
    with pytest.raises(RuntimeError, match="expected parts 0..12"):
        fetch._assemble(short, wheels, tmp_path / "h.gguf", progress=False)
