"""Architecture name -> model class, and building a ready model from loaded files."""
from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from pagellm.attention.base import get_attention_backend
from pagellm import parallel
from pagellm.kernels import native
from pagellm.layers import q32_smooth
from pagellm.layers.linear import float32_biases, keep_float32, prepack_bf16, upcast
from pagellm.layers.rotary import rotary_fraction
from pagellm.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from pagellm.models.llama import WINDOWED_TYPES, LlamaForCausalLM, layer_window

logger = logging.getLogger(__name__)

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "SmolLM3ForCausalLM": LlamaForCausalLM,
    # Phi-3: its fused qkv and gate|up read as their parts (models/loader.py, gguf_loader.py)
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    # mixtures of experts: the Llama form with models/moe.py's blocks
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
}
# model types whose sliding windows the model attends over as such (elsewhere a config's
# sliding_window caps the context: full attention is exact up to it)
WINDOWED_MODEL_TYPES = frozenset({"gemma3_text", "gemma2"}) | WINDOWED_TYPES
# model_type -> class, for configs that name no architecture
_MODEL_TYPES = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM,
                "qwen3": LlamaForCausalLM, "smollm3": LlamaForCausalLM, "phi3": LlamaForCausalLM,
                "gemma3_text": Gemma3ForCausalLM,
                "gemma2": Gemma2ForCausalLM, "mixtral": LlamaForCausalLM,
                "qwen2_moe": LlamaForCausalLM, "qwen3_moe": LlamaForCausalLM}


def model_class(config):
    rotated = rotary_fraction(config)
    if rotated != 1.0 and getattr(config, "model_type", None) != "phi3":
        # Phi-3's q / k rows are laid out for it at load (layers/rotary.partial_rotary_order)
        raise ValueError(f"partial_rotary_factor {rotated}: rotating part of each head is "
                         f"supported for Phi-3 models (Phi-4-mini), not {config.model_type}")
    for arch in getattr(config, "architectures", None) or []:
        if arch in MODEL_CLASSES:
            return MODEL_CLASSES[arch]
    if getattr(config, "model_type", None) in _MODEL_TYPES:
        return _MODEL_TYPES[config.model_type]
    raise ValueError(f"unsupported architecture {getattr(config, 'architectures', None)}; "
                     f"supported: {sorted(MODEL_CLASSES)}")


def may_pack(files, quantization: str | None) -> bool:
    """Whether the file has block-quantized projections that the quantization setting lets stay
    packed (what dtype "auto" looks at, before the dtype is known)."""
    return files.packed_linears and quantization != "none"


def use_packed(quantization: str | None, files, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether to keep GGUF block-quantized projections packed (EngineConfig validated
    `quantization`). Q4_0 / Q4_1 take NativeQ4 (or PyTorch's int4 kernel without a compiler);
    the other types need the native kernels (cpu_gguf.c) and otherwise load dense.
    None (auto): when the file has them and the model runs in bfloat16 on the CPU (the packed
    kernel computes with bf16 activations, so a float32 model stays dense); "gguf": the same,
    but an error when that is impossible; "none": always dequantize at load."""
    possible = (may_pack(files, quantization) and device.type == "cpu"
                and dtype == torch.bfloat16
                and (native.available() or hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")))
    if quantization == "gguf" and not possible:
        raise ValueError("quantization='gguf' keeps a GGUF file's block-quantized weights packed; "
                         "it needs such a file, dtype bfloat16 and the CPU (got "
                         f"{'a file with them' if files.packed_linears else 'no packable weights'}, "
                         f"{dtype}, {device.type})")
    return possible


@contextlib.contextmanager
def materialised_in(dtype: torch.dtype, device: torch.device):
    """Modules built inside make their parameters directly in `dtype` on `device`, without
    random initialisation (every parameter is then loaded from the checkpoint, which refuses
    a missing one): no float32 host copy of the model first (~4 bytes a parameter: a 32B
    model would not fit), no seconds spent drawing random weights."""
    skipped = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_",
               "xavier_uniform_", "xavier_normal_")
    saved = {name: getattr(nn.init, name) for name in skipped}
    previous = torch.get_default_dtype()
    try:
        for name in skipped:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        torch.set_default_dtype(dtype)
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def build_model(files, dtype: torch.dtype, device: torch.device, max_position: int,
                quantization: str | None = None):
    cls = model_class(files.config)
    with materialised_in(dtype, device):
        # windows and soft-capped scores: not in the Triton kernels
        sliding = ("sliding_attention" in (getattr(files.config, "layer_types", None) or ())
                   or getattr(files.config, "attn_logit_softcapping", None) is not None
                   or layer_window(files.config, max_position) is not None)
        model = cls(files.config, get_attention_backend(device, sliding), max_position)
    packed = use_packed(quantization, files, dtype, device)
    # the head kernels are native only; they follow the packing decision of the projections
    packed_head = packed and files.packed_head and native.available()
    # an untied embedding keeps the file's blocks too (rows decoded per lookup: no dense table)
    model.load_weights(files.weights(keep_packed=True, keep_head=packed_head,
                                     keep_embedding=packed and native.available())
                       if packed else files.weights())
    # The parameters are in dtype on the device already; this converts the float32 buffers
    # (rotary angles) as a model converted whole would have them.
    model = model.to(dtype=dtype)
    model = model.eval()
    if packed:
        n_packed, total = model.num_packed()
        if n_packed < total:  # shapes the kernel does not take, or a split inside a group
            msg = f"{total - n_packed} of {total} projections could not stay packed (dense instead)"
            if quantization == "gguf" and n_packed == 0:
                raise ValueError(f"quantization='gguf': {msg}")
            logger.warning(msg)
        keep_float32(model)
    if upcast(torch.empty(2, 1, dtype=dtype, device=device)):
        model.use_float32_activations()
        model.head_float32()
        if packed:
            model.enable_fused_decode()
    elif packed and parallel.tp_size() == 1 and native.available():
        # bf16 units: many-row products stay in bf16 (linear() converts their activations),
        # but few-row steps run each layer as one native call, which takes float32
        # activations and KV: the module path's ~20 PyTorch ops a layer made a 1.5B Q4_K_M
        # decode step 142 ms against 103 (an AVX-512 bf16 Xeon, 2 cores).
        float32_biases(model)
        model.use_float32_activations()
        model.enable_fused_decode()
    # requantized q32 blocks (PAGELLM_Q32_BLOCK), smoothed by a measured forward through the
    # file's own blocks: before the one-call layers, which take the forms' pointers
    q32_smooth.requantize_model(model, files.tokenizer, files.config.vocab_size, max_position,
                                dtype, device)
    if device.type == "cpu" and dtype == torch.bfloat16:
        # bf16 units: dense products from oneDNN's layout, made once; the one-call many-row
        # layers where the products allow them (without bf16 units: all four q32 ones)
        prepack_bf16(model)
        if parallel.tp_size() == 1:
            model.prepack_head()
            if model.act_dtype == torch.float32:
                model.enable_wide_layers()
    return model
