"""What a KV cache dtype costs in accuracy: perplexity of a real text under each pool, and how
far each pool's per-token log-probabilities move from a float32 pool's.

    pagellm bench accuracy [--model M --kv-dtypes float32,bfloat16,int8 --window 1024
                            --windows 8 --text FILE --peers hf]

The text (default: this project's README and docs, ~40k tokens of English and code) is cut into
windows of --window tokens; each window is one request whose prompt log-probabilities
(SamplingParams.prompt_logprobs) score every token after its first, given the ones before it.
Per pool: perplexity (exp of the mean negative log-likelihood), the mean and the largest
|log-probability difference| from the first pool's (float32 by default) over the same tokens,
and how often the pool's most likely next token is the first pool's. `--peers hf` adds Hugging
Face transformers on the same weights (float32; a GGUF dequantized by transformers) as a row
of its own: how far pagellm's default configuration is from the reference implementation.
"""
from __future__ import annotations

import argparse
import math
import os

import torch
from tqdm.auto import tqdm

from pagellm.benchmarks import common


def parse_args(argv):
    p = argparse.ArgumentParser(prog="pagellm bench accuracy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the default model (GGUF)")
    p.add_argument("--kv-dtypes", default="float32,bfloat16,int8",
                   help="KV pools to compare, comma-separated; the first is the reference")
    p.add_argument("--window", type=int, default=1024, help="tokens a window (one request)")
    p.add_argument("--windows", type=int, default=8, help="windows scored (from the text's start)")
    p.add_argument("--text", default=None,
                   help="a UTF-8 text file (default: README.md and docs/*.md of this checkout)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--peers", default="",
                   help="'hf': transformers (float32) as a row too; 'hf-bf16': transformers in "
                        "bfloat16 (where a bf16 engine's numerics sit)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="pagellm's model dtype (auto: its default, bf16 where the CPU has bf16 "
                        "units)")
    common.add_output_args(p)
    args = p.parse_args(argv)
    args.kv_dtypes = [d for d in args.kv_dtypes.split(",") if d]
    if len(args.kv_dtypes) < 1:
        raise ValueError("--kv-dtypes: name at least one pool")
    if args.smoke:
        args.window, args.windows = 48, 2
    return args


def default_text() -> str:
    """README.md and docs/*.md beside this package (a source checkout), else the package's
    own docstrings: English prose with code, the same text on every machine."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [os.path.join(root, "README.md")]
    docs = os.path.join(root, "docs")
    if os.path.isdir(docs):
        paths += sorted(os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))
    parts = [open(p, encoding="utf-8").read() for p in paths if os.path.isfile(p)]
    if not parts:
        import pagellm.engine.llm_engine as m

        parts = [m.__doc__ or "", m.LLMEngine.__doc__ or ""]
    return "\n\n".join(parts)


def windows(llm, args) -> list[list[int]]:
    tok = llm.engine.tokenizer
    if tok is None or args.smoke:  # the smoke model's ids are random
        return common.random_prompts(args.windows, args.window, llm.engine.vocab_size, seed=5)
    text = open(args.text, encoding="utf-8").read() if args.text else default_text()
    ids = tok.encode(text)
    n = min(args.windows, len(ids) // args.window)
    if n < 1:
        raise ValueError(f"--text: {len(ids)} tokens, fewer than one window of {args.window}")
    return [ids[i * args.window:(i + 1) * args.window] for i in range(n)]


def score(path: str, kv: str, wins: list[list[int]] | None, args):
    """(windows, per window: each scored token's log-probability and its position's most
    likely token) under pool `kv`; the windows are made by the first engine."""
    from pagellm import LLM, SamplingParams

    llm = LLM(path, dtype=args.dtype, kv_cache_dtype=kv, max_model_len=args.window + 8,
              enable_prefix_caching=False)
    wins = wins if wins is not None else windows(llm, args)
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    lps, tops = [], []
    for w in tqdm(wins, desc=f"kv {kv}", leave=False):
        out = llm.generate([w], sp, use_tqdm=False)[0]
        entries = out.prompt_logprobs[1:]
        lps.append([e[t] for e, t in zip(entries, w[1:])])
        tops.append([max(e, key=e.get) for e in entries])
    llm.shutdown()
    return wins, lps, tops


def score_hf(wins: list[list[int]], args, dtype: str = "float32"):
    """The same windows through transformers on the same weights, in float32 (the reference)
    or bfloat16 (weights and activations: what an engine computing in bf16 computes)."""
    spec = (common.ModelSpec(args.smoke_path, args.smoke_path, None) if args.smoke
            else common.ModelSpec.resolve(args.model))
    model = common.HFRunner(spec, dtype).model
    lps, tops = [], []
    for w in tqdm(wins, desc="hf", leave=False):
        with torch.inference_mode():
            logits = model(torch.tensor([w])).logits[0, :-1].float()
        rows = torch.log_softmax(logits, -1)
        lps.append(rows.gather(1, torch.tensor(w[1:]).unsqueeze(1)).squeeze(1).tolist())
        tops.append(rows.argmax(-1).tolist())
    return wins, lps, tops


def summarize(ref, got) -> dict:
    (_, ref_lps, ref_tops), (_, lps, tops) = ref, got
    flat = [v for w in lps for v in w]
    diffs = [abs(a - b) for wa, wb in zip(ref_lps, lps) for a, b in zip(wa, wb)]
    same = [a == b for wa, wb in zip(ref_tops, tops) for a, b in zip(wa, wb)]
    return {"tokens": len(flat), "perplexity": math.exp(-sum(flat) / len(flat)),
            "mean_abs_logprob_diff": sum(diffs) / len(diffs), "max_abs_logprob_diff": max(diffs),
            "top1_agreement": sum(same) / len(same)}


def render(rows: list[dict], args) -> str:
    lines = [f"# KV cache dtype and accuracy ({args.windows} windows of {args.window} tokens; "
             f"pagellm dtype {args.dtype}; reference: {rows[0]['kv_cache_dtype']})", ""]
    vs_hf = "vs_hf_top1_agreement" in rows[0]
    lines.append(common.markdown_table(
        ["KV pool", "tokens", "perplexity", "mean abs logprob diff", "max abs logprob diff",
         "top-1 agreement"] + (["vs hf float32: mean abs diff", "top-1"] if vs_hf else []),
        [[r["kv_cache_dtype"], r["tokens"], r["perplexity"], r["mean_abs_logprob_diff"],
          r["max_abs_logprob_diff"], f"{100 * r['top1_agreement']:.2f}%"]
         + ([r["vs_hf_mean_abs_logprob_diff"], f"{100 * r['vs_hf_top1_agreement']:.2f}%"]
            if vs_hf else []) for r in rows]))
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["kv_cache_dtype"] for r in rows]
    a.bar(names, [r["perplexity"] for r in rows], color="#4c72b0")
    a.set_title("perplexity")
    b.bar(names, [r["mean_abs_logprob_diff"] for r in rows], color="#dd8452")
    b.set_title(f"mean |log-prob difference| from {names[0]}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = common.smoke_model_dir() if args.smoke else common.ModelSpec.resolve(args.model).path
    args.smoke_path = path if args.smoke else None
    peers = [p for p in args.peers.split(",") if p]
    if set(peers) - {"hf", "hf-bf16"}:
        raise ValueError(f"--peers: only 'hf' and 'hf-bf16' here, got {args.peers!r}")
    results, wins = {}, None
    for kv in tqdm(args.kv_dtypes, desc="accuracy", unit="pool"):
        results[kv] = score(path, kv, wins, args)
        wins = results[kv][0]
    ref = results[args.kv_dtypes[0]]
    rows = [{"kv_cache_dtype": kv, **summarize(ref, results[kv])} for kv in args.kv_dtypes]
    scored = [results[kv] for kv in args.kv_dtypes]
    for peer, dtype in (("hf", "float32"), ("hf-bf16", "bfloat16")):
        if peer in peers:
            scored.append(score_hf(wins, args, dtype))
            rows.append({"kv_cache_dtype": f"hf transformers ({dtype})",
                         **summarize(ref, scored[-1])})
    if "hf" in peers:  # every row against the reference implementation as well
        hf = scored[len(args.kv_dtypes)]
        for row, got in zip(rows, scored):
            far = summarize(hf, got)
            row["vs_hf_mean_abs_logprob_diff"] = far["mean_abs_logprob_diff"]
            row["vs_hf_top1_agreement"] = far["top1_agreement"]
    files = common.write_results(args.out, "accuracy", {
        "config": {**{k: v for k, v in vars(args).items()},  # and the numerics knobs set
                   "env": {k: v for k, v in os.environ.items() if k.startswith("PAGELLM_")}},
        "results": rows}, render(rows, args))
    if not args.no_plot:
        plot(rows, os.path.join(args.out, "accuracy.png"))
    return 0 if files else 1
