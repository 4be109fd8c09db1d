"""Command line: pagellm generate | serve | fetch | bench."""
from __future__ import annotations

import argparse
import json
import logging
import sys


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", dest="model_opt", default=None,
                   help="HF model folder or .gguf file (default: SmolLM2-135M-Instruct GGUF)")
    g.add_argument("--tokenizer", default=None,
                   help="a tokenizer folder used instead of the model's own")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                   help="auto: bfloat16 on GPUs and CPUs with bf16 units, else float32")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--quantization", default=None, choices=["gguf", "none"],
                   help="default: a GGUF file's Q4_0/Q4_1 weights stay packed when running "
                        "bfloat16 on the CPU; gguf: insist on it; none: dequantize at load")
    g.add_argument("--warmup", choices=["auto", "on", "off"], default="auto",
                   help="a profiling forward before the KV budget is read and warm-up forwards "
                        "of the step shapes (auto: on for serve, and on a GPU)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", default=None, help="KV budget, e.g. 2GiB or 500MB")
    g.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16", "int8"],
                   help="auto: the model's dtype, but float32 for bfloat16 models on CPUs "
                        "without bf16 units (faster attention, twice the bytes per token); "
                        "int8 (CPU): codes and a scale per head row, ~half bf16's bytes")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="on a GPU: its memory's share for the engine (default 0.9)")
    g.add_argument("--kv-cache-fraction", type=float, default=None,
                   help="KV budget as a fraction of available memory")
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tensor-parallel-size", type=int, default=1)
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's form, instead of the --speculative-* flags: "
                   "'{\"model\": \"draft.gguf\", \"num_speculative_tokens\": 5}' (a model "
                   "and no method: draft_model) or '{\"method\": \"ngram\", "
                   "\"prompt_lookup_max\": 4}'; keys: LLM's speculative_config")
    g.add_argument("--speculative-method", choices=["ngram", "draft_model"], default=None,
                   help="default draft_model where a --speculative-model or "
                   "--speculative-draft-num-layers is given")
    g.add_argument("--speculative-model", default=None, help="draft model path")
    g.add_argument("--num-speculative-tokens", type=int, default=None, help="default 4")
    g.add_argument("--speculative-draft-dtype", default=None,
                   help="dtype of the draft (e.g. the target's own weights in bfloat16)")
    g.add_argument("--speculative-draft-num-layers", type=int, default=None,
                   help="keep the draft's first N layers (without --speculative-model: the "
                        "target's own first N layers, sharing its weights and KV cache)")
    g.add_argument("--speculative-fixed-k", action="store_true",
                   help="always propose --num-speculative-tokens (no adaptive controller)")
    g.add_argument("--speculative-prompt-lookup-first", action="store_true",
                   help="with a draft model: n-gram lookup proposes first (matches of 3+ "
                        "tokens), the draft only where it finds nothing")
    g.add_argument("--speculative-draft-quantization", choices=["q4_1"], default=None,
                   help="requantize a GGUF draft's blocks of more than 5 bits a weight to "
                        "Q4_1: a cheaper draft step, exact output")
    g.add_argument("--speculative-draft-vocab-size", type=int, default=None,
                   help="the draft scores only its first N token ids and the ids of each "
                        "request's own text: a cheaper draft head, exact output")


SPEC_FLAGS = {"speculative_method": "method", "speculative_model": "model",
              "num_speculative_tokens": "num_speculative_tokens",
              "speculative_draft_dtype": "draft_dtype",
              "speculative_draft_num_layers": "draft_num_layers",
              "speculative_fixed_k": "adaptive",
              "speculative_prompt_lookup_first": "prompt_lookup_first",
              "speculative_draft_quantization": "draft_quantization",
              "speculative_draft_vocab_size": "draft_vocab_size"}


def speculative_config(args: argparse.Namespace) -> dict | None:
    """--speculative-config's JSON, or the --speculative-* flags as LLM's speculative_config
    (None: no speculation). A flag without a method or a draft is an error, not ignored."""
    # None: not given; False: a switch left off (0 is a value given: `0 in (None, False)`)
    given = [f for f in SPEC_FLAGS if getattr(args, f) is not None
             and getattr(args, f) is not False]
    flag = lambda f: "--" + f.replace("_", "-")  # noqa: E731
    if args.speculative_config is not None:
        if given:
            raise ValueError(f"--speculative-config: give it or {flag(given[0])}, not both")
        try:
            spec = json.loads(args.speculative_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config: not JSON ({e.msg})") from None
        if not isinstance(spec, dict):
            raise ValueError("--speculative-config: must be a JSON object")
        return spec
    if not given:
        return None
    method = args.speculative_method or (
        "draft_model" if args.speculative_model or args.speculative_draft_num_layers else None)
    if method is None:
        raise ValueError(f"{flag(given[0])}: needs --speculative-method (or a "
                         "--speculative-model)")
    spec = {key: getattr(args, f) for f, key in SPEC_FLAGS.items()
            if getattr(args, f) is not None}
    spec.update(method=method, adaptive=not args.speculative_fixed_k)
    return spec


def engine_kwargs(args: argparse.Namespace) -> dict:
    spec = speculative_config(args)
    return dict(
        model=getattr(args, "model", None) or args.model_opt, tokenizer=args.tokenizer,
        gpu_memory_utilization=args.gpu_memory_utilization, dtype=args.dtype,
        device=args.device, block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
        kv_cache_fraction=args.kv_cache_fraction, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching, seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size, speculative_config=spec,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        warmup={"auto": None, "on": True, "off": False}[args.warmup])


def cmd_generate(args: argparse.Namespace) -> int:
    from pagellm import LLM, SamplingParams

    from pagellm.chat_template import load_chat_template

    if args.chat_template is not None and not args.chat:
        raise ValueError("--chat-template: applies with --chat only")
    template = (None if args.chat_template is None
                else load_chat_template(args.chat_template))
    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.sample_seed,
                            stop=args.stop or None)
    if args.chat:
        outs = llm.chat([{"role": "user", "content": p} for p in args.prompt][:1], params,
                        use_tqdm=False, chat_template=template)
    else:
        outs = llm.generate(args.prompt, params, use_tqdm=False)
    for out in outs:
        o = out.outputs[0]
        print(o.text if args.chat else (out.prompt or "") + o.text)
        m = out.metrics
        tpot = m.time_per_output_token
        print(f"[{len(o.token_ids)} tokens, finish_reason={o.finish_reason}, "
              f"ttft={m.time_to_first_token * 1000:.0f} ms"
              + (f", {1 / tpot:.1f} tok/s" if tpot else "") + "]", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pagellm.server.api_server import serve

    kwargs = engine_kwargs(args)
    if args.warmup == "auto":
        # a server warms up whatever the device: its first requests should not pay for first
        # use (on the CPU, a draft model's first probe ran at 0.67x of plain decoding, 0.93x
        # after the warm-up; the Qwen2.5-Coder 1.5B/0.5B pair, chat)
        kwargs["warmup"] = True
    return serve(args, kwargs)


def cmd_run_batch(args: argparse.Namespace) -> int:
    import asyncio
    import contextlib

    from pagellm.server.api_server import build_app, make_api
    from pagellm.server.batch import run_batch

    if args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    with (contextlib.nullcontext(sys.stdin) if args.input_file == "-"
          else open(args.input_file, encoding="utf-8")) as f:
        # JSON Lines end at \n only (U+2028 and the like may stand raw inside a string)
        lines = [line.removesuffix("\r") for line in f.read().split("\n")]
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    app = build_app(make_api(args, engine_kwargs(args)))
    with (contextlib.nullcontext(sys.stdout) if args.output_file == "-"
          else open(args.output_file, "w", encoding="utf-8")) as out:
        ok, total = asyncio.run(run_batch(app, lines, out, args.concurrency))
    logging.getLogger("pagellm.batch").info("%d of %d requests answered with 2xx", ok, total)
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    from pagellm.models import fetch

    if args.name is None:
        for name, model in fetch.MODELS.items():
            print(f"{name}\t{model.size / 2**20:.0f} MiB\t{model.description}")
        return 0
    print(fetch.fetch(args.name))
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # every option after the kind is the kind's own (--help too)
        from pagellm.benchmarks.__main__ import main as bench_main

        return bench_main(argv[1:])
    parser = argparse.ArgumentParser(prog="pagellm")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompt", nargs="+")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                     help="with --chat: this Jinja template (a file, or its text) instead of "
                     "the model's own")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    srv.add_argument("model", nargs="?", default=None)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None)
    srv.add_argument("--max-waiting", type=int, default=1024,
                     help="queued requests beyond which new ones get 503")
    srv.add_argument("--drain-timeout", type=float, default=30.0,
                     help="seconds SIGTERM waits for running requests")
    cors = srv.add_argument_group("cross-origin requests (CORS) from web pages' scripts")
    cors.add_argument("--allowed-origins", default=None, metavar="LIST",
                      help="origins a browser may call from: a JSON list "
                      "('[\"http://localhost:3000\"]') or comma-separated; '[]' or none: no "
                      "CORS; default any ('*')")
    cors.add_argument("--allowed-methods", default=None, metavar="LIST",
                      help="HTTP methods a cross-origin call may use; default any")
    cors.add_argument("--allowed-headers", default=None, metavar="LIST",
                      help="request headers a cross-origin call may send; default any")
    cors.add_argument("--allow-credentials", action="store_true",
                      help="let cross-origin calls send cookies / HTTP auth")
    add_api_args(srv)
    srv.set_defaults(func=cmd_serve)

    batch = sub.add_parser("run-batch", help="answer a file of requests in OpenAI's Batch API "
                           "form (JSONL: custom_id, method, url, body), offline")
    batch.add_argument("model", nargs="?", default=None)
    batch.add_argument("-i", "--input-file", required=True, help="JSONL requests ('-': stdin)")
    batch.add_argument("-o", "--output-file", required=True, help="JSONL answers ('-': stdout)")
    batch.add_argument("--concurrency", type=int, default=256,
                       help="requests in flight at once (the engine batches them)")
    add_api_args(batch)
    batch.set_defaults(func=cmd_run_batch)

    fetch = sub.add_parser("fetch", help="download and assemble a named GGUF model; prints its path")
    fetch.add_argument("name", nargs="?", default=None, help="omit to list the known models")
    fetch.set_defaults(func=cmd_fetch)

    # listed for --help; `pagellm bench ...` is handled before parsing (above)
    sub.add_parser("bench", help="benchmarks: spec, profile, serve, soak, ... "
                   "(`pagellm bench --help`)")

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def add_api_args(srv: argparse.ArgumentParser) -> None:
    """What `serve` and `run-batch` answer requests with: the model's name, the reasoning
    parser, sampling defaults, request limits, and the engine's arguments."""
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                     help="the chat template for every chat request, instead of the model's "
                     "own (a Jinja file, or the template's text): for a model whose file has "
                     "none, or a better one")
    srv.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                     help="LoRA adapters (PEFT folders or GGUF LoRA files) served beside the "
                     "base model: a "
                     "request whose `model` is NAME runs with that adapter")
    srv.add_argument("--reasoning-parser", choices=["qwen3", "deepseek_r1"], default=None,
                     help="chat completions carry a reasoning model's <think> text in "
                     "`reasoning` / `reasoning_content`, apart from `content`")
    srv.add_argument("--generation-config", choices=["auto", "none"], default="auto",
                     help="sampling defaults for fields a request omits: auto = the model's "
                     "generation config, else llama.cpp's (temperature 0.8, top_k 40, top_p "
                     "0.95, min_p 0.05); none = OpenAI's (temperature 1, no truncation)")
    for name, kind in (("temperature", float), ("top-p", float), ("top-k", int),
                       ("min-p", float), ("repetition-penalty", float)):
        srv.add_argument(f"--default-{name}", type=kind, default=None,
                         help=f"{name} for requests that omit it")
    lim = srv.add_argument_group("request limits (a request past one gets a 4xx naming it)")
    for flag, help_ in (("max-body-bytes", "request body size (413); default 8 MiB"),
                        ("max-sequences", "prompts x n of one request; default 256"),
                        ("max-prompt-tokens", "tokens of one prompt; default the context length"),
                        ("max-stop-strings", "stop strings of one request; default 16"),
                        ("max-stop-length", "characters of one stop string; default 256"),
                        ("max-logprobs", "logprobs / top_logprobs; default (and at most) 20"),
                        ("max-connections", "HTTP requests in flight (503 + Retry-After past "
                         "it); default 512")):
        lim.add_argument(f"--{flag}", type=int, default=None, help=help_)
    add_engine_args(srv)


if __name__ == "__main__":
    sys.exit(main())
