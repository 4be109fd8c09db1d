"""Mixture-of-experts feed-forward blocks (Mixtral, Qwen2-MoE / Qwen1.5-MoE, Qwen3-MoE): a
router scores every expert for each row, each row runs through its top k experts, and their
outputs are summed, weighted by the router's probabilities (renormalized over the k where the
model says so); Qwen2-MoE adds a shared expert that every row takes, gated by a sigmoid.

Each expert is an ordinary gate|up / down MLP (models/llama.MLP), so a GGUF file's expert
weights stay packed in their file form and run through the same kernels as a dense model's
projections. A step gathers each expert's rows, multiplies them as one small batch, and adds
the weighted results back: only the experts some row chose run, which is what makes a 30B
model with 3B active parameters cost like a 3B one per token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm import parallel

# model_type -> whether the top k probabilities are renormalized to sum to 1 when the config
# does not say (Mixtral always; the Qwen models by their config's norm_topk_prob)
MOE_MODEL_TYPES = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": False}


def num_experts(config) -> int:
    """How many routed experts the config's MoE layers have (0: a dense model)."""
    if config.model_type not in MOE_MODEL_TYPES:
        return 0
    return int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0) or 0)


def is_sparse_layer(config, layer: int) -> bool:
    """Whether decoder layer `layer` has an MoE block (Qwen's configs may keep some dense:
    mlp_only_layers, and decoder_sparse_step > 1 makes every n-th layer sparse)."""
    if num_experts(config) == 0:
        return False
    if layer in (getattr(config, "mlp_only_layers", None) or ()):
        return False
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer + 1) % step == 0


def checkpoint_name(name: str) -> str:
    """A Mixtral checkpoint's names in the Qwen MoE form the model uses:
    block_sparse_moe.experts.E.w1 / w3 / w2 -> mlp.experts.E.gate_proj / up_proj / down_proj,
    block_sparse_moe.gate -> mlp.gate."""
    if ".block_sparse_moe." not in name:
        return name
    name = name.replace(".block_sparse_moe.", ".mlp.")
    for old, new in ((".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj.")):
        name = name.replace(old, new)
    return name


class Router(nn.Module):
    """A small [outputs, hidden] float32 product: the expert scores, or the shared expert's
    gate. Its weight stays float32 whatever the model's dtype (a plain attribute, which
    .to(dtype) leaves alone), as llama.cpp keeps a file's ffn_gate_inp: near-ties between
    experts then fall as the checkpoint's values decide, not as bf16 rounding does."""

    def __init__(self, hidden: int, outputs: int):
        super().__init__()
        self.shape = (outputs, hidden)
        self.device = torch.empty(0).device  # where the model is being built (materialised_in)
        self.weight: torch.Tensor | None = None

    def load(self, name: str, tensor: torch.Tensor, shard: int = 0) -> None:
        if name != "weight":
            raise ValueError(f"the router has no {name}")
        if tensor.dim() == 1 and self.shape[0] == 1:  # a GGUF shared-expert gate may be 1-D
            tensor = tensor.reshape(self.shape)
        if tuple(tensor.shape) != self.shape:
            raise ValueError(f"weight: shape {tuple(tensor.shape)} does not match the "
                             f"config's {self.shape}")
        self.weight = tensor.to(self.device, torch.float32).contiguous()

    def _apply(self, fn, recurse=True):
        # .to(device) moves the weight; .to(dtype) must not round it (see the class doc)
        super()._apply(fn, recurse)
        if self.weight is not None:
            moved = fn(torch.empty(0, device=self.weight.device))
            self.weight = self.weight.to(moved.device)
            self.device = moved.device
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows, outputs] float32
        return F.linear(x.float(), self.weight)


class SparseMoE(nn.Module):
    """The MoE feed-forward block of one decoder layer: [rows, hidden] -> [rows, hidden]."""

    def __init__(self, config, mlp_cls):
        super().__init__()
        hidden = config.hidden_size
        self.num_experts = num_experts(config)
        self.top_k = int(config.num_experts_per_tok)
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok is {self.top_k}; must be between 1 and the "
                             f"{self.num_experts} experts")
        # (Mixtral's config has no norm_topk_prob: its family's default, True)
        self.renormalize = bool(getattr(config, "norm_topk_prob",
                                        MOE_MODEL_TYPES[config.model_type]))
        # Mixtral's experts are as wide as a dense layer; Qwen's have their own width
        width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate = Router(hidden, self.num_experts)
        self.experts = nn.ModuleList(mlp_cls(hidden, width, bias) for _ in range(self.num_experts))
        shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
        self.shared_expert = mlp_cls(hidden, shared, bias) if shared else None
        self.shared_expert_gate = Router(hidden, 1) if shared else None
        # with tensor parallelism each expert's down projection gives partial sums; the block
        # reduces its total once instead of once per expert
        self.reduce = parallel.tp_size() > 1
        for mlp in [*self.experts, *([self.shared_expert] if shared else [])]:
            mlp.down_proj.reduce = False
        for mlp in self.experts:  # the file's blocks alone (linear._Packed.packed_only);
            # the shared expert sees every row and keeps its many-row form
            mlp.gate_up_proj.packed_only = mlp.down_proj.packed_only = True

    def routing(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [rows, k] in x's dtype, experts [rows, k] int64): each row's top k experts
        by the router's softmax, the probabilities renormalized over them where the model does
        (computed in float32, as transformers computes them)."""
        probs = self.gate(x).softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    native = None  # a NativeExperts once enable_native() found the experts' forms fit it

    def enable_native(self) -> bool:
        """Multiply the routed experts in one native call a step (NativeExperts) where their
        packed forms allow it; returns whether they do."""
        self.native = NativeExperts(self) if NativeExperts.supports(self) else None
        return self.native is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.dtype == torch.float32 and x.is_contiguous():
            out = self.native(x, self.gate(x), self.top_k, self.renormalize)
        else:
            out = self._routed(x)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x)).to(x.dtype)
            out += gate * self.shared_expert(x)
        return parallel.all_reduce(out) if self.reduce else out

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum as modules: each expert's rows gathered,
        multiplied, added back."""
        weights, experts = self.routing(x)
        out = torch.zeros_like(x)
        flat = experts.reshape(-1)  # [rows * k]: slot s is row s // k's choice s % k
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            slots = order[start:start + n]
            start += n
            rows = slots // self.top_k
            y = self.experts[e](x.index_select(0, rows))
            out.index_add_(0, rows, y * weights.reshape(-1, 1).index_select(0, slots))
        return out

    def missing(self) -> list[str]:
        """The names of this block's routers the checkpoint has not given (relative to it)."""
        return [name for name in ("gate", "shared_expert_gate")
                if getattr(self, name) is not None and getattr(self, name).weight is None]


class NativeExperts:
    """A block's routed experts as kernels/cpu_layer.c's moe_experts takes them: each
    expert's packed gate | up and down forms, multiplied for a whole step in one call (each
    expert's rows gathered into one batch, the weighted outputs added back in C). At batch 1
    the module path's ~15 PyTorch ops an expert (gathers, slices, the gating, the weighted
    add) cost as much as the experts' products. One process, float32 activations."""

    def __init__(self, moe: SparseMoE):
        from pagellm.kernels import cpu_layer

        self.projs = (cpu_layer._Projection * (2 * moe.num_experts))()
        for i, mlp in enumerate(moe.experts):
            for j, m in enumerate((mlp.gate_up_proj, mlp.down_proj)):
                proj, parts = self.projs[2 * i + j], cpu_layer._parts(m.packed)
                proj.nparts = len(parts)
                for k, part in enumerate(parts):
                    proj.parts[k] = part
        self.widths = torch.tensor([mlp.down_proj.weight.shape[1] for mlp in moe.experts])
        self.num_experts = moe.num_experts

    @staticmethod
    def supports(moe: SparseMoE) -> bool:
        from pagellm.kernels import cpu_layer, native

        linears = [m for mlp in moe.experts for m in (mlp.gate_up_proj, mlp.down_proj)]
        return (native.available() and parallel.tp_size() == 1
                and all(m.packed is not None and m.bias is None
                        and cpu_layer._parts(m.packed) is not None for m in linears))

    def __call__(self, x: torch.Tensor, logits: torch.Tensor, k: int, renormalize: bool) -> torch.Tensor:
        """x [T, D] float32 and the router's logits [T, E] float32 -> the routed experts'
        weighted sum [T, D]: SparseMoE.routing's choice (moe_route: the top k by score, their
        softmax probabilities) and the products (moe_experts), two native calls in all."""
        import ctypes

        from pagellm.kernels import native

        lib, rows = native.library(), x.shape[0]
        experts = torch.empty(rows, k, dtype=torch.int64)
        pairs = torch.empty(rows, k, dtype=torch.int64)
        weights = torch.empty(rows, k, dtype=torch.float32)
        logits = logits.contiguous()
        rc = lib.moe_route(logits.data_ptr(), rows, self.num_experts, k, int(renormalize),
                           experts.data_ptr(), weights.data_ptr(), pairs.data_ptr())
        out = torch.zeros_like(x)
        if rc == 0:
            rc = lib.moe_experts(
                x.data_ptr(), rows, x.shape[1], ctypes.addressof(self.projs),
                self.widths.data_ptr(), self.num_experts, pairs.data_ptr(), experts.data_ptr(),
                weights.data_ptr(), rows * k, out.data_ptr(), 0, torch.get_num_threads())
        if rc != 0:
            raise (MemoryError if rc == -1 else ValueError)(f"moe_experts failed ({rc})")
        return out
