"""Serving benchmark: Poisson arrivals of streaming requests against an OpenAI-compatible server.

For each request rate, issues --num-prompts streaming /v1/completions requests (random
token-id prompts of --input-len, exactly --output-len generated tokens via ignore_eos) with
exponential inter-arrival times, bounded by --max-duration seconds, and reports TTFT,
inter-token latency (ITL), time per output token (TPOT) and end-to-end latency at p50/p90/p99
plus request and token throughput. Writes <out>/serve.json, serve.md and serve.png.

The same client drives any OpenAI-compatible server on the same weights, e.g. vLLM's CPU
build (`vllm serve <model folder> --port 8001`): point --base-url at it. Loopback only.

    python -m benchmarks serve --launch                       # pagellm serve on the default model
    python -m benchmarks serve --launch --base-url vllm=http://127.0.0.1:8001   # and vLLM-CPU
    python -m benchmarks serve --base-url http://127.0.0.1:8000 # a server that is already up
    python -m benchmarks serve --smoke                        # tiny random model, seconds
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

from pagellm.benchmarks import common

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    output_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        if self.e2e is None or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    res = RequestResult()
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    res.error = str(data["error"])[:200]
                    return res
                if data.get("usage"):
                    res.output_tokens = data["usage"]["completion_tokens"]
                if not data.get("choices"):  # the usage-only final chunk
                    continue
                now = time.perf_counter()
                if res.ttft is None:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
                chunks += 1
        res.e2e = time.perf_counter() - start
        res.output_tokens = res.output_tokens or chunks
        res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = repr(e)[:200]
    return res


async def run_rate(base_url: str, model: str, prompts: list[list[int]], rate: float,
                   output_len: int, max_duration: float, seed: int) -> dict:
    rng = random.Random(seed)
    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    tasks = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=limits) as client:
        start = time.perf_counter()
        for prompt in prompts:
            if time.perf_counter() - start > max_duration:
                break
            body = {"model": model, "prompt": prompt, "max_tokens": output_len, "stream": True,
                    "temperature": 0.0, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            tasks.append(asyncio.create_task(one_request(client, url, body)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        remaining = max(1.0, max_duration - (time.perf_counter() - start))
        done, pending = await asyncio.wait(tasks, timeout=remaining)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - start
    results = [t.result() for t in done]
    return summarize(results, rate, duration, len(tasks), len(pending))


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    v = sorted(values)

    def q(p):
        k = (len(v) - 1) * p
        lo, hi = math.floor(k), math.ceil(k)
        return v[lo] + (v[hi] - v[lo]) * (k - lo)

    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "mean": sum(v) / len(v)}


def summarize(results: list[RequestResult], rate: float, duration: float, issued: int,
              timed_out: int) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "request_rate": rate if math.isfinite(rate) else "inf",
        "issued": issued, "completed": len(ok), "failed": len(results) - len(ok),
        "timed_out": timed_out, "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": percentiles([x for r in ok for x in r.itl]),
        "tpot_s": percentiles([r.tpot for r in ok if r.tpot is not None]),
        "e2e_s": percentiles([r.e2e for r in ok if r.e2e is not None]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


def ms(d: dict, key: str) -> str:
    return "-" if d[key] is None else f"{d[key] * 1000:.0f}"


def render(rows: list[dict], args) -> str:
    head = (f"Serving: {args.num_prompts} streaming requests per rate, {args.input_len} prompt "
            f"tokens (random ids), {args.output_len} output tokens (ignore_eos), Poisson "
            f"arrivals; latencies in ms as p50 / p90 / p99.\n")
    table = [[r["target"], r["request_rate"], f"{r['completed']}/{r['issued']}",
              round(r["request_throughput"], 2), round(r["output_throughput"], 1),
              "/".join(ms(r["ttft_s"], k) for k in ("p50", "p90", "p99")),
              "/".join(ms(r["itl_s"], k) for k in ("p50", "p90", "p99")),
              ms(r["tpot_s"], "p50"),
              "/".join(ms(r["e2e_s"], k) for k in ("p50", "p90", "p99"))] for r in rows]
    return head + "\n" + common.markdown_table(
        ["server", "rate (req/s)", "done", "req/s", "out tok/s", "TTFT", "ITL", "TPOT p50",
         "e2e"], table)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    for target in dict.fromkeys(r["target"] for r in rows):
        mine = [r for r in rows if r["target"] == target]
        x = [str(r["request_rate"]) for r in mine]
        for key, style in (("ttft_s", "o-"), ("itl_s", "s--")):
            ax1.plot(x, [(r[key]["p50"] or 0) * 1e3 for r in mine], style,
                     label=f"{target} {key[:-2].upper()}")
        ax2.plot(x, [r["output_throughput"] for r in mine], "o-", label=target)
    ax1.set(xlabel="request rate (req/s)", ylabel="p50 ms", title="latency (lower is better)")
    ax2.set(xlabel="request rate (req/s)", ylabel="output tokens/s", title="throughput")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- server handling -------------------------------------------------------------------------
def check_loopback(base_url: str) -> None:
    host = urlparse(base_url).hostname
    if host not in LOOPBACK:
        raise SystemExit(f"--base-url must be a loopback address ({sorted(LOOPBACK)}), got {host}")


def wait_ready(base_url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(base_url.rstrip("/") + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{base_url} did not become healthy within {timeout:.0f} s")


def launch(server_args: list[str], log_path: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pagellm.cli", "serve", *server_args,
           "--host", "127.0.0.1", "--port", str(port)]
    common.log("launching: " + " ".join(cmd))
    log = open(log_path, "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}"


def served_model(base_url: str) -> str:
    r = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks serve",
                                description=__doc__.split("\n\n")[0])
    common.add_output_args(p)
    p.add_argument("--base-url", action="append", default=[],
                   help="server to measure, [label=]URL, repeatable (e.g. "
                        "vllm=http://127.0.0.1:8001); loopback only")
    p.add_argument("--launch", action="store_true",
                   help="also start `pagellm serve` on a free loopback port and measure it")
    p.add_argument("--server-args", default="--dtype bfloat16 --kv-cache-memory 1GiB",
                   help="arguments of the launched `pagellm serve` (model first, if any)")
    p.add_argument("--request-rates", default="1,2,4,inf",
                   help="comma-separated request rates (req/s); inf sends all at once")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per rate")
    p.add_argument("--max-duration", type=float, default=120.0, help="seconds per rate, at most")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--token-range", default="1000,20000",
                   help="prompt token ids are drawn from [lo, hi): valid in the vocab of both "
                        "servers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    if args.smoke:  # the tiny random model (vocab 256), a few short requests
        args.launch = True
        args.server_args = f"{common.smoke_model_dir()} --dtype float32 --kv-cache-memory 16MiB"
        args.request_rates, args.num_prompts, args.max_duration = "8,inf", 4, 60.0
        args.input_len, args.output_len, args.token_range = 8, 4, "3,256"
    if not args.base_url and not args.launch:
        args.base_url = ["http://127.0.0.1:8000"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    targets = {}
    for item in args.base_url:
        label, _, url = item.partition("=") if "=" in item.split("//")[0] else ("", "", item)
        check_loopback(url)
        targets[label or url] = url
    proc = None
    try:
        if args.launch:
            proc, url = launch(shlex.split(args.server_args),
                               os.path.join(args.out, "serve-server.log"))
            targets = {"pagellm": url, **targets}
        for url in targets.values():
            wait_ready(url, args.startup_timeout, proc if url == targets.get("pagellm") else None)
        models = {label: served_model(url) for label, url in targets.items()}
        lo, hi = (int(x) for x in args.token_range.split(","))
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(lo, hi) for _ in range(args.input_len)]
                   for _ in range(args.num_prompts)]
        for label, url in targets.items():  # warm-up, not measured
            asyncio.run(run_rate(url, models[label], prompts[:2], math.inf, 4, 120, args.seed))
        rows = []
        for rate in (float(x) for x in args.request_rates.split(",")):
            for label, url in targets.items():  # taking turns: machine noise hits all alike
                row = asyncio.run(run_rate(url, models[label], prompts, rate, args.output_len,
                                           args.max_duration, args.seed))
                rows.append({"target": label, **row})
                common.log(f"{label} @ {rate} req/s: {row['completed']}/{row['issued']} done, "
                           f"{row['output_throughput']:.1f} out tok/s")
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    common.write_results(args.out, "serve", {
        "config": vars(args), "targets": targets, "models": models, "results": rows},
        render(rows, args))
    if not args.no_plot:
        plot(rows, os.path.join(args.out, "serve.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
