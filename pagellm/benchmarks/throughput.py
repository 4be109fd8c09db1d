"""Offline throughput: N requests of random-token prompts, fixed output length (ignore_eos),
greedy, on the same weights in every engine. Output tokens/s end to end and time to first token
(median over requests), medians over repeats. Each engine runs in a process of its own (no
engine inherits another's allocator state or threads; vLLM can live in another environment).

    python -m benchmarks throughput [--num-prompts 64 --input-len 128 --output-len 128]
    python -m benchmarks throughput --workloads default:64,qwen2.5-coder-1.5b-instruct-q4_k_m:16 \\
        --dtype auto --peers hf,vllm,llama.cpp --vllm-python /opt/vllm-venv/bin/python \\
        --llama-cpp-bin DIR

--rounds N runs every engine N times in turn (pagellm, the peers, pagellm, ...), each time in a
fresh process: a shared machine's speed drifts over minutes, and a ratio of two engines run
minutes apart carries that drift. The table then gives each engine's median over all its runs
and the median over rounds of pagellm's ratio to it within the round.

llama.cpp runs as its own `llama-batched-bench` (N sequences decoded together) when
--llama-cpp-bin names a folder holding it, else through llama-cpp-python (one request at a
time: the binding has no multi-sequence batch API).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

from tqdm.auto import tqdm

from pagellm.benchmarks import common

_RESULT = "THROUGHPUT-RESULT "


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks throughput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--workloads", default=None,
                   help="MODEL:N,...: each model with its own number of requests, one after "
                        "another in this run (MODEL: 'default', a name `pagellm fetch` knows, or a "
                        "path); default: --model with --num-prompts")
    p.add_argument("--hf-batch-size", type=int, default=None,
                   help="HF static batch size (default: all prompts in one batch)")
    p.add_argument("--llama-cpp-bin", default=os.environ.get("LLAMA_CPP_BIN"),
                   help="folder with llama-batched-bench (or $LLAMA_CPP_BIN)")
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", sys.executable),
                   help="the Python whose environment has vLLM (or $VLLM_PYTHON; default: this one)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every engine this many times in turn, each in a fresh process; "
                        "ratios are medians of each round's ratios (default 1)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one engine, this process
    p.add_argument("--vocab-size", type=int, default=None, help=argparse.SUPPRESS)
    common.add_engine_args(p)
    common.add_output_args(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.num_prompts, args.input_len, args.output_len, args.repeats = 4, 16, 8, 1
        args.kv_cache_memory = "16MiB"
    args.threads = args.threads or os.cpu_count()
    if args.rounds < 1:
        raise ValueError(f"--rounds: must be at least 1, got {args.rounds}")
    return args


def resolve_model(name: str | None) -> str:
    if name in (None, "default"):
        return common.ModelSpec.resolve(None).path
    if name.endswith(".gguf") or os.path.isdir(name):
        return os.path.abspath(name)
    from pagellm.models import fetch

    return str(fetch.fetch(name))


def workloads(args) -> list[tuple[str, int]]:
    if args.smoke:
        return [(common.smoke_model_dir(), args.num_prompts)]
    if not args.workloads:
        return [(resolve_model(args.model), args.num_prompts)]
    out = []
    for item in args.workloads.split(","):
        name, _, n = item.rpartition(":")
        if not name or not n.isdigit() or int(n) < 1:
            raise ValueError(f"--workloads: {item!r} is not MODEL:N with N >= 1")
        out.append((resolve_model(name), int(n)))
    return out


# ---- one engine, in its own process -------------------------------------------------------
def make_runner(engine: str, args, spec: common.ModelSpec, max_len: int):
    if engine.startswith("pagellm"):
        quant = engine[len("pagellm ["):-1] if "[" in engine else "auto"
        return common.PagellmRunner(spec, args.dtype, args.max_num_seqs, args.kv_cache_memory,
                                    quant, args.kv_cache_dtype)
    if engine == "hf":
        return common.HFRunner(spec, common.peer_dtype(args.dtype))
    if engine == "vllm":
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, _gib(args.kv_cache_memory))))
        dest = os.path.join(args.out, "models", "hf-" + os.path.basename(spec.path))
        return common.VLLMRunner(common.prepare_hf_folder(spec, dest),
                                 common.peer_dtype(args.dtype), args.max_num_seqs, max_len)
    if engine == "llama.cpp":
        return common.LlamaCppRunner(spec.path, max_len)
    raise ValueError(f"unknown engine {engine!r}")


def _gib(size: str) -> int:
    from pagellm.config import parse_bytes

    return round(parse_bytes(size, "--kv-cache-memory") / 2**30)


def worker(args) -> dict:
    """Warm up, then `repeats` timed runs of N fresh prompts (seed + repeat: the same prompts
    for every engine, never seen before by a prefix cache)."""
    import torch

    torch.set_num_threads(args.threads)
    spec = common.ModelSpec.resolve(args.model)
    max_len = args.input_len + args.output_len + 16
    runner = make_runner(args.worker, args, spec, max_len)
    vocab = min(args.vocab_size or runner.vocab_size, runner.vocab_size)
    make = lambda n, seed: common.random_prompts(n, args.input_len, vocab, seed)  # noqa: E731
    kw = {"batch_size": args.hf_batch_size} if args.worker == "hf" else {}
    runner.generate(make(2, args.seed + 10_000), 4, **kw)  # first-call costs are not throughput
    runs = []
    for rep in range(args.repeats):
        prompts = make(args.num_prompts, args.seed + rep)
        t = time.perf_counter()
        n = runner.generate(prompts, args.output_len, **kw)
        dt = time.perf_counter() - t
        ttfts = runner.last_ttfts
        if ttfts is None and args.worker == "hf":  # static batches: first tokens come together
            t = time.perf_counter()
            runner.generate(prompts, 1, **kw)
            ttfts = [time.perf_counter() - t]
        runs.append({"seconds": dt, "output_tokens": n, "output_tok_s": n / dt,
                     "ttft_s": common.median(ttfts) if ttfts else None})
    return {"engine": runner.name, "vocab_size": vocab, "runs": runs}


def run_worker_process(engine: str, model: str, n: int, args) -> dict:
    """This module with --worker ENGINE in a fresh Python (vLLM's may be another venv's)."""
    python = args.vllm_python if engine == "vllm" else sys.executable
    cmd = [python, "-m", "pagellm.benchmarks", "throughput", "--worker", engine,
           "--model", model, "--num-prompts", str(n), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--dtype", args.dtype,
           "--repeats", str(args.repeats), "--max-num-seqs", str(args.max_num_seqs),
           "--kv-cache-memory", args.kv_cache_memory, "--kv-cache-dtype", args.kv_cache_dtype,
           "--seed", str(args.seed),
           "--threads", str(args.threads), "--out", args.out]
    if args.vocab_size:
        cmd += ["--vocab-size", str(args.vocab_size)]
    if args.hf_batch_size:
        cmd += ["--hf-batch-size", str(args.hf_batch_size)]
    if args.smoke:
        cmd.append("--smoke")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # stderr: the user's terminal
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(_RESULT)), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{engine} worker exited with {proc.returncode}: "
                           f"{proc.stdout.strip()[-500:]}")
    return json.loads(line[len(_RESULT):])


def run_batched_bench(model: str, n: int, args) -> dict:
    """llama.cpp's own `llama-batched-bench`: n sequences of input-len prompt tokens (processed
    together), then output-len tokens decoded for all n at once. One row per repeat."""
    binary = os.path.join(args.llama_cpp_bin, "llama-batched-bench")
    ctx = n * (args.input_len + args.output_len) + 64
    runs = []
    for _ in range(args.repeats):
        out = subprocess.run([binary, "-m", model, "-t", str(args.threads), "-c", str(ctx),
                              "-npp", str(args.input_len), "-ntg", str(args.output_len),
                              "-npl", str(n)], capture_output=True, text=True, check=True).stdout
        # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
        pattern = rf"\|\s*{args.input_len}\s*\|\s*{args.output_len}\s*\|\s*{n}\s*\|"
        row = next(ln for ln in out.splitlines() if re.match(pattern, ln))
        v = [float(c) for c in row.strip("| \n").split("|")]
        runs.append({"seconds": v[8], "output_tokens": n * args.output_len,
                     "output_tok_s": n * args.output_len / v[8],
                     "ttft_s": v[4],  # every prompt is processed before the first decode step
                     "decode_phase_tok_s": v[7]})
    return {"engine": "llama.cpp", "runs": runs}


# ---- the run ------------------------------------------------------------------------------
def engines(args) -> tuple[list[str], dict[str, str]]:
    names = ["pagellm" if q == "auto" else f"pagellm [{q}]"
             for q in common.quantization_variants(args)]
    skipped = {}
    for peer in [p for p in args.peers.split(",") if p]:
        if peer not in common.PEERS:
            raise ValueError(f"--peers: unknown {peer!r}; choose from {common.PEERS}")
        if peer == "llama.cpp" and _has_batched_bench(args):
            names.append(peer)
        elif args.smoke and peer != "hf":
            skipped[peer] = "skipped in --smoke (tiny random model)"
        elif peer == "vllm" and not _importable_in(args.vllm_python, "vllm"):
            skipped[peer] = common.INSTALL_HINT["vllm"] + " (or --vllm-python)"
        elif peer != "vllm" and not common.importable(
                {"hf": "transformers", "llama.cpp": "llama_cpp"}[peer]):
            skipped[peer] = common.INSTALL_HINT.get(peer, "not installed")
        else:
            names.append(peer)
    return names, skipped


def _has_batched_bench(args) -> bool:
    return bool(args.llama_cpp_bin) and os.path.isfile(
        os.path.join(args.llama_cpp_bin, "llama-batched-bench"))


def _importable_in(python: str, module: str) -> bool:
    if python == sys.executable:
        return common.importable(module)
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([python, "-c", probe], capture_output=True).returncode == 0


def summarize(result: dict, n: int, input_len: int) -> dict:
    rs = result["runs"]
    secs = common.median([r["seconds"] for r in rs])
    ttfts = [r["ttft_s"] for r in rs if r.get("ttft_s") is not None]
    return {"engine": result["engine"], "requests": n,
            "output_tok_s": common.median([r["output_tok_s"] for r in rs]),
            "total_tok_s": (n * input_len + rs[0]["output_tokens"]) / secs, "seconds": secs,
            "ttft_s": common.median(ttfts), "repeats": len(rs)}


def round_ratios(rounds: list[dict[str, list[dict]]], base: str, engine: str) -> list[float]:
    """Per round, base's output tok/s (its runs' median in the round) over engine's in the
    same round."""
    return [common.median([r["output_tok_s"] for r in rnd[base]])
            / common.median([r["output_tok_s"] for r in rnd[engine]])
            for rnd in rounds if base in rnd and engine in rnd]


def render(table_rows: list[dict], skipped: dict[str, str], args) -> str:
    head = (f"### Offline throughput: requests x {args.input_len} prompt tokens -> "
            f"{args.output_len} new tokens (ignore_eos, greedy, dtype {args.dtype}: pagellm; "
            f"peers {common.peer_dtype(args.dtype)}), {args.threads} threads, median of "
            f"{args.repeats * args.rounds}, each engine in its own process"
            + (f"; {args.rounds} rounds in turn, pagellm x: the median of the rounds' ratios"
               if args.rounds > 1 else "") + "\n")
    cells = [[r["model"], r["requests"], r["engine"], round(r["output_tok_s"], 1),
              round(r["total_tok_s"], 1),
              "-" if r["ttft_s"] is None else round(r["ttft_s"], 2), round(r["seconds"], 2),
              f"{r['pagellm_x']:.2f}x"] for r in table_rows]
    cells += [["", "", name, reason, "", "", "", ""] for name, reason in skipped.items()]
    return head + "\n" + common.markdown_table(
        ["model", "requests", "engine", "output tok/s", "total tok/s", "TTFT median s",
         "seconds", "pagellm x"], cells)


def plot(table_rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in table_rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 3.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [r for r in table_rows if r["model"] == model]
        ax.bar([r["engine"] for r in rows], [r["output_tok_s"] for r in rows], color="tab:blue")
        for i, r in enumerate(rows):
            ax.text(i, r["output_tok_s"], f"{r['output_tok_s']:.0f}", ha="center", va="bottom")
        ax.set_ylabel("output tokens / s")
        ax.set_title(f"{model}, {rows[0]['requests']} requests (higher is better)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(_RESULT + json.dumps(worker(args)), flush=True)
        return 0
    names, skipped = engines(args)
    jobs = workloads(args)
    table_rows, raw = [], {}
    with tqdm(total=len(jobs) * len(names) * args.rounds, desc="throughput",
              unit="engine") as bar:
        for model, n in jobs:
            label = os.path.basename(model.rstrip("/"))
            args.vocab_size = None  # the first engine (pagellm) sets the prompts' id range
            rounds, results = [], {}
            for i in range(args.rounds):
                rnd = {}
                for name in names:
                    bar.set_postfix_str(f"{label}: {name}"
                                        + (f" (round {i + 1})" if args.rounds > 1 else ""))
                    if name == "llama.cpp" and _has_batched_bench(args):
                        if not model.endswith(".gguf"):
                            skipped[f"llama.cpp ({label})"] = "llama.cpp runs GGUF files only"
                            bar.update(1)
                            continue
                        res = run_batched_bench(model, n, args)
                    else:
                        res = run_worker_process(name, model, n, args)
                        args.vocab_size = args.vocab_size or res["vocab_size"]
                    rnd[res["engine"]] = res["runs"]
                    results.setdefault(res["engine"], {"engine": res["engine"], "runs": []})
                    results[res["engine"]]["runs"] += res["runs"]
                    bar.update(1)
                rounds.append(rnd)
            raw[label] = {e: r["runs"] for e, r in results.items()}
            rows = [{"model": label, **summarize(r, n, args.input_len)} for r in results.values()]
            base = rows[0]["engine"]  # pagellm (its first --quantization)
            for r in rows:
                r["round_ratios"] = round_ratios(rounds, base, r["engine"])
                r["pagellm_x"] = common.median(r["round_ratios"])
            table_rows += rows
    files = common.write_results(args.out, "throughput", {
        "config": {k: v for k, v in vars(args).items()}, "results": table_rows, "runs": raw,
        "skipped": skipped}, render(table_rows, skipped, args))
    if not args.no_plot:
        plot(table_rows, f"{args.out}/throughput.png")
    return 0 if files else 1
