"""The test harness itself: the leak check's engine tracking is installed exactly once."""
from __future__ import annotations

import sys

from pagellm.engine import llm_engine


def test_conftest_is_loaded_once_and_wraps_the_engine_once():
    # Importing conftest from a test module made a second copy of it, which wrapped
    # LLMEngine.__init__ again (engines tracked twice); shared helpers live in helpers.py.
    assert "tests.conftest" not in sys.modules
    init = llm_engine.LLMEngine.__init__
    assert init.__name__ == "_tracking_init"
    assert init.__globals__["_original_init"].__name__ == "__init__"


def test_an_engine_collected_with_a_request_is_reported(tiny_llama):
    """The leak check also covers engines that are gone before it runs."""
    import gc

    import conftest
    from pagellm import LLM, SamplingParams

    llm = LLM(tiny_llama[0], dtype="float32", kv_cache_memory=2**20)
    llm.engine.add_request("left", [1, 2, 3], SamplingParams(max_tokens=4))
    llm.engine.step()  # the request holds blocks now
    del llm
    gc.collect()
    found, conftest._COLLECTED_LEAKS[:] = list(conftest._COLLECTED_LEAKS), []
    assert found and "left" in found[0] and "blocks" in found[0]
