"""Builds the speculative decoder from SpeculativeConfig, checking the draft against the target."""
from __future__ import annotations

import copy
import dataclasses
import functools
import logging

import torch
from gguf import GGMLQuantizationType

from pagellm import parallel
from pagellm.config import SpeculativeConfig
from pagellm.engine.memory import resolve_dtype, resolve_kv_dtype
from pagellm.engine.model_runner import kv_bytes_per_block
from pagellm.models.loader import load_model_files
from pagellm.models.registry import build_model, may_pack
from pagellm.spec_decode.combined import LookupThenDraft
from pagellm.spec_decode.decoder import SpecDecoder
from pagellm.spec_decode.draft_model import DraftModelProposer, EarlyExitProposer
from pagellm.spec_decode.ngram import NgramProposer

logger = logging.getLogger("pagellm")


def load_draft(spec: SpeculativeConfig, target_files, target_dtype: torch.dtype,
               device: torch.device, max_model_len: int, quantization: str | None = None,
               shared_tokenizer: bool = False):
    """Load the draft model (default: the target's own files, in a cheaper form) and refuse one
    whose vocabulary or tokenizer differs from the target's. shared_tokenizer: a tokenizer
    given for the engine (LLM's `tokenizer`) serves both, as in vLLM: the draft's own is
    neither read nor compared (its vocabulary's size still is)."""
    files = (load_model_files(spec.model, load_tokenizer=not shared_tokenizer) if spec.model
             else target_files)
    if files.config.vocab_size != target_files.config.vocab_size:
        raise ValueError(f"speculative_config.model: draft vocab size {files.config.vocab_size} "
                         f"differs from the target's {target_files.config.vocab_size}")
    t_tok, d_tok = target_files.tokenizer, files.tokenizer
    if t_tok is not None and d_tok is not None and t_tok.get_vocab() != d_tok.get_vocab():
        raise ValueError("speculative_config.model: the draft's tokenizer differs from the "
                         "target's; speculative decoding needs the same tokenizer")
    if spec.draft_quantization:
        if not files.path.endswith(".gguf"):
            raise ValueError("speculative_config.draft_quantization: the draft must be a GGUF "
                             f"file, got {files.path}")
        files = dataclasses.replace(files, weights=functools.partial(
            files.weights, requantize=GGMLQuantizationType.Q4_1))
    if spec.draft_num_layers is not None:
        config = copy.deepcopy(files.config)
        config.num_hidden_layers = min(spec.draft_num_layers, config.num_hidden_layers)
        files = dataclasses.replace(files, config=config)
    dtype = (resolve_dtype(spec.draft_dtype, device, may_pack(files, quantization))
             if spec.draft_dtype else target_dtype)
    with parallel.single_process():  # the draft runs whole on rank 0
        # "gguf" is the target's demand; the draft (maybe another dtype) packs when it can.
        draft_q = "none" if quantization == "none" else None
        draft = build_model(files, dtype, device, max_model_len, draft_q)
    # here, before the engine reads the KV budget: a limited head may keep a copy of its rows
    draft.limit_vocab(spec.draft_vocab_size or None)  # 0 / None: all ids
    return files, draft, dtype


def shares_target(spec: SpeculativeConfig, target_dtype: torch.dtype, device) -> bool:
    """Whether the draft can be the target's own first layers, run in place: no other
    model, the target's dtype, and the whole target in this process."""
    same_dtype = spec.draft_dtype is None or resolve_dtype(spec.draft_dtype, device) == target_dtype
    return spec.model is None and same_dtype and parallel.tp_size() == 1


def needs_draft_model(spec: SpeculativeConfig, target_dtype: torch.dtype, device) -> bool:
    """Whether the speculation has a draft model of its own to load (the engine loads it
    before reading the KV budget, so that the budget counts its weights)."""
    return spec.method != "ngram" and not shares_target(spec, target_dtype, device)


def build_spec_decoder(spec: SpeculativeConfig, *, target_files, target_model, target_dtype,
                       device, max_model_len, eos_token_id, kv_budget: int, block_size: int,
                       quantization: str | None = None, kv_cache_dtype: str = "auto",
                       draft=None, enable_prefix_caching: bool = True):
    """(SpecDecoder, number of target KV blocks). The KV budget is split so that target and
    draft caches hold the same number of tokens. draft: load_draft's result where
    needs_draft_model (the engine loads it before it reads the budget)."""
    t_kv = resolve_kv_dtype(kv_cache_dtype, target_dtype, device, target_model.act_dtype)
    t_block = kv_bytes_per_block(target_files.config, block_size, t_kv, parallel.tp_size())
    if spec.method == "ngram":
        num_blocks = kv_budget // t_block
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        logger.info("speculative decoding: n-gram lookup, k=%d", spec.num_speculative_tokens)
    elif shares_target(spec, target_dtype, device):
        num_blocks = kv_budget // t_block
        n = min(spec.draft_num_layers or 10**9, target_files.config.num_hidden_layers)
        proposer = EarlyExitProposer(target_model, n, eos_token_id, max_model_len)
        logger.info(
            "speculative decoding: draft = the target's first %d of %d layers, sharing its "
            "weights and KV cache (no memory of its own), k=%d. Memory: weights %.0f MiB + "
            "KV %.0f MiB", n, target_files.config.num_hidden_layers,
            spec.num_speculative_tokens, target_model.weight_bytes() / 2**20,
            num_blocks * t_block / 2**20)
    else:
        files, draft, dtype = draft  # its vocabulary limit set by load_draft
        d_kv = resolve_kv_dtype(kv_cache_dtype, dtype, device, draft.act_dtype)
        d_block = kv_bytes_per_block(files.config, block_size, d_kv)
        num_blocks = kv_budget // (t_block + d_block)
        with parallel.single_process():
            proposer = DraftModelProposer(draft, num_blocks, block_size, d_kv, device,
                                          eos_token_id, max_model_len, enable_prefix_caching)
        mib = 2**20
        logger.info(
            "speculative decoding: draft %s (%d layers, %s, scores %s token ids), k=%d. "
            "Memory: target weights %.0f MiB + KV %.0f MiB; draft weights %.0f MiB + KV %.0f MiB",
            files.path, files.config.num_hidden_layers, dtype,
            draft.vocab_limit or "all", spec.num_speculative_tokens,
            target_model.weight_bytes() / mib, num_blocks * t_block / mib,
            draft.weight_bytes() / mib, num_blocks * d_block / mib)
    if num_blocks < 1:
        raise ValueError("kv_cache_memory is too small for target and draft caches")
    if spec.prompt_lookup_first:
        # Matches shorter than 3 tokens are right far less often (a one-token match: 0.39 of
        # the time on copy prompts, 0.13 on chat) and proposing them would take the place of
        # the draft's proposals: those are left to the draft.
        lo = max(3, spec.prompt_lookup_min)
        hi = max(lo, spec.prompt_lookup_max)
        proposer = LookupThenDraft(NgramProposer(lo, hi), proposer, spec.num_speculative_tokens)
        logger.info("speculative decoding: n-gram lookup (%d-%d tokens) first, the draft where "
                    "it finds nothing", lo, hi)
    decoder = SpecDecoder(proposer, spec.num_speculative_tokens, spec.adaptive, max_model_len,
                          eos_token_id)
    return decoder, int(num_blocks)
