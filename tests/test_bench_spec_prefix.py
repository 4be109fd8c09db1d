"""pagellm/benchmarks/spec.py and prefix.py run end to end with --smoke (tiny random model)
and write JSON / Markdown / PNG with the expected fields. Timing is never checked here."""
from __future__ import annotations

import json

from pagellm.benchmarks import prefix, spec, spec_peers, spec_replay


def outputs(out, kind: str) -> dict:
    for ext in ("json", "md", "png"):
        path = out / f"{kind}.{ext}"
        assert path.is_file() and path.stat().st_size > 0, path
    data = json.loads((out / f"{kind}.json").read_text())
    assert data["kind"] == kind and "system" in data and data["config"]["smoke"]
    return data


def test_spec_smoke(tmp_path):
    assert spec.main(["--smoke", "--out", str(tmp_path)]) == 0
    data = outputs(tmp_path, "spec")
    rows = {(r["workload"], r["batch"], r["engine"]): r for r in data["results"]}
    engines = {"off", "ngram", "ngram fixed-k", "draft-L1", "draft-L1 fixed-k",
               "ngram spec-off", "draft-L1 spec-off"}
    peers = {"hf", "hf prompt-lookup", "hf early-exit-L1"}
    assert {e for _, _, e in rows} == engines | peers
    assert {(w, b) for w, b, _ in rows} == {(w, b) for w in ("copy", "chat") for b in (1, 4)}
    for (w, b, e), r in rows.items():
        assert r["ms_per_token"] > 0 and r["speedup_vs_off"] > 0 and r["tok_s"] > 0
        assert r["mean_output_tokens"] == 8  # --smoke ignores EOS: every request is full length
        assert 0 <= r["same_as_off"] <= 1 and r["preemptions"] == 0
        if e in engines - {"off", "ngram spec-off", "draft-L1 spec-off"}:
            assert 0 <= r["spec_step_share"] <= 1 and set(r["controller"]) == {
                "alpha", "alpha_by_kind", "draft_round_s", "step_wall_s"}
            assert r["acceptance_rate"] is None or len(r["accepted_per_position"]) == 4
    # "spec-off": the same engine with speculation forced off, the floor's baseline.
    for e in ("ngram spec-off", "draft-L1 spec-off"):
        off_row = rows[("copy", 1, e)]
        assert not off_row["spec_step_share"] and off_row["acceptance_rate"] is None
        assert rows[("copy", 1, e.removesuffix(" spec-off"))]["speedup_vs_own_off"] > 0
    # Adaptive off always proposes k tokens; its acceptance is therefore always measured.
    fixed = rows[("copy", 1, "draft-L1 fixed-k")]
    assert fixed["spec_step_share"] == 1 and 0 <= fixed["acceptance_rate"] <= 1
    assert 1 <= fixed["mean_acceptance_length"] <= 5
    assert rows[("copy", 1, "off")]["speedup_vs_off"] == 1
    assert {"ngram_copy_b1_speedup", "adaptive_worst", "adaptive_floor_met"} <= set(data["targets"])
    assert "speedup vs off" in (tmp_path / "spec.md").read_text()


def test_prefix_smoke(tmp_path):
    assert prefix.main(["--smoke", "--out", str(tmp_path)]) == 0
    data = outputs(tmp_path, "prefix")
    rows = {r["engine"]: r for r in data["results"]}
    on, off = rows["pagellm prefix cache on"], rows["pagellm prefix cache off"]
    assert any(e.startswith("hf") for e in rows)
    for r in rows.values():
        assert r["ttft_median_ms"] > 0 and r["ttft_p90_ms"] >= r["ttft_median_ms"]
        assert r["output_tok_s"] > 0 and r["total_tok_s"] > r["output_tok_s"]
    # Bookkeeping, not timing: 8 requests of 64 shared + 8 own tokens, block size 16.
    assert off["prefix_hit_rate"] == 0 and on["prefix_hit_rate"] == 7 * 64 / (8 * 72)
    assert on["peak_used_blocks"] < off["peak_used_blocks"] <= off["num_blocks"]
    assert on["preemptions"] == off["preemptions"] == 0
    assert on["same_tokens_as_off"] == 1


def test_spec_replay_smoke(tmp_path):
    """Recorded greedy outputs replayed through the real decoder and controller at fixed
    step costs: every policy replays every request; the oracle, which speculates exactly the
    proposals that verification accepts when that pays, is never below plain decoding and
    never below fixed k (the smoke prompts repeat their first half: n-gram proposals exist)."""
    assert spec_replay.main(["--smoke", "--out", str(tmp_path)]) == 0
    data = outputs(tmp_path, "spec_replay")
    rows = {(r["workload"], r["policy"]): r for r in data["results"]}
    assert {p for _, p in rows} == {"adaptive", "fixed k=4", "oracle"}
    for (w, p), r in rows.items():
        assert r["requests"] == 4 and r["median_speedup"] > 0
    for w in ("copy", "chat"):
        oracle = data["per_request"][f"{w} oracle"]
        fixed = data["per_request"][f"{w} fixed k=4"]
        assert all(o >= 1.0 for o in oracle)
        assert all(o >= f - 1e-9 for o, f in zip(oracle, fixed))


def test_spec_pretest_of_a_draft_on_your_prompts(tmp_path):
    """The acceptance pre-test: `pagellm bench spec --draft D --prompts mine.jsonl` runs the
    user's prompts through the pair and reports acceptance per position, mean accepted length,
    ms/token with and without the draft, and a verdict per configuration. A draft equal to
    the target ('target') accepts every proposal."""
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_token_ids": [5 + i, 17, 33, 4, 90] * 3})
                                 for i in range(3)) + "\n")
    out = tmp_path / "out"
    assert spec.main(["--smoke", "--draft", "target", "--prompts", str(prompts), "--peers", "",
                      "--out", str(out)]) == 0
    data = outputs(out, "spec")
    rows = {(r["workload"], r["batch"], r["engine"]): r for r in data["results"]}
    assert {w for w, _, _ in rows} == {"yours"}
    assert {e for _, _, e in rows} == {"off", "ngram", "ngram fixed-k", "ngram spec-off",
                                       "draft", "draft fixed-k", "draft spec-off",
                                       "draft+lookup", "draft+lookup fixed-k",
                                       "draft+lookup spec-off"}
    fixed = rows[("yours", 1, "draft fixed-k")]
    # every proposal accepted (near max_tokens fewer than k are proposed, so the mean length
    # is below k + 1 and the later positions are not always drafted)
    assert fixed["acceptance_rate"] == 1.0 and 2 < fixed["mean_acceptance_length"] <= 5
    assert fixed["accepted_per_position"][0] == 1.0 and fixed["ms_per_token"] > 0
    verdicts = data["targets"]["verdicts"]
    assert set(verdicts) == {"ngram", "ngram fixed-k", "draft", "draft fixed-k", "draft+lookup",
                             "draft+lookup fixed-k"}
    # the prompts repeat 5-token runs: the lookup proposes first, and every proposal of the
    # target's own draft or of its text is accepted
    both = rows[("yours", 1, "draft+lookup fixed-k")]
    assert both["acceptance_rate"] == 1.0
    # the paired baseline is the same engine with speculation off per request: nothing is
    # proposed for it, not even the lookup's free proposals
    for e in ("draft spec-off", "draft+lookup spec-off"):
        assert rows[("yours", 1, e)]["acceptance_rate"] is None
    assert all(v.startswith(("pays at batch <= ", "does not pay at batch 1"))
               for v in verdicts.values())
    assert "Verdicts" in (out / "spec.md").read_text()


def test_spec_pretest_runs_hf_assisted_generation_with_the_draft(tmp_path):
    """With --draft and --peers hf, HF assisted generation with the same draft model is the
    peer ("hf assisted"). The tiny draft here has the target's weights (seed 0 both), so HF's
    greedy output with its assistant is the target's own."""
    from pagellm.benchmarks import common

    draft = common.smoke_model_dir()
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [5, 17, 33, 4, 90] * 3}) + "\n")
    out = tmp_path / "out"
    assert spec.main(["--smoke", "--draft", draft, "--prompts", str(prompts), "--peers", "hf",
                      "--no-fixed-k", "--out", str(out)]) == 0
    rows = {r["engine"]: r for r in outputs(out, "spec")["results"] if r["batch"] == 1}
    assert {"hf", "hf prompt-lookup", "hf assisted"} <= set(rows)
    assert not any(e.startswith("hf early-exit") for e in rows)  # no --draft-layers given
    assisted = rows["hf assisted"]
    assert assisted["ms_per_token"] > 0 and assisted["mean_output_tokens"] == 8
    assert assisted["same_as_off"] == 1.0


def test_spec_configs_choose_the_engines(tmp_path):
    """--configs keeps "off" and the configurations named (each one is an engine holding both
    models); an unknown name is refused, naming the flag."""
    import pytest

    out = tmp_path / "out"
    assert spec.main(["--smoke", "--configs", "ngram", "--peers", "", "--out", str(out)]) == 0
    engines = {r["engine"] for r in outputs(out, "spec")["results"]}
    assert engines == {"off", "ngram", "ngram spec-off"}
    with pytest.raises(ValueError, match="--configs"):
        spec.main(["--smoke", "--configs", "ngramm", "--peers", "", "--out", str(out)])


def test_the_cheapest_draft_form_also_runs_behind_the_lookup():
    """With --draft-vocab-size a GGUF draft's cheapest form (Q4_1, the sub-vocabulary head)
    is also offered behind the n-gram lookup, adaptive and at fixed k; without it, not."""
    args = spec.parse_args(["--draft", "d.gguf", "--draft-vocab-size", "64", "--k", "1"])
    out = spec.configs(args)
    cfg = out["draft q4_1 v64+lookup"]
    assert cfg == {"method": "draft_model", "model": "d.gguf", "draft_quantization": "q4_1",
                   "draft_vocab_size": 64, "prompt_lookup_first": True,
                   "num_speculative_tokens": 1, "adaptive": True}
    assert out["draft q4_1 v64+lookup fixed-k"]["adaptive"] is False
    plain = spec.configs(spec.parse_args(["--draft", "d.gguf"]))
    assert "draft+lookup" in plain and not any(n.endswith("v64+lookup") for n in plain)
    assert not any("+lookup" in n and n.startswith("draft q4_1") for n in plain)


def test_spec_temperatures_and_workloads(tmp_path):
    """--temperatures runs every workload at each temperature, a sampled one labelled
    "<workload> t<T>"; sampling is seeded, so the engine with speculation forced off gives the
    "off" engine's tokens exactly at 0.7 too. Bad values are refused, naming the flag."""
    import pytest

    out = tmp_path / "out"
    assert spec.main(["--smoke", "--configs", "ngram", "--peers", "hf", "--temperatures",
                      "0,0.7", "--no-fixed-k", "--out", str(out)]) == 0
    rows = {(r["workload"], r["batch"], r["engine"]): r for r in outputs(out, "spec")["results"]}
    assert {w for w, _, _ in rows} == {"copy", "chat", "copy t0.7", "chat t0.7"}
    assert rows[("chat t0.7", 1, "ngram spec-off")]["same_as_off"] == 1.0
    assert rows[("chat t0.7", 4, "ngram spec-off")]["same_as_off"] == 1.0
    assert rows[("copy t0.7", 1, "hf")]["ms_per_token"] > 0
    for bad in (["--temperatures", "hot"], ["--temperatures", "-1"], ["--workloads", "poetry"],
                ["--peers", "vllm"], ["--peers", "llama.cpp", "--llama-cpp-bin", str(tmp_path)]):
        with pytest.raises(SystemExit):
            spec.main(["--smoke", *bad, "--out", str(out)])


FAKE_SPEC = """#!/bin/sh
# stands in for llama.cpp's llama-speculative-simple: records its arguments, echoes the prompt
# file (-f) and a continuation on stdout, and logs its counts on stderr as the tool does
printf '%s\\n' "$@" > "$(dirname "$0")/argv.txt"
while [ $# -gt 0 ]; do [ "$1" = "-f" ] && file="$2"; shift; done
printf '\\n\\n'; cat "$file"; printf ' def add(a, b):\\n    return a + b\\n\\n'
echo "encoded   20 tokens in    0.100 seconds, speed:  200.000 t/s" >&2
echo "decoded   12 tokens in    0.600 seconds, speed:   20.000 t/s" >&2
echo "n_draft   = 4" >&2
echo "n_predict = 12" >&2
echo "n_drafted = 16" >&2
echo "n_accept  = 10" >&2
"""
FAKE_BENCH = """#!/bin/sh
# stands in for llama-bench -o json
printf '%s\\n' "$@" > "$(dirname "$0")/argv.txt"
echo '[{"n_prompt": 0, "n_gen": 8, "n_depth": 5, "avg_ts": 40.0}]'
"""


def test_llama_cpp_peer_command_and_parsing(tmp_path):
    """The llama.cpp peer: plain decoding from llama-bench at the prompt's depth (its
    speculation tool cannot turn the draft off), its speculation from
    llama-speculative-simple with the draft (draft-simple, k tokens a round); time per token
    is the tool's decode time over its tokens, acceptance its own counts, and its new text
    comes back as token ids. Stand-in scripts play the tools (their output as llama.cpp
    11434 prints it)."""
    import os
    import stat

    from transformers import AutoTokenizer

    from pagellm.benchmarks import common
    from pagellm.models.loader import default_model_path

    for name, text in (("llama-speculative-simple", FAKE_SPEC), ("llama-bench", FAKE_BENCH)):
        binary = tmp_path / name
        binary.write_text(text)
        binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    target = default_model_path()
    args = spec.parse_args(["--model", target, "--draft", target, "--peers", "llama.cpp",
                            "--llama-cpp-bin", str(tmp_path), "--threads", "2", "--k", "3",
                            "--max-tokens", "8"])
    tok = AutoTokenizer.from_pretrained(os.path.dirname(target),
                                        gguf_file=os.path.basename(target))
    peer = spec_peers.LlamaCppPeer(common.ModelSpec.resolve(target), args, tok)
    assert set(peer.variants) == {"llama.cpp", "llama.cpp spec"}
    prompt = tok.encode("<|im_start|>user\nWrite add.<|im_end|>\n<|im_start|>assistant\n")

    plain = peer.run("llama.cpp", prompt)
    argv = (tmp_path / "argv.txt").read_text().split("\n")
    assert argv[argv.index("-m") + 1] == target and argv[argv.index("-t") + 1] == "2"
    assert argv[argv.index("-d") + 1] == str(len(prompt)) and argv[argv.index("-n") + 1] == "8"
    req = plain["requests"][0]
    assert abs(req["tpot_s"] - 1 / 40) < 1e-12 and req["tokens"] is None
    assert "peer_stats" not in plain

    run = peer.run("llama.cpp spec", prompt, temperature=0.7)
    argv = (tmp_path / "argv.txt").read_text().split("\n")
    assert argv[argv.index("-m") + 1] == target and argv[argv.index("-md") + 1] == target
    assert argv[argv.index("--spec-type") + 1] == "draft-simple"
    assert argv[argv.index("--spec-draft-n-max") + 1] == "3"
    assert argv[argv.index("--temp") + 1] == "0.7"
    req = run["requests"][0]
    assert req["num_tokens"] == 12 and abs(req["tpot_s"] - 0.05) < 1e-12
    assert tok.decode(req["tokens"]) == " def add(a, b):\n    return a + b"
    assert run["peer_stats"] == {"drafted": 16, "accepted": 10}
    # a row without token ids (llama-bench) has no "same tokens as off"
    runs = [{"engine": e, "workload": "code", "batch": 1, "repeat": 0, "prompts": [0],
             "wall_s": 1.0, "preemptions": 0, **r}
            for e, r in (("off", {"requests": [{**req, "num_tokens": 12}]}),
                         ("llama.cpp", plain), ("llama.cpp spec", run))]
    spec.mark_identity(runs)
    rows = {r["engine"]: r for r in spec.summarize(runs)}
    assert rows["llama.cpp"]["same_as_off"] is None and rows["llama.cpp spec"]["same_as_off"] == 1
    assert rows["llama.cpp spec"]["acceptance_rate"] == 10 / 16


def test_spec_targets_for_a_draft_model():
    """The draft pair's targets: its best configuration on code at batch 1 against off
    (>= 1.5x), and against llama.cpp's own speculation per batch-1 workload (>= 2x)."""
    def row(w, e, ms, b=1):
        return {"workload": w, "batch": b, "engine": e, "ms_per_token": ms,
                "speedup_vs_off": None, "paired_vs_own_off": None}

    rows = [row("code", "off", 30.0), row("code", "draft", 20.0), row("code", "draft fixed-k", 25.0),
            row("code", "draft spec-off", 10.0), row("code", "llama.cpp spec", 42.0),
            row("chat", "off", 30.0), row("chat", "draft", 31.0), row("chat", "llama.cpp spec", 60.0),
            row("code", "off", 90.0, 8), row("code", "draft", 100.0, 8)]
    for r in rows:
        off = next(o for o in rows if (o["workload"], o["batch"], o["engine"]) ==
                   (r["workload"], r["batch"], "off"))
        r["speedup_vs_off"] = off["ms_per_token"] / r["ms_per_token"]
    tg = spec.targets(rows)
    assert tg["draft_code_b1_speedup"] == 1.5 and tg["draft_code_b1_met"]
    assert tg["draft_vs_llama_cpp_spec"] == {"code": 42.0 / 20.0, "chat": 60.0 / 31.0}
    assert not tg["draft_vs_llama_cpp_spec_met"]  # chat: 1.94x
    rows[-3]["ms_per_token"] = 62.0
    assert spec.targets(rows)["draft_vs_llama_cpp_spec_met"]
