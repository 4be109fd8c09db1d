"""The speculation controller's choices at fixed step costs: greedy outputs replayed.

    python -m benchmarks spec_replay [--costs 1,1.15,1.35,1.48,1.63 --k 4 --prompts 16]

Live benchmarks (benchmarks/spec.py) on a shared machine swing by 10-15% between runs minutes
apart, more than most controller changes move. Here the target runs once per prompt with
speculation off (greedy, default model, the copy and chat prompts of spec.py); then each
request is replayed at batch 1 through the engine's own SpecDecoder, n-gram proposer and
adaptive controller, its proposals verified against the recorded greedy tokens (what greedy
verification accepts), each step charged a fixed cost: --costs gives a step with k proposals
relative to a plain step (default: forward passes over 1..5 rows of the default model on
this project's CPU). The controller sees those costs as its measured step walls, with
--noise (lognormal sigma) to see how much scattered walls cost it. Policies: the adaptive
controller, fixed k, and an oracle that knows how many proposals verification would accept
(speculates exactly those, when that pays): the bound for this proposer at these costs.
speedup = plain steps' cost / replayed steps' cost, per request; median and mean reported.
"""
from __future__ import annotations

import argparse
import random
import statistics

from tqdm.auto import tqdm

from pagellm.benchmarks import common
from pagellm.benchmarks import spec as live


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks spec_replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--costs", default="1,1.15,1.35,1.48,1.63",
                   help="step cost with 0..k proposals, relative to a plain step")
    p.add_argument("--prompts", type=int, default=16, help="prompts per workload")
    p.add_argument("--prompt-lookup", default="1,4",
                   help="min,max n-gram length (the engine's defaults)")
    p.add_argument("--noise", type=float, default=0.0,
                   help="lognormal sigma of the walls the controller sees (costs stay exact)")
    common.add_output_args(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.max_tokens, args.prompts = 24, 4
    costs = [float(c) for c in args.costs.split(",")]
    if len(costs) < args.k + 1:
        p.error(f"--costs needs {args.k + 1} values (k = 0..{args.k}), got {len(costs)}")
    args.cost_list = costs
    return args


def record(args) -> dict[str, list[tuple[list[int], list[int]]]]:
    """(prompt, greedy output) per request and workload, speculation off."""
    from pagellm import LLM, SamplingParams

    spec = common.ModelSpec.resolve(common.smoke_model_dir() if args.smoke else args.model)
    llm = LLM(spec.path, dtype=args.dtype, kv_cache_memory="256MiB")
    vocab = llm.engine.vocab_size
    prompts = live.smoke_prompts(vocab) if args.smoke else live.chat_prompts(llm)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                            ignore_eos=args.smoke)
    out = {}
    for workload, ps in prompts.items():
        ps = ps[:args.prompts]
        outs = llm.generate(ps, params, use_tqdm=False)
        out[workload] = [(p, list(o.outputs[0].token_ids)) for p, o in zip(ps, outs)]
    llm.shutdown()
    return out


def _leading(proposal: list[int], tokens: list[int]) -> int:
    a = 0
    while a < len(proposal) and a < len(tokens) and proposal[a] == tokens[a]:
        a += 1
    return a


def replay(requests, args, policy: str) -> list[float]:
    """Per request: plain cost / replayed cost. One decoder for all requests in turn, as one
    engine serves them (the controller keeps what it learnt)."""
    from pagellm.sampling_params import SamplingParams
    from pagellm.sequence import Sequence
    from pagellm.spec_decode.decoder import SpecDecoder
    from pagellm.spec_decode.ngram import NgramIndex, NgramProposer

    lo, hi = (int(n) for n in args.prompt_lookup.split(","))
    dec = SpecDecoder(NgramProposer(lo, hi), max_k=args.k, adaptive=policy == "adaptive",
                      max_model_len=1 << 20, eos_token_id=None)
    costs, rng = args.cost_list, random.Random(0)
    speedups = []
    for i, (prompt, greedy) in enumerate(requests):
        if len(greedy) < 2:
            continue
        seq = Sequence(i, str(i), 0, list(prompt), SamplingParams(max_tokens=len(greedy)), None)
        seq.output_token_ids.append(greedy[0])  # the prefill step's token
        seq.num_computed_tokens = seq.num_tokens - 1
        oracle = NgramIndex(lo, hi)
        cost = 0.0
        while seq.num_output_tokens < len(greedy):
            pos = seq.num_output_tokens
            if policy == "oracle":  # the same lookups as the engine's (room: as propose's)
                room = min(args.k, len(greedy) - pos - 1)
                prop = oracle.lookup(prompt, seq.output_token_ids, room)[0] if room else []
                a = _leading(prop, greedy[pos:])
                spec = prop[:a] if a and (a + 1) / costs[a] > 1 else []
            else:  # the engine's step: propose, verify greedily, learn
                dec.propose([seq])
                spec, seq.spec_token_ids = seq.spec_token_ids, []
                a = _leading(spec, greedy[pos:])
                dec._record(seq, len(spec), a)
                dec._q.pop(seq.seq_id, None)
                dec.observe(1, costs[len(spec)] * rng.lognormvariate(0, args.noise))
            seq.output_token_ids.extend(greedy[pos:pos + a + 1])
            seq.num_computed_tokens = seq.num_tokens - 1
            cost += costs[len(spec)]
        dec.release(seq)
        speedups.append((len(greedy) - 1) / cost)
    return speedups


def main(argv=None) -> int:
    args = parse_args(argv)
    requests = record(args)
    policies = ["adaptive", f"fixed k={args.k}", "oracle"]
    rows, per_request = [], {}
    bar = tqdm(total=len(policies) * len(requests), desc="replay", unit="policy")
    for workload, reqs in requests.items():
        for policy in policies:
            sp = replay(reqs, args, policy.split(" ")[0])
            per_request[f"{workload} {policy}"] = sp
            rows.append({"workload": workload, "policy": policy,
                         "median_speedup": statistics.median(sp) if sp else None,
                         "mean_speedup": statistics.fmean(sp) if sp else None,
                         "requests": len(sp)})
            bar.update(1)
    bar.close()
    fmt = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    md = (f"### Speculation replayed at fixed step costs {args.cost_list[:args.k + 1]}, "
          f"k={args.k}, noise {args.noise}\n\n" + common.markdown_table(
              ["workload", "policy", "median speedup", "mean speedup", "requests"],
              [[r["workload"], r["policy"], fmt(r["median_speedup"]), fmt(r["mean_speedup"]),
                r["requests"]] for r in rows]))
    common.write_results(args.out, "spec_replay", {"config": vars(args), "results": rows,
                                                  "per_request": per_request}, md)
    if not args.no_plot:
        plot(per_request, f"{args.out}/spec_replay.png")
    return 0


def plot(per_request: dict[str, list[float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    names = list(per_request)
    ax.boxplot([per_request[n] or [0.0] for n in names])
    ax.set_xticks(range(1, len(names) + 1), names, rotation=30, ha="right")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("speedup over plain decoding (per request)")
    ax.set_title("n-gram speculation replayed at fixed step costs")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
