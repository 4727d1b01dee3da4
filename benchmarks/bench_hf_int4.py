"""Batch-1 decode of a GPTQ checkpoint converted by scripts/convert_hf_checkpoint.py, beside Redline's own int4 model
of the same shapes and group size, in one process. Random weights, nothing downloaded: the GPTQ folder (config.json
with its quantization_config, one model.safetensors) is written here from random codes, as GPTQ lays them out.

    python benchmarks/bench_hf_int4.py [--model Llama-3-8B] [--groupsize 128] [--dir DIR] [--new-tokens 256] [--runs 3]

The folder and its conversion (about 2 x 5.5 GB for 8B) go to a new temporary folder under --dir, removed at the end.

The GPTQ file quantizes the output head too (GPTQModel's lm_head option), as Redline's own int4 does, so both read
the same bytes per token. Prints each model's decode tok/s (the median of --runs, the two alternated after one
warm-up each), then `ratio converted/own`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from redline.model import ModelArgs

# Symmetric 4-bit zero point 8, stored as 7 in each nibble by GPTQ's original format.
GPTQ_SYMMETRIC_QZEROS = 0x77777777
# HF projection names and their (output, input) widths from the config.
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def projection_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    return dict(zip(PROJECTIONS, [(args.q_size, args.dim), (args.kv_size, args.dim), (args.kv_size, args.dim),
                                  (args.dim, args.q_size), (args.intermediate_size, args.dim),
                                  (args.intermediate_size, args.dim), (args.dim, args.intermediate_size)]))


def hf_config(args: ModelArgs, group_size: int) -> dict:
    """config.json of a Llama-family model of args, with GPTQ's quantization_config (symmetric, no act-order)."""
    if args.n_experts or args.qkv_bias or args.qk_norm != "none" or args.rope_scaling is not None:
        raise ValueError("the GPTQ benchmark builds plain Llama-shaped models (no experts, biases, q/k norms or rope "
                         "scaling); pick Llama-3-8B, Llama-2-7B or Mistral-7B")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.dim,
            "num_hidden_layers": args.n_layer, "num_attention_heads": args.n_head,
            "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
            "intermediate_size": args.intermediate_size, "vocab_size": args.vocab_size,
            "max_position_embeddings": args.block_size, "rope_theta": args.rope_base, "rms_norm_eps": args.norm_eps,
            "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
            "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": group_size, "sym": True,
                                    "desc_act": False, "checkpoint_format": "gptq", "lm_head": True}}


def gptq_module(n: int, k: int, group_size: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One GPTQ module of random codes: qweight (K/8, N), qzeros (K/G, N/8), fp16 scales (K/G, N) around 0.005
    (values within about +-0.04, like an N(0, 0.02) matrix), g_idx (K,) in the plain order."""
    return {"qweight": torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=gen, dtype=torch.int32),
            "qzeros": torch.full((k // group_size, n // 8), GPTQ_SYMMETRIC_QZEROS, dtype=torch.int32),
            "scales": (0.004 + 0.002 * torch.rand(k // group_size, n, generator=gen)).half(),
            "g_idx": (torch.arange(k, dtype=torch.int32) // group_size)}


def write_gptq_folder(folder: Path, args: ModelArgs, group_size: int, seed: int = 0) -> Path:
    """A GPTQ checkpoint folder of args' shapes with random weights (float tensors in bf16)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {"model.embed_tokens.weight": (0.02 * torch.randn(args.vocab_size, args.dim, generator=gen)).bfloat16(),
               "model.norm.weight": torch.ones(args.dim, dtype=torch.bfloat16)}
    tensors.update({f"lm_head.{s}": t for s, t in gptq_module(args.vocab_size, args.dim, group_size, gen).items()})
    for layer in range(args.n_layer):
        prefix = f"model.layers.{layer}."
        tensors[prefix + "input_layernorm.weight"] = torch.ones(args.dim, dtype=torch.bfloat16)
        tensors[prefix + "post_attention_layernorm.weight"] = torch.ones(args.dim, dtype=torch.bfloat16)
        for name, (n, k) in projection_shapes(args).items():
            tensors.update({f"{prefix}{name}.{s}": t for s, t in gptq_module(n, k, group_size, gen).items()})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(args, group_size)))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def decode_rates(llms: dict, prompt: torch.Tensor, new_tokens: int, runs: int, log) -> dict[str, list[float]]:
    """Per model, the decode tok/s of `runs` batch-1 generations, the models alternated after one warm-up each."""
    from redline.benchmarks.bench_redline import timed_generation

    for name, llm in llms.items():
        log(f"{name}: warm-up generation (compiles decode)")
        timed_generation(llm, prompt, new_tokens)
    rates: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(runs):
        for name, llm in llms.items():
            rates[name].append(timed_generation(llm, prompt, new_tokens).decode_tok_s)
    return rates


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Llama-3-8B", help="a Llama-shaped registry model (default Llama-3-8B)")
    parser.add_argument("--groupsize", type=int, default=128,
                        help="GPTQ group size, and Redline's int4 group size beside it (default 128)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where a temporary folder for the GPTQ files and their conversion is made (default: the "
                             "system's temporary folder)")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens decoded per timed run (default 256)")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="random prompt length (default 16)")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per model, alternated (default 3)")
    parser.add_argument("--device", default="cuda", help="torch device (default cuda)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    try:
        from redline.quantize import check_group_size

        args = ModelArgs.from_name(ns.model)
        hf_config(args, ns.groupsize)  # a shape the benchmark cannot build is refused before any work
        check_group_size(ns.groupsize, args.dim)
        if min(ns.new_tokens, ns.prompt_tokens, ns.runs) < 1:
            raise ValueError("--new-tokens, --prompt-tokens and --runs must be at least 1")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return run(ns, args)


def run(ns: argparse.Namespace, args: ModelArgs) -> int:
    from redline.benchmarks.bench_model import build_random_model, random_prompts
    from redline.checkpoint import read_checkpoint_info
    from redline.generate import LLM
    from redline.quantize import load_model
    from redline.scripts.convert_hf_checkpoint import convert_hf_checkpoint

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    device = torch.device(ns.device)
    if ns.dir is not None:
        ns.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="redline-gptq-bench-", dir=ns.dir) as scratch:
        start = time.perf_counter()
        folder = write_gptq_folder(Path(scratch) / "gptq", args, ns.groupsize)
        log(f"wrote the GPTQ g{ns.groupsize} folder in {time.perf_counter() - start:.0f} s")
        start = time.perf_counter()
        path = convert_hf_checkpoint(folder, Path(scratch) / "converted.safetensors", dtype="bfloat16")
        log(f"converted it in {time.perf_counter() - start:.0f} s")
        converted = load_model(read_checkpoint_info(path), device)
    own = build_random_model(args, device, torch.bfloat16, "int4", 0, ns.groupsize)
    llms = {"converted GPTQ": LLM(converted, tokenizer=None, device=device, compile=device.type == "cuda",
                                  name=f"{ns.model} GPTQ g{ns.groupsize} (converted)"),
            "Redline int4": LLM(own, tokenizer=None, device=device, compile=device.type == "cuda",
                                name=f"{ns.model} int4 g{ns.groupsize}")}
    sizes = {name: llm.bytes_per_token for name, llm in llms.items()}
    prompt = random_prompts(args.vocab_size, 1, ns.prompt_tokens, 0)  # (1, T)
    rates = decode_rates(llms, prompt, ns.new_tokens, ns.runs, log)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    medians = {name: statistics.median(r) for name, r in rates.items()}
    for name, rate in medians.items():
        print(f"{ns.model} batch 1 {name} g{ns.groupsize}: {rate:.1f} tok/s (runs "
              f"{', '.join(f'{r:.1f}' for r in rates[name])}; {sizes[name] / 1e9:.2f} GB read a token) on {card}")
    print(f"ratio converted/own: {medians['converted GPTQ'] / medians['Redline int4']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
