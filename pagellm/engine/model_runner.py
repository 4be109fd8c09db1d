"""Builds a step's tensors (tokens, positions, slot_mapping, block tables), runs the model,
and returns logits for the rows the engine wants to sample.

The KV pool is allocated once here (by the attention backend, which picks the storage order):
per layer K and V of logical shape [num_blocks, block_size, num_kv_heads, head_dim], bound to
the attention layers.
"""
from __future__ import annotations

import time

import torch

from pagellm.attention.base import AttentionMetadata
from pagellm.kernels.packed_rows import PackedRowChoice
from pagellm.engine.scheduler import SchedulerOutput
from pagellm.layers import quant


def kv_bytes_per_block(config, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = -(-config.num_key_value_heads // tp_size)  # the largest rank's share
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * kv_heads * head_dim * elem


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker is gone: the engine cannot run any step any more."""


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.model = model
        self.block_size = block_size
        self.device = device
        cfg = model.config
        attn = model.layers[0].self_attn
        shape = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
        alloc = attn.backend.allocate_kv_cache
        self.kv_caches = [(alloc(*shape, dtype, device), alloc(*shape, dtype, device))
                          for _ in range(cfg.num_hidden_layers)]
        for layer, (k, v) in zip(model.layers, self.kv_caches):
            layer.self_attn.k_cache, layer.self_attn.v_cache = k, v
        self.packed_rows = PackedRowChoice.for_model(model)

    @classmethod
    def over_bound_caches(cls, model, runner: "ModelRunner") -> "ModelRunner":
        """A runner for another model whose attention layers are already bound to `runner`'s
        caches (a draft made of the target's own layers); it allocates nothing."""
        self = cls.__new__(cls)
        self.model, self.block_size, self.device = model, runner.block_size, runner.device
        self.kv_caches = runner.kv_caches
        self.packed_rows = None  # (the draft's few rows per step stay packed)
        return self

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks (every layer's K and V) src -> dst."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for k, v in self.kv_caches:
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens = [], []
        for seq, n in zip(out.seqs, out.num_tokens):
            start = seq.num_computed_tokens
            input_ids.extend(seq.tokens_slice(start, start + n))
            positions.extend(range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
        max_blocks = max(len(s.block_table) for s in out.seqs)
        tables = torch.zeros(len(out.seqs), max_blocks, dtype=torch.int32)
        for i, seq in enumerate(out.seqs):
            tables[i, : len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
        pos = torch.tensor(positions, dtype=torch.long)
        seq_index = torch.repeat_interleave(torch.arange(len(out.seqs)), torch.tensor(query_lens))
        block_ids = tables[seq_index, pos // self.block_size].long()
        slot_mapping = block_ids * self.block_size + pos % self.block_size
        qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
        dev = self.device
        md = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev), query_start_loc=qsl.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev), query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)
        return torch.tensor(input_ids, device=dev), pos.to(dev), md

    def execute(self, out: SchedulerOutput, logit_rows: list[int]) -> torch.Tensor:
        """Run the step; return float32 logits [len(logit_rows), vocab] for the given rows of
        the flat token batch, on the model's device (sampling runs there: a GPU step copies no
        logits to the host)."""
        # Decode steps only (each sequence's latest token and its proposals) pick packed or
        # dense products: prefill keeps each packed form's own limit, so that a prompt's
        # numerics do not depend on what the machine measured so far.
        decode = all(n == 1 + len(s.spec_token_ids) for s, n in zip(out.seqs, out.num_tokens))
        return self.forward(*self.prepare(out), logit_rows, choose_path=decode)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                logit_rows: list[int] | None, choose_path: bool = False) -> torch.Tensor | None:
        choice = self.packed_rows if choose_path else None
        if choice is None:
            hidden = self.model(input_ids, positions, md)
        else:  # packed or dense products for this many rows: the faster one measured
            rows = input_ids.shape[0]
            dense_from = choice.choose(rows)
            start = time.perf_counter()
            with quant.dense_from(dense_from):
                hidden = self.model(input_ids, positions, md)
            choice.observe(rows, dense_from, time.perf_counter() - start)
        if logit_rows is None:  # a tensor-parallel worker: rank 0 computes the logits
            return None
        rows = torch.tensor(logit_rows, dtype=torch.long, device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, rows))
