"""SamplingParams with vLLM's names; every invalid value raises ValueError naming the field."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

# The constraint kinds of StructuredOutputsParams, in vLLM's names.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Constrain the output (vLLM's StructuredOutputsParams). Exactly one of:
    json: a JSON schema (dict or JSON text); regex: a regular expression the whole output
    matches; choice: one of these strings; grammar: a Lark or GBNF (llama.cpp) grammar;
    json_object: any JSON object."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self):
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of "
                             f"{list(STRUCTURED_KINDS)}, got {given or 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        ok = {"json": isinstance(value, (dict, str)) and bool(value),
              "regex": isinstance(value, str) and bool(value),
              "grammar": isinstance(value, str) and bool(value.strip()),
              "choice": isinstance(value, (list, tuple)) and bool(value)
              and all(isinstance(c, str) and c for c in value),
              "json_object": value is True}[kind]
        if not ok:
            what = {"json": "a JSON schema (an object or its JSON text)",
                    "regex": "a non-empty string", "grammar": "a non-empty string",
                    "choice": "a non-empty list of non-empty strings",
                    "json_object": "true"}[kind]
            raise ValueError(f"structured_outputs.{kind} must be {what}, got {value!r}")
        if kind == "choice":
            self.choice = list(value)

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @classmethod
    def from_any(cls, value: Any) -> StructuredOutputsParams | None:
        """None, a StructuredOutputsParams, or a dict of its fields (vLLM's guided_decoding
        dicts also name them guided_json, ...)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError("structured_outputs must be a StructuredOutputsParams or a dict, "
                             f"got {type(value).__name__}")
        names = {f.name for f in fields(cls)}
        kw = {k.removeprefix("guided_"): v for k, v in value.items()}
        unknown = sorted(set(kw) - names)
        if unknown:
            raise ValueError(f"structured_outputs: unknown fields {unknown}; "
                             f"expected one of {list(STRUCTURED_KINDS)}")
        return cls(**kw)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None -> up to the model's context length
    min_tokens: int = 0
    logprobs: int | None = None  # top-N logprobs of each generated token
    # the log-probability of each prompt token after the first (given the tokens before it),
    # with the top-N of its position; RequestOutput.prompt_logprobs (a request with it takes
    # no prefix-cache hits: cached tokens have no logits)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias: -100 bans,
    # +100 all but forces).
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None
    guided_decoding: StructuredOutputsParams | dict | None = None  # the older vLLM name
    # Speculative decoding for this request: at most this many proposals a step (0: none);
    # None: as the engine's speculative_config and its controller decide.
    num_speculative_tokens: int | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self):
        # Fix: stop=5 or stop_token_ids=5 used to raise TypeError from list(); reject by name.
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError("stop_token_ids must be a list of integers, "
                             f"got {self.stop_token_ids!r}")
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("structured_outputs: give it or guided_decoding, not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        self.structured_outputs = StructuredOutputsParams.from_any(self.structured_outputs)
        self._validate()
        self._validate_logit_bias()

    def _validate(self) -> None:
        def check(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"{name} {msg}, got {getattr(self, name)!r}")

        num = (int, float)
        # NaN fails every comparison below; infinity passes "> 0" (repetition_penalty=inf made
        # NaN logits inside the step, failing the whole batch): finite numbers only
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            check(not isinstance(value, num) or math.isfinite(value), name, "must be a finite number")
        # Fix: bool is a subclass of int, so n=True or max_tokens=True used to pass.
        for name in ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
                     "seed", "num_speculative_tokens"):
            check(not isinstance(getattr(self, name), bool), name, "must be an integer, not a bool")
        check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        check(self.num_speculative_tokens is None or (isinstance(self.num_speculative_tokens, int)
                                                      and self.num_speculative_tokens >= 0),
              "num_speculative_tokens", "must be an integer >= 0 (0: no speculation)")
        check(isinstance(self.temperature, num) and self.temperature >= 0, "temperature",
              "must be >= 0")
        check(isinstance(self.top_p, num) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k",
              "must be -1, 0 (off) or a positive integer")
        check(isinstance(self.min_p, num) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        check(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer")
        check(isinstance(self.presence_penalty, num) and -2 <= self.presence_penalty <= 2,
              "presence_penalty", "must be in [-2, 2]")
        check(isinstance(self.frequency_penalty, num) and -2 <= self.frequency_penalty <= 2,
              "frequency_penalty", "must be in [-2, 2]")
        check(isinstance(self.repetition_penalty, num) and self.repetition_penalty > 0,
              "repetition_penalty", "must be > 0")
        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
              "max_tokens", "must be an integer >= 1")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be >= 0")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              "must be <= max_tokens")
        check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
              "logprobs", "must be an integer in [0, 20]")
        check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                               and 0 <= self.prompt_logprobs <= 20),
              "prompt_logprobs", "must be an integer in [0, 20]")
        check(all(isinstance(s, str) and s for s in self.stop_strings), "stop",
              "must be a non-empty string or a list of non-empty strings")
        check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                  for t in self.stop_token_ids), "stop_token_ids",
              "must be a list of non-negative integers")

    def _validate_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got "
                             f"{type(self.logit_bias).__name__}")
        bias = {}
        for t, b in self.logit_bias.items():
            if isinstance(t, str) and t.strip().lstrip("-").isdigit():
                t = int(t)  # JSON object keys are strings
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), "
                                 f"got {t!r}")
            if (not isinstance(b, (int, float)) or isinstance(b, bool) or not math.isfinite(b)
                    or not -100 <= b <= 100):
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got "
                                 f"{b!r} for token {t}")
            bias[t] = float(b)
        self.logit_bias = bias or None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1.0)
