"""Engine configuration: frozen, slotted dataclasses validated in __post_init__.

Components receive the few scalars they need from here, never the whole config.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def parse_bytes(value: int | float | str, name: str) -> int:
    """'2GiB', '512MB', 1e9 -> bytes. ValueError naming `name` on anything else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{name}: cannot parse {value!r} as a size (e.g. 2GiB, 512MB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    # At most one of these decides the KV budget; both None -> on the CPU min(2 GiB, a quarter
    # of available memory), on a GPU 0.9 of its memory less what is in use (engine/memory.py).
    kv_cache_memory: int | None = None  # bytes
    kv_cache_fraction: float | None = None  # of available (CPU) / free (GPU) memory
    # vLLM's: on a GPU (with neither of the above) the budget is this share of the device's
    # memory less what is in use; None: 0.9. The CPU's budget does not read it.
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    # "auto": the model's dtype, except float32 for a bfloat16 model on a CPU without bf16
    # units (see engine/memory.resolve_kv_dtype); or "float32" | "bfloat16" | "float16", or
    # "int8" (CPU: codes and a scale per row of head_dim values, ~half a bf16 pool's bytes).
    kv_cache_dtype: str = "auto"

    def __post_init__(self):
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16", "float16", "int8"):
            raise ValueError(f"kv_cache_dtype must be auto, float32, bfloat16, float16 or int8, "
                             f"got {self.kv_cache_dtype!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.kv_cache_fraction is not None and not 0 < self.kv_cache_fraction <= 1:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"  # "ngram" | "draft_model"
    model: str | None = None  # draft model path, for method "draft_model"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    # 1: a one-token match proposes too. On copy prompts it is right 0.39 of the time at the
    # first token (where no longer match exists), against 0.13 on chat; the controller keeps
    # acceptance per match length and request, so it speculates on it where it pays (replayed
    # at measured step costs: copy 2.05x against 1.96x with 2, chat unchanged).
    prompt_lookup_min: int = 1
    draft_dtype: str | None = None  # None -> the target's dtype
    # Keep only the first N layers of the draft (a cheaper form of the target's own weights
    # when no smaller sibling exists). None -> all layers.
    draft_num_layers: int | None = None
    adaptive: bool = True
    # The draft model scores only its first N token ids (LlamaForCausalLM.limit_vocab), plus
    # the ids past N that its requests' own prompts and outputs hold and the end-of-sequence
    # ids (DraftModelProposer._score_own_text): its LM head is a large share of a small draft's
    # step (Qwen2.5-0.5B: 136 of ~400 MB read per token). None or 0: all of them. Qwen2.5-Coder
    # 0.5B drafting for the 1.5B, 32768 ids: a q4_1 draft round 17.0 -> 12.9 ms, acceptance
    # 0.87 -> 0.86 on code (the first ids alone: 0.706 -> 0.649 over five prompts; with the
    # requests' own ids 0.681). Off by default: a text in a script the first ids hardly cover
    # (CJK in Qwen's) would be proposed from its prompt's ids only.
    draft_vocab_size: int | None = None
    # method "draft_model", batch 1: n-gram lookup proposes first (matches of at least
    # max(3, prompt_lookup_min) tokens), the draft only where it finds nothing.
    prompt_lookup_first: bool = False
    # "q4_1": a GGUF draft's blocks of more than 5 bits a weight (Q8_0, Q5_0/1, Q5_K, Q6_K)
    # requantized to Q4_1 at load. A draft's decode step reads all its weights, so fewer bytes
    # make every proposal cheaper; its proposals change a little, the output distribution not
    # at all (verification is exact). Qwen2.5-Coder-0.5B (Q8_0 head, Q5_0 layers): 391 -> 305 MB
    # of weights a token, its 1-row forward 11.3 -> 9.7 ms, same acceptance on a code prompt.
    draft_quantization: str | None = None

    def __post_init__(self):
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(
                f"speculative_config.method must be 'ngram' or 'draft_model', got {self.method!r}")
        if self.method == "ngram":
            for name in ("model", "draft_dtype", "draft_num_layers", "draft_vocab_size"):
                if getattr(self, name):
                    raise ValueError(f"speculative_config.{name}: n-gram lookup has no draft "
                                     "model; use method 'draft_model' (or leave the method out)")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("speculative_config.num_speculative_tokens must be in [1, 16], "
                             f"got {self.num_speculative_tokens}")
        if self.draft_num_layers is not None and self.draft_num_layers < 1:
            raise ValueError("speculative_config.draft_num_layers must be >= 1")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 0:
            raise ValueError("speculative_config.draft_vocab_size must be >= 0 (0: the whole "
                             f"vocabulary), got {self.draft_vocab_size}")
        if self.draft_quantization not in (None, "q4_1"):
            raise ValueError("speculative_config.draft_quantization must be 'q4_1' or None, got "
                             f"{self.draft_quantization!r}")
        if self.draft_quantization and (self.method != "draft_model" or not self.model):
            raise ValueError("speculative_config.draft_quantization needs method 'draft_model' "
                             "and a draft 'model' of its own (GGUF)")
        if self.prompt_lookup_first and self.method != "draft_model":
            raise ValueError("speculative_config.prompt_lookup_first needs method 'draft_model' "
                             "(it puts n-gram lookup before the draft)")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        if d is None or isinstance(d, SpeculativeConfig):
            return d
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}")
        if "method" not in d and (d.get("model") or d.get("draft_num_layers")):
            # vLLM's reading: a draft model (or the target's first layers) and no method
            d = {**d, "method": "draft_model"}
        return cls(**d)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # HF folder or .gguf; None -> the default model
    # a tokenizer folder used instead of the model's own (vLLM's `tokenizer`)
    tokenizer: str | None = None
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    max_model_len: int | None = None  # None -> the model's context length
    seed: int = 0
    tensor_parallel_size: int = 1
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None
    # None (auto): a GGUF file's Q4_0/Q4_1 projections stay packed when running bfloat16 on
    # the CPU; "gguf": insist on that; "none": dequantize every weight at load.
    quantization: str | None = None
    # A profiling forward at the largest step before the KV budget is read (its activations
    # come off the budget) and warm-up forwards of the step shapes (GPU kernels compile
    # here, not on the first requests). None (auto): on a GPU; off on the CPU, where there is
    # nothing to compile and the budget is not taken from what is left.
    warmup: bool | None = None

    def __post_init__(self):
        if self.warmup not in (None, True, False):
            raise ValueError(f"warmup must be true, false or None (auto), got {self.warmup!r}")
        if self.quantization not in (None, "gguf", "none"):
            raise ValueError(f"quantization must be gguf, none or None (auto), "
                             f"got {self.quantization!r}")
        if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise ValueError(f"dtype must be float32, bfloat16, float16 or auto, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
