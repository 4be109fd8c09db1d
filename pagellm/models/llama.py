"""Llama-architecture decoder (Llama 2/3, Mistral, SmolLM, Qwen2, Qwen3, and their
mixture-of-experts forms Mixtral, Qwen2-MoE, Qwen3-MoE through models/moe.py): one class, flat
token batches (models/gemma.py builds Gemma 3 on it).

Input is the step's flat batch of new tokens from every scheduled sequence; the paged KV cache
and AttentionMetadata say where each token's context lives. q|k|v and gate|up are fused.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagellm import lora
from pagellm.attention.base import AttentionBackend, AttentionMetadata
from pagellm.kernels.cpu_layer import FusedDecodeLayer, gate_up_silu_bf16
from pagellm.kernels.cpu_wide_layer import WideLayer, WideStack
from pagellm.layers import greedy_head, onednn, panels, quant
from pagellm.layers.embedding import BlockEmbedding, Q8RowsEmbedding
from pagellm.layers.attention import PagedSelfAttention
from pagellm.layers import linear as linear_mod
from pagellm.layers.linear import ColumnParallelLinear, RowParallelLinear, linear, upcast
from pagellm.layers.norm import RMSNorm
from pagellm.layers.rotary import NoRotation, RotaryEmbedding
from pagellm.models import moe
from pagellm.models.moe import SparseMoE, is_sparse_layer
from pagellm.sampling.sampler import argmax_rows


def head_max_rows(head) -> int:
    """Rows below which a packed LM head (quant.NativeQ8, NativeGGUF, NativePanels) beats the dense one.
    Where bf16 products run natively (AVX-512 bf16 / AMX) the dense bf16 head wins early
    (2-core Xeon with AMX: the default model's Q8_0 head level at 8 rows, 64 rows 23.5 vs
    5.0 ms; Qwen2.5-1.5B's Q6_K head 1 row 7.3 vs 24 ms, 6 rows 28 vs 26, 16 rows 75 vs 28),
    except a panel head with int8 activations (Q4_K8, Q6_K8): it keeps its own limit (the
    1.5B's Q6_K head on a Zen 4 core pair against the prepacked bf16 one: 8 rows 13.8 vs 23.6
    ms, 16 rows 22.7 vs 28.0, 40 rows 51.6 vs 53.4)."""
    if not linear_mod.UPCAST_BF16:
        if isinstance(head, quant.NativePanels) and head.fmt in panels.INT8_FORMATS:
            return head.max_rows
        return min(head.max_rows, 9 if isinstance(head, quant.NativeQ8) else 6)
    return head.max_rows


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden_size, ((intermediate_size, 1),) * 2,
                                                 bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu, down = self.gate_up_proj, self.down_proj
        if (lora.STEP is None and gu.bf16_wide is not None and down.bf16_wide is not None
                and gu.int8 is None
                and down.int8 is None and gu.bias is None and down.bias is None
                and not down.reduce and gu.takes_wide(x) and down.takes_wide(x)):
            # prepacked bf16 products (CPUs with bf16 units): the gate|up output stays bf16
            # into one native SiLU-and-product (float32 inside, rounded once, as the down
            # projection's input would be anyway); float32 tensors between them made a
            # 2,048-token prefill step of a 1.5B model spend 2.7 of 6 s converting and gating
            # [2048, 17920] values
            return down.bf16_wide(gate_up_silu_bf16(gu, x)).to(x.dtype)
        gate, up = gu(x).chunk(2, dim=-1)
        return down(F.silu(gate) * up)


# Llama-form model types whose every layer attends over the config's sliding window, as
# transformers' attention does (Mistral 7B v0.1: 4,096; Phi-3-mini-4k: 2,047)
WINDOWED_TYPES = frozenset({"mistral", "phi3"})


def layer_window(config, max_position: int) -> int | None:
    """The window every layer attends over (each row its last `window` positions), or None
    (also where the window spans every position the model is built for, max_position: full
    attention, and the paths that take no window)."""
    window = getattr(config, "sliding_window", None)
    if (config.model_type in WINDOWED_TYPES and window
            and getattr(config, "use_sliding_window", True) and window < max_position):
        return int(window)
    return None


def has_qk_norm(config) -> bool:
    """q and k normalized per head before the rotation (Qwen3, Qwen3-MoE)."""
    return config.model_type in ("qwen3", "qwen3_moe")


class DecoderLayer(nn.Module):
    # the many-row one-call layer (kernels/cpu_wide_layer.py) computes this form (Qwen3's
    # per-head q/k norms included), not Gemma 3's (models/gemma.py)
    llama_form = True

    def __init__(self, config, rotary: RotaryEmbedding, backend: AttentionBackend, qkv_bias: bool,
                 index: int = 0, window: int | None = None):
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = PagedSelfAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
            qkv_bias, rotary, backend,
            qk_norm_eps=config.rms_norm_eps if has_qk_norm(config) else None,
            window=window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # a mixture of experts (models/moe.py) where the config makes this layer sparse
        self.mlp = (SparseMoE(config, MLP) if is_sparse_layer(config, index) else
                    MLP(config.hidden_size, config.intermediate_size,
                        bool(getattr(config, "mlp_bias", False))))

    fused = None  # a FusedDecodeLayer (kernels/cpu_layer.py) once enabled
    wide_layer = None  # a WideLayer (kernels/cpu_wide_layer.py) once enabled

    def forward(self, positions, x, md, out_rows=None):
        """out_rows (strictly increasing int64 rows, or None for all): the rows whose output
        is wanted, [len(out_rows), hidden]. Every row's K and V are still written; the others
        stop after the attention (a model's last layer in a prefill step, where only each
        prompt's last row is sampled). The one-call q32 layer gives those rows the bits of the
        whole step; the module path multiplies them as a step of that many rows."""
        if positions.dtype == torch.int64 and lora.STEP is None:  # adapters: the modules
            if self.fused is not None and self.fused.usable(x, md):  # few rows: all of them
                x = self.fused(positions, x, md)
                return x if out_rows is None else x.index_select(0, out_rows)
            if (self.wide_layer is not None and self.wide_layer.usable(x, md)
                    and self.wide_layer.positions_ok(positions, md)):
                return self.wide_layer(positions, x, md, out_rows)
        a = self.self_attn(positions, self.input_layernorm(x), md, out_rows)
        x, h = self.post_attention_layernorm.add_forward(
            x if out_rows is None else x.index_select(0, out_rows), a)
        return x + self.mlp(h)


def _named(name: str, load, *args) -> None:
    """load(*args), its ValueError naming the checkpoint's tensor."""
    try:
        load(*args)
    except ValueError as e:
        raise ValueError(f"weight {name}: {e}") from None


class LlamaForCausalLM(nn.Module):
    # checkpoint projection name -> (fused module attribute, part index)
    _FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config, backend: AttentionBackend, max_position: int):
        super().__init__()
        self.config = config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        qkv_bias = (bool(getattr(config, "attention_bias", False))
                    or config.model_type in ("qwen2", "qwen2_moe"))
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self._make_layers(config, backend, max_position, qkv_bias))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False)
        self.requires_grad_(False)
        # The LM head kept in its block form when the loader hands it out so (GGUF, native
        # kernels available): a plain attribute, so .to(dtype) leaves it alone.
        self.head_packed: quant.NativeQ8 | quant.NativeGGUF | quant.NativePanels | None = None
        self.act_dtype: torch.dtype | None = None  # None: the parameters' dtype

    def _make_layers(self, config, backend: AttentionBackend, max_position: int,
                     qkv_bias: bool) -> list[nn.Module]:
        """The decoder layers, and self.rotary (the rotary they share)."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary = RotaryEmbedding(config, head_dim, max_position)
        # SmolLM3: layers whose flag is 0 rotate nothing (one shared identity rotary)
        uses_rope = getattr(config, "no_rope_layers", None) or [1] * config.num_hidden_layers
        nope = NoRotation(head_dim, max_position) if not all(uses_rope) else None
        window = layer_window(config, max_position)
        return [DecoderLayer(config, self.rotary if uses_rope[i] else nope, backend, qkv_bias, i,
                             window) for i in range(config.num_hidden_layers)]

    # what the embedding's rows are multiplied by (Gemma: sqrt(hidden_size)); None: nothing
    embed_scale: float | None = None

    def use_float32_activations(self) -> None:
        """Run a bf16 model's activations (and norms) in float32, its weights staying bf16 or
        packed: on a CPU without bf16 units every product already computes in float32
        (layers/linear.py), so bf16 activations only added conversions around each op (~22
        per layer, ~1/3 of a batch-1 decode step). More exact than bf16 activations, never less."""
        self.act_dtype = torch.float32
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.weight.data = m.weight.data.float()

    def enable_fused_decode(self) -> int:
        """Steps in the packed kernel's few-row regime (up to 40 rows) run each layer as one
        native call where the layer allows it (packed Q4 projections without biases, float32
        activations, one process). Returns the number of layers that do. A mixture of experts'
        layers run their attention so, and their experts in one native call of their own
        (moe.NativeExperts), at any number of rows."""
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.enable_native()
        return self._give_layers("fused", FusedDecodeLayer)

    def enable_wide_layers(self) -> int:
        """Steps of many rows on CPUs with bf16 units run each layer as its four prepacked
        bf16 products with native steps between them (kernels/cpu_wide_layer.py), where the
        layer allows it (float32 activations, prepacked projections, one process); on CPUs
        without them, where all four are q32 products (AVX2: the 4- and 5-bit types), as one
        native call. Returns the number of layers that do."""
        n = self._give_layers("wide_layer", WideLayer)
        self.wide_stack = WideStack.of(self.layers)
        return n

    wide_stack = None  # a WideStack (kernels/cpu_wide_layer.py) once wide layers are enabled

    def _give_layers(self, attr: str, kind) -> int:
        """Each layer that `kind` supports gets kind(layer) as its `attr`; how many did."""
        n = 0
        for layer in self.layers:
            if kind.supports(layer):
                setattr(layer, attr, kind(layer))
                n += 1
        return n

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        md: AttentionMetadata,
        num_layers: int | None = None,  # only the first ones (an early-exit draft)
        out_rows: torch.Tensor | None = None,  # only these rows' hidden states are wanted
    ) -> torch.Tensor:  # [num_tokens, hidden], or [len(out_rows), hidden]
        """out_rows (strictly increasing int64 rows of the step): the last layer carries only
        these rows past its attention (DecoderLayer.forward), as llama.cpp's graphs do; a
        prefill chunk's other rows need only their K and V. At 2,048 prompt rows that is most
        of a layer of 30's products."""
        x = self.embed_tokens(input_ids)
        if self.act_dtype is not None:
            x = x.to(self.act_dtype)
        if self.embed_scale is not None:  # in the activations' dtype (float32: as llama.cpp and
            # float32 transformers scale; transformers in bf16 rounds the scale to bf16 first)
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        stack = self.wide_stack if num_layers is None and lora.STEP is None else None
        if stack is not None and stack.usable(positions, x, md):
            return self.norm(stack(positions, x, md, out_rows))  # every layer in one native call
        layers = self.layers[:num_layers]
        for i, layer in enumerate(layers):
            x = layer(positions, x, md, out_rows if i == len(layers) - 1 else None)
        return self.norm(x)

    def limit_vocab(self, n: int | None) -> None:
        """Score only the first n token ids (a draft's head: FR-Spec, 2025); the others get
        -inf logits, so a draft never proposes them and its q is zero there, which keeps
        verification exact. BPE ids follow merge order, so a prefix holds the frequent tokens
        (Qwen2.5: 32768 ids hold 94.5% of the tokens of Python sources, 65536 98.2%). None:
        the whole vocab."""
        vocab = self._head().shape[0]
        self.vocab_limit = None if n is None or n >= vocab else n
        self._head_sub = self._head_sub_onednn = None
        self.extra_ids = None
        if self.vocab_limit is not None and self.head_packed is not None:
            self._head_sub = self.head_packed.first_rows(self.vocab_limit)
        if self.vocab_limit is not None and self.head_onednn is not None:
            # a prepacked copy of the first n rows (a tied Q8_0 head's decoded from its
            # codes); an untied head whose dense weight the prepacked one replaced has none to
            # slice, so it scores all ids and keeps n
            dense = self._head()
            if isinstance(self.embed_tokens, Q8RowsEmbedding):
                self._head_sub_onednn = onednn.OneDNNLinear(
                    self.embed_tokens.first_rows(self.vocab_limit))
            elif dense.device.type != "meta":
                self._head_sub_onednn = onednn.OneDNNLinear(dense.data[: self.vocab_limit])

    def also_score(self, ids: torch.Tensor | None) -> None:
        """With a vocabulary limit: score these ids too (int64, sorted, unique, all past the
        limit; None: none). A draft's proposer passes the ids of its requests' own text: an
        identifier of the code being edited, or a word of the question, is often past the
        first n ids, and the draft could never propose it otherwise."""
        self.extra_ids = ids if ids is not None and ids.numel() else None

    vocab_limit: int | None = None
    extra_ids: torch.Tensor | None = None
    _head_sub = None
    _head_sub_onednn = None
    # The dense bf16 head reordered once into oneDNN's layout (prepack_head): bf16 units only.
    head_onednn: onednn.OneDNNLinear | None = None

    def prepack_head(self) -> bool:
        """On CPUs with bf16 units, reorder the dense bf16 LM head once for oneDNN, as
        `linear.prepack_bf16` does for the projections: F.linear reordered the whole head at
        every call (a Zen 5 core pair, bf16, the default model's 49152 x 576 head at 64 rows
        7.0 -> 4.6 ms; Qwen2.5-1.5B's 151936 x 1536 at 6 / 16 rows 16.5 -> 8.6 / 23.2 -> 13.4
        ms; bit-identical). An untied head's dense weight goes to the meta device (the
        prepacked copy holds the same bytes); a tied one stays, as the embedding, beside it.
        A Q8_0 head also gets its greedy form (layers/greedy_head.py), which argmax-only
        steps take instead. A tied Q8_0 head's lookups then read its codes
        (layers/embedding.Q8RowsEmbedding) and the dense table goes. Returns whether the head
        was prepacked."""
        head = self._head()
        if (linear_mod.UPCAST_BF16 or not onednn.available() or head.dtype != torch.bfloat16
                or head.device.type != "cpu" or self.head_onednn is not None):
            return False
        self.head_onednn = onednn.OneDNNLinear(head.data)
        if (isinstance(self.head_packed, quant.NativeQ8) and greedy_head.available()
                and greedy_head.GreedyHeadQ8.supports(self.head_packed)):
            self.head_greedy = greedy_head.GreedyHeadQ8(self.head_packed)
        if self.lm_head is not None:
            self.lm_head.weight = nn.Parameter(torch.empty(head.shape, dtype=head.dtype,
                                                           device="meta"), requires_grad=False)
        elif isinstance(self.head_packed, quant.NativeQ8):
            self.embed_tokens = Q8RowsEmbedding(self.head_packed, head.dtype)
        return True

    # A Q8_0 head's int8 form for steps whose rows read only their argmax (prepack_head).
    head_greedy: greedy_head.GreedyHeadQ8 | None = None

    def compute_logits(self, hidden: torch.Tensor, argmax_only: bool = False) -> torch.Tensor:
        """[num_rows, hidden] -> [num_rows, vocab] float32. argmax_only: the caller reads
        nothing of a row but its argmax (greedy rows, nothing applied to the logits); where
        the bf16 head would run, the greedy head then gives logits whose argmax is the exact
        product's, and only that."""
        if (argmax_only and self.head_greedy is not None and self.vocab_limit is None
                and hidden.shape[0] >= head_max_rows(self.head_packed)):
            logits = self.head_greedy(hidden)
            if logits is not None:  # None: a value that is not finite; the head below
                return logits
        if self.vocab_limit is not None:
            n, full = self.vocab_limit, None
            out = torch.full((hidden.shape[0], self._head().shape[0]), float("-inf"),
                             device=hidden.device)
            if self._head_sub is not None and hidden.shape[0] < head_max_rows(self._head_sub):
                out[:, :n] = self._head_sub(hidden)
            elif self._head_sub_onednn is not None:
                out[:, :n] = self._head_sub_onednn(hidden).float()
            elif self.head_onednn is not None:  # the whole head: the extra ids from it too
                full = self.head_onednn(hidden).float()
                out[:, :n] = full[:, :n]
            else:
                out[:, :n] = linear(hidden, self._head()[:n]).float()
            if self.extra_ids is not None:
                ids = self.extra_ids.to(hidden.device)
                out[:, ids] = full[:, ids] if full is not None else self._head_rows(hidden, ids)
            return out
        if self.head_packed is not None and hidden.shape[0] < head_max_rows(self.head_packed):
            return self.head_packed(hidden)
        if self.head_onednn is not None:
            return self.head_onednn(hidden).float()
        if upcast(hidden) or (linear_mod.UPCAST_BF16 and hidden.shape[0] > 1
                              and hidden.dtype != self._head().dtype):
            return F.linear(hidden.float(), self.head_float32())
        return linear(hidden, self._head()).float()

    def argmax_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> [num_rows] int64: each row's argmax of compute_logits(hidden,
        argmax_only=True), the same ids; where the greedy head runs, without any logits made."""
        if (self.head_greedy is not None and self.vocab_limit is None
                and hidden.shape[0] >= head_max_rows(self.head_packed)):
            ids = self.head_greedy(hidden, ids_only=True)
            if ids is not None:  # None: a value that is not finite; the head below
                return ids
        return argmax_rows(self.compute_logits(hidden, argmax_only=True))

    def _head_rows(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Logits [rows, len(ids)] float32 of the head's rows `ids`: a few hundred rows
        gathered each call (the packed forms' kernels give each output the bits the whole
        head gives it)."""
        packed = self.head_packed
        if packed is not None and hidden.shape[0] < head_max_rows(packed) and hasattr(packed, "rows"):
            return packed.rows(ids)(hidden)
        if isinstance(self.embed_tokens, Q8RowsEmbedding) and self.lm_head is None:
            return linear(hidden, self.embed_tokens(ids)).float()  # the dense rows, decoded
        return linear(hidden, self._head().index_select(0, ids)).float()

    def _head(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def _head_name(self) -> str:
        return "embed_tokens.weight" if self.lm_head is None else "lm_head.weight"

    def head_float32(self) -> torch.Tensor:
        """A float32 copy of the LM head, for multi-row products of a bf16 model on a CPU
        without bf16 units: converting the (vocab x hidden) head at every step cost more than
        the product itself (58 of 143 ms of a k=4 verification step, batch 1). The build
        makes it at load, so that no step pays for it (a first verification step 3x slower
        than the rest misleads the speculation controller)."""
        weight = self._head()
        if getattr(self, "_head_f32", None) is None or self._head_f32[0] is not weight:
            self._head_f32 = (weight, weight.float())
        return self._head_f32[1]

    def num_packed(self) -> tuple[int, int]:
        """(projections holding packed 4-bit weights, projections in all)."""
        linears = [m for m in self.modules() if hasattr(m, "packed") and m is not self]
        return sum(m.packed is not None for m in linears), len(linears)

    def weight_bytes(self) -> int:
        """Parameters plus packed 4-bit copies and wide forms (int8 codes, prepacked bf16):
        what the weights occupy in memory (a dense weight a wide form replaced is on the meta
        device and counts nothing)."""
        packed = sum(m.packed.nbytes for m in self.modules() if getattr(m, "packed", None) is not None)
        packed += sum(m.wide.nbytes for m in self.modules() if getattr(m, "wide", None) is not None)
        packed += self.head_packed.nbytes if self.head_packed is not None else 0
        if isinstance(self.embed_tokens, BlockEmbedding):  # the file's blocks, no parameter
            packed += self.embed_tokens.nbytes
        packed += self.head_onednn.nbytes if self.head_onednn is not None else 0
        packed += self.head_greedy.nbytes if self.head_greedy is not None else 0
        # a limited head's prepacked copy of its first rows (the packed one is a view)
        packed += self._head_sub_onednn.nbytes if self._head_sub_onednn is not None else 0
        head = getattr(self, "_head_f32", None)
        head = 0 if head is None else head[1].numel() * 4
        return packed + head + sum(p.numel() * p.element_size() for p in self.parameters()
                                   if p.device.type != "meta")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors; q|k|v and gate|up go into their fused slices."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            name = moe.checkpoint_name(name.removeprefix("model."))
            parts = name.split(".")
            if parts[0] == "layers" and int(parts[1]) >= len(self.layers):
                continue  # a draft built from the first layers of a deeper checkpoint
            if "experts" in parts[:-2]:  # an MoE layer's expert: one the config has
                layer, at = self.layers[int(parts[1])], parts.index("experts")
                n = len(getattr(layer.mlp, "experts", ()))
                if not (parts[at + 1].isdigit() and int(parts[at + 1]) < n):
                    raise ValueError(f"weight {name}: layer {parts[1]} has {n} experts")
            if len(parts) >= 4 and parts[-2] in self._FUSED:
                fused, shard = self._FUSED[parts[-2]]
                module = self.get_submodule(".".join(parts[:-2] + [fused]))
                _named(name, module.load, parts[-1], tensor, shard)
                loaded.add(".".join(parts[:-2] + [fused, parts[-1]]))
            elif parts[-2:-1] and parts[-2] in ("o_proj", "down_proj", "gate", "shared_expert_gate"):
                # (an MoE block's router and shared-expert gate load as the projections do)
                _named(name, self.get_submodule(".".join(parts[:-1])).load, parts[-1], tensor)
                loaded.add(name)
            elif name in params:
                if params[name].shape != tensor.shape:
                    raise ValueError(f"weight {name}: shape {tuple(tensor.shape)} does not match "
                                     f"the config's {tuple(params[name].shape)}")
                if (name == "embed_tokens.weight" and self.lm_head is not None
                        and BlockEmbedding.available(tensor)):  # untied: rows decoded per lookup
                    self.embed_tokens = BlockEmbedding(tensor, params[name].dtype)
                    loaded.add(name)
                    continue
                if isinstance(tensor, (quant.Int8Blocks, quant.GGUFBlocks)):  # a packed head
                    if name == self._head_name():
                        self.head_packed = (quant.NativeQ8(tensor) if isinstance(tensor, quant.Int8Blocks)
                                            else quant.head_form(tensor))
                    tensor = tensor.dequantize()
                params[name].data.copy_(tensor)
                loaded.add(name)
        missing = set(params) - loaded
        missing |= {f"layers.{i}.mlp.{name}.weight" for i, layer in enumerate(self.layers)
                    if isinstance(layer.mlp, SparseMoE) for name in layer.mlp.missing()}
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")
