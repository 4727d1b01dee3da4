"""A GGUF file of random weights in a real model's shapes, for side-by-side CPU benchmarks of models that cannot be
downloaded here.

python -m redline.benchmarks.random_gguf --model Llama-3.2-1B --like checkpoints/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
    --types Q8_0,Q4_1 --out-dir checkpoints/llama-3.2-1b-random

Writes MODEL-random.F16.gguf (llama.cpp's Llama layout: the shapes of model.MODEL_REGISTRY's entry, weights drawn from
N(0, 0.02) in fp16, norms 1.0 in fp32), then each of --types as llama.cpp's own quantization of that file
(llama-cpp-python's `llama_model_quantize`, with llama.cpp's default choices per tensor). The tokenizer is the --like
file's (a byte-level BPE), padded with unused tokens up to the model's vocabulary, so the head has the real size.
RoPE scaling is left out (plain RoPE at the registry's base): the bytes and FLOPs of a step are the model's.
Every file is written to a temp file beside its final name and renamed into place; an existing file is kept (--force replaces it).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from redline.checkpoint import write_atomically

# llama.cpp's file types (llama_ftype) of the quantizations this script asks llama.cpp for.
LLAMA_FTYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3}
WEIGHT_STD = 0.02
# GGUF token type of the padding tokens (llama.cpp's LLAMA_TOKEN_TYPE_UNUSED).
TOKEN_UNUSED = 5
# The context the file declares: enough for a benchmark's prompt and new tokens, and a small KV cache.
CONTEXT_LENGTH = 4096


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a model.MODEL_REGISTRY name with Llama's layout (e.g. Llama-3.2-1B)")
    p.add_argument("--like", type=Path, required=True, help="a GGUF file whose byte-level BPE tokenizer to copy")
    p.add_argument("--types", default="Q8_0,Q4_1", help=f"quantizations to make from the F16 file: "
                   f"{', '.join(LLAMA_FTYPES)} (comma-separated; empty: the F16 file only)")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's quantization threads")
    p.add_argument("--force", action="store_true", help="replace files that exist")
    ns = p.parse_args(list(argv))
    ns.types = [t.strip().upper() for t in ns.types.split(",") if t.strip()]
    unknown = [t for t in ns.types if t not in LLAMA_FTYPES]
    if unknown:
        raise ValueError(f"unknown --types {', '.join(unknown)}; choose from {', '.join(LLAMA_FTYPES)}")
    if not ns.like.is_file():
        raise FileNotFoundError(f"--like {ns.like}: no such file; pass a GGUF file with a tokenizer (the demo's: "
                                f"python scripts/demo_model.py)")
    return ns


def model_args(name: str) -> Any:
    from redline.model import ModelArgs

    args = ModelArgs.from_name(name)
    dense_llama = (args.n_experts == 0 and args.qk_norm == "none" and not args.qkv_bias and args.norm_offset == 0
                   and args.norm_placement == "pre" and args.activation == "silu"
                   and args.rotary_dim == args.head_dim and not args.layer_windows)
    if not dense_llama:
        raise ValueError(f"--model {name} is not a dense model of Llama's layout; this script writes only those")
    return args


def padded_tokenizer(like: Path, vocab_size: int) -> dict[str, Any]:
    """The --like file's tokenizer fields, its token list padded with unused tokens to vocab_size."""
    import gguf

    from redline.scripts.gguf_metadata import field as checked_field

    reader = gguf.GGUFReader(str(like))

    def field(key: str) -> Any:
        return checked_field(reader, key)

    if field("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"--like {like}: its tokenizer is {field('tokenizer.ggml.model')!r}, not a byte-level BPE "
                         f"('gpt2'); pass the demo's GGUF file")
    tokens = list(field("tokenizer.ggml.tokens"))
    types = list(field("tokenizer.ggml.token_type") or [1] * len(tokens))  # absent: every token a normal one
    if len(tokens) > vocab_size:
        raise ValueError(f"--like {like} has {len(tokens)} tokens, more than the model's {vocab_size}")
    pad = vocab_size - len(tokens)
    return {"tokens": tokens + [f"<|unused_{i}|>" for i in range(pad)], "types": types + [TOKEN_UNUSED] * pad,
            "merges": list(field("tokenizer.ggml.merges") or []), "pre": field("tokenizer.ggml.pre") or "default",
            "bos": field("tokenizer.ggml.bos_token_id"), "eos": field("tokenizer.ggml.eos_token_id"),
            "template": field("tokenizer.chat_template")}


def layer_shapes(args: Any) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> numpy shape (rows = output features) of one transformer block's tensors."""
    q, kv = args.n_head * args.head_dim, args.n_kv_heads * args.head_dim
    return {"attn_norm": (args.dim,), "attn_q": (q, args.dim), "attn_k": (kv, args.dim), "attn_v": (kv, args.dim),
            "attn_output": (args.dim, q), "ffn_norm": (args.dim,), "ffn_gate": (args.intermediate_size, args.dim),
            "ffn_up": (args.intermediate_size, args.dim), "ffn_down": (args.dim, args.intermediate_size)}


def random_tensor(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """A norm's weight (1-D) is ones in fp32; a matrix N(0, WEIGHT_STD) in fp16."""
    if len(shape) == 1:
        return np.ones(shape, dtype=np.float32)
    return (rng.standard_normal(shape, dtype=np.float32) * WEIGHT_STD).astype(np.float16)


def write_f16_gguf(args: Any, name: str, tokenizer: dict[str, Any], path: Path, seed: int) -> None:
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"{name} (random weights)")
    writer.add_block_count(args.n_layer)
    writer.add_context_length(min(CONTEXT_LENGTH, args.block_size))
    writer.add_embedding_length(args.dim)
    writer.add_feed_forward_length(args.intermediate_size)
    writer.add_head_count(args.n_head)
    writer.add_head_count_kv(args.n_kv_heads)
    writer.add_rope_freq_base(float(args.rope_base))
    writer.add_layer_norm_rms_eps(float(args.norm_eps))
    writer.add_vocab_size(args.vocab_size)
    writer.add_rope_dimension_count(args.head_dim)
    writer.add_file_type(1)  # mostly F16
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer["pre"])
    writer.add_token_list(tokenizer["tokens"])
    writer.add_token_types(tokenizer["types"])
    writer.add_token_merges(tokenizer["merges"])
    if tokenizer["bos"] is not None:
        writer.add_bos_token_id(int(tokenizer["bos"]))
    if tokenizer["eos"] is not None:
        writer.add_eos_token_id(int(tokenizer["eos"]))
    if tokenizer["template"]:
        writer.add_chat_template(tokenizer["template"])
    writer.add_tensor("token_embd.weight", random_tensor(rng, (args.vocab_size, args.dim)))
    for layer in range(args.n_layer):
        for part, shape in layer_shapes(args).items():
            writer.add_tensor(f"blk.{layer}.{part}.weight", random_tensor(rng, shape))
    writer.add_tensor("output_norm.weight", random_tensor(rng, (args.dim,)))
    if not args.tie_word_embeddings:
        writer.add_tensor("output.weight", random_tensor(rng, (args.vocab_size, args.dim)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantize_with_llama_cpp(source: Path, target: Path, kind: str, threads: int) -> None:
    try:
        import llama_cpp
    except ImportError:
        raise ValueError("--types needs llama-cpp-python (pip install 'redline[llamacpp]'); or pass --types ''") \
            from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPES[kind]
    params.nthread = threads
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params)
    if status != 0:
        raise ValueError(f"llama.cpp could not quantize {source.name} to {kind} (status {status})")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        ns = parse_args(sys.argv[1:] if argv is None else argv)
        args = model_args(ns.model)
        f16 = ns.out_dir / f"{ns.model}-random.F16.gguf"
        if ns.force or not f16.exists():
            tokenizer = padded_tokenizer(ns.like, args.vocab_size)
            write_atomically(f16, lambda tmp: write_f16_gguf(args, ns.model, tokenizer, tmp, ns.seed))
            print(f"wrote {f16}")
        for kind in ns.types:
            target = ns.out_dir / f"{ns.model}-random.{kind}.gguf"
            if ns.force or not target.exists():
                write_atomically(target, lambda tmp: quantize_with_llama_cpp(f16, tmp, kind, ns.threads))
                print(f"wrote {target}")
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from redline.benchmarks.random_gguf import main as package_main

    sys.exit(package_main())
