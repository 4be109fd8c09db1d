"""Structured outputs: what the grammar costs a decode step, and JSON-schema throughput
against unconstrained decoding on the same prompts.

The constrained run times everything structured decoding adds inside the engine step: the
masks (llguidance, all rows of a step in one call, turned into a logit bias), applying them,
checking unmasked draws against the grammar and drawing again where it forbids them, advancing
the matchers, verification masks and cutting speculative proposals. Its share is that time over
the whole step time. The unconstrained run generates the same number of tokens per request
(ignore_eos, max_tokens set to what the constrained one produced) so tok/s compare like for like.

    python -m benchmarks structured [--batch-sizes 1,16 --max-tokens 96 --repeats 3]
"""
from __future__ import annotations

import argparse
import time

from tqdm.auto import tqdm

from pagellm.benchmarks import common

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24},
    "skills": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 16}},
    "employed": {"type": "boolean"}},
    "required": ["name", "age", "city", "skills", "employed"], "additionalProperties": False}
PEOPLE = ["Alice, 30, a nurse in Paris who speaks French and plays chess",
          "Bob, 45, an unemployed welder from Leeds who likes fishing",
          "Chen, 28, a software engineer in Shanghai who knows Rust and Go",
          "Dana, 61, a retired teacher in Austin who gardens",
          "Emeka, 35, a doctor in Lagos who runs marathons",
          "Fatima, 22, a student in Cairo studying physics",
          "Goran, 50, a chef in Zagreb who bakes bread and cooks fish",
          "Hana, 39, a pilot from Osaka who paints"]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks structured", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--sampling", default="greedy,defaults",
                   help="greedy (temperature 0) and/or defaults (the server's defaults for a "
                   "model without a generation config: temperature 0.8, top-k 40, top-p 0.95, "
                   "min-p 0.05; truncating rows compute every mask)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats; medians are reported")
    p.add_argument("--threads", type=int, default=None)
    common.add_output_args(p)
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.sampling = args.sampling.split(",")
    if args.smoke:
        args.batch_sizes, args.max_tokens, args.repeats = [1, 2], 12, 1
    return args


class StructuredTimer:
    """Wall time in the engine's structured-output work (patched in place): `seconds`."""

    def __init__(self):
        import pagellm.engine.llm_engine as eng
        import pagellm.sampling.sampler as sampler
        import pagellm.spec_decode.decoder as dec
        import pagellm.spec_decode.draft_model as draft
        from pagellm.structured import matcher

        self.seconds = 0.0
        self._redo = False  # inside a second draw of _sample_plain (timed whole)
        self._undo = []
        for owner, name in ((eng, "mask_rows"), (dec, "batch_masks"), (dec, "_within_grammar"),
                            (draft, "batch_masks"), (matcher.Constraint, "accept"),
                            (matcher.Constraint, "allows")):
            self._wrap(owner, name)
        self._wrap(sampler, "_apply_grammar", unless_redo=True)
        plain, timer = eng.LLMEngine._sample_plain, self

        def sample_plain(engine, *a):
            calls = [0]
            first = eng.sample

            def counted(*sa):
                calls[0] += 1
                if calls[0] == 1:
                    return first(*sa)
                t, timer._redo = time.perf_counter(), True
                try:
                    return first(*sa)
                finally:
                    timer._redo = False
                    timer.seconds += time.perf_counter() - t

            eng.sample = counted
            try:
                return plain(engine, *a)
            finally:
                eng.sample = first

        eng.LLMEngine._sample_plain = sample_plain
        self._undo.append((eng.LLMEngine, "_sample_plain", plain))

    def _wrap(self, owner, name, unless_redo=False):
        fn = getattr(owner, name)

        def timed(*a, **kw):
            if unless_redo and self._redo:
                return fn(*a, **kw)
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t

        setattr(owner, name, timed)
        self._undo.append((owner, name, fn))

    def close(self):
        for owner, name, fn in reversed(self._undo):
            setattr(owner, name, fn)


def run_batch(llm, prompts, params) -> tuple[float, int, int, float]:
    """-> (wall seconds, output tokens, engine steps, seconds inside steps)."""
    engine = llm.engine
    step, stats = engine.step, {"steps": 0, "seconds": 0.0}

    def counted(**kw):
        t = time.perf_counter()
        try:
            return step(**kw)
        finally:
            stats["steps"] += 1
            stats["seconds"] += time.perf_counter() - t

    engine.step = counted
    try:
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
    finally:
        engine.step = step
    return wall, sum(len(o.outputs[0].token_ids) for o in outs), stats["steps"], stats["seconds"]


def main(argv=None) -> int:
    import torch

    from pagellm import LLM, SamplingParams
    from pagellm.sampling_params import StructuredOutputsParams

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model
    if args.smoke and model is None:
        model = _smoke_model()
    llm = LLM(model, dtype=args.dtype, kv_cache_memory="256MiB")
    tok = llm.get_tokenizer()
    so = StructuredOutputsParams(json=SCHEMA)
    from pagellm.server.defaults import LLAMA_CPP

    results = []
    configs = [(s, b) for s in args.sampling for b in args.batch_sizes]
    for sampling, batch in tqdm(configs, desc="configurations"):
        base = {"temperature": 0.0} if sampling == "greedy" else dict(LLAMA_CPP, seed=0)
        prompts = [llm.apply_chat_template([{"role": "user", "content":
                   f"Return JSON with name, age, city, skills, employed for: {PEOPLE[i % 8]}"}])
                   for i in range(batch)]
        constrained = SamplingParams(**base, max_tokens=args.max_tokens, structured_outputs=so)
        llm.generate(prompts, constrained, use_tqdm=False)  # warm: tokenizer, grammar, kernels
        runs = []
        for _ in range(args.repeats):
            timer = StructuredTimer()
            try:
                wall, ntok, steps, step_s = run_batch(llm, prompts, constrained)
            finally:
                timer.close()
            cost = timer.seconds / steps
            per_req = max(1, ntok // batch)
            free = SamplingParams(**base, max_tokens=per_req, ignore_eos=True)
            fwall, fntok, fsteps, fstep_s = run_batch(llm, prompts, free)
            runs.append({"tok_s": ntok / wall, "free_tok_s": fntok / fwall,
                         "mask_ms_per_step": 1e3 * cost, "step_ms": 1e3 * step_s / steps,
                         "free_step_ms": 1e3 * fstep_s / fsteps,
                         "mask_share": cost / (step_s / steps), "tokens": ntok})
        med = {k: common.median([r[k] for r in runs]) for k in runs[0]}
        results.append({"sampling": sampling, "batch": batch, **med, "ratio_vs_free": med["tok_s"] / med["free_tok_s"],
                        "runs": runs})
    del tok
    rows = [[r["sampling"], r["batch"], r["mask_ms_per_step"], r["step_ms"],
             100 * r["mask_share"], r["tok_s"], r["free_tok_s"], r["ratio_vs_free"]]
            for r in results]
    md = ("Structured outputs (JSON schema), median of "
          f"{args.repeats}; threads {torch.get_num_threads()}\n\n" + common.markdown_table(
              ["sampling", "batch", "mask ms/step", "step ms", "mask % of step", "JSON tok/s",
               "unconstrained tok/s", "ratio"], rows))
    target = {f"{r['sampling']} batch {r['batch']}": r["mask_share"] < 0.05 for r in results}
    common.write_results(args.out, "structured", {"results": results, "targets": {
        "mask_under_5pct_of_step": target}, "schema": SCHEMA}, md)
    if not args.no_plot:
        _plot(results, args.out)
    return 0


def _smoke_model() -> str:
    import tempfile

    from pagellm.models.loader import load_model_files

    tok = load_model_files(None).tokenizer
    path = tempfile.mkdtemp(prefix="pagellm-bench-structured-")
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=len(tok), max_position_embeddings=512,
                                   eos_token_id=tok.eos_token_id, bos_token_id=1)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _plot(results, out: str) -> None:
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    labels = [f"{r['sampling']}\n{r['batch']}" for r in results]
    a.bar(labels, [100 * r["mask_share"] for r in results])
    a.axhline(5, color="red", linestyle="--", label="5% target")
    a.set_xlabel("sampling, batch size")
    a.set_ylabel("structured-output share of step (%)")
    a.legend()
    x = range(len(results))
    b.bar([i - 0.2 for i in x], [r["tok_s"] for r in results], width=0.4, label="JSON schema")
    b.bar([i + 0.2 for i in x], [r["free_tok_s"] for r in results], width=0.4,
          label="unconstrained")
    b.set_xticks(list(x), labels)
    b.set_xlabel("sampling, batch size")
    b.set_ylabel("output tok/s")
    b.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "structured.png"), dpi=120)
    plt.close(fig)
