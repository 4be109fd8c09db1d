"""Batch-1 latency: time to first token (TTFT) and time per output token (TPOT) for one
request at a time, vs the same peers; and the memory-bandwidth floor of a decode step.

A decode step at batch 1 must read every weight once (the tied embedding counts once, as the
LM head) plus the KV of its context. Divided by the machine's measured copy bandwidth, that
is the fastest any engine could decode here; the table shows how far each engine is from it.

    python -m benchmarks latency [--input-len 128 --output-len 128 --repeats 3]
"""
from __future__ import annotations

import argparse

import torch
from torch.utils import benchmark as torch_benchmark
from tqdm.auto import tqdm

from pagellm.benchmarks import common


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks latency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--bandwidth-mib", type=int, default=256,
                   help="size of the tensor copied to measure memory bandwidth")
    common.add_engine_args(p)
    common.add_output_args(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.input_len, args.output_len, args.repeats, args.bandwidth_mib = 16, 8, 1, 16
        args.kv_cache_memory = "16MiB"
    return args


def measure_bandwidth(mib: int, tries: int = 5) -> float:
    """Bytes per second of a large tensor copy (read + write both counted), best of `tries`."""
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    best = 0.0
    for _ in range(tries):
        t = torch_benchmark.Timer("dst.copy_(src)", globals={"dst": dst, "src": src},
                                  num_threads=torch.get_num_threads())  # the engines' threads
        secs = t.timeit(3).median
        best = max(best, 2 * src.numel() * 4 / secs)
    return best


def bytes_per_token(runner, context_len: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) read by one batch-1 decode step of pagellm at this context."""
    from pagellm.engine.model_runner import kv_bytes_per_block

    engine = runner.llm.engine
    kv_per_token = kv_bytes_per_block(engine.hf_config, 1, engine.kv_dtype)
    return runner.param_bytes, kv_per_token * context_len


def run(runners, args) -> dict[str, list[tuple[float, float]]]:
    """A fresh prompt per repeat (seed + repeat, the same for every engine): no prefix-cache hits."""
    make = lambda seed: common.random_prompts(  # noqa: E731
        1, args.input_len, runners[0].vocab_size, seed)[0]
    for r in runners:  # warm-up
        r.stream(make(args.seed + 10_000), 4)
    runs: dict[str, list] = {r.name: [] for r in runners}
    output_len = args.output_len
    with tqdm(total=args.repeats * len(runners), desc="latency", unit="run") as bar:
        for rep in range(args.repeats):
            prompt = make(args.seed + rep)
            for r in runners:
                runs[r.name].append(r.stream(prompt, output_len))
                bar.update(1)
    return runs


def summarize(runs, floor_s: float) -> list[dict]:
    rows = []
    for name, rs in runs.items():
        ttft = common.median([a for a, _ in rs])
        tpot = common.median([b for _, b in rs if b is not None])
        rows.append({"engine": name, "ttft_ms": ttft * 1e3, "tpot_ms": tpot * 1e3,
                     "decode_tok_s": 1 / tpot, "x_floor": tpot / floor_s,
                     "runs": [{"ttft_s": a, "tpot_s": b} for a, b in rs]})
    hf = next((r for r in rows if r["engine"] == "hf"), None)
    for r in rows:
        r["decode_vs_hf"] = hf["tpot_ms"] / r["tpot_ms"] if hf else None
        r["ttft_vs_hf"] = hf["ttft_ms"] / r["ttft_ms"] if hf else None
    return rows


def render(rows, skipped, bw, weight_b, kv_b, floor_s, args) -> str:
    head = (f"### Batch-1 latency: {args.input_len}-token prompt -> {args.output_len} new tokens "
            f"({args.dtype}, greedy), median of {args.repeats}\n\n"
            f"Bandwidth floor: {weight_b / 2**20:.1f} MiB weights + {kv_b / 2**20:.2f} MiB KV "
            f"(context {args.input_len + args.output_len // 2}) per token / "
            f"{bw / 1e9:.1f} GB/s measured copy bandwidth = **{floor_s * 1e3:.2f} ms/token** "
            f"({1 / floor_s:.0f} tok/s at most).\n")
    ratio = lambda v: f"{v:.2f}x" if v else "-"  # noqa: E731
    table = [[r["engine"], round(r["ttft_ms"], 1), round(r["tpot_ms"], 2),
              round(r["decode_tok_s"], 1), ratio(r["decode_vs_hf"]), ratio(r["ttft_vs_hf"]),
              f"{r['x_floor']:.1f}x" + (" (Q4_1 weights)" if r["engine"] == "llama.cpp" else "")]
             for r in rows]
    table += [[name, reason, "", "", "", "", ""] for name, reason in skipped.items()]
    return head + "\n" + common.markdown_table(
        ["engine", "TTFT ms", "TPOT ms", "decode tok/s", "decode vs HF", "TTFT vs HF",
         "TPOT / floor"], table)


def plot(rows, floor_s: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r["engine"] for r in rows], [r["tpot_ms"] for r in rows], color="tab:orange")
    ax.axhline(floor_s * 1e3, color="k", ls="--", label="memory-bandwidth floor")
    ax.set_ylabel("ms per output token (batch 1)")
    ax.set_title("decode latency (lower is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spec = common.ModelSpec.resolve(common.smoke_model_dir() if args.smoke else args.model)
    max_len = args.input_len + args.output_len + 16
    args.max_num_seqs = 1
    common.log(f"loading engines for {spec.path}")
    runners, skipped = common.make_runners(args, spec, max_len)
    bw = measure_bandwidth(args.bandwidth_mib)
    weight_b, kv_b = bytes_per_token(runners[0], args.input_len + args.output_len // 2)
    floor_s = (weight_b + kv_b) / bw
    rows = summarize(run(runners, args), floor_s)
    common.write_results(args.out, "latency", {
        "config": vars(args), "model": spec.path,
        "bandwidth": {"bytes_per_s": bw, "weight_bytes": weight_b, "kv_bytes": kv_b,
                      "floor_ms_per_token": floor_s * 1e3},
        "results": rows, "skipped": skipped},
        render(rows, skipped, bw, weight_b, kv_b, floor_s, args))
    if not args.no_plot:
        plot(rows, floor_s, f"{args.out}/latency.png")
    common.release(runners)
    return 0
