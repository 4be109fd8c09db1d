"""The peers of `pagellm bench spec` at batch 1, on the same weights: HF transformers
`generate` (plain, prompt lookup, early-exit and assisted generation with the draft) and
llama.cpp's own tools on the same GGUF files (plain decoding and its draft-model speculation).
Each has `variants` (the names its rows get) and `run(variant, prompt, temperature)`, which
returns a run as `spec.Engine.run` does."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time

import torch

from pagellm.benchmarks import common


class HFPeer:
    """HF transformers generate at batch 1, timing each streamed chunk of new tokens."""

    def __init__(self, spec: common.ModelSpec, args):
        from transformers import AutoModelForCausalLM

        kw = {"gguf_file": spec.gguf_file} if spec.gguf_file else {}
        self.model = AutoModelForCausalLM.from_pretrained(
            spec.folder, dtype=getattr(torch, common.peer_dtype(args.dtype)), **kw).eval()
        self.model.generation_config.pad_token_id = 0
        self.args = args
        self.variants = {"hf": {}, "hf prompt-lookup": {"prompt_lookup_num_tokens": args.k}}
        if args.draft_layers:
            n = int(args.draft_layers.split(",")[0])
            self.variants[f"hf early-exit-L{n}"] = {"assistant_early_exit": n,
                                                    "num_assistant_tokens": args.k,
                                                    "num_assistant_tokens_schedule": "constant"}
        if args.draft and args.draft != "target":
            # assisted generation with the same draft model, HF's own schedule of k (it grows
            # after fully accepted rounds and shrinks after rejections)
            draft = common.ModelSpec.resolve(args.draft)
            kw = {"gguf_file": draft.gguf_file} if draft.gguf_file else {}
            assistant = AutoModelForCausalLM.from_pretrained(
                draft.folder, dtype=self.model.dtype, **kw).eval()
            self.variants["hf assisted"] = {"assistant_model": assistant,
                                            "num_assistant_tokens": args.k}

    def run(self, variant: str, prompt: list[int], temperature: float = 0.0) -> dict:
        ids, clock, args = torch.tensor([prompt]), Clock(), self.args
        extra = {"min_new_tokens": args.max_tokens} if args.ignore_eos else {}
        if temperature > 0:
            torch.manual_seed(0)
            extra.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        else:
            extra["do_sample"] = False
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=args.max_tokens,
                                      streamer=clock, **extra, **self.variants[variant])
        end, tokens = time.perf_counter(), out[0, ids.shape[1]:].tolist()
        (t1, c1), (tn, _) = clock.puts[1], clock.puts[-1]  # puts[0] is the prompt
        tpot = (tn - t1) / (len(tokens) - c1) if len(tokens) > c1 else None
        return {"wall_s": end - start, "preemptions": 0, "requests": [
            {"tpot_s": tpot, "e2e_s": end - start, "ttft_s": t1 - start, "tokens": tokens}]}


class Clock:
    """A streamer for HF generate: (time, number of tokens) of every chunk it is handed."""

    def __init__(self):
        self.puts: list[tuple[float, int]] = []

    def put(self, value):
        self.puts.append((time.perf_counter(), value.numel()))

    def end(self):
        pass


class LlamaCppPeer:
    """llama.cpp on the same GGUF files at batch 1: plain decoding ("llama.cpp": `llama-bench
    -p 0 -n N -d P`, N tokens generated after P tokens of context, the request's prompt length;
    its tool for speculation cannot turn the draft off) and, with --draft, its own draft-model
    speculation ("llama.cpp spec": `llama-speculative-simple --spec-type draft-simple`, k
    tokens a round) on the request's chat-templated text (llama.cpp tokenizes it, special
    tokens included). Its printed text is tokenized back with the target's tokenizer to
    compare with pagellm's output; llama-bench prints none."""

    def __init__(self, spec: common.ModelSpec, args, tokenizer):
        if not spec.path.endswith(".gguf") or (args.draft and not args.draft.endswith(".gguf")):
            raise SystemExit("--peers llama.cpp: the model and the draft must be GGUF files")
        self.bin, self.model, self.args, self.tokenizer = (args.llama_cpp_bin, spec.path, args,
                                                           tokenizer)
        self.variants = {"llama.cpp": None}
        if args.draft:
            self.variants["llama.cpp spec"] = ["-md", args.draft, "--spec-type", "draft-simple",
                                               "--spec-draft-n-max", str(args.k)]

    def _exec(self, cmd: list[str]) -> tuple[subprocess.CompletedProcess, float]:
        start = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n"
                               f"{done.stderr[-2000:]}")
        return done, time.perf_counter() - start

    def run(self, variant: str, prompt: list[int], temperature: float = 0.0) -> dict:
        args = self.args
        if self.variants[variant] is None:  # plain: generation time at the prompt's depth
            import json

            done, wall = self._exec([
                os.path.join(self.bin, "llama-bench"), "-m", self.model, "-p", "0",
                "-n", str(args.max_tokens), "-d", str(len(prompt)), "-t", str(args.threads),
                "-r", "1", "-o", "json"])
            tok_s = json.loads(done.stdout)[0]["avg_ts"]
            return {"wall_s": wall, "preemptions": 0, "requests": [
                {"tpot_s": 1 / tok_s, "e2e_s": wall, "ttft_s": None, "tokens": None,
                 "num_tokens": args.max_tokens}]}
        text = self.tokenizer.decode(prompt, skip_special_tokens=False)
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write(text)
        cmd = [os.path.join(self.bin, "llama-speculative-simple"), "-m", self.model,
               "-f", f.name, "-n", str(args.max_tokens), "-t", str(args.threads),
               "-c", str(len(prompt) + args.max_tokens + 64), "--temp", str(temperature),
               "--seed", "0", *self.variants[variant]]
        if args.ignore_eos:
            cmd.append("--ignore-eos")
        try:
            done, wall = self._exec(cmd)
        finally:
            os.unlink(f.name)
        log = done.stderr
        m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
        if m is None:
            raise RuntimeError(f"{' '.join(cmd)}: no 'decoded N tokens' line:\n{log[-2000:]}")
        n, seconds = int(m.group(1)), float(m.group(2))
        tail = text.strip()[-200:]  # the echoed prompt ends here; the new text follows
        at = done.stdout.find(tail)
        new_text = done.stdout[at + len(tail):] if at >= 0 else ""
        tokens = self.tokenizer.encode(new_text.strip("\n"), add_special_tokens=False)
        res = {"wall_s": wall, "preemptions": 0, "requests": [
            {"tpot_s": seconds / n if n else None, "e2e_s": wall, "ttft_s": None,
             "tokens": tokens, "num_tokens": n}]}
        drafted = re.search(r"n_drafted\s*=\s*(\d+)", log)
        accepted = re.search(r"n_accept\s*=\s*(\d+)", log)
        if drafted and accepted:
            res["peer_stats"] = {"drafted": int(drafted.group(1)),
                                 "accepted": int(accepted.group(1))}
        return res
