"""Real GGUF models (K-quant mixes): pagellm against llama.cpp on the file itself and HF
transformers on the same weights, in one run on one machine.

Per engine: batch-1 decode (ms per output token), prefill of one prompt (tokens/s), and N
requests at once (output tokens/s end to end). llama.cpp is measured by its own tools, built
from source (benchmarks/README.md, "llama.cpp from source"): `llama-bench` (pp / tg) and
`llama-batched-bench` (-npl N), pointed at with --llama-cpp-bin.

    python -m benchmarks gguf_models [--model qwen2.5-coder-1.5b-instruct-q4_k_m]
        [--llama-cpp-bin DIR] [--peers llama.cpp,hf] [--prompt-len 128 --gen 64 --batch 16]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time

import torch
from tqdm.auto import tqdm

from pagellm.benchmarks import common


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks gguf_models", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct-q4_k_m",
                   help="a name `pagellm fetch` knows, or a .gguf path")
    p.add_argument("--llama-cpp-bin", default=os.environ.get("LLAMA_CPP_BIN"),
                   help="folder with llama-bench and llama-batched-bench (or $LLAMA_CPP_BIN)")
    p.add_argument("--peers", default="llama.cpp,hf", help="comma-separated: llama.cpp, hf")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen", type=int, default=64, help="output tokens per request")
    p.add_argument("--batch", type=int, default=16, help="requests at once for the batched row")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--kv-cache-memory", default="1GiB")
    common.add_output_args(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.model = None
        args.prompt_len, args.gen, args.batch, args.repeats = 16, 8, 4, 1
        args.kv_cache_memory = "16MiB"
    return args


def model_path(name: str | None) -> str:
    if name is None:  # --smoke: a tiny random model in an HF folder
        return common.smoke_model_dir()
    if name.endswith(".gguf") or os.path.isdir(name):
        return os.path.abspath(name)
    from pagellm.models import fetch

    return str(fetch.fetch(name))


def measure_pagellm(path: str, args) -> dict:
    from pagellm import LLM, SamplingParams

    llm = LLM(path, kv_cache_memory=args.kv_cache_memory, max_num_seqs=max(args.batch, 1))
    vocab = llm.engine.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.gen, ignore_eos=True)
    llm.generate(common.random_prompts(1, args.prompt_len, vocab, seed=999), params, use_tqdm=False)
    runs = []
    for r in tqdm(range(args.repeats), desc="pagellm", leave=False):
        one = llm.generate(common.random_prompts(1, args.prompt_len, vocab, seed=r),
                           params, use_tqdm=False)[0].metrics
        prompts = common.random_prompts(args.batch, args.prompt_len, vocab, seed=1000 + r)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
        runs.append({"decode_ms": one.time_per_output_token * 1e3,
                     "prefill_tok_s": args.prompt_len / one.time_to_first_token,
                     "batch_output_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall})
    del llm
    return {"runs": runs}


def measure_hf(path: str, args) -> dict:
    spec = common.ModelSpec.resolve(path)
    runner = common.HFRunner(spec, "float32")  # float32: its faster dtype on CPUs without bf16 units
    vocab = runner.model.config.vocab_size
    runs = []
    for r in tqdm(range(args.repeats), desc="hf", leave=False):
        ttft, tpot = runner.stream(common.random_prompts(1, args.prompt_len, vocab, seed=r)[0],
                                   args.gen)
        prompts = common.random_prompts(args.batch, args.prompt_len, vocab, seed=1000 + r)
        t = time.perf_counter()
        n = runner.generate(prompts, args.gen)
        runs.append({"decode_ms": tpot * 1e3, "prefill_tok_s": args.prompt_len / ttft,
                     "batch_output_tok_s": n / (time.perf_counter() - t)})
    del runner
    return {"runs": runs}


def measure_llama_cpp(path: str, args) -> dict:
    """llama-bench (prompt processing and generation t/s) and llama-batched-bench (N
    sequences of prompt-len + gen tokens: output tokens over the whole time)."""
    binary = os.path.join(args.llama_cpp_bin, "llama-bench")
    out = subprocess.run([binary, "-m", path, "-t", str(args.threads), "-p", str(args.prompt_len),
                          "-n", str(args.gen), "-r", str(args.repeats), "-o", "json"],
                         capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    pp = next(r for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0)
    tg = next(r for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0)
    batched = subprocess.run(
        [os.path.join(args.llama_cpp_bin, "llama-batched-bench"), "-m", path, "-t", str(args.threads),
         "-c", str(args.batch * (args.prompt_len + args.gen) + 64), "-npp", str(args.prompt_len),
         "-ntg", str(args.gen), "-npl", str(args.batch)], capture_output=True, text=True, check=True).stdout
    # table row: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    cells = next(line for line in batched.splitlines()
                 if re.match(rf"\|\s*{args.prompt_len}\s*\|\s*{args.gen}\s*\|\s*{args.batch}\s*\|", line))
    values = [float(c) for c in cells.strip("| \n").split("|")]
    total_s = values[8]
    return {"runs": [{"decode_ms": 1e3 / tg["avg_ts"], "prefill_tok_s": pp["avg_ts"],
                      "batch_output_tok_s": args.batch * args.gen / total_s,
                      "batch_decode_phase_tok_s": values[7]}],
            "llama_bench": {"pp": pp["avg_ts"], "tg": tg["avg_ts"], "samples_ts": tg.get("samples_ts")},
            "batched_bench_row": values}


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(10, 3.2))
    metrics = [("decode_ms", "batch-1 ms / token (lower is better)"),
               ("prefill_tok_s", "prefill tokens/s"), ("batch_output_tok_s", "batched output tokens/s")]
    for ax, (key, title) in zip(axes, metrics):
        ax.bar([r["engine"] for r in rows], [r[key] for r in rows], color="tab:blue")
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.threads = args.threads or os.cpu_count()
    torch.set_num_threads(args.threads)
    path = model_path(args.model)
    peers = [p for p in args.peers.split(",") if p]
    results, skipped = {"pagellm": measure_pagellm(path, args)}, {}
    for peer in peers:
        if peer == "llama.cpp" and not (args.llama_cpp_bin and os.path.isfile(
                os.path.join(args.llama_cpp_bin, "llama-bench"))):
            skipped[peer] = "no --llama-cpp-bin with llama-bench (see benchmarks/README.md)"
            continue
        if peer == "llama.cpp" and not path.endswith(".gguf"):
            skipped[peer] = "llama.cpp runs GGUF files only"
            continue
        results[peer] = (measure_llama_cpp if peer == "llama.cpp" else measure_hf)(path, args)
    rows = []
    for engine, res in results.items():
        row = {"engine": engine}
        for key in ("decode_ms", "prefill_tok_s", "batch_output_tok_s"):
            row[key] = common.median([r[key] for r in res["runs"]])
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["decode_speedup_of_pagellm"] = row["decode_ms"] / base["decode_ms"]
        row["prefill_pagellm_ratio"] = base["prefill_tok_s"] / row["prefill_tok_s"]
        row["batch_pagellm_ratio"] = base["batch_output_tok_s"] / row["batch_output_tok_s"]
    headers = ["engine", "batch-1 ms/token", "pagellm faster x", "prefill tok/s", "pagellm x",
               f"{args.batch} requests output tok/s", "pagellm x"]
    table = common.markdown_table(headers, [[r["engine"], r["decode_ms"], r["decode_speedup_of_pagellm"],
                                             r["prefill_tok_s"], r["prefill_pagellm_ratio"],
                                             r["batch_output_tok_s"], r["batch_pagellm_ratio"]] for r in rows])
    title = (f"{os.path.basename(path)}: {args.prompt_len}-token prompts, {args.gen} new tokens, "
             f"{args.threads} threads, medians of {args.repeats}")
    md = f"### {title}\n\n{table}" + "".join(f"\n\n{k}: {v}" for k, v in skipped.items())
    common.write_results(args.out, "gguf_models", {"config": vars(args), "results": rows, "runs": results,
                                                   "skipped": skipped}, md)
    if not args.no_plot:
        plot(rows, os.path.join(args.out, "gguf_models.png"))
    return 0
