"""Shared fixtures: tiny random models written to disk, and the leak check after every test."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from pagellm.engine import llm_engine
from tests.helpers import assert_no_leaks, make_tiny_model

_ENGINES: list[weakref.ref] = []  # engines made since the last leak check
_LIVE: weakref.WeakSet = weakref.WeakSet()  # every engine still alive (module fixtures too)
_original_init = llm_engine.LLMEngine.__init__


_COLLECTED_LEAKS: list[str] = []  # engines garbage-collected with requests or blocks out


def _tracking_init(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    _ENGINES.append(weakref.ref(self))
    _LIVE.add(self)
    # An engine collected before the check after its test would escape it: check its pool
    # when it goes (the finalizer holds the block managers and the request table, not it).
    draft = getattr(getattr(self.spec, "proposer", None), "block_manager", None)
    weakref.finalize(self, _check_collected, self.block_manager, self.requests, draft)


def _check_collected(bm, requests, draft_bm) -> None:
    leaks = []
    if requests:
        leaks.append(f"requests left: {list(requests)[:5]}")
    if bm.num_free_blocks != bm.num_blocks:
        leaks.append(f"{bm.num_blocks - bm.num_free_blocks} blocks")
    if draft_bm is not None and draft_bm.num_free_blocks != draft_bm.num_blocks:
        leaks.append("draft cache blocks")
    if leaks:
        _COLLECTED_LEAKS.append(", ".join(leaks))


llm_engine.LLMEngine.__init__ = _tracking_init

# Tiny test models run much faster on one thread than with OpenMP spread over busy cores.
torch.set_num_threads(1)
# Everything imported so far lives for the whole run: keep it out of the collector's scans,
# so the leak check's gc.collect() stays cheap.
gc.freeze()


@pytest.fixture(autouse=True)
def exact_q32_blocks(monkeypatch):
    """Tests assume the default numerics: the many-row products on the file's own blocks,
    whatever PAGELLM_Q32_BLOCK the shell has (a test that wants requantized blocks sets it)."""
    monkeypatch.delenv("PAGELLM_Q32_BLOCK", raising=False)


@pytest.fixture(scope="session")
def avx2_kernels(tmp_path_factory):
    """The native kernels built for AVX2 alone (no AVX-512: the 8-wide paths and the AVX2
    q32 tiles that a 16-wide CPU never runs), on any CPU with AVX2."""
    from pagellm.kernels import native

    if not native.available():
        pytest.skip("no C compiler on this machine")
    if "avx2" not in native.cpu_flags():
        pytest.skip("this CPU has no AVX2")
    mp = pytest.MonkeyPatch()
    mp.setenv("PAGELLM_CACHE_DIR", str(tmp_path_factory.mktemp("avx2")))
    try:
        flags = [f for f in native.FLAGS if f != "-march=native"] + ["-mavx2", "-mfma", "-mf16c"]
        return native.load(native.build("cc", flags))
    finally:
        mp.undo()


@pytest.fixture(autouse=True)
def leak_check():
    """After every test, every engine still alive is checked: those the test made and those a
    module- or session-scoped fixture made before it (and that this test used); and every
    engine collected meanwhile was checked as it went."""
    yield
    created = bool(_ENGINES)
    for engine in list(_LIVE):
        assert_no_leaks(engine)
    _ENGINES.clear()
    if created:
        gc.collect()  # free the engine's KV pool before the next test allocates its own
    leaked, _COLLECTED_LEAKS[:] = list(_COLLECTED_LEAKS), []
    assert not leaked, f"an engine was collected with leaks: {leaked}"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    return str(path), make_tiny_model(path, "llama")
