"""Prefix caching: many requests sharing one long system prompt, with the cache on vs off.

    python -m benchmarks prefix [--num-requests 64 --system-len 512 --question-len 64
                                 --output-len 32 --repeats 2 --threads 1]

Each request is the same `--system-len`-token system prompt followed by its own
`--question-len`-token question (random token ids, fixed `--seed`); all are submitted at once and
generate `--output-len` tokens (greedy, ignore_eos). Every configuration gets a fresh LLM per
repeat (on and off take turns); a short unrelated request warms it up first. Reported: time to
first token (median, p90), output and total tokens/s, peak KV blocks referenced at once
(`block_manager.peak_used_blocks`), prefix-cache hit rate (prompt tokens served from the cache /
prompt tokens looked up), preemptions and whether the outputs match. `--kv-cache-memory` is
generous so that "off" does not preempt. Peer: HF transformers `generate` on the same 64 prompts
as one static batch (no prefix sharing); its TTFT is when the first tokens of the batch appear.
Expected: the shared part is computed once, so TTFT and peak blocks drop several times.
"""
from __future__ import annotations

import argparse
import time

import torch
from tqdm.auto import tqdm

from pagellm.benchmarks import common


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks prefix", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--peers", default="hf", help="'hf' or '' (none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: stable on a shared machine; see benchmarks/README)")
    common.add_output_args(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.num_requests, args.system_len, args.question_len, args.output_len = 8, 64, 8, 4
        args.repeats, args.kv_cache_memory = 1, "16MiB"
    return args


def make_prompts(args, vocab_size: int) -> list[list[int]]:
    system = common.random_prompts(1, args.system_len, vocab_size, args.seed)[0]
    questions = common.random_prompts(args.num_requests, args.question_len, vocab_size,
                                      args.seed + 1)
    return [system + q for q in questions]


def percentile(xs: list[float], q: float) -> float:
    return float(torch.quantile(torch.tensor(xs, dtype=torch.float64), q))


def run_pagellm(spec: common.ModelSpec, args, prompts, caching: bool) -> dict:
    from pagellm import LLM, SamplingParams

    llm = LLM(spec.path, dtype=args.dtype, block_size=args.block_size,
              kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=caching)
    warm = common.random_prompts(1, 16, llm.engine.vocab_size, args.seed + 2)[0]
    llm.generate([warm], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    bm, sched = llm.engine.block_manager, llm.engine.scheduler
    bm.peak_used_blocks = bm.num_used_blocks  # count this workload's peak only
    queries, hits, preempt = bm.prefix_queries, bm.prefix_hits, sched.num_preemptions
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    looked_up = bm.prefix_queries - queries
    return {"engine": f"pagellm prefix cache {'on' if caching else 'off'}", "wall_s": wall,
            "ttft_s": [o.metrics.time_to_first_token for o in outs],
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "peak_used_blocks": bm.peak_used_blocks, "num_blocks": bm.num_blocks,
            "prefix_hit_rate": (bm.prefix_hits - hits) / looked_up if looked_up else 0.0,
            "cached_tokens": sum(o.num_cached_tokens for o in outs),
            "preemptions": sched.num_preemptions - preempt}


def run_hf(model, args, prompts) -> dict:
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.times = []  # the first put is the prompt, then one per step

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    ids, clock = torch.tensor(prompts), Clock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                             do_sample=False, streamer=clock)
    wall = time.perf_counter() - start
    return {"engine": "hf (static batch, no prefix sharing)", "wall_s": wall,
            "ttft_s": [clock.times[1] - start] * len(prompts),
            "output_tokens": (out.shape[1] - ids.shape[1]) * ids.shape[0],
            "tokens": out[:, ids.shape[1]:].tolist(), "peak_used_blocks": None,
            "num_blocks": None, "prefix_hit_rate": None, "cached_tokens": 0, "preemptions": 0}


def summarize(runs: list[dict], prompts) -> list[dict]:
    prompt_tokens = sum(len(p) for p in prompts)
    rows = []
    for engine in dict.fromkeys(r["engine"] for r in runs):
        rs = [r for r in runs if r["engine"] == engine]
        ttft = [t for r in rs for t in r["ttft_s"]]
        walls = [r["wall_s"] for r in rs]
        rows.append({
            "engine": engine, "ttft_median_ms": common.median(ttft) * 1e3,
            "ttft_p90_ms": percentile(ttft, 0.9) * 1e3,
            "output_tok_s": common.median([r["output_tokens"] / r["wall_s"] for r in rs]),
            "total_tok_s": common.median([(prompt_tokens + r["output_tokens"]) / w
                                          for r, w in zip(rs, walls)]),
            "wall_s": common.median(walls), "peak_used_blocks": rs[0]["peak_used_blocks"],
            "num_blocks": rs[0]["num_blocks"], "prefix_hit_rate": rs[0]["prefix_hit_rate"],
            "preemptions": sum(r["preemptions"] for r in rs)})
    off = next(r for r in rows if r["engine"].endswith("off"))
    ref = [r for r in runs if r["engine"] == off["engine"]]
    for row in rows:
        rs = [r for r in runs if r["engine"] == row["engine"]]
        same = [a == b for r, o in zip(rs, ref) for a, b in zip(r["tokens"], o["tokens"])]
        row["same_tokens_as_off"] = sum(same) / len(same)
        row["ttft_median_vs_off"] = off["ttft_median_ms"] / row["ttft_median_ms"]
        row["output_tok_s_vs_off"] = row["output_tok_s"] / off["output_tok_s"]
        row["peak_blocks_vs_off"] = (off["peak_used_blocks"] / row["peak_used_blocks"]
                                     if row["peak_used_blocks"] else None)
    return rows


def render(rows, args) -> str:
    fmt = lambda v, f: "-" if v is None else f.format(v)  # noqa: E731
    table = [[r["engine"], f"{r['ttft_median_ms']:.0f}", f"{r['ttft_p90_ms']:.0f}",
              f"{r['ttft_median_vs_off']:.2f}x", f"{r['output_tok_s']:.1f}",
              f"{r['total_tok_s']:.0f}", f"{r['output_tok_s_vs_off']:.2f}x",
              fmt(r["peak_used_blocks"], "{}") + fmt(r["num_blocks"], " / {}")[1:],
              fmt(r["peak_blocks_vs_off"], "{:.2f}x"), fmt(r["prefix_hit_rate"], "{:.1%}"),
              r["preemptions"], f"{r['same_tokens_as_off']:.0%}"] for r in rows]
    head = (f"### Prefix caching: {args.num_requests} requests = shared {args.system_len}-token "
            f"system prompt + own {args.question_len}-token question -> {args.output_len} tokens"
            f" ({args.dtype}, greedy, block {args.block_size}, {args.threads} thread(s)), "
            f"median of {args.repeats}\n\n")
    return head + common.markdown_table(
        ["engine", "TTFT median ms", "TTFT p90 ms", "TTFT gain vs off", "output tok/s",
         "total tok/s", "tok/s vs off", "peak KV blocks / pool", "blocks saved vs off",
         "prefix hit rate", "preemptions", "same tokens as off"], table)


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["engine"].replace(" (", "\n(") for r in rows]
    panels = [("TTFT median (ms)", "ttft_median_ms"), ("TTFT p90 (ms)", "ttft_p90_ms"),
              ("total tokens/s", "total_tok_s"), ("peak KV blocks", "peak_used_blocks")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.8))
    for ax, (title, key) in zip(axes, panels):
        ax.bar(names, [r[key] or 0 for r in rows], color=["tab:green", "tab:red", "tab:gray"])
        ax.set_title(title)
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    import gc

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = common.ModelSpec.resolve(common.smoke_model_dir() if args.smoke else args.model)
    from pagellm.models.loader import load_model_files

    vocab = load_model_files(spec.path, load_tokenizer=False).config.vocab_size
    prompts = make_prompts(args, vocab)
    hf = common.HFRunner(spec, common.peer_dtype(args.dtype)).model if "hf" in args.peers.split(",") else None
    runs = []
    steps = args.repeats * (2 + (hf is not None))
    with tqdm(total=steps, desc="prefix", unit="run") as bar:
        for rep in range(args.repeats):
            for caching in ((True, False) if rep % 2 == 0 else (False, True)):
                runs.append(run_pagellm(spec, args, prompts, caching))
                gc.collect()  # free this LLM's KV pool before the next one allocates its own
                bar.update(1)
            if hf is not None:
                runs.append(run_hf(hf, args, prompts))
                bar.update(1)
    rows = summarize(runs, prompts)
    for r in runs:
        del r["tokens"]
    common.write_results(args.out, "prefix", {
        "config": vars(args), "model": spec.path, "results": rows, "runs": runs}, render(rows, args))
    if not args.no_plot:
        plot(rows, f"{args.out}/prefix.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
