#!/usr/bin/env python3
"""A few-minute verdict on pagellm's GPU path, for one call on a borrowed GPU machine.

Sections, each on its own (one failing never hides the others; each one's figures and error
go into the JSON, which is rewritten after every section, so a timeout still leaves results):

  env         versions, device, SMs, TF32 flags
  models      tiny random Llama and Qwen2 (transformers configs, like tests/helpers.py), the
              reduced real model (.gpu/*.gguf -> an HF float32 folder with pagellm's loader),
              and a full-depth copy of it (its blocks repeated to 30 layers, bf16) for timings
  kernel      triton_paged.paged_attention at decode / verification / prefill shapes:
              max error against a float32 SDPA reference on the gathered K/V, CUDA-event
              median time, KV bytes read per second; peers: the single-kernel path (where the
              split-KV path exists), other block_n, and torch SDPA on contiguous K/V
  parity      greedy tokens of the whole engine, CPU float32 as reference, against: CUDA
              float32, CUDA float32 chunked prefill with block_size 4, the GGUF file itself on
              CUDA, HF transformers float32 on CUDA (each must be identical or diverge only at a
              near-tie of the reference: first divergence index and margin per prompt); CUDA
              bfloat16 and dtype auto as information
  features    on CUDA: seeded sampling (vs CPU), penalties, n > 1 / logprobs / min_tokens /
              stop / logit_bias, structured outputs (JSON schema, choice), speculative decoding
              (n-gram and early-exit draft: greedy output unchanged; sampled runs), prefix
              caching, forced preemption, chat
  latency     batch-1 ms/token (pagellm bf16: tiny, reduced real, full depth; HF generate peer)
  throughput  64 requests x 128 -> 128 tokens, output tok/s (pagellm; HF static batch peer)
  defaults    LLM(model) with every default on the GPU (dtype auto, KV from free memory)

    python tools/gpu_check.py [--out DIR] [--budget-s S] [--only a,b] [--cpu-dry-run]

--cpu-dry-run runs the same code paths on the CPU (the Triton kernel under its interpreter)
with tiny sizes: a check that this script has no bugs, on a machine without a GPU.
"""
from __future__ import annotations

import argparse
import copy
import gc
import glob
import inspect
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
import traceback
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SECTION_NAMES = ("env", "models", "kernel", "parity", "features", "latency", "throughput",
                 "defaults")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="no GPU: the same code paths on the CPU with tiny sizes")
    p.add_argument("--out", default=None, help="results folder (default: $OUT, else ./gpu_out)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="sections that would start later than this are skipped "
                        "(default 230 on a GPU, 240 in a dry run)")
    p.add_argument("--only", default="", help=f"comma-separated sections from {SECTION_NAMES}")
    p.add_argument("--model", default=None, help="reduced GGUF (default: the one in .gpu/)")
    p.add_argument("--deep-layers", type=int, default=None,
                   help="layers of the full-depth timing copy (default 30; dry run 5)")
    args = p.parse_args(argv)
    args.out = args.out or os.environ.get("OUT") or os.path.join(os.getcwd(), "gpu_out")
    if args.budget_s is None:
        args.budget_s = 240.0 if args.cpu_dry_run else 230.0
    if args.deep_layers is None:
        args.deep_layers = 5 if args.cpu_dry_run else 30
    args.only = [s for s in args.only.split(",") if s]
    bad = set(args.only) - set(SECTION_NAMES)
    if bad:
        p.error(f"--only: unknown sections {sorted(bad)}")
    return args


ARGS = parse_args()
DRY = ARGS.cpu_dry_run
if DRY:  # the Triton kernels run under the interpreter on CPU tensors (set before decorating)
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

DEV = "cpu" if DRY else "cuda"
# Sizes: the GPU run fits a few minutes on an H200; the dry run a couple of minutes on 2 cores.
S = dict(
    parity_tokens=8 if DRY else 32,
    parity_long_repeats=2 if DRY else 12,
    feature_tokens=6 if DRY else 24,
    kernel_iters=1 if DRY else 50,
    kernel_warmup=0 if DRY else 5,
    lat_in=16 if DRY else 128,
    lat_out=6 if DRY else 64,
    lat_repeats=1 if DRY else 3,
    tp_requests=4 if DRY else 64,
    tp_in=16 if DRY else 128,
    tp_out=6 if DRY else 128,
    kv_small="64MiB" if DRY else "256MiB",
    kv_big="128MiB" if DRY else "8GiB",
)
NEED = dict(env=0, models=8, kernel=15, parity=25, features=20, latency=20, throughput=15,
            defaults=8)

RESULTS: dict = {"meta": {"dry_run": DRY, "device": DEV, "sizes": S, "argv": sys.argv[1:]},
                 "sections": {}, "verdict": {}}
T0 = time.monotonic()
MODELS: dict[str, dict] = {}
WORK = tempfile.mkdtemp(prefix="pagellm-gpu-check-")


# ---- plumbing ----------------------------------------------------------------------------
def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def left() -> float:
    return ARGS.budget_s - (time.monotonic() - T0)


def save() -> None:
    os.makedirs(ARGS.out, exist_ok=True)
    path = os.path.join(ARGS.out, "gpu_check.json")
    with open(path + ".tmp", "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def free() -> None:
    gc.collect()
    if DEV == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:2000]


def attempt(rec: dict, key: str, fn, *args, **kwargs):
    """rec[key] = fn(...) or {"error": ...}; returns the value or None."""
    t = time.monotonic()
    try:
        value = fn(*args, **kwargs)
        rec[key] = value
        return value
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        log(f"  {key}: FAILED {err(e)}")
        rec[key] = {"error": err(e), "traceback": traceback.format_exc()[-3000:]}
        return None
    finally:
        if isinstance(rec.get(key), dict):
            rec[key].setdefault("seconds", round(time.monotonic() - t, 2))
        free()


SECTIONS: list = []


def section(fn):
    SECTIONS.append((fn.__name__.removeprefix("sec_"), fn))
    return fn


def run_sections() -> None:
    no_gpu = False
    for name, fn in SECTIONS:
        if ARGS.only and name not in ARGS.only:
            continue
        rec = RESULTS["sections"][name] = {"status": "running"}
        if no_gpu:
            rec.update(status="skipped", reason="no CUDA device (see env)")
            continue
        if left() < NEED[name]:
            rec.update(status="skipped", reason=f"time budget: {left():.0f} s left, "
                                                f"~{NEED[name]} s needed")
            log(f"== {name}: skipped ({rec['reason']})")
            save()
            continue
        log(f"== {name}")
        t = time.monotonic()
        try:
            rec.update(fn(rec) or {})
            rec["status"] = "ok"
        except Exception as e:  # noqa: BLE001
            rec.update(status="error", error=err(e), traceback=traceback.format_exc()[-4000:])
            log(f"== {name}: ERROR {err(e)}")
        rec["seconds"] = round(time.monotonic() - t, 1)
        no_gpu = name == "env" and not DRY and not torch.cuda.is_available()
        free()
        save()


def bench(fn, iters: int, warmup: int) -> dict:
    """Median / min milliseconds of fn(): CUDA events around each call on the GPU."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    if DEV == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in events]
    else:
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "iters": iters}


def stub_llguidance(reason: str) -> None:
    """The engine imports llguidance at start (structured outputs). Where its wheel cannot load,
    a stub lets everything else run; structured-output checks then fail and say why."""
    mod = types.ModuleType("llguidance")
    mod.__stub_reason__ = reason

    class _Missing:
        def __init__(self, *a, **k):
            raise RuntimeError(f"llguidance is not available here: {reason}")

    mod.LLTokenizer = mod.LLExecutor = mod.LLMatcher = _Missing
    sub = types.ModuleType("llguidance.gbnf_to_lark")
    sub.GbnfToLarkError = RuntimeError
    sub.gbnf_to_lark = _Missing
    sys.modules["llguidance"] = mod
    sys.modules["llguidance.gbnf_to_lark"] = sub


try:
    import llguidance  # noqa: F401
except Exception as e:  # noqa: BLE001
    stub_llguidance(err(e))
    RESULTS["meta"]["llguidance_stub"] = err(e)


# ---- models ------------------------------------------------------------------------------
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
            eos_token_id=2, bos_token_id=1)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    low = 100 if vocab > 1000 else 3
    return torch.randint(low, vocab, (n, length), generator=g).tolist()


def make_tiny(arch: str) -> dict:
    import transformers

    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    kwargs = dict(TINY, **({"tie_word_embeddings": True} if arch == "qwen2" else {}))
    path = os.path.join(WORK, f"tiny-{arch}")
    torch.manual_seed(0)
    model_cls(cfg_cls(**kwargs)).eval().float().save_pretrained(path)
    long = [(7 * i) % 250 + 3 for i in range(60 if DRY else 150)]
    prompts = [[5, 17, 33, 4, 90, 12, 7], [3, 3, 3], list(range(10, 51)),
               [200, 100, 50, 25, 12, 6, 3, 1, 9, 8, 7, 6, 5], long]
    return {"path": path, "vocab": 256, "prompts": prompts, "tokenizer": False, "arch": arch}


def find_gguf() -> str:
    if ARGS.model:
        return os.path.abspath(ARGS.model)
    found = sorted(glob.glob(os.path.join(ROOT, ".gpu", "*.gguf")))
    if not found:
        raise FileNotFoundError("no .gpu/*.gguf: run tools/gpu_prepare.sh first and carry .gpu")
    return found[0]


def make_smol(rec: dict) -> None:
    """The reduced real model as HF folders: float32 (parity; what HF and pagellm both load) and
    a full-depth bf16 copy with the blocks repeated (timings at the real model's shape)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from pagellm.models.loader import load_model_files

    gguf_path = find_gguf()
    rec["gguf"] = {"path": gguf_path, "mib": round(os.path.getsize(gguf_path) / 2**20, 1)}
    try:
        files = load_model_files(gguf_path)
        tok, rec["tokenizer_from"] = files.tokenizer, "gguf (transformers' conversion)"
    except Exception as e:  # noqa: BLE001
        log(f"  GGUF tokenizer conversion failed ({err(e)}); using .gpu/tokenizer.tar.gz")
        files = load_model_files(gguf_path, load_tokenizer=False)
        with tarfile.open(os.path.join(os.path.dirname(gguf_path), "tokenizer.tar.gz")) as tar:
            tar.extractall(WORK)
        tok = AutoTokenizer.from_pretrained(os.path.join(WORK, "tokenizer"))
        rec["tokenizer_from"] = f"tokenizer.tar.gz (gguf conversion failed: {err(e)})"
    cfg = files.config
    state = {name: t.float().contiguous() for name, t in files.weights()}
    folder = os.path.join(WORK, "smol")
    os.makedirs(folder, exist_ok=True)
    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(folder)
    tok.save_pretrained(folder)
    n_layers = cfg.num_hidden_layers
    texts = ["The capital of France is", "def fibonacci(n):\n    ",
             "Once upon a time, in a small village by the sea,", "Water boils at a temperature of"]
    long = " ".join(["The quick brown fox jumps over the lazy dog while the farmer watches "
                     "from the porch of his old wooden house."] * S["parity_long_repeats"])
    prompts = [tok.encode(t) for t in texts + [long]]
    MODELS["smol"] = {"path": folder, "vocab": cfg.vocab_size, "prompts": prompts,
                      "tokenizer": True, "gguf": gguf_path, "layers": n_layers}
    rec["smol"] = {"layers": n_layers, "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads,
                   "kv_heads": cfg.num_key_value_heads, "vocab": cfg.vocab_size,
                   "prompt_lens": [len(p) for p in prompts],
                   "params_m": round(sum(t.numel() for t in state.values()) / 1e6, 1)}

    deep = {}
    for name, t in state.items():
        if name.startswith("model.layers."):
            i, rest = name.split(".", 3)[2:]
            for j in range(int(i), ARGS.deep_layers, n_layers):
                deep[f"model.layers.{j}.{rest}"] = t.to(torch.bfloat16)
        else:
            deep[name] = t.to(torch.bfloat16)
    dfolder = os.path.join(WORK, "smol-deep")
    os.makedirs(dfolder, exist_ok=True)
    save_file(deep, os.path.join(dfolder, "model.safetensors"), metadata={"format": "pt"})
    dcfg = copy.deepcopy(cfg)
    dcfg.num_hidden_layers = ARGS.deep_layers
    dcfg.save_pretrained(dfolder)
    tok.save_pretrained(dfolder)
    MODELS["smol-deep"] = {"path": dfolder, "vocab": cfg.vocab_size, "prompts": prompts,
                           "tokenizer": True, "layers": ARGS.deep_layers}
    rec["smol-deep"] = {"layers": ARGS.deep_layers, "note": f"blocks 0..{n_layers - 1} repeated",
                        "params_m": round(sum(t.numel() for t in deep.values()) / 1e6, 1)}


# ---- engine helpers -----------------------------------------------------------------------
class torch_attention:
    """Build models with the PyTorch attention backend whatever the device (registry's
    get_attention_backend patched): the engine on CUDA without the Triton kernels, which tells
    a kernel bug from the rest of the GPU path."""

    def __enter__(self):
        from pagellm.attention.torch_paged import TorchPagedAttention
        from pagellm.models import registry

        self.registry, self.saved = registry, registry.get_attention_backend
        registry.get_attention_backend = lambda device: TorchPagedAttention()

    def __exit__(self, *exc):
        self.registry.get_attention_backend = self.saved


def with_torch_attention(fn, *args, **kwargs):
    with torch_attention():
        return fn(*args, **kwargs)


def make_llm(path: str, device: str, dtype: str, reference: bool = False, **kw):
    """An engine; kv_cache_memory small unless given. The engines under test get the GPU
    defaults otherwise (warm-up auto: on with CUDA); in a dry run they are told warmup=True,
    so the warm-up and profiling forwards run on the CPU too (where auto is off)."""
    from pagellm import LLM

    kw.setdefault("kv_cache_memory", S["kv_small"])
    if DRY and not reference and "warmup" in inspect.signature(LLM).parameters:
        kw.setdefault("warmup", True)
        # the warm-up runs max_num_seqs sequences and profiles a max_num_batched_tokens step:
        # cheap on a GPU, not on 2 CPU cores
        kw.setdefault("max_num_seqs", 8)
        kw.setdefault("max_num_batched_tokens", 256)
    return LLM(path, device=device, dtype=dtype, seed=0, **kw)


def greedy(path: str, device: str, dtype: str, prompts, n: int, logprobs: int | None = 2,
           **kw) -> dict:
    from pagellm import SamplingParams

    t = time.perf_counter()
    llm = make_llm(path, device, dtype, **kw)
    load_s = time.perf_counter() - t
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=logprobs)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    gen_s = time.perf_counter() - t
    res = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
           "logprobs": ([[dict(d) for d in o.outputs[0].logprobs] for o in outs]
                        if logprobs is not None else None),
           "load_s": load_s, "gen_s": gen_s, "engine_dtype": str(llm.engine.dtype),
           "kv_dtype": str(getattr(llm.engine, "kv_dtype", "?")),
           "warmup": getattr(llm.engine, "warmup", None),
           "preemptions": llm.engine.scheduler.num_preemptions}
    llm.shutdown()
    del llm
    free()
    return res


def hf_load(path: str, device: str, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # ignore_eos, as the engine runs
    model.generation_config.pad_token_id = 0
    return model


def hf_generate(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                              max_new_tokens=n, min_new_tokens=n, do_sample=False)


def hf_greedy(path: str, device: str, dtype, prompts, n: int) -> dict:
    model = hf_load(path, device, dtype)
    toks = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        toks.append(hf_generate(model, ids, n)[0, len(p):].tolist())
    del model
    free()
    return {"tokens": toks, "logprobs": None}


def compare(ref: dict, got: dict, tie: float, lp_tol: float) -> dict:
    """Per prompt: the first index where the tokens differ, the reference's margin there
    (logprob of its token minus the runner-up's: a near-tie when below `tie`), and the largest
    logprob difference of the chosen tokens before it."""
    rows = []
    for p, (rt, gt) in enumerate(zip(ref["tokens"], got["tokens"])):
        div = next((i for i, (a, b) in enumerate(zip(rt, gt)) if a != b), None)
        if div is None and len(rt) != len(gt):
            div = min(len(rt), len(gt))
        upto = len(rt) if div is None else div
        lp_diff = None
        if ref.get("logprobs") and got.get("logprobs"):
            diffs = [abs(ref["logprobs"][p][i][rt[i]] - got["logprobs"][p][i][rt[i]])
                     for i in range(upto) if rt[i] in got["logprobs"][p][i]]
            lp_diff = max(diffs, default=0.0)
        kind, margin = "identical", None
        if div is not None:
            kind = "MISMATCH"
            if ref.get("logprobs") and div < len(ref["logprobs"][p]):
                lp = ref["logprobs"][p][div]
                others = [v for t, v in lp.items() if t != rt[div]]
                if others:
                    margin = lp[rt[div]] - max(others)
                    if margin < tie:
                        kind = "near-tie"
        if kind != "MISMATCH" and lp_diff is not None and lp_diff > lp_tol:
            kind = "LOGPROB-DRIFT"
        rows.append({"prompt": p, "tokens": len(rt), "first_divergence": div, "kind": kind,
                     "ref_margin_at_divergence": margin, "max_logprob_diff_before": lp_diff})
    kinds = {r["kind"] for r in rows}
    status = ("identical" if kinds == {"identical"} else
              "near-ties only" if kinds <= {"identical", "near-tie"} else "FAIL")
    return {"status": status, "per_prompt": rows}


# ---- sections ----------------------------------------------------------------------------
@section
def sec_env(rec):
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "cuda_available": torch.cuda.is_available(),
            "torch_cuda": torch.version.cuda}
    for mod in ("triton", "gguf", "llguidance", "numpy", "safetensors", "tokenizers"):
        try:
            m = __import__(mod)
            info[mod] = getattr(m, "__version__", None) or getattr(m, "__stub_reason__", "?")
        except Exception as e:  # noqa: BLE001
            info[mod] = f"missing: {err(e)}"
    try:
        from pagellm.kernels import native

        info["pagellm_native_kernels"] = native.available()
        info["cpu_bf16_units"] = native.cpu_has_bf16_units()
    except Exception as e:  # noqa: BLE001
        info["pagellm_native_kernels"] = f"error: {err(e)}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    sms=props.multi_processor_count, gpu_mem_gib=round(props.total_memory / 2**30, 1),
                    matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
                    cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
                    float32_matmul_precision=torch.get_float32_matmul_precision())
    elif not DRY:
        raise RuntimeError("CUDA is not available (run with --cpu-dry-run on a CPU machine)")
    try:
        from pagellm.attention import triton_paged

        info["paged_attention_params"] = list(inspect.signature(triton_paged.paged_attention).parameters)
    except Exception as e:  # noqa: BLE001
        info["triton_paged_import"] = err(e)
    log("  " + ", ".join(f"{k}={v}" for k, v in info.items()))
    return info


@section
def sec_models(rec):
    for arch in ("llama", "qwen2"):
        MODELS[f"tiny-{arch}"] = make_tiny(arch)
    make_smol(rec)
    log(f"  models: {', '.join(MODELS)}")
    return {"models": {k: {kk: vv for kk, vv in v.items() if kk != "prompts"}
                       for k, v in MODELS.items()}}


def kernel_cases():
    bf = torch.float16 if DRY else torch.bfloat16  # the interpreter has no bf16 tl.dot
    if DRY:
        return [("decode 2x40 kv2 g2 d16", 2, 40, 1, 2, 2, 16, bf),
                ("decode 1x600 kv1 g2 d16 (split-KV range)", 1, 600, 1, 1, 2, 16, bf),
                ("verify 2x40 q3 kv2 g3 d16", 2, 40, 3, 2, 3, 16, bf),
                ("prefill 1x32 kv1 g2 d16", 1, 32, 32, 1, 2, 16, bf),
                ("decode 2x40 float32", 2, 40, 1, 2, 2, 16, torch.float32)]
    return [("decode 64x2048 llama8b (32q/8kv/128)", 64, 2048, 1, 8, 4, 128, bf),
            ("decode 1x32768 llama8b", 1, 32768, 1, 8, 4, 128, bf),
            ("decode 64x2048 qwen1.5b (12q/2kv/128)", 64, 2048, 1, 2, 6, 128, bf),
            ("decode 32x8192 smollm2 (9q/3kv/64)", 32, 8192, 1, 3, 3, 64, bf),
            ("verify 64x2048 q5 llama8b", 64, 2048, 5, 8, 4, 128, bf),
            ("prefill 1x2048 llama8b (q = ctx)", 1, 2048, 2048, 8, 4, 128, bf),
            ("decode 64x2048 llama8b float32", 64, 2048, 1, 8, 4, 128, torch.float32)]


@section
def sec_kernel(rec):
    import torch.nn.functional as F

    from pagellm.attention import triton_paged
    from pagellm.attention.base import AttentionMetadata

    params = inspect.signature(triton_paged.paged_attention).parameters
    has_splits = "num_splits" in params
    cases = {}
    for ci, (name, nseq, ctx, qlen, kvh, group, hd, dtype) in enumerate(kernel_cases()):
        if left() < 5:
            cases[name] = {"skipped": "time budget"}
            continue
        c = cases[name] = {"num_seqs": nseq, "ctx": ctx, "qlen": qlen, "kv_heads": kvh,
                           "group": group, "head_dim": hd, "dtype": str(dtype)}
        log(f"  kernel: {name}")
        try:
            bs = 16
            per = -(-ctx // bs)
            g = torch.Generator().manual_seed(0)
            nblocks = nseq * per + 1  # block 0 holds junk nobody may read
            tables = (torch.randperm(nblocks - 1, generator=g) + 1)[: nseq * per].view(nseq, per)
            k_cache = torch.randn(nblocks, bs, kvh, hd, device=DEV, dtype=dtype)
            v_cache = torch.randn(nblocks, bs, kvh, hd, device=DEV, dtype=dtype)
            q = torch.randn(nseq * qlen, kvh * group, hd, device=DEV, dtype=dtype)
            md = AttentionMetadata(
                slot_mapping=torch.zeros(nseq * qlen, dtype=torch.long, device=DEV),
                query_start_loc=(torch.arange(nseq + 1) * qlen).to(torch.int32).to(DEV),
                seq_lens=torch.full((nseq,), ctx, dtype=torch.int32, device=DEV),
                block_tables=tables.to(torch.int32).to(DEV),
                query_lens_cpu=[qlen] * nseq, seq_lens_cpu=[ctx] * nseq)
            scale = hd ** -0.5
            out = torch.empty_like(q)
            if has_splits:
                try:
                    c["auto_num_splits"] = triton_paged.choose_num_splits(
                        nseq, kvh, group, qlen, ctx, triton_paged._num_sms(q.device))
                except Exception as ex:  # noqa: BLE001 - informational only
                    c["auto_num_splits"] = err(ex)

            # reference: float32 SDPA over the gathered K/V
            idx = tables.to(DEV)
            kg = k_cache[idx].reshape(nseq, per * bs, kvh, hd)[:, :ctx].float()
            vg = v_cache[idx].reshape(nseq, per * bs, kvh, hd)[:, :ctx].float()
            q4 = q.float().view(nseq, qlen, kvh * group, hd).transpose(1, 2)
            k4 = kg.transpose(1, 2).repeat_interleave(group, dim=1)
            v4 = vg.transpose(1, 2).repeat_interleave(group, dim=1)
            mask = None
            if qlen > 1:
                qpos = torch.arange(ctx - qlen, ctx, device=DEV)[:, None]
                mask = torch.arange(ctx, device=DEV)[None, :] <= qpos
            ref = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale)
            ref = ref.transpose(1, 2).reshape(nseq * qlen, kvh * group, hd)
            del kg, vg, k4, v4, q4

            kv_bytes = 2 * nseq * ctx * kvh * hd * k_cache.element_size()
            tol = 2e-3 if dtype == torch.float32 else 3e-2
            variants = {"pagellm": {}}
            if has_splits:
                variants["single kernel (num_splits=0)"] = {"num_splits": 0}
            if ci < 2:  # tile size: on the two first shapes only (each variant compiles)
                variants["block_n=64"] = {"block_n": 64}
                if not DRY:
                    variants["block_n=16"] = {"block_n": 16}
            for vname, kw in variants.items():
                v = c.setdefault("variants", {})[vname] = {}
                try:
                    out.fill_(float("nan"))
                    triton_paged.paged_attention(q, k_cache, v_cache, md, scale, out, **kw)
                    sync()
                    e = (out.float() - ref).abs().max().item()
                    v["max_abs_err"] = e
                    v["ok"] = bool(e < tol)  # (NaN fails)
                    t = bench(lambda: triton_paged.paged_attention(q, k_cache, v_cache, md, scale,
                                                                   out, **kw),
                              S["kernel_iters"], S["kernel_warmup"])
                    v.update(t)
                    v["kv_gb_per_s"] = kv_bytes / (t["median_ms"] / 1e3) / 1e9
                except Exception as ex:  # noqa: BLE001
                    v["error"] = err(ex)
                    log(f"    {vname}: FAILED {err(ex)}")
            # peer: SDPA on contiguous K/V (what a non-paged engine would run)
            try:
                kc = k_cache[idx].reshape(nseq, per * bs, kvh, hd)[:, :ctx].transpose(1, 2).contiguous()
                vc = v_cache[idx].reshape(nseq, per * bs, kvh, hd)[:, :ctx].transpose(1, 2).contiguous()
                qc = q.view(nseq, qlen, kvh * group, hd).transpose(1, 2).contiguous()
                if qlen == ctx:
                    sdpa = lambda: F.scaled_dot_product_attention(qc, kc, vc, is_causal=True,  # noqa: E731
                                                                  scale=scale, enable_gqa=True)
                else:
                    sdpa = lambda: F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask,  # noqa: E731
                                                                  scale=scale, enable_gqa=True)
                t = bench(sdpa, S["kernel_iters"], S["kernel_warmup"])
                t["kv_gb_per_s"] = kv_bytes / (t["median_ms"] / 1e3) / 1e9
                c["variants"]["torch sdpa, contiguous KV (peer)"] = t
                del kc, vc, qc
            except Exception as ex:  # noqa: BLE001
                c["variants"]["torch sdpa, contiguous KV (peer)"] = {"error": err(ex)}
            c["kv_mib"] = round(kv_bytes / 2**20, 1)
            for vname, v in c["variants"].items():
                if "median_ms" in v:
                    log(f"    {vname:34s} {v['median_ms'] * 1e3:9.1f} us  "
                        f"{v['kv_gb_per_s']:7.1f} GB/s  err {v.get('max_abs_err', '-')}")
            del k_cache, v_cache, q, out, ref
        except Exception as ex:  # noqa: BLE001
            c["error"] = err(ex)
            c["traceback"] = traceback.format_exc()[-3000:]
            log(f"    FAILED {err(ex)}")
        free()
    bad = [n for n, c in cases.items()
           if "error" in c or any(v.get("ok") is False or ("error" in v and "sdpa" not in k)
                                  for k, v in c.get("variants", {}).items())]
    return {"cases": cases, "has_split_kv": has_splits, "failures": bad}


@section
def sec_parity(rec):
    n = S["parity_tokens"]
    results = {}
    for mname in ("tiny-llama", "tiny-qwen2", "smol"):
        if mname not in MODELS:
            results[mname] = {"error": "model not built (see models)"}
            continue
        if left() < 10:
            results[mname] = {"skipped": "time budget"}
            continue
        m = MODELS[mname]
        r = results[mname] = {}
        log(f"  parity: {mname}")
        ref = attempt(r, "ref_cpu_float32", greedy, m["path"], "cpu", "float32", m["prompts"], n,
                      reference=True)
        if ref is None or "error" in ref:
            continue
        runs = {
            "cuda_float32": (lambda: greedy(m["path"], DEV, "float32", m["prompts"], n), 1e-3, 1e-3),
            "cuda_float32_chunked_bs4": (lambda: greedy(m["path"], DEV, "float32", m["prompts"], n,
                                                        block_size=4, max_num_batched_tokens=48),
                                         1e-3, 1e-3),
            "cuda_float32_torch_attention": (
                lambda: with_torch_attention(greedy, m["path"], DEV, "float32", m["prompts"], n),
                1e-3, 1e-3),
            "hf_float32_cuda": (lambda: hf_greedy(m["path"], DEV, torch.float32, m["prompts"], n),
                                1e-3, 1e-3),
            "cuda_bfloat16 (info)": (lambda: greedy(m["path"], DEV, "bfloat16", m["prompts"], n),
                                     0.1, 0.1),
        }
        if mname == "smol":
            runs["gguf_file_cuda_float32"] = (
                lambda: greedy(m["gguf"], DEV, "float32", m["prompts"], n), 1e-3, 1e-3)
            runs["gguf_file_cuda_auto (info)"] = (
                lambda: greedy(m["gguf"], DEV, "auto", m["prompts"], n), 0.1, 0.1)
        for key, (fn, tie, lp_tol) in runs.items():
            got = attempt(r, key, fn)
            if got is None or "error" in got:
                continue
            cmp = compare(ref, got, tie, lp_tol)
            cmp.update({k: got[k] for k in ("load_s", "gen_s", "engine_dtype", "kv_dtype",
                                             "warmup") if k in got})
            r[key] = cmp
            firsts = [row["first_divergence"] for row in cmp["per_prompt"]]
            log(f"    {key:32s} {cmp['status']:15s} first divergence per prompt {firsts}")
        ref_summary = {k: ref[k] for k in ("load_s", "gen_s", "engine_dtype", "kv_dtype")}
        ref_summary["tokens_prompt0"] = ref["tokens"][0]
        r["ref_cpu_float32"] = ref_summary
    fails = [f"{m}/{k}" for m, r in results.items() for k, v in r.items()
             if isinstance(v, dict) and "(info)" not in k
             and (v.get("status") == "FAIL" or "error" in v)]
    return {"models": results, "failures": fails}


@section
def sec_features(rec):
    from pagellm import SamplingParams
    from pagellm.sampling_params import StructuredOutputsParams

    if "smol" not in MODELS:
        raise RuntimeError("reduced real model not built (see models)")
    m = MODELS["smol"]
    path, prompts, n = m["path"], m["prompts"], S["feature_tokens"]
    checks: dict = {}

    def run(llm, ps, sp):
        return llm.generate(ps, sp, use_tqdm=False)

    def toks(outs):
        return [list(o.outputs[0].token_ids) for o in outs]

    cpu = make_llm(path, "cpu", "float32", reference=True)
    dev = make_llm(path, DEV, "float32")
    base_greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    dev_greedy = toks(run(dev, prompts, base_greedy))

    def seeded_sampling():
        sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1, max_tokens=n,
                            ignore_eos=True)
        a, b = toks(run(cpu, prompts[:3], sp)), toks(run(dev, prompts[:3], sp))
        return {"same_as_cpu": a == b, "matching_prompts": sum(x == y for x, y in zip(a, b)),
                "note": "CPU generators: the same draws on both devices; logits differ in the "
                        "last bits, so a rare near-tie may differ", "ok": True}

    def penalties():
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, repetition_penalty=1.3,
                            presence_penalty=0.5, frequency_penalty=0.5)
        a, b = toks(run(cpu, prompts, sp)), toks(run(dev, prompts, sp))
        return {"same_as_cpu": a == b, "ok": True,
                "differs_from_plain_greedy": b != dev_greedy}

    def many_options():
        sp = SamplingParams(n=3, temperature=0.9, seed=3, max_tokens=n, logprobs=3, min_tokens=4,
                            stop=["\n\n"], logit_bias={prompts[0][0]: 2.0})
        outs = run(dev, prompts[:2], sp)
        counts = [len(o.outputs) for o in outs]
        lens = [[len(c.token_ids) for c in o.outputs] for o in outs]
        ok = counts == [3, 3] and all(x >= 4 for ls in lens for x in ls) and all(
            c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
            for o in outs for c in o.outputs)
        return {"ok": ok, "outputs_per_request": counts, "lengths": lens}

    def structured_json():
        schema = {"type": "object", "properties": {"name": {"type": "string"},
                                                   "age": {"type": "integer"}},
                  "required": ["name", "age"], "additionalProperties": False}
        sp = SamplingParams(temperature=0, max_tokens=96 if not DRY else 24,
                            structured_outputs=StructuredOutputsParams(json=schema))
        o = run(dev, ["Alice is 30 years old. As JSON:"], sp)[0].outputs[0]
        parsed = None
        if o.finish_reason == "stop":
            parsed = json.loads(o.text)
        return {"ok": o.finish_reason in ("stop", "length"), "finish_reason": o.finish_reason,
                "text": o.text[:200], "parsed": parsed}

    def structured_choice():
        sp = SamplingParams(temperature=0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
        o = run(dev, ["Is water wet? Answer:"], sp)[0].outputs[0]
        return {"ok": o.text in ("yes", "no"), "text": o.text}

    def prefix_cache():
        long = prompts[-1]
        a = run(dev, [long], base_greedy)[0]
        b = run(dev, [long], base_greedy)[0]
        return {"ok": list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
                and b.num_cached_tokens > 0, "cached_tokens_second": b.num_cached_tokens,
                "prompt_len": len(long)}

    def chat():
        o = dev.chat([{"role": "user", "content": "Name three colors."}],
                     SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
        return {"ok": True, "text": o.text, "finish_reason": o.finish_reason}

    for name, fn in [("seeded_sampling_vs_cpu", seeded_sampling), ("penalties_vs_cpu", penalties),
                     ("n3_logprobs_min_tokens_stop_logit_bias", many_options),
                     ("structured_json_schema", structured_json),
                     ("structured_choice", structured_choice), ("prefix_cache", prefix_cache),
                     ("chat", chat)]:
        attempt(checks, name, fn)
    del cpu, dev
    free()

    def spec(config, sampled=False):
        llm = make_llm(path, DEV, "float32", speculative_config=config)
        if sampled:
            sp = SamplingParams(temperature=0.7, seed=5, max_tokens=n, ignore_eos=True)
            outs = run(llm, prompts, sp)
            res = {"ok": all(len(o.outputs[0].token_ids) == n for o in outs)}
        else:
            got = toks(run(llm, prompts, base_greedy))
            res = {"ok": got == dev_greedy, "same_as_no_spec": got == dev_greedy,
                   "matching_prompts": sum(x == y for x, y in zip(got, dev_greedy))}
        st = llm.engine.spec_stats
        res.update(drafts=st.num_drafts, draft_tokens=st.num_draft_tokens,
                   accepted=st.num_accepted_tokens)
        if not st.num_draft_tokens:  # nothing was verified: the check proved nothing
            res["ok"] = False
            res["why"] = "no proposals were made"
        llm.shutdown()
        return res

    # adaptive off: proposals at every step (the controller may otherwise switch them off)
    attempt(checks, "spec_ngram_greedy_unchanged", spec,
            {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    attempt(checks, "spec_ngram_sampled", spec,
            {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}, True)
    attempt(checks, "spec_early_exit_draft_greedy_unchanged", spec,
            {"method": "draft_model", "draft_num_layers": 2, "num_speculative_tokens": 3,
             "adaptive": False})
    attempt(checks, "spec_early_exit_draft_sampled", spec,
            {"method": "draft_model", "draft_num_layers": 2, "num_speculative_tokens": 3,
             "adaptive": False}, True)

    def preemption():
        from pagellm.engine.model_runner import kv_bytes_per_block
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(path)
        per_block = kv_bytes_per_block(cfg, 4, torch.float32)
        # every prompt fits at admission, but not the outputs that follow: running sequences
        # must be preempted (and the longest one still fits alone)
        blocks = max(sum(-(-len(p) // 4) for p in prompts) + 1,
                     -(-(max(len(p) for p in prompts) + n) // 4) + 1)
        llm = make_llm(path, DEV, "float32", block_size=4, kv_cache_memory=per_block * blocks)
        got = toks(run(llm, prompts, base_greedy))
        pre = llm.engine.scheduler.num_preemptions
        return {"ok": got == dev_greedy and pre > 0, "same_as_unpreempted": got == dev_greedy,
                "preemptions": pre, "blocks": blocks}

    attempt(checks, "preemption", preemption)
    fails = [k for k, v in checks.items() if not isinstance(v, dict) or "error" in v
             or v.get("ok") is False]
    for k, v in checks.items():
        log(f"  {k:42s} {'ok' if k not in fails else 'FAIL'}"
            + (f"  {v.get('error', '')[:150]}" if isinstance(v, dict) and "error" in v else ""))
    return {"checks": checks, "failures": fails}


def pagellm_latency(path: str, vocab: int) -> dict:
    from pagellm import SamplingParams

    llm = make_llm(path, DEV, "bfloat16", kv_cache_memory=S["kv_small"], max_num_seqs=8,
                   enable_prefix_caching=False)
    ps = random_prompts(2 * S["lat_repeats"] + 1, S["lat_in"], vocab, seed=1)
    out_n = S["lat_out"]

    def gen(p, k):
        sp = SamplingParams(temperature=0, max_tokens=k, ignore_eos=True)
        sync()
        t = time.perf_counter()
        o = llm.generate([p], sp, use_tqdm=False)[0]
        sync()
        return time.perf_counter() - t, o

    gen(ps[-1], 8)  # warm-up (kernel compiles)
    walls, tpots, ttfts = [], [], []
    for r in range(S["lat_repeats"]):
        t1, _ = gen(ps[2 * r], 1)
        tn, o = gen(ps[2 * r + 1], out_n)
        walls.append((tn - t1) / (out_n - 1))
        tpots.append(o.metrics.time_per_output_token)
        ttfts.append(o.metrics.time_to_first_token)
    res = {"ms_per_token": statistics.median(walls) * 1e3,
           "ms_per_token_metrics": statistics.median(tpots) * 1e3,
           "ttft_ms": statistics.median(ttfts) * 1e3,
           "runs_ms_per_token": [w * 1e3 for w in walls]}
    llm.shutdown()
    return res


def hf_latency(path: str, vocab: int) -> dict:
    model = hf_load(path, DEV, torch.bfloat16)
    ps = random_prompts(2 * S["lat_repeats"] + 1, S["lat_in"], vocab, seed=1)
    out_n = S["lat_out"]

    def gen(p, k):
        ids = torch.tensor([p], device=DEV)
        sync()
        t = time.perf_counter()
        hf_generate(model, ids, k)
        sync()
        return time.perf_counter() - t

    gen(ps[-1], 8)
    walls = []
    for r in range(S["lat_repeats"]):
        t1 = gen(ps[2 * r], 1)
        tn = gen(ps[2 * r + 1], out_n)
        walls.append((tn - t1) / (out_n - 1))
    del model
    return {"ms_per_token": statistics.median(walls) * 1e3,
            "runs_ms_per_token": [w * 1e3 for w in walls]}


@section
def sec_latency(rec):
    rows = {}
    for mname in ("tiny-llama", "smol", "smol-deep"):
        if mname not in MODELS:
            continue
        if left() < 8:
            rows[mname] = {"skipped": "time budget"}
            continue
        m = MODELS[mname]
        r = rows[mname] = {}
        log(f"  latency: {mname}")
        p = attempt(r, "pagellm_bf16", pagellm_latency, m["path"], m["vocab"])
        h = attempt(r, "hf_bf16", hf_latency, m["path"], m["vocab"])
        if p and h and "ms_per_token" in p and "ms_per_token" in h:
            r["pagellm_speedup_vs_hf"] = h["ms_per_token"] / p["ms_per_token"]
        log(f"    pagellm {p.get('ms_per_token', float('nan')) if p else float('nan'):.2f} ms/token"
            f" | hf {h.get('ms_per_token', float('nan')) if h else float('nan'):.2f} ms/token")
    return {"input_len": S["lat_in"], "output_len": S["lat_out"], "models": rows}


def pagellm_throughput(path: str, vocab: int) -> dict:
    from pagellm import SamplingParams

    llm = make_llm(path, DEV, "bfloat16", kv_cache_memory=S["kv_big"], max_num_seqs=128,
                   enable_prefix_caching=False)
    ps = random_prompts(S["tp_requests"], S["tp_in"], vocab, seed=2)
    # warm-up at the same batch shapes (kernel variants compile on first use; no prefix cache)
    llm.generate(random_prompts(S["tp_requests"], S["tp_in"], vocab, seed=3),
                 SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    sp = SamplingParams(temperature=0, max_tokens=S["tp_out"], ignore_eos=True)
    sync()
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    outs = llm.generate(ps, sp, use_tqdm=False)
    sync()
    wall = time.perf_counter() - t
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    res = {"output_tok_per_s": out_tokens / wall, "wall_s": wall, "output_tokens": out_tokens,
           "ttft_median_ms": statistics.median(o.metrics.time_to_first_token for o in outs) * 1e3,
           "preemptions": llm.engine.scheduler.num_preemptions}
    if DEV == "cuda":
        res["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    # the same requests sampled (temperature, top-p): the draws come from CPU generators and
    # travel to the GPU, a vocab-sized tensor per row and step; does that cost show?
    sp = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=S["tp_out"], ignore_eos=True)
    sync()
    t = time.perf_counter()
    outs = llm.generate(ps, sp, use_tqdm=False)
    sync()
    wall = time.perf_counter() - t
    res["sampled_output_tok_per_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / wall
    llm.shutdown()
    return res


def hf_throughput(path: str, vocab: int) -> dict:
    model = hf_load(path, DEV, torch.bfloat16)
    ids = torch.tensor(random_prompts(S["tp_requests"], S["tp_in"], vocab, seed=2), device=DEV)
    hf_generate(model, ids, 4)
    sync()
    t = time.perf_counter()
    out = hf_generate(model, ids, S["tp_out"])
    sync()
    wall = time.perf_counter() - t
    n = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    del model
    return {"output_tok_per_s": n / wall, "wall_s": wall, "output_tokens": n,
            "note": "one static batch"}


@section
def sec_throughput(rec):
    rows = {}
    for mname in ("smol", "smol-deep"):
        if mname not in MODELS:
            continue
        if left() < 8:
            rows[mname] = {"skipped": "time budget"}
            continue
        m = MODELS[mname]
        r = rows[mname] = {}
        log(f"  throughput: {mname}")
        p = attempt(r, "pagellm_bf16", pagellm_throughput, m["path"], m["vocab"])
        h = attempt(r, "hf_bf16_static_batch", hf_throughput, m["path"], m["vocab"])
        if p and h and "output_tok_per_s" in p and "output_tok_per_s" in h:
            r["pagellm_vs_hf"] = p["output_tok_per_s"] / h["output_tok_per_s"]
        log(f"    pagellm {p.get('output_tok_per_s', float('nan')) if p else float('nan'):.0f} tok/s"
            f" (sampled {p.get('sampled_output_tok_per_s', float('nan')) if p else float('nan'):.0f})"
            f" | hf {h.get('output_tok_per_s', float('nan')) if h else float('nan'):.0f} tok/s")
    return {"requests": S["tp_requests"], "input_len": S["tp_in"], "output_len": S["tp_out"],
            "models": rows}


@section
def sec_defaults(rec):
    """What `pagellm serve MODEL` does on a GPU: device auto, dtype auto, KV from free memory."""
    from pagellm import LLM, SamplingParams

    m = MODELS.get("smol")
    path = m["gguf"] if m else find_gguf()
    kw = {"kv_cache_memory": S["kv_small"], "device": "cpu"} if DRY else {}
    if DRY and "warmup" in inspect.signature(LLM).parameters:
        kw["warmup"] = True  # what auto does on a GPU
    t = time.perf_counter()
    llm = LLM(path, **kw)
    load_s = time.perf_counter() - t
    eng = llm.engine
    res = {"load_s": load_s, "device": str(eng.device), "dtype": str(eng.dtype),
           "kv_dtype": str(getattr(eng, "kv_dtype", "?")), "kv_blocks": eng.num_blocks,
           "warmup": getattr(eng, "warmup", None),
           "warmup_shapes": getattr(eng, "warmup_shapes", None),
           "memory_split_mib": {k: round(v / 2**20) for k, v in
                                getattr(eng, "memory_split", {}).items()}}
    if DEV == "cuda":
        res["gpu_mem_allocated_gib"] = torch.cuda.memory_allocated() / 2**30
        free_b, total_b = torch.cuda.mem_get_info()
        res["gpu_free_gib_after_load"] = free_b / 2**30
    t = time.perf_counter()
    o = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                 SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    res.update(chat_s=time.perf_counter() - t, text=o.text, finish_reason=o.finish_reason)
    llm.shutdown()
    del llm, eng
    log(f"  defaults: {res}")
    return res


# ---- verdict -----------------------------------------------------------------------------
def verdict() -> dict:
    sec = RESULTS["sections"]
    v: dict = {}
    for name, rec in sec.items():
        v[f"{name}_status"] = rec.get("status")
    k = sec.get("kernel", {})
    if k.get("status") == "ok":
        v["kernel_correct"] = not k.get("failures")
        v["kernel_failures"] = k.get("failures")
        figs = {}
        for cname, c in k.get("cases", {}).items():
            pv = c.get("variants", {}).get("pagellm", {})
            peer = c.get("variants", {}).get("torch sdpa, contiguous KV (peer)", {})
            if "median_ms" in pv:
                figs[cname] = {"us": round(pv["median_ms"] * 1e3, 1),
                               "GB/s": round(pv["kv_gb_per_s"], 1),
                               "sdpa_peer_us": round(peer["median_ms"] * 1e3, 1)
                               if "median_ms" in peer else None}
        v["kernel_figures"] = figs
    p = sec.get("parity", {})
    if p.get("status") == "ok":
        v["parity_float32_pass"] = not p.get("failures")
        v["parity_failures"] = p.get("failures")
        v["parity_status"] = {f"{m}/{k}": r.get("status") for m, rs in p.get("models", {}).items()
                              for k, r in rs.items() if isinstance(r, dict) and "status" in r}
    f = sec.get("features", {})
    if f.get("status") == "ok":
        v["features_pass"] = not f.get("failures")
        v["feature_failures"] = f.get("failures")
    lat = sec.get("latency", {}).get("models", {})
    v["batch1_ms_per_token"] = {m: {"pagellm": r.get("pagellm_bf16", {}).get("ms_per_token"),
                                    "hf": r.get("hf_bf16", {}).get("ms_per_token")}
                                for m, r in lat.items()}
    tp = sec.get("throughput", {}).get("models", {})
    v["throughput_tok_per_s"] = {
        m: {"pagellm": r.get("pagellm_bf16", {}).get("output_tok_per_s"),
            "pagellm_sampled": r.get("pagellm_bf16", {}).get("sampled_output_tok_per_s"),
            "hf_static": r.get("hf_bf16_static_batch", {}).get("output_tok_per_s")}
        for m, r in tp.items()}
    v["ok"] = all(rec.get("status") == "ok" for rec in sec.values()) and all(
        v.get(key, True) for key in ("kernel_correct", "parity_float32_pass", "features_pass"))
    return v


def summary_text(v: dict) -> str:
    lines = [f"pagellm GPU check ({'CPU DRY RUN' if DRY else DEV}) - overall: "
             f"{'PASS' if v['ok'] else 'FAIL / INCOMPLETE'}",
             "sections: " + ", ".join(f"{n}={r.get('status')}"
                                      for n, r in RESULTS["sections"].items())]
    env = RESULTS["sections"].get("env", {})
    lines.append(f"env: torch {env.get('torch')} triton {env.get('triton')} transformers "
                 f"{env.get('transformers')} gpu {env.get('gpu', '-')}")
    if "kernel_correct" in v:
        lines.append(f"kernel correct: {v['kernel_correct']} {v.get('kernel_failures') or ''}")
        for c, fig in v.get("kernel_figures", {}).items():
            lines.append(f"  {c:42s} {fig['us']:>9} us {fig['GB/s']:>8} GB/s   sdpa peer "
                         f"{fig['sdpa_peer_us']} us")
    if "parity_status" in v:
        lines.append(f"parity (float32 runs must be identical or near-ties): "
                     f"{'PASS' if v['parity_float32_pass'] else 'FAIL'} "
                     f"{v.get('parity_failures') or ''}")
        for k, s in v["parity_status"].items():
            lines.append(f"  {k:50s} {s}")
    if "features_pass" in v:
        lines.append(f"features: {'PASS' if v['features_pass'] else 'FAIL'} "
                     f"{v.get('feature_failures') or ''}")
    for m, r in v.get("batch1_ms_per_token", {}).items():
        lines.append(f"batch-1 ms/token {m:12s} pagellm {fmt(r['pagellm'])}  hf {fmt(r['hf'])}")
    for m, r in v.get("throughput_tok_per_s", {}).items():
        lines.append(f"throughput tok/s {m:12s} pagellm greedy {fmt(r['pagellm'], 0)}  sampled "
                     f"{fmt(r['pagellm_sampled'], 0)}  hf static batch {fmt(r['hf_static'], 0)}")
    for n, r in RESULTS["sections"].items():
        if r.get("status") == "error":
            lines.append(f"ERROR in {n}: {r.get('error')}")
    return "\n".join(lines)


def fmt(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main() -> int:
    log(f"pagellm GPU check: device {DEV}, dry run {DRY}, budget {ARGS.budget_s:.0f} s, "
        f"out {ARGS.out}, work {WORK}")
    save()
    try:
        run_sections()
    finally:
        RESULTS["verdict"] = v = verdict()
        RESULTS["meta"]["total_s"] = round(time.monotonic() - T0, 1)
        save()
        text = summary_text(v)
        with open(os.path.join(ARGS.out, "gpu_check_summary.txt"), "w") as f:
            f.write(text + "\n")
        print("\n" + "=" * 100 + "\n" + text + "\n" + "=" * 100, flush=True)
        shutil.rmtree(WORK, ignore_errors=True)  # the model folders made here (~0.5 GB)
    return 0 if v["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
