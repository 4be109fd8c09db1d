"""Tensor parallelism on torch.distributed (gloo on CPU, NCCL on GPU).

Rank 0 is the engine process: it runs the scheduler once and, every step, broadcasts the step's
tensors to ranks 1..N-1, which run their shard of the model on them. Attention heads and MLP
columns are sharded by the parallel linear layers; the row-parallel outputs are all-reduced.
Each rank holds its share of every KV block (same block ids everywhere), so block tables,
prefix caching and speculative decoding (the draft runs on rank 0) work unchanged.
"""
from __future__ import annotations

import gc
import logging
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagellm import parallel
from pagellm.engine.model_runner import ModelRunner, WorkerDiedError  # noqa: F401 (re-export)

logger = logging.getLogger("pagellm")
_TIMEOUT = timedelta(seconds=120)
_JOINED = "pagellm/joined"  # store counter: workers about to join the group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _threads(tp_size: int) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp_size))


def start_workers(config, device: torch.device, max_model_len: int) -> list:
    """Spawn ranks 1..N-1 and join the process group as rank 0. A worker that exits before
    it joins is noticed at once (WorkerDiedError), not after the store's timeout."""
    if dist.is_initialized():
        gc.collect()  # a deleted engine caught in a reference cycle: its finalizer stops it
    if dist.is_initialized():
        raise RuntimeError("this process already runs a tensor-parallel engine; shut it down "
                           "(LLM.shutdown(), or `with LLM(...)`) before starting another")
    tp = config.tensor_parallel_size
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, tp, True, timeout=_TIMEOUT,
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker_main, args=(rank, port, config, str(device), max_model_len),
                         daemon=True, name=f"pagellm-tp{rank}") for rank in range(1, tp)]
    for p in procs:
        p.start()
    try:
        _wait_joined(store, procs)
        dist.init_process_group(_backend(device), store=store, rank=0, world_size=tp,
                                timeout=_TIMEOUT)
    except BaseException:
        stop_workers(procs)
        raise
    parallel.set_tp(0, tp)
    _threads(tp)
    logger.info("tensor parallel: %d ranks (%s)", tp, _backend(device))
    return procs


def _wait_joined(store, procs: list) -> None:
    """Until every worker has said it is joining (a counter in the store), watching that
    each is still alive."""
    deadline = time.monotonic() + _TIMEOUT.total_seconds()
    while store.add(_JOINED, 0) < len(procs):
        for p in procs:
            if not p.is_alive():
                raise WorkerDiedError(f"tensor-parallel worker {p.name} exited while starting "
                                      f"(exit code {p.exitcode})")
        if time.monotonic() > deadline:
            raise WorkerDiedError("tensor-parallel workers did not start within "
                                  f"{_TIMEOUT.total_seconds():.0f} s")
        time.sleep(0.05)


def stop_workers(procs: list) -> None:
    """Stop the workers and leave the process group (idempotent): also run by the engine's
    finalizer when it is garbage-collected or at exit, so that a later engine in the same
    process can start its own group."""
    if procs and dist.is_initialized() and all(p.is_alive() for p in procs):
        try:
            dist.broadcast_object_list([("stop",)], src=0)
        except RuntimeError:
            pass
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
    if dist.is_initialized():
        dist.destroy_process_group()
    parallel.set_tp(0, 1)


def _worker_main(rank: int, port: int, config, device: str, max_model_len: int) -> None:
    from pagellm.engine.memory import resolve_dtype, resolve_kv_dtype
    from pagellm.kernels.malloc import keep_freed_memory
    from pagellm.models.loader import load_model_files
    from pagellm.models.registry import build_model, may_pack

    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", port, config.tensor_parallel_size, False,
                          timeout=_TIMEOUT)
    store.add(_JOINED, 1)
    dist.init_process_group(_backend(dev), store=store, rank=rank,
                            world_size=config.tensor_parallel_size, timeout=_TIMEOUT)
    parallel.set_tp(rank, config.tensor_parallel_size)
    _threads(config.tensor_parallel_size)
    if dev.type == "cpu":
        keep_freed_memory()
    files = load_model_files(config.model, load_tokenizer=False)
    dtype = resolve_dtype(config.dtype, dev, may_pack(files, config.quantization))
    model = build_model(files, dtype, dev, max_model_len, config.quantization)
    num_blocks = _recv()
    kv_dtype = resolve_kv_dtype(config.cache.kv_cache_dtype, dtype, dev)
    runner = ModelRunner(model, num_blocks, config.cache.block_size, kv_dtype, dev)
    while True:
        msg = _recv()
        if msg[0] == "step":
            _, input_ids, positions, md = msg
            runner.forward(input_ids.to(dev), positions.to(dev), _to(md, dev), None)
        elif msg[0] == "copy":
            runner.copy_blocks(msg[1])
        elif msg[0] == "stop":
            break
    dist.destroy_process_group()


def _recv():
    box = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _to(md, device):
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        setattr(md, name, getattr(md, name).to(device))
    return md


class TPModelRunner(ModelRunner):
    """Rank 0's runner: sends every step and block copy to the workers before doing its share."""

    def __init__(self, procs: list, model, num_blocks: int, block_size: int, dtype, device):
        self.procs = procs
        self._send(num_blocks)
        super().__init__(model, num_blocks, block_size, dtype, device)

    def _send(self, msg) -> None:
        for p in self.procs:
            if not p.is_alive():
                raise WorkerDiedError(f"tensor-parallel worker {p.name} exited "
                                      f"(exit code {p.exitcode}); the engine cannot continue")
        try:
            dist.broadcast_object_list([msg], src=0)
        except RuntimeError as e:
            raise WorkerDiedError(f"tensor-parallel worker lost: {e}") from e

    def execute(self, out, logit_rows, *, constrained=None, ids=False):
        """ModelRunner.execute; always logits (constrained, ids: as there, not used)."""
        input_ids, positions, md = self.prepare(out)
        self._send(("step", input_ids.cpu(), positions.cpu(), _to(md, torch.device("cpu"))))
        md = _to(md, self.device)
        try:
            return self.forward(input_ids, positions, md, logit_rows, keep_hidden=any(
                s.pooling is not None for s in out.seqs))
        except RuntimeError as e:
            raise WorkerDiedError(f"tensor-parallel step failed: {e}") from e

    def copy_blocks(self, copies) -> None:
        if copies:
            self._send(("copy", copies))
        super().copy_blocks(copies)

    def shutdown(self) -> None:
        stop_workers(self.procs)
