"""Prefill rate by prompt length: one request at a time, pagellm against llama.cpp's
`llama-bench -p` on the same GGUF file (and HF transformers with --peers hf).

    pagellm bench prefill [--model M.gguf --lengths 128,1000,4000,7000 --peers llama.cpp
                           --llama-cpp-bin DIR --repeats 3]

pagellm's rate is the prompt's length over its time to first token (the whole prompt computed,
chunked by the engine's token budget, and the first token sampled); llama.cpp's is
llama-bench's prompt processing rate (`-p N -n 0`). Every engine uses all cores (--threads).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess

import torch
from tqdm.auto import tqdm

from pagellm.benchmarks import common
from pagellm.benchmarks.gguf_models import model_path


def parse_args(argv):
    p = argparse.ArgumentParser(prog="pagellm bench prefill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the default model (GGUF)")
    p.add_argument("--lengths", default="128,1000,4000,7000", help="prompt lengths, comma-separated")
    p.add_argument("--peers", default="llama.cpp", help="comma-separated: llama.cpp, hf")
    p.add_argument("--llama-cpp-bin", default=os.environ.get("LLAMA_CPP_BIN"),
                   help="folder with llama-bench (see benchmarks/README.md)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="pagellm's token budget per step (default: the engine's)")
    p.add_argument("--kv-cache-memory", default="2GiB",
                   help="pagellm's KV budget: must hold the longest prompt")
    common.add_output_args(p)
    args = p.parse_args(argv)
    args.lengths = [int(n) for n in args.lengths.split(",")]
    if args.smoke:
        args.model, args.lengths, args.repeats, args.kv_cache_memory = None, [24, 40], 1, "16MiB"
    return args


def measure_pagellm(path: str, args) -> dict[int, list[float]]:
    from pagellm import LLM, SamplingParams

    kw = {} if args.max_num_batched_tokens is None else {
        "max_num_batched_tokens": args.max_num_batched_tokens}
    longest = max(args.lengths) + 8
    llm = LLM(path, max_model_len=longest, kv_cache_memory=args.kv_cache_memory,
              enable_prefix_caching=False, **kw)
    vocab, params = llm.engine.vocab_size, SamplingParams(temperature=0, max_tokens=1)
    llm.generate(common.random_prompts(1, min(args.lengths), vocab, seed=999), params,
                 use_tqdm=False)  # warm-up: kernels built, pages touched
    rates = {}
    for n in tqdm(args.lengths, desc="pagellm", leave=False):
        rates[n] = [n / llm.generate(common.random_prompts(1, n, vocab, seed=r), params,
                                     use_tqdm=False)[0].metrics.time_to_first_token
                    for r in range(args.repeats)]
    llm.shutdown()
    return rates


def measure_hf(path: str, args) -> dict[int, list[float]]:
    runner = common.HFRunner(common.ModelSpec.resolve(path), "float32")
    vocab, rates = runner.model.config.vocab_size, {}
    for n in tqdm(args.lengths, desc="hf", leave=False):
        rates[n] = [n / runner.stream(common.random_prompts(1, n, vocab, seed=r)[0], 1)[0]
                    for r in range(args.repeats)]
    return rates


def measure_llama_cpp(path: str, args) -> dict[int, list[float]]:
    binary = os.path.join(args.llama_cpp_bin, "llama-bench")
    out = subprocess.run([binary, "-m", path, "-t", str(args.threads), "-n", "0", "-r",
                          str(args.repeats), "-p", ",".join(map(str, args.lengths)), "-o", "json"],
                         capture_output=True, text=True, check=True).stdout
    return {r["n_prompt"]: r.get("samples_ts") or [r["avg_ts"]] for r in json.loads(out)
            if r["n_prompt"] > 0 and r["n_gen"] == 0}


def plot(rows, engines, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for engine in engines:
        pts = [(r["length"], r[engine]) for r in rows if r.get(engine)]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=engine)
    ax.set_xscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prefill tokens/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.threads = args.threads or os.cpu_count()
    torch.set_num_threads(args.threads)
    path = model_path(args.model) if args.model or args.smoke else common.ModelSpec.resolve(None).path
    results, skipped = {"pagellm": measure_pagellm(path, args)}, {}
    for peer in [p for p in args.peers.split(",") if p]:
        if peer == "llama.cpp" and not (args.llama_cpp_bin and os.path.isfile(
                os.path.join(args.llama_cpp_bin, "llama-bench")) and path.endswith(".gguf")):
            skipped[peer] = "needs --llama-cpp-bin with llama-bench and a GGUF model"
            continue
        results[peer] = (measure_llama_cpp if peer == "llama.cpp" else measure_hf)(path, args)
    engines = list(results)
    rows = []
    for n in args.lengths:
        row = {"length": n, **{e: common.median(results[e].get(n, [])) for e in engines}}
        for e in engines[1:]:
            row[f"pagellm / {e}"] = row["pagellm"] / row[e] if row.get(e) else None
        rows.append(row)
    headers = ["prompt tokens", *[f"{e} tok/s" for e in engines],
               *[f"pagellm / {e}" for e in engines[1:]]]
    table = common.markdown_table(headers, [[r["length"], *[r[e] for e in engines],
                                             *[r[f"pagellm / {e}"] for e in engines[1:]]]
                                            for r in rows])
    title = (f"{os.path.basename(path)}: prefill of one prompt, {args.threads} threads, "
             f"medians of {args.repeats}")
    md = f"### {title}\n\n{table}" + "".join(f"\n\n{k}: {v}" for k, v in skipped.items())
    common.write_results(args.out, "prefill", {"config": vars(args), "results": rows,
                                               "runs": {e: {str(n): v for n, v in r.items()}
                                                        for e, r in results.items()},
                                               "skipped": skipped}, md)
    if not args.no_plot:
        plot(rows, engines, os.path.join(args.out, "prefill.png"))
    return 0
