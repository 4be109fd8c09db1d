"""The offline API: LLM(...).generate(prompts, sampling_params), .chat(messages) and
.embed(prompts)."""
from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

from tqdm.auto import tqdm

from pagellm.config import (CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig,
                            parse_bytes)
from pagellm.engine.llm_engine import LLMEngine
from pagellm.lora import LoRARequest
from pagellm.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, *, dtype: str = "auto", block_size: int = 16,
                 kv_cache_memory: int | str | None = None, kv_cache_fraction: float | None = None,
                 max_num_seqs: int = 128, max_num_batched_tokens: int = 2048,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 speculative_config: dict | SpeculativeConfig | None = None, seed: int = 0,
                 device: str = "auto", tensor_parallel_size: int = 1,
                 quantization: str | None = None, kv_cache_dtype: str = "auto",
                 warmup: bool | None = None, tokenizer: str | None = None,
                 gpu_memory_utilization: float | None = None,
                 trust_remote_code: bool = False, enforce_eager: bool = False):
        """vLLM's names. tokenizer: a tokenizer folder instead of the model's own;
        gpu_memory_utilization: the GPU's share for the engine (the CPU's budget is
        kv_cache_memory / kv_cache_fraction). trust_remote_code and enforce_eager are taken for
        scripts written for vLLM and change nothing: pagellm runs no code from model folders,
        and captures no CUDA graphs."""
        config = EngineConfig(
            model=model, tokenizer=tokenizer, dtype=dtype, device=device,
            max_model_len=max_model_len, seed=seed,
            tensor_parallel_size=tensor_parallel_size, quantization=quantization, warmup=warmup,
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_memory=None if kv_cache_memory is None else parse_bytes(
                    kv_cache_memory, "kv_cache_memory"),
                kv_cache_fraction=kv_cache_fraction, enable_prefix_caching=enable_prefix_caching,
                gpu_memory_utilization=gpu_memory_utilization,
                kv_cache_dtype=kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens),
            speculative=SpeculativeConfig.from_dict(speculative_config))
        self.engine = LLMEngine(config)
        self._ids = itertools.count()
        self._token_texts: dict[int, str] = {}  # Logprob.decoded_token, by id

    def shutdown(self) -> None:
        """Stop tensor-parallel worker processes (a no-op with one process)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """lora_request: an adapter for every prompt, or one (or None) a prompt."""
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, (SamplingParams, PoolingParams)):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple))
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request: got {len(loras)} for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p, adapter in zip(prompts, params, loras):
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(rid, prompt, p, lora_request=adapter)
                ids.append(rid)
        except Exception:  # a refused prompt or adapter: the ones already added go too
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def embed(self, prompts: Prompt | Seq[Prompt], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (pooling_params.py: the last token's final hidden state, of
        unit length by default), batched as generation is. A model trained for embeddings
        (Qwen3-Embedding, gte-Qwen2, e5-mistral) gives retrieval-grade vectors; a chat model's
        are its hidden states, nothing more."""
        outs = self.generate(prompts, pooling_params or PoolingParams(), use_tqdm)
        return [EmbeddingRequestOutput(o.request_id, o.prompt_token_ids,
                                       EmbeddingOutput(o.embedding), o.finished,
                                       o.num_cached_tokens) for o in outs]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(ids)
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            try:
                while wanted - finished.keys():
                    for out in self.engine.step(finished_only=True):
                        if out.finished and out.request_id in wanted:
                            finished[out.request_id] = out
                            bar.update(1)
            except BaseException:
                for rid in wanted - finished.keys():  # nothing stays behind in the engine
                    self.engine.abort_request(rid)
                raise
        outs = [finished[rid] for rid in ids]
        self._name_tokens(outs)
        return outs

    def _name_tokens(self, outs: list[RequestOutput]) -> None:
        """Each log-probability's decoded_token (vLLM's Logprob field): its token's text, one
        decode per id this LLM has met (here, off the engine's step loop; the server formats
        its own)."""
        tok = self.engine.tokenizer
        if tok is None:
            return
        texts = self._token_texts
        for out in outs:
            entries = [e for c in out.outputs for e in (c.logprobs or [])]
            entries += [e for e in out.prompt_logprobs or [] if e is not None]
            for entry in entries:
                for tid, lp in entry.items():
                    text = texts.get(tid)
                    if text is None:
                        text = texts[tid] = tok.decode([tid])
                    lp.decoded_token = text

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | None = None,
             continue_final_message: bool = False,
             chat_template: str | None = None) -> list[RequestOutput]:
        """chat_template_kwargs: more variables for the chat template (e.g. Qwen3's
        {"enable_thinking": False}); continue_final_message: the model goes on writing the
        last message (with add_generation_prompt=False); chat_template: a Jinja template
        instead of the model's own."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt, chat_template_kwargs,
                                            continue_final_message, chat_template)
                   for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template_kwargs: dict | None = None,
                            continue_final_message: bool = False,
                            chat_template: str | None = None) -> list[int]:
        from pagellm.chat_template import render_chat

        return render_chat(self.engine.tokenizer, messages, add_generation_prompt,
                           template_kwargs=chat_template_kwargs,
                           continue_final_message=continue_final_message,
                           chat_template=chat_template)
