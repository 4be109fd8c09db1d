"""Every benchmark kind runs end to end with --smoke (tiny random model, small sizes) and writes
its JSON / Markdown / PNG with the expected fields. Timing is never checked here."""
from __future__ import annotations

import json
import sys

import pytest

from pagellm.benchmarks.__main__ import main as bench_main


def run_kind(kind: str, out, *extra: str) -> dict:
    assert bench_main([kind, "--smoke", "--out", str(out), *extra]) == 0
    for ext in ("json", "md", "png"):
        path = out / f"{kind}.{ext}"
        assert path.is_file() and path.stat().st_size > 0, path
    data = json.loads((out / f"{kind}.json").read_text())
    assert data["kind"] == kind and "system" in data
    return data


def test_memory(tmp_path):
    data = run_kind("memory", tmp_path)
    res = data["results"]
    assert set(res) == {"static-max-len", "static-declared", "paged"}
    for r in res.values():
        assert abs(sum(r["fractions_of_budget"].values()) - 1) < 1e-9
        assert r["mean_concurrency"] > 0 and r["peak_concurrency"] >= 1
    paged = res["paged"]["fractions_of_budget"]
    assert paged["reserved_not_yet"] == paged["reserved_never"] == paged["external_frag"] == 0
    assert "concurrency_vs_static" in data["targets"]


def test_throughput(tmp_path):
    data = run_kind("throughput", tmp_path, "--peers", "hf,vllm,llama.cpp")
    rows = {r["engine"]: r for r in data["results"]}
    assert {"pagellm", "hf"} <= set(rows)
    runs = next(iter(data["runs"].values()))
    for r in rows.values():
        assert r["output_tok_s"] > 0 and r["pagellm_x"] > 0 and r["requests"] == 4
        assert 0 < r["ttft_s"] < r["seconds"]  # first tokens come before the run ends
        assert runs[r["engine"]][0]["output_tokens"] == 4 * 8  # ignore_eos: all tokens
    assert rows["pagellm"]["pagellm_x"] == 1.0
    for peer in ("vllm", "llama.cpp"):  # skipped with a reason, never silently missing
        assert peer in rows or peer in data["skipped"]
    md = (tmp_path / "throughput.md").read_text()
    assert "not installed" in md or "skipped" in md or not data["skipped"]


def test_throughput_rounds_alternate_the_engines(tmp_path):
    """--rounds 2: every engine runs twice in turn, its runs pooled; pagellm x is the median
    of the rounds' ratios."""
    data = run_kind("throughput", tmp_path, "--peers", "hf", "--rounds", "2")
    rows = {r["engine"]: r for r in data["results"]}
    assert set(rows) == {"pagellm", "hf"}
    runs = next(iter(data["runs"].values()))
    assert len(runs["pagellm"]) == len(runs["hf"]) == 2  # --smoke: one repeat a round
    assert rows["pagellm"]["round_ratios"] == [1.0, 1.0]
    hf = rows["hf"]
    assert len(hf["round_ratios"]) == 2
    assert hf["pagellm_x"] == pytest.approx(sum(hf["round_ratios"]) / 2)  # two: their mean
    expected = [p["output_tok_s"] / h["output_tok_s"]
                for p, h in zip(runs["pagellm"], runs["hf"])]  # round i: each one's run i
    assert hf["round_ratios"] == pytest.approx(expected)
    with pytest.raises(ValueError, match="--rounds"):
        bench_main(["throughput", "--rounds", "0", "--peers", "", "--out", str(tmp_path)])


def test_throughput_workloads_are_checked(tmp_path):
    with pytest.raises(ValueError, match="--workloads"):
        bench_main(["throughput", "--workloads", "default:0", "--peers", "", "--out",
                    str(tmp_path)])


def test_latency(tmp_path):
    data = run_kind("latency", tmp_path, "--peers", "hf")
    rows = {r["engine"]: r for r in data["results"]}
    assert set(rows) == {"pagellm", "hf"}
    for r in rows.values():
        assert r["ttft_ms"] > 0 and r["tpot_ms"] > 0 and r["x_floor"] > 0
    bw = data["bandwidth"]
    assert bw["bytes_per_s"] > 0 and bw["weight_bytes"] > 0 and bw["floor_ms_per_token"] > 0


def test_profile(tmp_path):
    data = run_kind("profile", tmp_path)
    assert data["lengths"]["prompt"]["count"] == 200 and data["skipped"] == 0
    assert {"p50", "p90", "p99", "max"} <= set(data["lengths"]["output"])
    rec = data["recommendation"]
    assert rec["block_size"] in (8, 16, 32) and rec["max_num_seqs"] >= 1
    assert rec["kv_cache_memory_mib"] > 0 and rec["ngram_match_rate"] is not None


def test_profile_shapes(tmp_path):
    from pagellm.benchmarks.profile import Lengths, ngram_matches

    class Args:
        chars_per_token, tokenizer = 4.0, None

    lengths = Lengths(Args())
    assert lengths.parse({"prompt_tokens": 10, "completion_tokens": 3})[:2] == (10, 3)
    assert lengths.parse({"response": {"body": {"usage": {
        "prompt_tokens": 7, "completion_tokens": 2}}}})[:2] == (7, 2)
    assert lengths.parse({"body": {"messages": [{"role": "user", "content": "abcdefgh"}],
                                   "max_tokens": 5}})[:2] == (2 + 4, 5)
    assert lengths.parse({"prompt": [1, 2, 3], "output": [4]})[:2] == (3, 1)
    assert lengths.parse({"unrelated": 1}) is None
    assert ngram_matches([1, 2, 3, 9, 1, 2, 3], [9, 1, 7]) == (2, 3)


def test_unknown_kind_and_help(capsys):
    assert bench_main(["nope"]) == 2
    assert bench_main(["--help"]) == 0
    assert "memory" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["serve", "spec"])
def test_other_kinds_dispatch_when_present(kind, monkeypatch):
    import types

    import pagellm.benchmarks.__main__ as m

    called = []
    fake = types.SimpleNamespace(main=lambda argv: called.append(argv) or 0)
    monkeypatch.setitem(sys.modules, f"pagellm.benchmarks.{kind}", fake)  # import_module finds it
    monkeypatch.setattr(m, "available", lambda: m.KINDS)
    assert m.main([kind, "--x"]) == 0 and called == [["--x"]]


def test_gguf_models(tmp_path):
    data = run_kind("gguf_models", tmp_path, "--peers", "hf,llama.cpp")
    rows = {r["engine"]: r for r in data["results"]}
    assert set(rows) == {"pagellm", "hf"} and "llama.cpp" in data["skipped"]
    for r in rows.values():
        assert r["decode_ms"] > 0 and r["prefill_tok_s"] > 0 and r["batch_output_tok_s"] > 0
    assert rows["pagellm"]["decode_speedup_of_pagellm"] == 1.0
    assert len(data["runs"]["pagellm"]["runs"]) == 1


def test_structured(tmp_path):
    data = run_kind("structured", tmp_path)
    rows = {(r["sampling"], r["batch"]): r for r in data["results"]}
    assert set(rows) == {(s, b) for s in ("greedy", "defaults") for b in (1, 2)}
    for r in rows.values():
        assert r["tokens"] > 0 and r["tok_s"] > 0 and r["free_tok_s"] > 0
        assert 0 <= r["mask_share"] < 1 and r["mask_ms_per_step"] >= 0
    assert len(data["targets"]["mask_under_5pct_of_step"]) == 4


def test_soak(tmp_path):
    """The soak's short mode: 8 streaming clients for 20 s with random parameters,
    disconnects and aborts against `pagellm serve` on the default model with n-gram
    speculation: no 5xx, no error chunk, no block left in use, healthy at the end."""
    data = run_kind("soak", tmp_path)
    r = data["results"]
    assert data["passed"], r
    assert r["num_5xx"] == 0 and r["stream_errors"] == 0 and r["leaked_blocks"] == 0
    assert r["requests_completed"] >= 10 and r["ttft_s"]["p50"] is not None
    assert sum(r["statuses"].values()) >= r["requests_completed"]


def test_installed_command_lists_the_kinds_outside_a_checkout(tmp_path):
    """`pagellm bench` works for a pip-installed pagellm: the benchmarks are part of the
    package, found without the source tree on the path or as the working directory."""
    import subprocess

    r = subprocess.run([sys.executable, "-c", "import sys; from pagellm.cli import main; "
                        "sys.exit(main(['bench', '--help']))"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for kind in ("spec", "profile", "serve", "soak"):
        assert kind in r.stdout


def test_prefill(tmp_path):
    data = run_kind("prefill", tmp_path, "--peers", "hf,llama.cpp")
    rows = {r["length"]: r for r in data["results"]}
    assert set(rows) == {24, 40}
    for r in rows.values():
        assert r["pagellm"] > 0 and r["hf"] > 0 and r["pagellm / hf"] > 0
    assert "llama.cpp" in data["skipped"]  # no GGUF in smoke mode: skipped with its reason


def test_accuracy(tmp_path):
    data = run_kind("accuracy", tmp_path, "--peers", "hf,hf-bf16")
    rows = {r["kv_cache_dtype"]: r for r in data["results"]}
    assert list(rows) == ["float32", "bfloat16", "int8", "hf transformers (float32)",
                          "hf transformers (bfloat16)"]
    # transformers on the same weights, float32: near pagellm's default configuration (bf16
    # activations where the CPU has bf16 units); wrong log-probabilities would be O(1) off
    hf = rows.pop("hf transformers (float32)")
    assert hf["mean_abs_logprob_diff"] < 1e-2 and hf["top1_agreement"] > 0.97
    # every row also against transformers in float32: itself at 0, its bf16 run near it
    assert hf["vs_hf_mean_abs_logprob_diff"] == 0 and hf["vs_hf_top1_agreement"] == 1
    hf16 = rows.pop("hf transformers (bfloat16)")
    assert 0 < hf16["vs_hf_mean_abs_logprob_diff"] < 0.1 and hf16["vs_hf_top1_agreement"] > 0.9
    assert rows["float32"]["vs_hf_mean_abs_logprob_diff"] == hf["mean_abs_logprob_diff"]
    ref = rows["float32"]
    assert ref["mean_abs_logprob_diff"] == 0 and ref["top1_agreement"] == 1
    for r in rows.values():
        assert r["tokens"] == 2 * 47 and r["perplexity"] > 1
    # the smaller pools move the log-probabilities, a little
    assert 0 < rows["int8"]["mean_abs_logprob_diff"] < 0.1


def test_synthetic_gguf_writes_a_moe_file_both_tokenizer_and_experts_load(tmp_path):
    """The random-weight writer's file (--smoke: 2 layers, 4 experts, the default model's
    vocabulary) loads as a Qwen3-MoE with its tokenizer, every expert packed, and generates
    from a text prompt."""
    from pagellm import LLM, SamplingParams
    from pagellm.benchmarks import synthetic_gguf
    from pagellm.models.moe import SparseMoE

    out = tmp_path / "moe.gguf"
    assert synthetic_gguf.run(["--smoke", "--out", str(out)]) == 0
    llm = LLM(str(out), kv_cache_memory=2**24)
    config = llm.engine.hf_config
    assert (config.model_type, config.num_experts, config.num_experts_per_tok) == ("qwen3_moe", 4, 2)
    model = llm.engine.model
    assert all(isinstance(layer.mlp, SparseMoE) for layer in model.layers)
    n_packed, total = model.num_packed()
    assert n_packed == total
    text = llm.generate(["Hello"], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0),
                        use_tqdm=False)[0]
    assert len(text.outputs[0].token_ids) == 4
