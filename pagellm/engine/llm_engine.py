"""LLMEngine: add_request / abort_request / step. Single-threaded; the async server drives it."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import weakref
from dataclasses import dataclass, field

import torch

from pagellm.config import EngineConfig
from pagellm.engine.block_manager import BlockManager
from pagellm.engine.detokenizer import append_text, find_stop_string
from pagellm.engine.model_runner import ModelRunner, WorkerDiedError, profile_forward
from pagellm.engine.scheduler import Scheduler, SchedulerOutput
from pagellm.kernels.malloc import keep_freed_memory, release_freed_memory
from pagellm.engine.memory import (num_kv_blocks, resolve_device,
                                   resolve_dtype, resolve_kv_dtype)
from pagellm.layers.linear import packed_row_limit
from pagellm.models.loader import load_model_files, load_tokenizer
from pagellm.models.registry import WINDOWED_MODEL_TYPES, build_model, may_pack
from pagellm import lora
from pagellm.lora import LoRARequest
from pagellm.pooling_params import PoolingParams
from pagellm.outputs import CompletionOutput, Prefix, RequestMetrics, RequestOutput
from pagellm.sampling.sampler import SamplingRow, logprobs_of, sample
from pagellm.sampling_params import SamplingParams
from pagellm.sequence import Sequence, SequenceStatus
from pagellm.structured import GrammarBackend, mask_rows

logger = logging.getLogger("pagellm")


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float
    # Samples 1..n-1 wait until sample 0 has computed the prompt, then fork from it.
    pending_forks: list[Sequence] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()
        # a tokenizer given instead of the file's: the file's is not even converted
        files = load_model_files(config.model, load_tokenizer=config.tokenizer is None)
        if config.tokenizer is not None:  # every use of the tokenizer (EOS too) takes it
            files = dataclasses.replace(files, tokenizer=load_tokenizer(config.tokenizer,
                                                                        files.config))
        cc = config.cache
        if cc.gpu_memory_utilization is not None and (
                self.device.type != "cuda" or cc.kv_cache_memory or cc.kv_cache_fraction):
            logger.info("gpu_memory_utilization is not read: %s",
                        "kv_cache_memory / kv_cache_fraction set the KV budget"
                        if self.device.type == "cuda" else "it applies on a GPU; here the KV "
                        "budget is kv_cache_memory or kv_cache_fraction (engine/memory.py)")
        self.dtype = resolve_dtype(config.dtype, self.device,
                                   may_pack(files, config.quantization))
        self.model_path = files.path
        self.tokenizer = files.tokenizer
        self.hf_config = files.config
        self.max_model_len = min(config.max_model_len or 10**9,
                                 _context_length(files.config))
        self._tp_procs = None
        self._tp_stop = None
        if config.tensor_parallel_size > 1:
            from pagellm.engine.tensor_parallel import start_workers, stop_workers

            self._tp_procs = start_workers(config, self.device, self.max_model_len)
            # Workers and the process group end with the engine: shutdown(), garbage
            # collection or interpreter exit, whichever comes first.
            self._tp_stop = weakref.finalize(self, stop_workers, self._tp_procs)
        self.model = build_model(files, self.dtype, self.device, self.max_model_len,
                                 config.quantization)
        if self.device.type == "cpu":
            release_freed_memory()
        self.eos_token_id = _eos_id(files)
        # Llama 3 style configs list several end tokens; any of them ends a sequence.
        cfg_eos = getattr(files.config, "eos_token_id", None)
        self.eos_token_ids = {self.eos_token_id, *(cfg_eos if isinstance(cfg_eos, list) else
                                                   [cfg_eos])} - {None}
        self.vocab_size = files.config.vocab_size
        self.structured = GrammarBackend(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.kv_dtype = resolve_kv_dtype(cc.kv_cache_dtype, self.dtype, self.device,
                                         self.model.act_dtype)
        # Every model is loaded, and the largest step profiled, before the KV budget is read:
        # the budget is what is left of one memory budget.
        draft = None
        if config.speculative is not None:
            from pagellm.spec_decode.setup import load_draft, needs_draft_model

            if needs_draft_model(config.speculative, self.dtype, self.device):
                draft = load_draft(config.speculative, files, self.dtype, self.device,
                                   self.max_model_len, config.quantization,
                                   shared_tokenizer=config.tokenizer is not None)
        self.warmup = (config.warmup if config.warmup is not None
                       else self.device.type == "cuda") and self._tp_procs is None
        activation_peak = self._profile(draft) if self.warmup else 0
        self.num_blocks, budget = num_kv_blocks(files.config, cc, self.kv_dtype, self.device,
                                                config.tensor_parallel_size, activation_peak)
        self.spec = None
        if config.speculative is not None:
            from pagellm.spec_decode.setup import build_spec_decoder

            self.spec, self.num_blocks = build_spec_decoder(
                config.speculative, target_files=files, target_model=self.model,
                target_dtype=self.dtype, device=self.device, max_model_len=self.max_model_len,
                eos_token_id=self.eos_token_ids, kv_budget=budget, block_size=cc.block_size,
                quantization=config.quantization, kv_cache_dtype=cc.kv_cache_dtype, draft=draft,
                enable_prefix_caching=cc.enable_prefix_caching)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB, %s, %d tokens)", self.num_blocks,
                    cc.block_size, budget / 2**20, self.kv_dtype, self.num_blocks * cc.block_size)
        self.block_manager = BlockManager(self.num_blocks, cc.block_size, cc.enable_prefix_caching)
        sc = config.scheduler
        self.scheduler = Scheduler(self.block_manager, sc.max_num_seqs, sc.max_num_batched_tokens,
                                   on_release=self.spec.release if self.spec else None)
        if self._tp_procs is not None:
            from pagellm.engine.tensor_parallel import TPModelRunner

            self.runner = TPModelRunner(self._tp_procs, self.model, self.num_blocks,
                                        cc.block_size, self.kv_dtype, self.device)
        else:
            self.runner = ModelRunner(self.model, self.num_blocks, cc.block_size, self.kv_dtype,
                                      self.device)
        if self.spec is not None:
            self.spec.bind(self.scheduler, self.runner, packed_row_limit(self.model))
        if self.warmup:
            self._warm_up()
        self.memory_split = self._memory_split()  # fixed from here on: read by /metrics
        m = {k: v / 2**20 for k, v in self.memory_split.items()}
        logger.info("memory: target weights %.0f MiB + KV %.0f MiB; draft weights %.0f MiB + "
                    "KV %.0f MiB", m["target_weights"], m["target_kv"], m["draft_weights"],
                    m["draft_kv"])
        self.requests: dict[str, Request] = {}
        self.adapters: dict[int, lora.LoRAAdapter] = {}  # LoRA adapters read so far, by id
        self._seq_ids = itertools.count()
        # Draws of requests without a seed of their own, on the model's device (a seeded
        # request's generator stays on the CPU: a seed draws the same on every device).
        self._rng = torch.Generator(device=self.device).manual_seed(config.seed)
        self.num_prompt_tokens = 0  # counters for metrics
        self.num_generation_tokens = 0
        self.dead: str | None = None  # why the engine cannot run any more (a lost worker)

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | PoolingParams, arrival_time: float | None = None,
                    cache_salt: str | None = None, lora_request: LoRARequest | None = None
                    ) -> None:
        """params: SamplingParams to generate, or PoolingParams for the prompt's embedding
        (the request ends when its prompt has run; its output's `embedding`). lora_request:
        an adapter for this request's rows (pagellm/lora.py)."""
        if self.dead is not None:
            raise RuntimeError(self.dead)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        adapter = self._adapter(lora_request) if lora_request is not None else None
        if adapter is not None:  # another adapter's K/V for the same prompt: apart in the cache
            cache_salt = (lora_request.lora_int_id, cache_salt)  # no string salt equals it
        pooling = None
        if isinstance(params, PoolingParams):
            kind = getattr(self.hf_config, "pooling_type", None)
            if kind not in (None, "last", "none"):
                raise ValueError(f"pooling: this model's embeddings are pooled by {kind!r} (its "
                                 "files say); pagellm pools the last token only")
            hidden = self.hf_config.hidden_size
            if params.dimensions is not None and params.dimensions > hidden:
                raise ValueError(f"dimensions: {params.dimensions} is more than the model's "
                                 f"{hidden} hidden values")
            pooling, params = params, SamplingParams(max_tokens=1, temperature=0.0)
        prompt_text, ids = self._tokenize(prompt)
        self._check_prompt(ids)
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:  # sampling would index past the logits inside the step, failing its batch
            raise ValueError(f"stop_token_ids out of range [0, {self.vocab_size}): {bad[:5]}")
        bad = [t for t in params.logit_bias or {} if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        # Compiled here, so a bad schema or grammar is this request's ValueError, never a step's.
        constraints = ([self.structured.constraint(params.structured_outputs)
                        for _ in range(params.n)] if params.structured_outputs else
                       [None] * params.n)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        seqs = [Sequence(next(self._seq_ids), request_id, i, ids, params, self.eos_token_id,
                         arrival_time=arrival, cache_salt=cache_salt) for i in range(params.n)]
        for seq, c in zip(seqs, constraints):
            seq.constraint = c
            seq.pooling = pooling
            seq.lora = adapter
        self.requests[request_id] = Request(request_id, prompt_text, ids, params, seqs, arrival,
                                            pending_forks=seqs[1:])
        self.num_prompt_tokens += len(ids)
        self.scheduler.add(seqs[0])

    def _adapter(self, request: LoRARequest) -> lora.LoRAAdapter:
        """The request's adapter, read at its first use and kept (by lora_int_id)."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        known = self.adapters.get(request.lora_int_id)
        if known is not None:
            if known.request != request:
                raise ValueError(f"lora_request: id {request.lora_int_id} is already "
                                 f"{known.request.lora_name!r} at {known.request.lora_path}")
            return known
        if self._tp_procs is not None:
            raise ValueError("lora_request: adapters are not supported with tensor parallelism")
        if not hasattr(self.model.layers[0].self_attn.qkv_proj, "lora_key"):
            lora.attach(self.model)
        adapter = lora.load_adapter(request, self.model)
        self.adapters[request.lora_int_id] = adapter
        logger.info("LoRA adapter %r (id %d) loaded from %s: %d projections", request.lora_name,
                    request.lora_int_id, request.lora_path, len(adapter.weights))
        return adapter

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this engine has no tokenizer; pass token ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._tokenize(prompt["prompt"])
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise ValueError("prompt must be a string or a list of token ids")
        return None, list(prompt)

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt must not be empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        # a prompt may fill the context: its one token is sampled from the last position
        # and never runs through the model (what scores a whole window: prompt logprobs)
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len "
                             f"{self.max_model_len}")
        capacity = self.num_blocks * self.config.cache.block_size
        if len(ids) >= capacity:
            raise ValueError(f"prompt has {len(ids)} tokens but the KV cache holds only "
                             f"{capacity}; raise kv_cache_memory")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now; its blocks return to the pool. Returns its final output
        (finish_reason "abort", partial text), or None for an unknown id."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.is_finished:
                self._finish(seq, "abort")
        return self.make_output(req)

    def shutdown(self) -> None:
        """Stop tensor-parallel workers, if any. The engine is unusable afterwards."""
        if self._tp_stop is not None:
            self._tp_stop()
            self._tp_procs = None

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- the step --------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One scheduling step. A failure inside it ends only the request that caused it
        (finish_reason "error", every sequence of the request, blocks returned): a failed
        forward is retried one sequence at a time, sampling and token processing are per
        request. A lost tensor-parallel worker ends every request, marks the engine dead and
        is raised. Returns the outputs of the requests the step touched; finished_only: of
        those that finished (offline generation reads no others: building 64 requests'
        outputs every step cost ~0.4 ms)."""
        if self.dead is not None:
            raise RuntimeError(self.dead)
        start = time.perf_counter()
        if self.spec is not None:  # speculation's two calls: propose before scheduling ...
            self.spec.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        try:
            outputs = self._run_batch(out, finished_only)  # ... and verify after the forward
            if self.spec is not None:
                self.spec.observe(len(out.seqs), time.perf_counter() - start)
            return outputs
        except WorkerDiedError as e:
            logger.exception("tensor-parallel worker lost; failing every request")
            self.dead, lost = str(e), e
            failed = set(self.requests)
        except Exception:  # outside the per-request parts: the batch's requests end
            logger.exception("engine step failed; failing the requests of its batch")
            self.block_manager.drop_uncommitted()
            failed = {s.request_id for s in out.seqs}
        for rid in failed:
            self._fail_request(rid)
        outputs = self._collect_outputs(failed, finished_only)
        if self.dead is not None:
            raise lost
        return outputs

    def _fail_request(self, request_id: str) -> None:
        """End every sequence of a request with finish_reason "error", forks not yet made
        included (n > 1), so none is left holding blocks or a slot."""
        req = self.requests.get(request_id)
        if req is None:
            return
        req.pending_forks = []
        for seq in req.seqs:
            if not seq.is_finished:
                self._finish(seq, "error")

    def _run_batch(self, out: SchedulerOutput, finished_only: bool = False) -> list[RequestOutput]:
        self.runner.copy_blocks(self.scheduler.take_pending_copies())
        if not out.seqs:
            self._fail_unschedulable()
            return self._collect_outputs(set(), finished_only)
        out, logits, pooled, failed = self._forward(out)
        self.block_manager.commit()  # the KV of this step's newly cached blocks is written
        rows, owners, prompt = self._logit_rows(out)
        if prompt:  # rows after the sampling rows: the prompt tokens' log-probabilities
            first = len(rows) - sum(n for _, _, n in prompt)
            failed |= self._prompt_logprobs(prompt, logits[first:])
            logits = logits[:first]
        self.scheduler.advance(out)
        touched = self._process_samples(owners, logits, pooled)
        return self._collect_outputs(touched | failed, finished_only)

    def _forward(self, out: SchedulerOutput):
        """The step's forward. If it fails, each sequence runs alone and the requests whose
        sequence fails alone are ended: one bad request never fails its batch. Returns the
        sequences that ran, their logits rows, the final hidden states embedding requests pool
        (by seq_id) and the failed request ids."""
        rows, owners, _ = self._logit_rows(out)
        try:  # an all-greedy step gets its tokens, not logits (_process_samples)
            logits = self.runner.execute(out, rows, ids=True)
            return out, logits, self._pooled(owners), set()
        except WorkerDiedError:
            raise
        except Exception:
            logger.exception("forward of %d sequences failed; running each alone", len(out))
        # Blocks this step put in the prefix cache may never be written now; a sequence that
        # took one as a cache hit in this step recomputes instead.
        dropped = self.block_manager.drop_uncommitted()
        bs = self.block_manager.block_size
        kept, parts, prompt_parts, pooled, failed = SchedulerOutput(), [], [], {}, set()
        for seq, n in zip(out.seqs, out.num_tokens):
            if seq.is_finished:  # a sibling's failure ended it
                continue
            if any(b in dropped for b in seq.block_table[:seq.num_cached_tokens // bs]):
                self.scheduler.recompute(seq)
                continue
            one = SchedulerOutput([seq], [n])
            try:
                rows, one_owners, prompt = self._logit_rows(one)
                logits = self.runner.execute(one, rows)
                pooled.update(self._pooled(one_owners))
                first = len(rows) - sum(k for _, _, k in prompt)
                parts.append(logits[:first])  # sampling rows first, then prompt rows: as a batch
                prompt_parts.append(logits[first:])
            except WorkerDiedError:
                raise
            except Exception:
                logger.exception("request %s: its forward fails alone; ending it",
                                 seq.request_id)
                failed.add(seq.request_id)
                self._fail_request(seq.request_id)
                continue
            kept.seqs.append(seq)
            kept.num_tokens.append(n)
        logits = torch.cat(parts + prompt_parts) if parts else torch.empty(0)
        return kept, logits, pooled, failed

    def _pooled(self, owners: list[tuple[Sequence, int]]) -> dict[int, torch.Tensor]:
        """The last forward's final hidden state of each embedding request's row, by seq_id
        (its owner row: one, as nothing is speculated for it)."""
        if self.runner.last_hidden is None:  # kept only on steps holding one (the usual: none)
            return {}
        pooled, offset = {}, 0
        for seq, n in owners:
            if seq.pooling is not None:
                pooled[seq.seq_id] = self.runner.last_hidden[offset]
            offset += n
        return pooled

    def _profile(self, draft) -> int:
        """A forward of the largest step (one prompt of the token budget, logits for as many
        rows as a step can sample) through the target and the draft model; returns the
        activation bytes to keep out of the KV budget (GPU; 0 on the CPU)."""
        sc, cc, spec = self.config.scheduler, self.config.cache, self.config.speculative
        tokens = min(sc.max_num_batched_tokens, self.max_model_len)
        rows = sc.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))
        start = time.perf_counter()
        peak = profile_forward(self.model, tokens, rows, cc.block_size, self.kv_dtype,
                               self.device)
        if draft is not None:
            _, model, dtype = draft
            kv = resolve_kv_dtype(cc.kv_cache_dtype, dtype, self.device, model.act_dtype)
            peak = max(peak, profile_forward(model, tokens, sc.max_num_seqs, cc.block_size, kv,
                                             self.device))
        logger.info("profiled a %d-token step in %.2f s: %.0f MiB of activations", tokens,
                    time.perf_counter() - start, peak / 2**20)
        return peak

    def _warm_up(self) -> None:
        """Forwards of the decode and verification shapes over the fresh pool (no block is in
        use yet), the draft's decode too: kernels compile here, not on the first requests."""
        start = time.perf_counter()
        spec = self.config.speculative
        k = spec.num_speculative_tokens if spec else 0
        lens = sorted({1, *(1 + 2**i for i in range(k.bit_length()) if 2**i <= k), 1 + k})
        shapes = self.runner.warm_up(self.config.scheduler.max_num_seqs, lens)
        draft = self.spec.draft_runner() if self.spec is not None else None
        if draft is not None:
            shapes += draft.warm_up(self.config.scheduler.max_num_seqs, [1])
        self.model.layers[0].self_attn.backend.warm_up(self.runner, lens)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info("warm-up: %d step shapes (sequences, tokens each) %s in %.2f s",
                    len(shapes), shapes, time.perf_counter() - start)
        self.warmup_shapes = shapes

    def _memory_split(self) -> dict[str, int]:
        """Bytes of the one memory budget: the target's weights and KV pool and, with a draft
        model of its own, the draft's (an early-exit draft shares the target's; n-gram has
        none). Printed at start and exposed in /metrics."""
        def pool(runner) -> int:
            return sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)

        split = {"target_weights": self.model.weight_bytes(), "target_kv": pool(self.runner),
                 "draft_weights": 0, "draft_kv": 0}
        draft = self.spec.draft_runner() if self.spec is not None else None
        if draft is not None:  # a draft with a cache of its own
            split["draft_weights"] = draft.model.weight_bytes()
            split["draft_kv"] = pool(draft)
        return split

    @property
    def spec_stats(self):
        """Speculative decoding counters (None without speculation), read by /metrics."""
        return self.spec.stats if self.spec is not None else None

    def _logit_rows(self, out: SchedulerOutput):
        """Rows of the flat batch whose logits are needed: for every sequence that catches up
        with its tokens, its last real token and each speculative proposal (a mid-prompt chunk
        needs none); after all of those, the rows of prompt positions whose next token's
        log-probability a request asked for (SamplingParams.prompt_logprobs). Returns the
        rows, (sequence, number of its sampling rows) in order, and (sequence, first prompt
        position, count) for the prompt rows."""
        rows, owners, prompt, extra, offset = [], [], [], [], 0
        for seq, n in zip(out.seqs, out.num_tokens):
            start = seq.num_computed_tokens
            if seq.params.prompt_logprobs is not None and seq.index == 0:
                # position p gives prompt token p + 1's entry; entries already made are not
                # made again (a recompute after preemption)
                lo = max(start, len(seq.prompt_logprobs) - 1)
                hi = min(start + n, seq.num_prompt_tokens - 1)
                if hi > lo:
                    extra.extend(range(offset + lo - start, offset + hi - start))
                    prompt.append((seq, lo, hi - lo))
            offset += n
            if start + n >= seq.num_tokens:
                k = len(seq.spec_token_ids)
                rows.extend(range(offset - k - 1, offset))
                owners.append((seq, k + 1))
        return rows + extra, owners, prompt

    @torch.inference_mode()
    def _prompt_logprobs(self, prompt: list[tuple[Sequence, int, int]], logits: torch.Tensor
                         ) -> set[str]:
        """The prompt rows' logits (in _logit_rows' order) -> each position's next prompt
        token's log-probability and its top-N, appended to the sequence's prompt_logprobs
        (from the raw logits: what the model assigns, as vLLM reports them). Each request's
        part runs on its own: one that fails ends that request alone. Returns the request ids
        that failed."""
        failed, row = set(), 0
        for seq, lo, count in prompt:
            rows, row = logits[row:row + count], row + count
            try:
                self._score_prompt_rows(seq, lo, rows)
            except Exception:
                logger.exception("prompt logprobs of request %s failed", seq.request_id)
                failed.add(seq.request_id)
        for rid in failed:
            self._fail_request(rid)
        return failed

    _PROMPT_SLICE = 256  # rows a [rows, vocab] float32 temporary holds (a 2,048-token chunk
    # of a 152k vocabulary would otherwise add 1.2 GB a copy)

    def _score_prompt_rows(self, seq: Sequence, lo: int, logits: torch.Tensor) -> None:
        k = seq.params.prompt_logprobs
        for a in range(0, logits.shape[0], self._PROMPT_SLICE):
            lps = torch.log_softmax(logits[a:a + self._PROMPT_SLICE].float(), dim=-1)
            first = lo + a + 1  # the prompt token these rows score
            tokens = seq.prompt_token_ids[first:first + lps.shape[0]]  # the last row may
            # score the first generated token instead: not a prompt row
            scored = logprobs_of(lps[:len(tokens)], tokens, [k] * len(tokens))
            for tok, (lp, top) in zip(tokens, scored):
                seq.prompt_logprobs.append({tok: lp, **{t: v for t, v in top.items() if t != tok}})

    def _process_samples(self, owners: list[tuple[Sequence, int]], logits: torch.Tensor,
                         pooled: dict[int, torch.Tensor] | None = None) -> set[str]:
        plain, plain_rows, spec, spec_logits = [], [], [], []
        offset = 0
        for seq, n in owners:
            if seq.pooling is not None:  # an embedding request: its prompt has run
                self._guarded(seq, self._pool, seq, pooled[seq.seq_id])
            elif n == 1:
                plain.append(seq)
                plain_rows.append(offset)
            else:
                spec.append(seq)
                spec_logits.append(logits[offset:offset + n])
            offset += n
        now = time.monotonic()
        for i in range(len(plain)):  # first token of sample 0: its siblings fork from it here
            forks = self._fork_siblings(plain[i])
            plain.extend(forks)
            plain_rows.extend([plain_rows[i]] * len(forks))
        if plain:
            if logits.dim() == 1:  # a step whose every row reads its argmax: the tokens
                drawn = [(t, None) for t in logits[plain_rows].tolist()]
            else:
                every = plain_rows == list(range(logits.shape[0]))  # then no copy of the rows
                drawn = self._per_request(self._draw_plain, plain,
                                          logits if every else logits[plain_rows])
            for seq, d in zip(plain, drawn):
                if d is not None and not seq.is_finished:
                    self._guarded(seq, self._emit_plain, seq, d, now)
        if spec:
            verified = self._per_request(self._verify, spec, spec_logits)
            for seq, v in zip(spec, verified):
                if v is not None and not seq.is_finished:
                    self._guarded(seq, self._emit_verified, seq, v, now)
        return {seq.request_id for seq, _ in owners}

    def _pool(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """The embedding of a request whose prompt has run: the last token's final hidden
        state, its first `dimensions` values, of unit length (PoolingParams)."""
        vec = hidden.float()
        if seq.pooling.dimensions is not None:
            vec = vec[: seq.pooling.dimensions]
        if seq.pooling.normalize:
            vec = torch.nn.functional.normalize(vec, dim=0)
        seq.embedding = vec.cpu().tolist()
        self._finish(seq, "stop")

    def _per_request(self, fn, seqs: list[Sequence], data) -> list:
        """fn(seqs, data) -> one result per sequence, for the batch at once; if that raises,
        per sequence, ending the requests whose sequence raises alone (result None)."""
        try:
            return fn(seqs, data)
        except Exception:
            logger.exception("%s over %d sequences failed; retrying each alone", fn.__name__,
                             len(seqs))
        results = []
        for i, seq in enumerate(seqs):
            results.append(None)
            if seq.is_finished:
                continue
            try:
                results[-1] = fn([seq], data[i:i + 1])[0]
            except Exception:
                logger.exception("request %s: %s fails alone; ending it", seq.request_id,
                                 fn.__name__)
                self._fail_request(seq.request_id)
        return results

    def _guarded(self, seq: Sequence, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:
            logger.exception("request %s: processing its tokens failed; ending it",
                             seq.request_id)
            self._fail_request(seq.request_id)

    def _draw_plain(self, seqs: list[Sequence], logits: torch.Tensor) -> list:
        rows = [SamplingRow(s.params, s.prompt_token_ids, s.output_token_ids,
                            s.generator or self._rng, self.eos_token_ids) for s in seqs]
        result, dead = self._sample_plain(seqs, rows, logits)
        return [_DEAD_END if i in dead else (result.token_ids[i], result.logprobs[i])
                for i in range(len(seqs))]

    def _emit_plain(self, seq: Sequence, drawn, now: float) -> None:
        if drawn is _DEAD_END:
            self._grammar_dead_end(seq)
        else:
            self._append_token(seq, *drawn, now)

    def _verify(self, seqs: list[Sequence], logits: list[torch.Tensor]) -> list:
        return self.spec.verify(seqs, logits, self._rng)

    def _emit_verified(self, seq: Sequence, verified, now: float) -> None:
        for token, lp in zip(verified.token_ids, verified.logprobs):
            self._append_token(seq, token, lp, now)
            if seq.is_finished:
                return
        self.scheduler.rollback(seq)  # KV stays valid up to the last accepted proposal

    def _sample_plain(self, seqs: list[Sequence], rows: list[SamplingRow], logits: torch.Tensor):
        """Sample one token per row. A constrained row first draws without its grammar's mask:
        a token the grammar allows is then a draw from the masked distribution (rejection
        sampling; for greedy rows the masked argmax), so the mask, llguidance's cost, is
        computed only for rows whose draw it forbids, which draw again under it. Rows that
        truncate (top-k/top-p/min-p) get the mask first, as truncation must see it. Returns the
        result and the rows whose grammar allows nothing."""
        constrained = [i for i, s in enumerate(seqs) if s.constraint is not None]
        dead = mask_rows(seqs, rows, [i for i in constrained if _truncates(seqs[i].params)])
        result = sample(logits, rows)
        redo = [i for i in constrained if rows[i].grammar_bias is None and i not in dead
                and not seqs[i].constraint.allows(result.token_ids[i])]
        if redo:
            dead |= mask_rows(seqs, rows, redo)
            redo = [i for i in redo if i not in dead]
        if redo:
            again = sample(logits[redo], [rows[i] for i in redo])
            for j, i in enumerate(redo):
                result.token_ids[i], result.logprobs[i] = again.token_ids[j], again.logprobs[j]
        return result, dead

    def _fork_siblings(self, seq: Sequence) -> list[Sequence]:
        req = self.requests.get(seq.request_id)
        if req is None or not req.pending_forks or seq.num_output_tokens:
            return []
        forks, req.pending_forks = req.pending_forks, []
        for child in forks:
            self.block_manager.fork(seq, child)
            child.status = SequenceStatus.RUNNING
            self.scheduler.running.append(child)
        return forks

    def _append_token(self, seq: Sequence, token: int, logprob, now: float) -> None:
        seq.output_token_ids.append(token)
        self.num_generation_tokens += 1
        if logprob is not None:
            lp, top = logprob
            seq.logprobs.append({token: lp, **{t: v for t, v in top.items() if t != token}})
            seq.cumulative_logprob += lp
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.token_times.append(now)
        delta = append_text(self.tokenizer, seq) if self.tokenizer is not None else ""
        reason, stop_reason = self._stop_check(seq, token, len(delta))
        if reason is not None:
            seq.stop_reason = stop_reason
            self._finish(seq, reason)

    def _grammar_dead_end(self, seq: Sequence) -> None:
        """The grammar allows no token at all here: it cannot be satisfied any more."""
        error = seq.constraint.error if seq.constraint is not None else None
        logger.warning("request %s: the structured-output grammar allows no further token%s",
                       seq.request_id, f" ({error})" if error else "")
        seq.stop_reason = GRAMMAR_DEAD_END
        self._finish(seq, "error")

    def _stop_check(self, seq: Sequence, token: int, delta_len: int):
        p = seq.params
        c = seq.constraint
        if c is not None:
            if not c.accept(token):
                # a token outside the mask (cannot happen when sampling masks it): the output
                # no longer matches the grammar, so it ends here
                logger.warning("request %s: token %d is outside its structured-output grammar"
                               "%s", seq.request_id, token,
                               f" ({c.error})" if getattr(c, "error", None) else "")
                return "error", GRAMMAR_DEAD_END
            if token not in self.eos_token_ids and c.is_stopped:
                return "stop", None  # the grammar is complete: only an end token could follow
        if seq.num_output_tokens >= p.min_tokens:
            if token in self.eos_token_ids and not p.ignore_eos:
                return "stop", None
            if token in p.stop_token_ids:
                return "stop", token
            s = find_stop_string(seq, delta_len)
            if s is not None:
                return "stop", s
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return "length", None
        if seq.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.constraint = None
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.monotonic()
        self.scheduler.remove(seq)

    def _fail_unschedulable(self) -> None:
        """Nothing could run: the head of the queue needs more blocks than the whole pool.
        It ends with finish_reason 'length' rather than blocking every request behind it."""
        if self.scheduler.waiting and not self.scheduler.running:
            seq = self.scheduler.waiting[0]
            logger.warning("request %s needs more KV than the pool holds; stopping it",
                           seq.request_id)
            self._finish(seq, "length")
            req = self.requests.get(seq.request_id)
            for sibling in req.pending_forks if req else []:
                self._finish(sibling, "length")

    def _collect_outputs(self, touched: set[str], finished_only: bool = False) -> list[RequestOutput]:
        outputs = []
        for rid in list(self.requests):
            req = self.requests[rid]
            if req.finished or (rid in touched and not finished_only):
                outputs.append(self.make_output(req))
                if req.finished:
                    del self.requests[rid]
        return outputs

    def make_output(self, req: Request) -> RequestOutput:
        # A running request's lists are Prefix views (O(1) a step); a finished one's are copies.
        snap = list if req.finished else Prefix
        comps = [CompletionOutput(
            index=s.index, text=s.text, token_ids=snap(s.output_token_ids),
            finish_reason=s.finish_reason, stop_reason=s.stop_reason,
            cumulative_logprob=s.cumulative_logprob if s.params.logprobs is not None else None,
            logprobs=snap(s.logprobs) if s.params.logprobs is not None else None,
            stop_strings=s.params.stop_strings)
            for s in req.seqs]
        first = [s.first_token_time for s in req.seqs if s.first_token_time is not None]
        fin = [s.finish_time for s in req.seqs if s.finish_time is not None]
        metrics = RequestMetrics(
            arrival_time=req.arrival_time, first_token_time=min(first) if first else None,
            finished_time=max(fin) if req.finished and fin else None,
            num_cached_tokens=req.seqs[0].num_cached_tokens,
            num_preemptions=sum(s.num_preemptions for s in req.seqs),
            token_times=snap(req.seqs[0].token_times),
            num_draft_tokens=sum(s.num_draft_tokens for s in req.seqs),
            num_accepted_tokens=sum(s.num_accepted_tokens for s in req.seqs))
        head = req.seqs[0]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, comps,
                             req.finished, metrics, head.num_cached_tokens,
                             snap(head.prompt_logprobs) if head.params.prompt_logprobs is not None
                             else None, head.embedding)


_DEAD_END = object()  # a drawn row whose grammar allows no token
# stop_reason of a sequence that ended ("error") because its structured-output grammar cannot be
# completed: it allows no token, or rejects the one its own mask allowed (llguidance can force
# bytes that no token of the tokenizer gives, e.g. some 4-byte UTF-8 characters in a regex)
GRAMMAR_DEAD_END = "structured output cannot be completed"


def _truncates(p: SamplingParams) -> bool:
    return not p.greedy and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0)


def _context_length(config) -> int:
    n = getattr(config, "max_position_embeddings", None) or 2048
    window = getattr(config, "sliding_window", None)
    if (window and getattr(config, "use_sliding_window", True)
            and config.model_type not in WINDOWED_MODEL_TYPES):
        # This model's attention is full-context here; capping at the window keeps it exact.
        n = min(n, window)
    return n


def _eos_id(files) -> int | None:
    eos = getattr(files.config, "eos_token_id", None)
    if files.tokenizer is not None and files.tokenizer.eos_token_id is not None:
        eos = files.tokenizer.eos_token_id
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos
