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
