#!/usr/bin/env python3
"""Write a reduced copy of the default model (SmolLM2-135M-Instruct Q4_1 GGUF) small enough to
travel to a borrowed GPU machine: the same file format, metadata, tokenizer and real weights,
but only the first N transformer blocks (llama.block_count = N). The tied Q8_0 embedding
(28.7 MiB) is kept whole; each Q4_1 block is 2.1 MiB, so 4 blocks make a ~39 MiB file.

Also saves the tokenizer as an HF tokenizer folder, gzipped, beside it (tokenizer.tar.gz, a
fallback for the GPU side in case its transformers cannot convert the GGUF vocabulary), and
checks that pagellm loads the reduced file and generates from it on the CPU.

    .venv/bin/python tools/gpu_make_model.py [--layers 4] [--out .gpu]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def reduce_gguf(src: str, dst: str, layers: int) -> None:
    import gguf

    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    total = int(reader.fields[f"{arch}.block_count"].contents())
    if not 1 <= layers <= total:
        raise SystemExit(f"--layers must be in 1..{total}")
    tmp = dst + ".part"
    writer = gguf.GGUFWriter(tmp, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        # GGUF.* are virtual (header) fields; the writer adds general.architecture itself
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == f"{arch}.block_count":
            value = layers
        elif field.name == "general.name":
            value = f"{value} (first {layers} of {total} blocks)"
        writer.add_key_value(field.name, value, vtype, sub_type=sub)

    def keep(name: str) -> bool:
        return not name.startswith("blk.") or int(name.split(".")[1]) < layers

    tensors = [t for t in reader.tensors if keep(t.name)]
    for t in tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    os.replace(tmp, dst)
    print(f"wrote {dst}: {len(tensors)} of {len(reader.tensors)} tensors, "
          f"{os.path.getsize(dst) / 2**20:.1f} MiB")


def check(path: str, tok_tar: str) -> None:
    import tarfile
    import tempfile

    from pagellm import LLM, SamplingParams
    from pagellm.models.loader import load_model_files

    files = load_model_files(path)
    print(f"config: {files.config.num_hidden_layers} layers, hidden {files.config.hidden_size}, "
          f"vocab {files.config.vocab_size}, tied {files.config.tie_word_embeddings}")
    with tempfile.TemporaryDirectory() as tmp:  # gzipped: 3.4 MiB of tokenizer.json -> 0.6
        files.tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))
        with tarfile.open(tok_tar, "w:gz") as tar:
            tar.add(os.path.join(tmp, "tokenizer"), arcname="tokenizer")
    print(f"tokenizer saved to {tok_tar} ({os.path.getsize(tok_tar) / 2**20:.1f} MiB)")
    t = time.perf_counter()
    llm = LLM(path, dtype="float32", kv_cache_memory="32MiB", device="cpu")
    out = llm.generate(["The capital of France is"],
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    print(f"pagellm on the CPU (float32): {out.token_ids} {out.text!r} "
          f"({time.perf_counter() - t:.1f} s with loading)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", default=os.path.join(ROOT, ".gpu"))
    p.add_argument("--src", default=None, help="default: pagellm's default model file")
    p.add_argument("--no-check", action="store_true")
    args = p.parse_args()
    src = args.src
    if src is None:
        from pagellm.models.loader import default_model_path

        src = default_model_path()
    os.makedirs(args.out, exist_ok=True)
    dst = os.path.join(args.out, f"smollm2-135m-instruct-{args.layers}l.Q4_1.gguf")
    for name in os.listdir(args.out):  # one reduced model at a time (the GPU side takes *.gguf)
        if name.endswith(".gguf") and os.path.join(args.out, name) != dst:
            os.remove(os.path.join(args.out, name))
            print(f"removed old {name}")
    reduce_gguf(src, dst, args.layers)
    if not args.no_check:
        check(dst, os.path.join(args.out, "tokenizer.tar.gz"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
