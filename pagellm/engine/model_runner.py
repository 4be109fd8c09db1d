"""Builds a step's tensors (tokens, positions, slot_mapping, block tables), runs the model,
and returns logits for the rows the engine wants to sample.

The KV pool is allocated once here (by the attention backend, which picks the storage order):
per layer K and V of logical shape [num_blocks, block_size, num_kv_heads, head_dim], bound to
the attention layers.
"""
from __future__ import annotations

import time

import torch

from pagellm import lora
from pagellm import parallel
from pagellm.attention.base import AttentionMetadata
from pagellm.kernels import cpu_attention
from pagellm.kernels.packed_rows import PackedRowChoice
from pagellm.engine.scheduler import SchedulerOutput
from pagellm.layers import quant
from pagellm.sampling.sampler import reads_argmax_only


def kv_bytes_per_block(config, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = -(-config.num_key_value_heads // tp_size)  # the largest rank's share
    elem = torch.tensor([], dtype=dtype).element_size()
    width = cpu_attention.row_width(head_dim, dtype)  # int8: the codes and their scale
    return 2 * config.num_hidden_layers * block_size * kv_heads * width * elem


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device: itself on the CPU; on a GPU one asynchronous copy from
    page-locked memory (PyTorch's caching host allocator keeps the pinned block until the copy
    has run, so the next step's buffer cannot overwrite it), which lets the host go on building
    the step while the copy runs."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _prunable(logit_rows: list[int], num_tokens: int) -> bool:
    """Whether the model's last layer may carry only the logit rows: fewer rows than the
    step's, strictly increasing, and one process (tensor-parallel ranks run every collective
    over the same rows, and only rank 0 knows the logit rows)."""
    return (len(logit_rows) < num_tokens and parallel.tp_size() == 1
            and all(a < b for a, b in zip(logit_rows, logit_rows[1:])))


def profile_forward(model, num_tokens: int, num_logit_rows: int, block_size: int,
                    kv_dtype: torch.dtype, device: torch.device) -> int:
    """One forward of a num_tokens-token prompt over a temporary pool just large enough, and
    logits (with a softmax, as sampling makes) for num_logit_rows rows: the largest step the
    scheduler can make. Returns the bytes it took beyond what was allocated before, on a GPU
    (0 on the CPU, where the allocator's retained memory shows in MemAvailable instead)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    runner = ModelRunner(model, -(-num_tokens // block_size), block_size, kv_dtype, device)
    ids, pos, md = runner.synthetic_step([num_tokens])
    rows = min(num_logit_rows, num_tokens)
    runner.forward(ids, pos, md, list(range(num_tokens - rows, num_tokens))).softmax(dim=-1)
    pool = sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)
    for layer in model.layers:  # the temporary pool goes; the engine's runner binds its own
        layer.self_attn.k_cache = layer.self_attn.v_cache = None
    del runner
    if not cuda:
        return 0
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - pool
    torch.cuda.empty_cache()
    return max(0, peak)


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
        self.num_blocks = num_blocks
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
        self.num_blocks = runner.num_blocks
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
        return self._step_tensors(input_ids, positions, query_lens, seq_lens,
                                  [s.block_table for s in out.seqs])

    def synthetic_step(self, query_lens: list[int]):
        """Step tensors for sequences that start at position 0 with these query lengths, each
        in its own consecutive blocks of the pool from block 0 on (warm-up and profiling:
        the tokens are id 0 and the blocks are free, whatever gets written into them)."""
        tables, first = [], 0
        for n in query_lens:
            blocks = -(-n // self.block_size)
            tables.append(list(range(first, first + blocks)))
            first += blocks
        if first > self.num_blocks:
            raise ValueError(f"a synthetic step of {query_lens} tokens needs {first} blocks; "
                             f"the pool has {self.num_blocks}")
        positions = [p for n in query_lens for p in range(n)]
        return self._step_tensors([0] * len(positions), positions, list(query_lens),
                                  list(query_lens), tables)

    def _step_tensors(self, input_ids: list[int], positions: list[int], query_lens: list[int],
                      seq_lens: list[int], block_tables: list[list[int]]
                      ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's tensors, built on the host in two buffers (int64: token ids, positions,
        slots; int32: query starts, sequence lengths, block tables) that reach the device in
        one copy each (`upload`): views of them are what the model reads."""
        num_seqs, num_tokens = len(query_lens), len(input_ids)
        width = max(len(t) for t in block_tables)
        # int32: query_start_loc [num_seqs + 1] | seq_lens [num_seqs] | tables [num_seqs, width]
        i32 = torch.zeros(2 * num_seqs + 1 + num_seqs * width, dtype=torch.int32)
        qsl, lens = i32[: num_seqs + 1], i32[num_seqs + 1: 2 * num_seqs + 1]
        tables = i32[2 * num_seqs + 1:].view(num_seqs, width)
        # one tensor from the rows padded with zeros (a tensor a row: 0.38 ms for 64 rows)
        tables.copy_(torch.tensor([t if len(t) == width else t + [0] * (width - len(t))
                                   for t in block_tables], dtype=torch.int32))
        torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0, out=qsl[1:])
        lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        # int64: input_ids [num_tokens] | positions [num_tokens] | slot_mapping [num_tokens]
        i64 = torch.empty(3 * num_tokens, dtype=torch.long)
        ids, pos, slots = i64.view(3, num_tokens)
        ids.copy_(torch.tensor(input_ids, dtype=torch.long))
        pos.copy_(torch.tensor(positions, dtype=torch.long))
        seq_index = torch.repeat_interleave(torch.arange(num_seqs), torch.tensor(query_lens))
        block_ids = tables[seq_index, pos // self.block_size].long()
        torch.add(block_ids * self.block_size, pos % self.block_size, out=slots)
        d32, d64 = upload(i32, self.device), upload(i64, self.device)
        md = AttentionMetadata(
            slot_mapping=d64[2 * num_tokens:], query_start_loc=d32[: num_seqs + 1],
            seq_lens=d32[num_seqs + 1: 2 * num_seqs + 1],
            block_tables=d32[2 * num_seqs + 1:].view(num_seqs, width),
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)
        return d64[:num_tokens], d64[num_tokens: 2 * num_tokens], md

    def warm_up(self, num_seqs: int, query_lens: list[int]) -> list[tuple[int, int]]:
        """Forwards of up to num_seqs sequences with each query length (decode: 1; speculative
        verification: 1 + k), as many as the pool's blocks hold, and their logits: a GPU
        compiles its kernels for these shapes here. Returns the (sequences, query length)
        shapes run."""
        shapes = []
        for q in query_lens:
            n = max(1, min(num_seqs, self.num_blocks // -(-q // self.block_size)))
            ids, pos, md = self.synthetic_step([q] * n)
            self.forward(ids, pos, md, list(range(n * q)))
            shapes.append((n, q))
        return shapes

    # The last forward's final hidden states of its logit rows, [rows, hidden], where a step
    # holds embedding requests (execute's keep_hidden; pooled by LLMEngine._pooled), else None.
    last_hidden: torch.Tensor | None = None

    def execute(self, out: SchedulerOutput, logit_rows: list[int], *,
                constrained: list[bool] | None = None, ids: bool = False) -> torch.Tensor:
        """Run the step; return float32 logits [len(logit_rows), vocab] for the given rows of
        the flat token batch, on the model's device (sampling runs there: a GPU step copies no
        logits to the host). constrained: which sequences sample under a grammar (default:
        each one's own constraint; a draft's shadow sequences carry none of their requests').
        ids: where every row's sampling reads only its argmax, return those argmaxes instead,
        [len(logit_rows)] int64 (a 1-D result): no [rows, vocab] logits made where the model
        can avoid them (LlamaModel.argmax_ids)."""
        # Decode steps only (each sequence's latest token and its proposals) pick packed or
        # dense products: prefill keeps each packed form's own limit, so that a prompt's
        # numerics do not depend on what the machine measured so far.
        decode = all(n == 1 + len(s.spec_token_ids) for s, n in zip(out.seqs, out.num_tokens))
        if constrained is None:
            constrained = [s.constraint is not None for s in out.seqs]
        argmax_only = all(not s.spec_token_ids and reads_argmax_only(
            s.params, s.num_output_tokens, c) for s, c in zip(out.seqs, constrained))
        keep = any(s.pooling is not None for s in out.seqs)
        step = _lora_step(out, self.device)
        if step is None:
            return self.forward(*self.prepare(out), logit_rows, choose_path=decode,
                                argmax_only=argmax_only, ids=ids, keep_hidden=keep)
        lora.STEP = step  # rows with adapters: their products added in every projection
        try:
            return self.forward(*self.prepare(out), logit_rows, argmax_only=argmax_only, ids=ids,
                                keep_hidden=keep)
        finally:
            lora.STEP = None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                logit_rows: list[int] | None, choose_path: bool = False,
                argmax_only: bool = False, ids: bool = False,
                keep_hidden: bool = False) -> torch.Tensor | None:
        """argmax_only: every row's sampling reads only its argmax (the logits may be right
        only there: `LlamaModel.compute_logits`); ids (with argmax_only): return those argmaxes,
        [rows] int64, not logits. keep_hidden: keep the logit rows' final hidden states in
        last_hidden."""
        choice = self.packed_rows if choose_path else None
        rows = out_rows = None
        self.last_hidden = None
        if logit_rows is not None:
            rows = upload(torch.tensor(logit_rows, dtype=torch.long), input_ids.device)
            if _prunable(logit_rows, input_ids.shape[0]) and lora.STEP is None:
                out_rows = rows  # the last layer carries only these rows past its attention
        if choice is None:
            hidden = self.model(input_ids, positions, md, out_rows=out_rows)
        else:  # packed or dense products for this many rows: the faster one measured
            n = input_ids.shape[0]
            dense_from = choice.choose(n)
            start = time.perf_counter()
            with quant.dense_from(dense_from):
                hidden = self.model(input_ids, positions, md, out_rows=out_rows)
            choice.observe(n, dense_from, time.perf_counter() - start)
        if logit_rows is None:  # a tensor-parallel worker: rank 0 computes the logits
            return None
        if out_rows is None:
            hidden = hidden.index_select(0, rows)
        self.last_hidden = hidden if keep_hidden else None  # embedding requests pool them
        if ids and argmax_only:
            return self.model.argmax_ids(hidden)
        return self.model.compute_logits(hidden, argmax_only=argmax_only)


def _lora_step(out: SchedulerOutput, device: torch.device) -> lora.LoRAStep | None:
    """The step's rows of each adapter (seq.lora, pagellm.lora), in the flat batch, or None."""
    groups: dict[int, tuple] = {}
    offset = 0
    for seq, n in zip(out.seqs, out.num_tokens):
        if seq.lora is not None:
            groups.setdefault(id(seq.lora), (seq.lora, []))[1].extend(range(offset, offset + n))
        offset += n
    if not groups:
        return None
    return lora.LoRAStep([(a, torch.tensor(rows, dtype=torch.long, device=device))
                          for a, rows in groups.values()])
