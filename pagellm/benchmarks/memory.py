"""KV memory accounting: how much of a fixed KV budget holds real KV, and how many requests
fit at once, under static contiguous allocation vs pagellm's paged cache.

Workload (seeded): prompt lengths ~ lognormal(median 300, sigma 0.9) clipped to [20, 2000];
output lengths ~ lognormal(median 150, sigma 1.0) clipped to [10, 1000]; all requests queued at
step 0 (or Poisson arrivals with --arrival-rate). One step = one decode token for every running
request; a prompt is prefilled in the step it is admitted.

Policies, all on the same budget (slots = budget / KV bytes per token):
  static-max-len  each request reserves max_model_len contiguous slots (older engines)
  static-declared each request reserves prompt + max_tokens (declared limit) contiguous slots
  paged           pagellm's real Scheduler + BlockManager (allocate_slots / free per step)
Static policies place reservations first-fit in one address space; they free on departure.

Each saturated step (some request waiting) splits the budget into: used (tokens with KV),
internal fragmentation (paged: unused slots of each request's last block), reserved-not-yet
(reserved for tokens still to be generated), reserved-never (reserved beyond the request's
final length), external fragmentation (free >= the head request's need, but no contiguous
hole fits it; zero for paged by construction) and free. Reported as time averages.

    python -m benchmarks memory [--num-requests 1000 --kv-cache-memory 1GiB --block-size 16]
"""
from __future__ import annotations

import argparse
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from tqdm.auto import tqdm

from pagellm.benchmarks import common

PARTS = ["used", "internal_frag", "reserved_not_yet", "reserved_never", "external_frag", "free"]
# SmolLM2-135M in bfloat16: 2 (K and V) x 30 layers x 3 KV heads x 64 dims x 2 bytes.
SMOLLM2_KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2


@dataclass
class Req:
    rid: int
    prompt_len: int
    output_len: int
    arrival_step: int

    @property
    def final_kv(self) -> int:  # the last sampled token never gets KV
        return self.prompt_len + self.output_len - 1


@dataclass
class Tally:
    total: int  # slots in the budget
    sums: dict = field(default_factory=lambda: dict.fromkeys(PARTS, 0))
    saturated_steps: int = 0
    steps: int = 0
    concurrency_sum: int = 0
    peak_concurrency: int = 0
    preemptions: int = 0

    def add(self, parts: dict, running: int, saturated: bool) -> None:
        self.steps += 1
        self.peak_concurrency = max(self.peak_concurrency, running)
        if not saturated:
            return
        parts["free"] = self.total - sum(parts.values())
        assert parts["free"] >= 0, parts
        for k, v in parts.items():
            self.sums[k] += v
        self.saturated_steps += 1
        self.concurrency_sum += running

    def summary(self) -> dict:
        n = max(self.saturated_steps, 1)
        frac = {k: v / (n * self.total) for k, v in self.sums.items()}
        held = sum(frac[k] for k in PARTS[:5])
        return {"fractions_of_budget": frac, "waste_pct": 100 * (held - frac["used"]) / held,
                "mean_concurrency": self.concurrency_sum / n, "peak_concurrency": self.peak_concurrency,
                "steps": self.steps, "saturated_steps": self.saturated_steps,
                "preemptions": self.preemptions}


def sample_workload(args) -> list[Req]:
    rng = np.random.default_rng(args.seed)
    n = args.num_requests
    prompts = np.clip(np.rint(rng.lognormal(np.log(300), 0.9, n)), 20, args.max_prompt)
    outputs = np.clip(np.rint(rng.lognormal(np.log(150), 1.0, n)), 10, args.max_output)
    if args.arrival_rate:
        arrivals = np.floor(np.cumsum(rng.exponential(1 / args.arrival_rate, n)))
    else:
        arrivals = np.zeros(n)
    return [Req(i, int(p), int(o), int(a)) for i, (p, o, a) in
            enumerate(zip(prompts, outputs, arrivals))]


def simulate_static(reqs: list[Req], total: int, reserve, bar) -> Tally:
    """First-fit contiguous reservations of reserve(req) slots; freed on departure."""
    tally = Tally(total)
    pending, waiting = deque(reqs), deque()
    running: list[list] = []  # [req, start, size, kv_len, generated]
    step = 0
    while pending or waiting or running:
        while pending and pending[0].arrival_step <= step:
            waiting.append(pending.popleft())
        for r in running:  # decode: KV of the last token, one new token
            r[3] += 1
            r[4] += 1
        done = [r for r in running if r[4] >= r[0].output_len]
        running = [r for r in running if r[4] < r[0].output_len]  # departures free first
        bar.update(len(done))
        while waiting:
            size = reserve(waiting[0])
            start = _first_fit(sorted((r[1], r[2]) for r in running), size, total)
            if start is None:
                break
            req = waiting.popleft()
            running.append([req, start, size, req.prompt_len, 1])  # prefill + first token
        parts = {"used": sum(r[3] for r in running), "internal_frag": 0,
                 "reserved_not_yet": sum(r[0].final_kv - r[3] for r in running),
                 "reserved_never": sum(r[2] - r[0].final_kv for r in running)}
        free = total - sum(r[2] for r in running)
        parts["external_frag"] = free if waiting and free >= reserve(waiting[0]) else 0
        tally.add(parts, len(running), bool(waiting))
        step += 1
    return tally


def _first_fit(allocs: list[tuple[int, int]], size: int, total: int) -> int | None:
    pos = 0
    for start, length in allocs:
        if start - pos >= size:
            return pos
        pos = start + length
    return pos if total - pos >= size else None


def simulate_paged(reqs: list[Req], total: int, block_size: int, max_batched: int, bar) -> Tally:
    """pagellm's Scheduler and BlockManager, with the model replaced by 'sample token 1'."""
    from pagellm.engine.block_manager import BlockManager
    from pagellm.engine.scheduler import Scheduler
    from pagellm.sampling_params import SamplingParams
    from pagellm.sequence import Sequence

    bm = BlockManager(total // block_size, block_size, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=10**9, max_num_batched_tokens=max_batched)
    tally = Tally(total)
    pending, step = deque(reqs), 0
    while pending or sched.has_unfinished():
        while pending and pending[0].arrival_step <= step:
            r = pending.popleft()
            sched.add(Sequence(r.rid, str(r.rid), 0, [0] * r.prompt_len,
                               SamplingParams(max_tokens=r.output_len), None))
        out = sched.schedule()
        assert out.seqs or not sched.waiting, "a request needs more KV than the whole budget"
        for seq, n in zip(out.seqs, out.num_tokens):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens >= seq.num_tokens:
                seq.output_token_ids.append(1)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    sched.remove(seq)  # -> block_manager.forget: every block back
                    bar.update(1)
        used = sum(s.num_computed_tokens for s in sched.running)
        reserved = bm.num_used_blocks * block_size
        assert all(len(s.block_table) * block_size - s.num_computed_tokens < block_size
                   for s in sched.running)
        tally.add({"used": used, "internal_frag": reserved - used, "reserved_not_yet": 0,
                   "reserved_never": 0, "external_frag": 0}, len(sched.running),
                  bool(sched.waiting))
        step += 1
    tally.preemptions = sched.num_preemptions
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    return tally


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--kv-cache-memory", default="1GiB", help="the KV budget, e.g. 1GiB")
    p.add_argument("--bytes-per-token", type=int, default=SMOLLM2_KV_BYTES_PER_TOKEN,
                   help="KV bytes per token (default: SmolLM2-135M in bfloat16, 23040)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-prompt", type=int, default=2000)
    p.add_argument("--max-output", type=int, default=1000)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="static reservation (default: max prompt + max output)")
    p.add_argument("--arrival-rate", type=float, default=None,
                   help="Poisson arrivals per step (default: all queued at step 0)")
    p.add_argument("--seed", type=int, default=0)
    common.add_output_args(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.num_requests, args.kv_cache_memory = 80, "256MiB"
    args.max_model_len = args.max_model_len or args.max_prompt + args.max_output
    return args


def render(res: dict, args, total: int) -> str:
    head = (f"### KV memory: {args.num_requests} requests, budget {args.kv_cache_memory} = "
            f"{total} token slots ({args.bytes_per_token} B/token), block size {args.block_size}, "
            f"max_model_len {args.max_model_len}; time averages over saturated steps\n")
    base = res["static-max-len"]["mean_concurrency"]
    rows = []
    for name, s in res.items():
        f = s["fractions_of_budget"]
        rows.append([name, f"{s['waste_pct']:.1f}%"] + [f"{100 * f[k]:.1f}%" for k in PARTS]
                    + [round(s["mean_concurrency"], 1), s["peak_concurrency"],
                       f"{s['mean_concurrency'] / base:.1f}x", s["steps"], s["preemptions"]])
    return head + "\n" + common.markdown_table(
        ["policy", "waste"] + PARTS + ["mean concurrent", "peak", "vs static", "steps",
                                        "preemptions"], rows)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = ["tab:green", "tab:orange", "tab:purple", "tab:red", "tab:brown", "lightgrey"]
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(res)
    bottom = np.zeros(len(names))
    for part, color in zip(PARTS, colors):
        vals = np.array([100 * res[n]["fractions_of_budget"][part] for n in names])
        ax.bar(names, vals, bottom=bottom, color=color, label=part.replace("_", " "))
        bottom += vals
    for i, n in enumerate(names):
        ax.text(i, 101, f"{res[n]['mean_concurrency']:.0f} concurrent", ha="center", va="bottom")
    ax.set_ylim(0, 112)
    ax.set_ylabel("% of KV budget (time average)")
    ax.set_title("Where the KV budget goes")
    ax.legend(loc="center left", bbox_to_anchor=(1, 0.5), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from pagellm.config import parse_bytes

    args = parse_args(argv)
    total = parse_bytes(args.kv_cache_memory, "kv_cache_memory") // args.bytes_per_token
    total -= total % args.block_size
    if args.max_model_len > total:
        raise SystemExit(f"budget of {total} slots is smaller than max_model_len {args.max_model_len}")
    reqs = sample_workload(args)
    res = {}
    policies = {"static-max-len": lambda r: args.max_model_len,
                "static-declared": lambda r: r.prompt_len + args.max_output}
    for name, reserve in policies.items():
        with tqdm(total=len(reqs), desc=name, unit="req") as bar:
            res[name] = simulate_static(reqs, total, reserve, bar).summary()
    with tqdm(total=len(reqs), desc="paged", unit="req") as bar:
        res["paged"] = simulate_paged(reqs, total, args.block_size, args.max_num_batched_tokens,
                                      bar).summary()
    lens = {"prompt": [r.prompt_len for r in reqs], "output": [r.output_len for r in reqs]}
    workload = {k: {f"p{q}": float(np.percentile(v, q)) for q in (10, 50, 90, 99)}
                | {"mean": float(np.mean(v))} for k, v in lens.items()}
    ratio = res["paged"]["mean_concurrency"] / res["static-max-len"]["mean_concurrency"]
    targets = {"paged_waste_below_4pct": res["paged"]["waste_pct"] < 4,
               "concurrency_vs_static": ratio, "concurrency_at_least_3x": ratio >= 3}
    common.write_results(args.out, "memory", {
        "config": vars(args), "token_slots": total, "workload": workload, "results": res,
        "targets": targets}, render(res, args, total))
    if not args.no_plot:
        plot(res, f"{args.out}/memory.png")
    return 0
