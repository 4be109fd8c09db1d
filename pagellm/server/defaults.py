"""The server's sampling defaults: what a request that leaves out temperature, top_p, ... gets.

In order: the --default-* flags; the model's own generation config (generation_config.json of an
HF folder, the `general.sampling.*` keys of a GGUF file); and for a model that brings none,
llama.cpp's server defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05), so a model
served as it was downloaded does not answer at temperature 1 with no truncation, which gives
small models' long tails free rein. `--generation-config none` keeps OpenAI's defaults
(temperature 1, no truncation) apart from the flags.
"""
from __future__ import annotations

import json
import os

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
LLAMA_CPP = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
              "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}


def model_generation_config(model_path: str) -> dict:
    """The sampling fields the model's files carry ({} if none)."""
    if os.path.isdir(model_path):
        path = os.path.join(model_path, "generation_config.json")
        if not os.path.exists(path):
            return {}
        with open(path) as f:
            cfg = json.load(f)
        return {k: cfg[k] for k in FIELDS if isinstance(cfg.get(k), (int, float))
                and not isinstance(cfg.get(k), bool)}
    if model_path.endswith(".gguf"):
        import gguf

        reader = gguf.GGUFReader(model_path)
        out = {}
        for key, name in _GGUF_KEYS.items():
            field = reader.fields.get(key)
            if field is not None and field.data:
                out[name] = field.parts[field.data[0]].tolist()[0]
        return out
    return {}


def sampling_defaults(model_path: str, generation_config: str = "auto",
                      flags: dict | None = None) -> tuple[dict, str]:
    """-> (defaults, where they came from: for the start-up log)."""
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    base, source = {}, "OpenAI's (temperature 1, no truncation)"
    if generation_config == "auto":
        base = model_generation_config(model_path)
        source = "the model's generation config"
        if not base:
            base, source = dict(LLAMA_CPP), "llama.cpp's (the model brings none)"
    defaults = {**base, **flags}
    if flags:
        source += " and --default-* flags"
    return defaults, source
