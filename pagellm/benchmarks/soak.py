"""Soak: many streaming clients with random parameters, disconnects and aborts against a live
`pagellm serve` for minutes; zero 5xx, zero leaked KV blocks, bounded memory growth.

    python -m benchmarks soak                  # 32 clients, 10 minutes, the default model
    python -m benchmarks soak --smoke          # 8 clients, 20 s (CI)

Each client loops: a completion or chat request with random n (1-3), max_tokens, temperature,
seed, stop strings, logprobs and streaming (80%), or (10%) llama.cpp's /completion with random
n_predict (0 included), n_probs, n_indent and t_max_predict_ms; 10% of streams are closed by the client after
a few chunks, 5% of requests are cancelled before their first token. The server runs n-gram
speculation. Reported: requests completed, HTTP statuses (every 5xx and every error chunk in a
stream is counted), p50/p99 time to first token and inter-token latency, the server's RSS
(after warm-up, at the end, the largest), and the KV blocks still in use once every request
has ended (must be zero; blocks kept for the prefix cache count as free).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import time
from collections import Counter

import httpx

from pagellm.benchmarks import common
from pagellm.benchmarks.serve import launch, percentiles, served_model, wait_ready

WORDS = ("the a of and to in is was for on that with as by at from it an be this which or "
         "time story code river city number light music garden market window letter").split()
STOPS = [".", "\n", " the", " and", "!", "ing"]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks soak",
                                description=__doc__.split("\n\n")[0])
    common.add_output_args(p)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--server-args", default="--speculative-method ngram --max-num-seqs 64",
                   help="arguments of the launched `pagellm serve` (model first, if any)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    if args.smoke:
        args.clients, args.minutes = 8, 20 / 60
    return args


def random_body(rng: random.Random, model: str) -> tuple[str, dict]:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))
    if rng.random() < 0.1:  # llama.cpp's own route, with its code-completion stops
        body = {"prompt": text, "n_predict": rng.randint(0, 48), "stream": rng.random() < 0.8,
                "temperature": rng.choice([0.0, 0.7, 1.0]), "n_probs": rng.choice([0, 0, 2]),
                "n_indent": rng.choice([0, 0, 2]), "t_max_predict_ms": rng.choice([0, 0, 50]),
                "cache_prompt": True}
        if rng.random() < 0.4:
            body["stop"] = rng.sample(STOPS, rng.randint(1, 3))
        return "/completion", body
    chat = rng.random() < 0.3
    body = {"model": model, "max_tokens": rng.randint(4, 48), "n": rng.choice([1, 1, 1, 2, 3]),
            "temperature": rng.choice([0.0, 0.7, 1.0]), "stream": rng.random() < 0.8}
    if rng.random() < 0.5:
        body["seed"] = rng.randrange(2**31)
    if rng.random() < 0.4:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 3))
    if rng.random() < 0.3:
        k = rng.randint(0, 3)
        body.update({"logprobs": True, "top_logprobs": k} if chat else {"logprobs": k})
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        return "/v1/chat/completions", body
    body["prompt"] = text
    return "/v1/completions", body


class Tally:
    def __init__(self):
        self.statuses: Counter = Counter()
        self.stream_errors = 0
        self.transport_errors: list[str] = []
        self.completed = self.disconnected = self.cancelled = 0
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.timeline: list[tuple[float, int]] = []  # (seconds, requests completed)


async def one(client, url: str, path: str, body: dict, rng: random.Random, tally: Tally):
    start = last = time.perf_counter()
    if not body["stream"]:
        r = await client.post(url + path, json=body)
        tally.statuses[r.status_code] += 1
        if r.status_code == 200:
            tally.completed += 1
        return
    close_after = rng.randint(1, 5) if rng.random() < 0.1 else None
    chunks = 0
    async with client.stream("POST", url + path, json=body) as r:
        tally.statuses[r.status_code] += 1
        if r.status_code != 200:
            await r.aread()
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                tally.stream_errors += 1
                return
            if not data.get("choices") and not data.get("content"):
                continue  # (a llama.cpp stream's chunks carry "content")
            now = time.perf_counter()
            if chunks == 0:
                tally.ttft.append(now - start)
            else:
                tally.itl.append(now - last)
            last, chunks = now, chunks + 1
            if close_after is not None and chunks >= close_after:
                tally.disconnected += 1
                return  # leaving the block closes the connection mid-stream
    tally.completed += 1


async def client_loop(idx: int, url: str, model: str, deadline: float, seed: int, tally: Tally,
                      t0: float):
    rng = random.Random(seed * 1000 + idx)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        while time.monotonic() < deadline:
            path, body = random_body(rng, model)
            task = asyncio.ensure_future(one(client, url, path, body, rng, tally))
            try:
                if rng.random() < 0.05:  # an abort: the client gives up early
                    await asyncio.sleep(rng.uniform(0.0, 0.5))
                    if not task.done():
                        task.cancel()
                        tally.cancelled += 1
                await task
            except asyncio.CancelledError:
                pass
            except (httpx.HTTPError, json.JSONDecodeError) as e:
                tally.transport_errors.append(repr(e)[:200])
            tally.timeline.append((time.monotonic() - t0, tally.completed))


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    return {s.name: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name.startswith("pagellm:")}


async def sample_rss(pid: int, deadline: float, t0: float, samples: list):
    while time.monotonic() < deadline:
        samples.append((time.monotonic() - t0, rss_mib(pid)))
        await asyncio.sleep(2.0)


async def soak(url: str, model: str, args, pid: int) -> tuple[Tally, list]:
    tally, rss = Tally(), []
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60
    await asyncio.gather(sample_rss(pid, deadline, t0, rss),
                         *(client_loop(i, url, model, deadline, args.seed, tally, t0)
                           for i in range(args.clients)))
    return tally, rss


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    proc, url = launch(shlex.split(args.server_args), os.path.join(args.out, "soak-server.log"))
    try:
        wait_ready(url, args.startup_timeout, proc)
        model = served_model(url)
        asyncio.run(_warm_up(url, model))
        rss_start = rss_mib(proc.pid)
        common.log(f"soak: {args.clients} clients for {args.minutes:g} min against {url}")
        tally, rss = asyncio.run(soak(url, model, args, proc.pid))
        idle_deadline = time.monotonic() + 60
        while True:  # every request ended (aborted ones included)?
            m = scrape(url)
            busy = m["pagellm:num_requests_running"] + m["pagellm:num_requests_waiting"]
            if not busy or time.monotonic() > idle_deadline:
                break
            time.sleep(0.5)
        leaked = round(m["pagellm:kv_cache_usage_perc"] * m["pagellm:kv_cache_num_blocks"])
        rss_end = rss_mib(proc.pid)
        healthy = httpx.get(url + "/health", timeout=30).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    num_5xx = sum(n for s, n in tally.statuses.items() if s >= 500)
    rss_max = max([v for _, v in rss] + [rss_end])
    result = {
        "clients": args.clients, "minutes": args.minutes,
        "requests_completed": tally.completed, "statuses": dict(tally.statuses),
        "num_5xx": num_5xx, "stream_errors": tally.stream_errors,
        "transport_errors": len(tally.transport_errors),
        "transport_error_examples": tally.transport_errors[:5],
        "client_disconnects": tally.disconnected, "client_aborts": tally.cancelled,
        "leaked_blocks": leaked, "busy_at_end": busy, "healthy_at_end": healthy,
        "ttft_s": percentiles(tally.ttft), "itl_s": percentiles(tally.itl),
        "rss_mib": {"after_warm_up": rss_start, "end": rss_end, "max": rss_max,
                    "growth": rss_end - rss_start},
        "rss_timeline": rss, "completed_timeline": tally.timeline[::max(1, len(
            tally.timeline) // 400)],
        "generation_tokens": m.get("pagellm:generation_tokens_total",
                                   m.get("pagellm:generation_tokens")),
    }
    ok = not num_5xx and not tally.stream_errors and not leaked and not busy and healthy
    md = render(result, ok)
    common.write_results(args.out, "soak", {"config": vars(args), "results": result,
                                            "passed": ok}, md)
    if not args.no_plot:
        plot(result, os.path.join(args.out, "soak.png"))
    return 0 if ok else 1


async def _warm_up(url: str, model: str) -> None:
    async with httpx.AsyncClient(timeout=300) as client:
        for _ in range(2):
            r = await client.post(url + "/v1/completions",
                                  json={"model": model, "prompt": "warm up", "max_tokens": 8})
            r.raise_for_status()


def render(r: dict, ok: bool) -> str:
    def ms(p):
        return "-" if p.get("p50") is None else f"{p['p50'] * 1e3:.0f} / {p['p99'] * 1e3:.0f}"

    rows = [["clients x minutes", f"{r['clients']} x {r['minutes']:g}"],
            ["requests completed", r["requests_completed"]],
            ["HTTP statuses", ", ".join(f"{k}: {v}" for k, v in sorted(r["statuses"].items()))],
            ["5xx / error chunks / transport errors",
             f"{r['num_5xx']} / {r['stream_errors']} / {r['transport_errors']}"],
            ["client disconnects / aborts", f"{r['client_disconnects']} / {r['client_aborts']}"],
            ["KV blocks in use at the end", r["leaked_blocks"]],
            ["TTFT p50 / p99 (ms)", ms(r["ttft_s"])], ["ITL p50 / p99 (ms)", ms(r["itl_s"])],
            ["server RSS after warm-up / end / max (MiB)",
             f"{r['rss_mib']['after_warm_up']:.0f} / {r['rss_mib']['end']:.0f} / "
             f"{r['rss_mib']['max']:.0f}"],
            ["passed", ok]]
    return "# Soak\n\n" + common.markdown_table(["", "value"], rows) + "\n"


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    if r["rss_timeline"]:
        t, v = zip(*r["rss_timeline"])
        ax.plot(t, v, color="tab:blue", label="server RSS (MiB)")
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS (MiB)")
    ax2 = ax.twinx()
    if r["completed_timeline"]:
        t, c = zip(*r["completed_timeline"])
        ax2.plot(t, c, color="tab:green", label="requests completed")
    ax2.set_ylabel("requests completed")
    fig.legend(loc="upper left")
    ax.set_title(f"soak: {r['clients']} clients, {r['num_5xx']} 5xx, "
                 f"{r['leaked_blocks']} blocks left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
