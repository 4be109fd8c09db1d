"""Architecture name -> model class, and building a ready model from loaded files."""
from __future__ import annotations

import torch

from pagellm.attention.base import get_attention_backend
from pagellm.models.llama import LlamaForCausalLM

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def model_class(config):
    for arch in getattr(config, "architectures", None) or []:
        if arch in MODEL_CLASSES:
            return MODEL_CLASSES[arch]
    if getattr(config, "model_type", None) in ("llama", "mistral", "qwen2"):
        return LlamaForCausalLM
    raise ValueError(f"unsupported architecture {getattr(config, 'architectures', None)}; "
                     f"supported: {sorted(MODEL_CLASSES)}")


def build_model(files, dtype: torch.dtype, device: torch.device, max_position: int):
    cls = model_class(files.config)
    model = cls(files.config, get_attention_backend(device), max_position)
    model.load_weights(files.weights())
    return model.to(dtype=dtype, device=device).eval()
