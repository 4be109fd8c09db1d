"""Offline throughput: N requests of random-token prompts, fixed output length (ignore_eos),
greedy, on the same weights in every engine. Output tokens per second, medians over repeats;
the engines take turns inside each repeat so that machine noise hits them alike.

    python -m benchmarks throughput [--num-prompts 64 --input-len 128 --output-len 128]
"""
from __future__ import annotations

import argparse
import time

from tqdm.auto import tqdm

from pagellm.benchmarks import common


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks throughput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--hf-batch-size", type=int, default=None,
                   help="HF static batch size (default: all prompts in one batch)")
    common.add_engine_args(p)
    common.add_output_args(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.num_prompts, args.input_len, args.output_len, args.repeats = 4, 16, 8, 1
        args.kv_cache_memory = "16MiB"
    return args


def run_timed(runners, args) -> dict[str, list[dict]]:
    """Each repeat gets fresh prompts (seed + repeat), the same for every engine, so that no
    engine's prefix cache serves a prompt it has seen before."""
    runs: dict[str, list[dict]] = {r.name: [] for r in runners}
    make = lambda n, seed: common.random_prompts(  # noqa: E731
        n, args.input_len, runners[0].vocab_size, seed)
    warm = make(2, args.seed + 10_000)
    for r in runners:  # warm-up: first-call costs (allocation, kernels) are not throughput
        r.generate(warm, 4)
    output_len, hf_batch_size = args.output_len, args.hf_batch_size
    with tqdm(total=args.repeats * len(runners), desc="throughput", unit="run") as bar:
        for rep in range(args.repeats):
            prompts = make(args.num_prompts, args.seed + rep)
            for r in runners:
                kw = {"batch_size": hf_batch_size} if r.name == "hf" else {}
                t = time.perf_counter()
                n = r.generate(prompts, output_len, **kw)
                dt = time.perf_counter() - t
                runs[r.name].append({"seconds": dt, "output_tokens": n,
                                     "output_tok_s": n / dt})
                bar.update(1)
    return runs


def summarize(runs: dict[str, list[dict]], num_prompts: int, input_len: int) -> list[dict]:
    rows = []
    for name, rs in runs.items():
        out_tps = common.median([r["output_tok_s"] for r in rs])
        secs = common.median([r["seconds"] for r in rs])
        total = (num_prompts * input_len + rs[0]["output_tokens"]) / secs
        rows.append({"engine": name, "output_tok_s": out_tps, "total_tok_s": total,
                     "seconds": secs, "repeats": len(rs)})
    hf = next((r["output_tok_s"] for r in rows if r["engine"] == "hf"), None)
    for r in rows:
        r["vs_hf"] = r["output_tok_s"] / hf if hf else None
    return rows


def render(rows: list[dict], skipped: dict[str, str], args) -> str:
    head = (f"### Offline throughput: {args.num_prompts} requests x {args.input_len} prompt "
            f"tokens -> {args.output_len} new tokens (ignore_eos, greedy, {args.dtype}), "
            f"median of {args.repeats}\n")
    table = [[r["engine"], round(r["output_tok_s"], 1), round(r["total_tok_s"], 1),
              round(r["seconds"], 2), f"{r['vs_hf']:.2f}x" if r["vs_hf"] else "-"] for r in rows]
    table += [[name, reason, "", "", ""] for name, reason in skipped.items()]
    return head + "\n" + common.markdown_table(
        ["engine", "output tok/s", "total tok/s", "seconds", "vs HF"], table)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r["engine"] for r in rows], [r["output_tok_s"] for r in rows], color="tab:blue")
    for i, r in enumerate(rows):
        ax.text(i, r["output_tok_s"], f"{r['output_tok_s']:.0f}", ha="center", va="bottom")
    ax.set_ylabel("output tokens / s")
    ax.set_title("offline throughput (higher is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spec = common.ModelSpec.resolve(common.smoke_model_dir() if args.smoke else args.model)
    max_len = args.input_len + args.output_len + 16
    common.log(f"loading engines for {spec.path}")
    runners, skipped = common.make_runners(args, spec, max_len)
    runs = run_timed(runners, args)
    rows = summarize(runs, args.num_prompts, args.input_len)
    files = common.write_results(args.out, "throughput", {
        "config": {k: v for k, v in vars(args).items()}, "model": spec.path,
        "results": rows, "runs": runs, "skipped": skipped}, render(rows, skipped, args))
    if not args.no_plot:
        plot(rows, f"{args.out}/throughput.png")
    common.release(runners)
    return 0 if files else 1
