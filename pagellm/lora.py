"""LoRA adapters, per request (vLLM's LoRARequest): many adapters over one base model, each
request's rows multiplied by its own.

An adapter is a PEFT folder (adapter_config.json and adapter_model.safetensors), or a GGUF
LoRA file (llama.cpp's convert_lora_to_gguf.py: general.type "adapter", tensors
blk.N.<proj>.weight.lora_a / .lora_b, q and k's lora_b rows in llama.cpp's order for the
architectures whose weights are so written), whose targets are among the decoder's
projections (q/k/v/o_proj, gate/up/down_proj; Phi-3's fused qkv_proj and gate_up_proj, split
into their parts). For a
request with an adapter, each targeted projection adds scale * (x A^T) B^T to the base
model's output (scale = lora_alpha / r, or / sqrt(r) with use_rslora): what transformers gives
with the adapter merged into the weights, without touching them. A step holding such rows
runs the module path (the one-call native layers know nothing of adapters) with the adapters'
products added per group of rows (`LoRAStep`); steps without them are as before.

Each adapter's requests keep their prefix-cache entries to themselves (the adapter's id joins
the cache salt): the same prompt has other K/V under another adapter.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# projection -> (the model's module, its part in a fused module)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0),
          "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
# Phi-3's fused projections: an adapter on one has one A, and B's rows for each part
FUSED_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                 "gate_up_proj": ("gate_proj", "up_proj")}
_KEY = re.compile(r"(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])(?:\.weight)?")


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request: its name (what the server lists and a request's `model`
    names), a positive id unique to it, and its PEFT folder."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")


@dataclass
class LoRAAdapter:
    """An adapter's weights: (layer, fused module name) -> [(part, A [r, in], scale * B
    [out, r])], float32 on the model's device."""
    request: LoRARequest
    weights: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = field(
        default_factory=dict)


def load_adapter(request: LoRARequest, model) -> LoRAAdapter:
    """Read an adapter (a PEFT folder or a GGUF LoRA file) for `model` (a LlamaForCausalLM);
    ValueError naming what does not fit: a missing file, a feature not supported, a module
    or shape the model lacks."""
    if request.lora_path.endswith(".gguf"):
        pairs = _read_gguf(request.lora_path, model)
    else:
        pairs = _read_peft(request.lora_path)
    return _fit(request, _unfuse(pairs, model), model)


def _unfuse(pairs: dict, model) -> dict:
    """Adapters on fused projections (Phi-3's qkv_proj, gate_up_proj) as their parts' (the
    one A; B's rows split as the loader splits the weight), and q / k's B rows in the order
    the loader lays a partly rotating head's rows out (models/loader.partial_rotary)."""
    from pagellm.layers.rotary import partial_rotary_order
    from pagellm.models.loader import fused_parts, partial_rotary

    sizes = {module.rpartition(".")[2]: [rows for _, rows in parts]
             for module, parts in fused_parts(model.config).items()}
    out = {}
    for (layer, proj), ab in pairs.items():
        if proj not in FUSED_TARGETS:
            out[(layer, proj)] = ab
            continue
        if proj not in sizes:
            raise ValueError(f"lora_path: layer {layer} {proj}: the model has no fused {proj}")
        if "B" in ab and ab["B"].shape[0] != sum(sizes[proj]):
            raise ValueError(f"lora_path: layer {layer} {proj}: lora_B has {ab['B'].shape[0]} "
                             f"rows; the model's {proj} has {sum(sizes[proj])}")
        rows = ab["B"].split(sizes[proj]) if "B" in ab else [None] * len(sizes[proj])
        both = [part for part in FUSED_TARGETS[proj] if (layer, part) in pairs]
        if both:
            raise ValueError(f"lora_path: layer {layer} has both {proj} and {both[0]}")
        for part, b in zip(FUSED_TARGETS[proj], rows):
            out[(layer, part)] = {**{k: v for k, v in ab.items() if k != "B"},
                                  **({} if b is None else {"B": b})}
    partial = partial_rotary(model.config)
    if partial is not None:
        head_dim, rotated = partial
        for (_, proj), ab in out.items():
            if proj in ("q_proj", "k_proj") and "B" in ab:
                order = partial_rotary_order(ab["B"].shape[0] // head_dim, head_dim, rotated)
                ab["B"] = ab["B"][torch.from_numpy(order)]
    return out


def _read_peft(folder: str) -> dict:
    """A PEFT folder -> {(layer, projection): {"A": A, "B": B, "scale": s}}."""
    from safetensors.torch import load_file

    cfg_path = os.path.join(folder, "adapter_config.json")
    weights_path = os.path.join(folder, "adapter_model.safetensors")
    for path in (cfg_path, weights_path):
        if not os.path.isfile(path):
            raise ValueError(f"lora_path: {path} does not exist (a PEFT adapter folder has "
                             "adapter_config.json and adapter_model.safetensors)")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"lora_path: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save",
                "layers_to_transform"):
        if cfg.get(key):
            raise ValueError(f"lora_path: adapter_config.json {key} is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError("lora_path: adapters that train biases are not supported")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise ValueError(f"lora_path: adapter_config.json needs a positive integer r and a "
                         f"number lora_alpha, got r={r!r}, lora_alpha={alpha!r}")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    tensors = load_file(weights_path)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _KEY.fullmatch(name)
        if m is None or (m.group(2) not in PROJECTIONS and m.group(2) not in FUSED_TARGETS):
            raise ValueError(f"lora_path: tensor {name!r} is not a LoRA weight of a decoder "
                             f"projection ({', '.join(PROJECTIONS + tuple(FUSED_TARGETS))})")
        pairs.setdefault((int(m.group(1)), m.group(2)), {"scale": scale})[m.group(3)] = t
    return pairs


# llama.cpp's tensor names of the projections
_GGUF_NAMES = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj",
               "attn_output": "o_proj", "ffn_gate": "gate_proj", "ffn_up": "up_proj",
               "ffn_down": "down_proj"}
_GGUF_KEY = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])")


def _read_gguf(path: str, model) -> dict:
    """A GGUF LoRA file -> pairs as _read_peft's (each scale alpha / its own rank, as llama.cpp
    scales it); q/k's lora_b rows back in transformers' order where llama.cpp's converter
    permuted them (as the base weights)."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    from pagellm.models.gguf_loader import PERMUTED_ARCHITECTURES, undo_rope_permute

    if not os.path.isfile(path):
        raise ValueError(f"lora_path: {path} does not exist")
    reader = gguf.GGUFReader(path)

    def meta(key):
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    if meta("general.type") != "adapter" or meta("adapter.type") != "lora":
        raise ValueError(f"lora_path: {path} is not a GGUF LoRA adapter (general.type "
                         f"{meta('general.type')!r}, adapter.type {meta('adapter.type')!r})")
    arch = meta("general.architecture")
    base = getattr(model.config, "model_type", None)
    if arch != {"gemma3_text": "gemma3", "mistral": "llama", "mixtral": "llama",
                "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}.get(base, base):
        raise ValueError(f"lora_path: the adapter is for architecture {arch!r}, the model is "
                         f"{base!r}")
    alpha = meta("adapter.lora.alpha")
    names = _GGUF_NAMES if arch != "phi3" else {  # its fused projections (_unfuse splits them)
        **_GGUF_NAMES, "attn_qkv": "qkv_proj", "ffn_up": "gate_up_proj"}
    pairs: dict[tuple[int, str], dict] = {}
    for t in reader.tensors:
        m = _GGUF_KEY.fullmatch(t.name)
        if m is None or m.group(2) not in names:
            raise ValueError(f"lora_path: tensor {t.name!r} is not a LoRA weight of a decoder "
                             f"projection ({', '.join(names)})")
        shape = tuple(int(n) for n in reversed(t.shape))  # ggml's dims, reversed: torch's
        data = np.asarray(t.data)
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                                 gguf.GGMLQuantizationType.BF16):
            data = dequantize(data, t.tensor_type)
        elif t.tensor_type == gguf.GGMLQuantizationType.BF16:
            data = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        data = np.ascontiguousarray(data, dtype=np.float32).reshape(shape)
        layer, proj, kind = int(m.group(1)), names[m.group(2)], m.group(3).upper()
        attn = model.layers[0].self_attn  # every layer's head counts
        if kind == "B" and arch in PERMUTED_ARCHITECTURES and proj in ("q_proj", "k_proj"):
            data = undo_rope_permute(data, attn.num_heads if proj == "q_proj"
                                     else attn.num_kv_heads)
        pair = pairs.setdefault((layer, proj), {})
        pair[kind] = torch.from_numpy(data.copy())
        if kind == "A":  # llama.cpp: alpha / this tensor's rank (no alpha: a scale of 1)
            pair["scale"] = float(alpha) / data.shape[0] if alpha else 1.0
    if not pairs:
        raise ValueError(f"lora_path: {path} has no LoRA tensors")
    return pairs


def _fit(request: LoRARequest, pairs: dict, model) -> LoRAAdapter:
    """The pairs checked against the model's projections; float32 (a few MB) whatever the
    model's dtype, so the products are as exact as the activations, each B times its scale."""
    adapter = LoRAAdapter(request)
    device = next(p for p in model.parameters()).device
    for (layer, proj), ab in sorted(pairs.items()):
        if not {"A", "B"} <= set(ab):
            raise ValueError(f"lora_path: layer {layer} {proj} has lora_"
                             f"{''.join(sorted(set('AB') - set(ab)))} missing")
        if layer >= len(model.layers):
            raise ValueError(f"lora_path: layer {layer} past the model's {len(model.layers)}")
        module_name, part = _FUSED[proj]
        if module_name in ("gate_up_proj", "down_proj") and not hasattr(
                model.layers[layer].mlp, module_name):
            raise ValueError(f"lora_path: layer {layer} {proj}: adapters on a mixture of "
                             "experts' MLP are not supported (attention projections are)")
        module = getattr(model.layers[layer].self_attn if module_name in ("qkv_proj", "o_proj")
                         else model.layers[layer].mlp, module_name)
        rows = (module.weight.shape[0] if module_name in ("o_proj", "down_proj")
                else module.ranges[part][1])
        a, b = ab["A"], ab["B"]
        want_a, want_b = (a.shape[0], module.in_features), (rows, a.shape[0])
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise ValueError(f"lora_path: layer {layer} {proj}: lora_A {tuple(a.shape)} and "
                             f"lora_B {tuple(b.shape)} do not fit the model's {want_a} / {want_b}")
        adapter.weights.setdefault((layer, module_name), []).append(
            (part, a.to(device, torch.float32).contiguous(),
             (b.to(device, torch.float32) * ab["scale"]).contiguous()))
    return adapter


def attach(model) -> None:
    """Name each decoder projection of `model` for adapters (module.lora_key = (layer,
    fused module name)); a draft model's stay unnamed, so a step's adapters never touch it."""
    for i, layer in enumerate(model.layers):
        for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                             (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            if hasattr(parent, name):  # (an MoE block's experts take no adapter)
                getattr(parent, name).lora_key = (i, name)


class LoRAStep:
    """The adapters of one step's rows: [(adapter, rows int64)], rows of the flat batch."""

    def __init__(self, groups: list[tuple[LoRAAdapter, torch.Tensor]]):
        self.groups = groups

    def apply(self, module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y = module(x) for the step's rows; each adapter's rows get its products added."""
        key = getattr(module, "lora_key", None)
        if key is None:
            return y
        offsets = None
        for adapter, rows in self.groups:
            parts = adapter.weights.get(key)
            if not parts:
                continue
            if offsets is None:
                ranges = getattr(module, "ranges", None) or [(0, y.shape[-1])]
                offsets = [sum(n for _, n in ranges[:i]) for i in range(len(ranges) + 1)]
                y = y.clone()
            xr = x.index_select(0, rows)
            for part, a, b in parts:
                delta = (xr.to(a.dtype) @ a.t()) @ b.t()
                lo, hi = offsets[part], offsets[part + 1]
                y[rows, lo:hi] += delta.to(y.dtype)
        return y


# The step now running through the target model (ModelRunner.forward sets it), or None.
STEP: LoRAStep | None = None
