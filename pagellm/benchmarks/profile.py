"""Profile a workload from a request log: input/output length distribution, and settings for it
(block size, KV budget, max sequences, prefill token budget, speculation), each with its rule.

Input: a .jsonl file (one record per line) or a .json list. Accepted records (first match wins):
  {"prompt_tokens": 412, "output_tokens": 87}          counts (also input_tokens /
                                                        completion_tokens)
  {"prompt": "text" | [ids], "output": "text" | [ids]}  (also completion / response, and
                                                        prompt_token_ids / output_token_ids)
  {"usage": {"prompt_tokens": .., "completion_tokens": ..}}   an OpenAI response, also nested
                                                        as {"response": {"body": {...}}} (Batch API)
  {"messages": [{"role": .., "content": ..}], "max_tokens": N}  an OpenAI chat request, also
                                                        as {"body": {...}}; output = max_tokens
  {"conversations": [{"from": "human", "value": ..}, {"from": "gpt", "value": ..}]}  ShareGPT
Text is tokenized with the model's tokenizer (--tokenizer; default model), or estimated at
--chars-per-token. With output text or ids present, the n-gram match rate (how often the next
output token is what prompt lookup would propose) is measured for the speculation advice.

    python -m benchmarks profile requests.jsonl [--kv-cache-memory 2GiB]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import tempfile

import numpy as np
from tqdm.auto import tqdm

from pagellm.benchmarks import common
from pagellm.benchmarks.memory import SMOLLM2_KV_BYTES_PER_TOKEN


class Lengths:
    def __init__(self, args):
        self.args, self._tok = args, None

    def count(self, x) -> tuple[int, list[int] | None]:
        """(length, token ids or None) of a text, id list or message list."""
        if isinstance(x, list) and all(isinstance(t, int) for t in x):
            return len(x), x
        if isinstance(x, list):  # chat messages: contents plus ~4 template tokens each
            n = [self.count(m.get("content") or "")[0] + 4 for m in x]
            return sum(n), None
        if self.args.chars_per_token:
            return max(1, math.ceil(len(x) / self.args.chars_per_token)), None
        if self._tok is None:
            from pagellm.models.loader import load_model_files

            self._tok = load_model_files(self.args.tokenizer).tokenizer
        ids = self._tok.encode(x, add_special_tokens=False)
        return len(ids), ids

    def parse(self, rec: dict):
        """-> (prompt_len, output_len or None, prompt ids, output ids) or None if unknown."""
        body = rec.get("body") if isinstance(rec.get("body"), dict) else {}
        resp = (rec.get("response") or {}).get("body") if isinstance(rec.get("response"), dict) else None
        usage = rec.get("usage") or (resp or {}).get("usage")
        p = _first(rec, "prompt_tokens", "input_tokens")
        o = _first(rec, "output_tokens", "completion_tokens")
        if p is not None:
            return int(p), None if o is None else int(o), None, None
        if usage:
            return usage["prompt_tokens"], usage.get("completion_tokens"), None, None
        if "conversations" in rec:
            turns = rec["conversations"]
            human = next((t["value"] for t in turns if t.get("from") in ("human", "user")), None)
            gpt = next((t["value"] for t in turns if t.get("from") in ("gpt", "assistant")), None)
            rec = {"prompt": human, "output": gpt}
        prompt = _first(rec, "prompt_token_ids", "prompt") or _first(body, "prompt")
        msgs = rec.get("messages") or body.get("messages")
        output = _first(rec, "output_token_ids", "output", "completion", "response")
        if prompt is None and msgs is None:
            return None
        plen, pids = self.count(prompt if prompt is not None else msgs)
        if isinstance(output, (str, list)):
            olen, oids = self.count(output)
            return plen, olen, pids, oids
        declared = _first(rec, "max_tokens", "max_completion_tokens") or _first(
            body, "max_tokens", "max_completion_tokens")
        return plen, declared, pids, None


def _first(d: dict, *keys):
    return next((d[k] for k in keys if isinstance(d, dict) and d.get(k) is not None), None)


def read_records(path: str):
    with open(path) as f:
        if path.endswith(".json"):
            data = json.load(f)
            yield from (data.get("data", []) if isinstance(data, dict) else data)
            return
        for line in f:
            if line.strip():
                yield json.loads(line)


def ngram_matches(prompt: list[int], output: list[int], n: int = 3) -> tuple[int, int]:
    """(matches, positions): for each output position, prompt lookup proposes the token that
    followed the latest earlier occurrence of the last n tokens; a match = the proposal is the
    real next token. E.g. context [a b c x ... a b c] proposes x."""
    ctx, last, hits = list(prompt), {}, 0
    for i in range(n, len(ctx)):
        last[tuple(ctx[i - n:i])] = i
    for tok in output:
        key = tuple(ctx[-n:])
        j = last.get(key)
        hits += j is not None and ctx[j] == tok
        if len(ctx) >= n:
            last[key] = len(ctx)
        ctx.append(tok)
    return hits, len(output)


def percentiles(xs) -> dict:
    xs = np.asarray(xs, dtype=float)
    return {**{f"p{q}": float(np.percentile(xs, q)) for q in (50, 90, 95, 99)},
            "max": float(xs.max()), "mean": float(xs.mean()), "count": int(xs.size)}


def recommend(prompts, outputs, match_rate, args) -> dict:
    p, o = np.asarray(prompts, float), np.asarray(outputs, float)
    total = p + o
    # Block size: the largest of 8/16/32 whose internal fragmentation (unused slots in each
    # request's last block) stays <= 2% of the slots it holds; bigger blocks mean shorter
    # block tables and fewer gather indices per step.
    waste = {b: float((np.ceil(total / b) * b - total).sum() / (np.ceil(total / b) * b).sum())
             for b in (8, 16, 32)}
    block = max([b for b, w in waste.items() if w <= 0.02], default=8)
    # KV per running request, time-weighted: a request holds prompt + (tokens so far) while it
    # decodes, for `output` steps, so the mean occupancy is sum(o * (p + o/2)) / sum(o).
    occupancy = float((o * (p + o / 2)).sum() / o.sum())
    bpt = args.bytes_per_token
    if args.kv_cache_memory:
        from pagellm.config import parse_bytes

        budget = parse_bytes(args.kv_cache_memory, "kv_cache_memory")
        seqs = max(1, min(256, int(budget / (1.2 * occupancy * bpt))))
        seqs_rule = "budget / (1.2 x time-weighted KV per request), capped at 256"
    else:
        seqs = args.concurrency
        budget = int(max(seqs * occupancy * 1.2, total.max()) * bpt)
        seqs_rule = ("--concurrency (CPU decode stops gaining past ~64); budget = max_num_seqs x "
                     "1.2 x time-weighted KV per request, and at least the longest request")
    batched = int(max(2048, 256 * math.ceil(np.percentile(p, 90) / 256)))
    spec_on = match_rate is not None and match_rate >= 0.3 and np.median(o) >= 32
    spec_rule = ("n-gram (prompt lookup, k=4) when >= 30% of output tokens are what prompt lookup "
                 "proposes and the median output is >= 32 tokens; it pays at small batches "
                 "(<= 8 running), where a decode step is memory-bound and verifying k tokens costs "
                 "about one step")
    spec = ("on for low concurrency: --speculative-method ngram" if spec_on else
            "off" + ("" if match_rate is not None else " (no output tokens in the log to measure "
                     "the n-gram match rate)"))
    return {"block_size": block, "block_waste": waste, "kv_cache_memory_mib": math.ceil(budget / 2**20),
            "max_num_seqs": seqs, "max_num_batched_tokens": batched,
            "time_weighted_kv_tokens_per_request": occupancy, "speculation": spec,
            "ngram_match_rate": match_rate, "rules": {"max_num_seqs": seqs_rule,
            "speculation": spec_rule, "max_num_batched_tokens": "p90 prompt rounded up to 256, "
            "at least 2048, so most prompts prefill in one step"}}


def render(stats, rec, n_skipped, args) -> str:
    rows = [[k] + [round(v[q], 1) for q in ("mean", "p50", "p90", "p95", "p99", "max")]
            + [v["count"]] for k, v in stats.items()]
    out = [f"### Workload profile: {args.log} ({n_skipped} records without lengths skipped)\n",
           common.markdown_table(["tokens", "mean", "p50", "p90", "p95", "p99", "max", "n"], rows),
           "\n### Recommended settings\n",
           common.markdown_table(["setting", "value", "rule"], [
               ["block_size", rec["block_size"], "largest of 8/16/32 with <= 2% internal "
                "fragmentation: " + ", ".join(f"{b}: {100 * w:.1f}%" for b, w in rec["block_waste"].items())],
               ["kv_cache_memory", f"{rec['kv_cache_memory_mib']} MiB",
                f"{args.bytes_per_token} B/token x time-weighted "
                f"{rec['time_weighted_kv_tokens_per_request']:.0f} tokens/request"],
               ["max_num_seqs", rec["max_num_seqs"], rec["rules"]["max_num_seqs"]],
               ["max_num_batched_tokens", rec["max_num_batched_tokens"],
                rec["rules"]["max_num_batched_tokens"]],
               ["speculation", rec["speculation"] + (f" (match rate {rec['ngram_match_rate']:.0%})"
                if rec["ngram_match_rate"] is not None else ""), rec["rules"]["speculation"]]])]
    return "\n".join(out)


def plot(prompts, outputs, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, xs, name in ((axes[0], prompts, "prompt"), (axes[1], outputs, "output")):
        xs = np.maximum(np.asarray(xs), 1)
        bins = np.logspace(np.log10(xs.min()), np.log10(xs.max() + 1), 30)
        ax.hist(xs, bins=bins, color="tab:blue")
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} tokens")
        ax.axvline(np.median(xs), color="k", ls="--", label=f"median {np.median(xs):.0f}")
        ax.legend()
    axes[0].set_ylabel("requests")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_smoke_log() -> str:
    """A small log mixing every accepted shape (prompt lookup finds copies in the id records)."""
    rng = np.random.default_rng(0)
    path = os.path.join(tempfile.mkdtemp(prefix="pagellm-profile-"), "log.jsonl")
    with open(path, "w") as f:
        for i in range(200):
            p, o = int(rng.lognormal(5.5, 0.8)) + 1, int(rng.lognormal(4.5, 0.8)) + 1
            ids = rng.integers(0, 500, p).tolist()
            rec = [{"prompt_tokens": p, "output_tokens": o},
                   {"prompt": ids, "output": (ids * 4)[5:5 + o]},
                   {"usage": {"prompt_tokens": p, "completion_tokens": o}},
                   {"response": {"body": {"usage": {"prompt_tokens": p, "completion_tokens": o}}}},
                   {"messages": [{"role": "user", "content": "x" * (4 * p)}], "max_tokens": o},
                   {"conversations": [{"from": "human", "value": "y" * (4 * p)},
                                      {"from": "gpt", "value": "z" * (4 * o)}]}][i % 6]
            f.write(json.dumps(rec) + "\n")
    return path


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", nargs="?", help="request log: .jsonl or .json list")
    p.add_argument("--tokenizer", default=None, help="model whose tokenizer counts text (default model)")
    p.add_argument("--chars-per-token", type=float, default=None,
                   help="estimate text lengths instead of tokenizing (e.g. 4)")
    p.add_argument("--bytes-per-token", type=int, default=SMOLLM2_KV_BYTES_PER_TOKEN,
                   help="KV bytes per token (default: SmolLM2-135M bfloat16)")
    p.add_argument("--kv-cache-memory", default=None, help="fixed KV budget -> max_num_seqs")
    p.add_argument("--concurrency", type=int, default=64, help="target max_num_seqs")
    common.add_output_args(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.log, args.chars_per_token = args.log or write_smoke_log(), args.chars_per_token or 4
    if not args.log:
        p.error("a request log is required (or --smoke)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    lengths, prompts, pairs, skipped, hits, positions = Lengths(args), [], [], 0, 0, 0
    for rec in tqdm(read_records(args.log), desc="profile", unit="rec"):
        parsed = lengths.parse(rec) if isinstance(rec, dict) else None
        if parsed is None:
            skipped += 1
            continue
        plen, olen, pids, oids = parsed
        prompts.append(plen)
        if olen is not None:
            pairs.append((plen, int(olen)))
        if pids is not None and oids:
            h, n = ngram_matches(pids, oids)
            hits, positions = hits + h, positions + n
    if not pairs:
        raise SystemExit(f"{args.log}: no records with both prompt and output lengths")
    outputs = [o for _, o in pairs]
    stats = {"prompt": percentiles(prompts), "output": percentiles(outputs),
             "total": percentiles([p + o for p, o in pairs])}
    rec = recommend([p for p, _ in pairs], outputs, hits / positions if positions else None, args)
    common.write_results(args.out, "profile", {"log": args.log, "lengths": stats,
                                               "recommendation": rec, "skipped": skipped},
                         render(stats, rec, skipped, args))
    if not args.no_plot:
        plot(prompts, outputs, f"{args.out}/profile.png")
    return 0
