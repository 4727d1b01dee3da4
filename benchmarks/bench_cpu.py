"""CPU decode speed of one model in several weight formats, measured alternately in one process.

python -m redline.benchmarks.bench_cpu --model demo [--rounds 5] [--tokens 32] [--threads N] [--out FILE.json]
python -m redline.benchmarks.bench_cpu --model Llama-3.2-1B --rounds 3 --tokens 8

`demo` is SmolLM2-135M-Instruct from its Q4_1 GGUF (scripts/demo_model.py): its float32 dequantization loaded as
float32 and bfloat16 and quantized on load to int8 and int4, and the native Q4_1 import (int4 g32, no re-quantizing).
A registry name (model.MODEL_REGISTRY) gets random weights of a realistic scale (benchmarks/bench_model.py); its
quantized variants share the float32 model's embedding table (tied to the output head), so memory holds one copy.

Every round runs each configuration once (a greedy generation of --tokens new tokens from the same prompt) and then
a large read (the sum of a --read_mb fp32 tensor) that measures the memory bandwidth in the same conditions; the
table reports medians over the rounds: decode tok/s, the weights read per token, and the share of the measured
bandwidth that decoding used (tok/s x bytes per token / bandwidth). On a machine shared with other work the rounds
vary; the alternation keeps that variation out of the comparison between configurations.
For the demo model it also checks that the native Q4_1 import's greedy tokens equal its float32 dequantization's.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from redline.generate import LLM
from redline.kernels.cpu_linear import kernel_threads

DEMO_PROMPT = "The capital of France is"
DEMO_CONFIGS = ("float32", "bfloat16", "int8", "int4-g32", "int4-g64", "q4_1-native")
# SmolLM2-135M's 576 features are not a multiple of 128: its largest int4 group is 64.
REGISTRY_CONFIGS = ("float32", "bfloat16", "int8", "int4-g32", "int4-g128")


def cpu_name() -> str:
    """lscpu's model name (from /proc/cpuinfo), or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_flags() -> list[str]:
    """The bf16/AMX/VNNI-related flags the CPU reports."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in flags if f.startswith(("avx512_bf16", "amx", "avx512_vnni", "avx_vnni", "avx512f")))


def read_bandwidth_gb_s(buffer: torch.Tensor) -> float:
    """GB/s of one full read of `buffer` (its sum), the memory bandwidth decoding competes for."""
    buffer.sum()  # warm: pages touched, threads started
    start = time.perf_counter()
    buffer.sum()
    return buffer.numel() * buffer.element_size() / (time.perf_counter() - start) / 1e9


def demo_engines(configs: tuple[str, ...], threads: int) -> dict[str, Callable[[], LLM]]:
    from redline.scripts.demo_model import DEFAULT_DIR, demo_checkpoint

    float32 = demo_checkpoint(DEFAULT_DIR)
    makers: dict[str, Callable[[], LLM]] = {
        "float32": lambda: LLM.load(float32, device="cpu", threads=threads),
        "bfloat16": lambda: LLM.load(float32, device="cpu", dtype="bfloat16", threads=threads),
        "int8": lambda: LLM.load(float32, device="cpu", quantize="int8", threads=threads),
        "q4_1-native": lambda: LLM.load(demo_checkpoint(DEFAULT_DIR, int4=True), device="cpu", threads=threads),
    }
    for config in configs:
        if config.startswith("int4-g"):
            makers[config] = lambda spec=config: LLM.load(float32, device="cpu", quantize=spec, threads=threads)
    return {c: makers[c] for c in configs}


def registry_engines(name: str, configs: tuple[str, ...], layers: int | None = None) -> dict[str, Callable[[], LLM]]:
    import dataclasses

    from redline.benchmarks.bench_model import build_random_model
    from redline.model import ModelArgs

    args = ModelArgs.from_name(name)
    if layers is not None:  # the model's first layers only: its real layer shapes in less memory
        args = dataclasses.replace(args, n_layer=layers, moe_layers=args.moe_layers[:layers])
    cpu = torch.device("cpu")
    base = build_random_model(args, cpu, torch.float32, "none")

    def quantized(quant: str, group_size: int = 128) -> LLM:
        model = build_random_model(args, cpu, torch.float32, quant, group_size=group_size)
        if args.tie_word_embeddings:  # one float32 table for every configuration
            model.tok_embeddings.weight = base.tok_embeddings.weight
            model.output.weight = base.tok_embeddings.weight
        return LLM(model, None, cpu, compile=False, name=name)

    makers: dict[str, Callable[[], LLM]] = {
        "float32": lambda: LLM(base, None, cpu, compile=False, name=name),
        "bfloat16": lambda: LLM(build_random_model(args, cpu, torch.bfloat16, "none"), None, cpu, compile=False,
                                name=name),
        "int8": lambda: quantized("int8"),
    }
    for config in configs:
        if config.startswith("int4-g"):
            makers[config] = lambda g=int(config[len("int4-g"):]): quantized("int4", g)
    return {c: makers[c] for c in configs}


def prompt_for(llm: LLM, prompt_tokens: int | None = None) -> Any:
    """The demo's text prompt; token ids 1..N for a random-weight model (N = prompt_tokens, default 5)."""
    return DEMO_PROMPT if llm.tokenizer is not None else list(range(1, 1 + (prompt_tokens or 5)))


def run(model: str, configs: tuple[str, ...], rounds: int, tokens: int, read_mb: int, threads: int,
        layers: int | None = None, prompt_tokens: int | None = None) -> dict[str, Any]:
    from redline.kernels.cpu_linear import use_threads

    use_threads(threads)
    makers = demo_engines(configs, threads) if model == "demo" else registry_engines(model, configs, layers)
    engines = {config: make() for config, make in makers.items()}
    for llm in engines.values():  # warm-up: caches sized, kernels built, pages touched
        llm.generate(prompt_for(llm, prompt_tokens), max_new_tokens=4, temperature=0, ignore_eos=True)
    buffer = torch.ones(read_mb * (1 << 20) // 4, dtype=torch.float32)
    rates: dict[str, list[float]] = {c: [] for c in configs}
    ttfts: dict[str, list[float]] = {c: [] for c in configs}
    bandwidth: list[float] = []
    tokens_of: dict[str, list[int]] = {}
    for _ in range(rounds):
        for config, llm in engines.items():
            result = llm.generate(prompt_for(llm, prompt_tokens), max_new_tokens=tokens, temperature=0,
                                  ignore_eos=True)
            rates[config].append(result.stats.decode_tok_s)
            ttfts[config].append(result.stats.ttft_s)
            tokens_of[config] = result.token_ids
        bandwidth.append(read_bandwidth_gb_s(buffer))
    bw = statistics.median(bandwidth)
    rows = []
    for config, llm in engines.items():
        tok_s = statistics.median(rates[config])
        rows.append({"config": config, "decode_tok_s": tok_s, "tok_s_all": rates[config],
                     "ttft_ms": 1e3 * statistics.median(ttfts[config]),
                     "bytes_per_token": llm.bytes_per_token,
                     "bandwidth_share": tok_s * llm.bytes_per_token / (bw * 1e9)})
    base = next((r["decode_tok_s"] for r in rows if r["config"] == "float32"), None)
    for row in rows:
        row["vs_float32"] = row["decode_tok_s"] / base if base else None
    out: dict[str, Any] = {
        "model": model if layers is None else f"{model} (first {layers} layers)", "rounds": rounds,
        "prompt_tokens": len(prompt_for(next(iter(engines.values())), prompt_tokens))
        if model != "demo" else None, "new_tokens": tokens, "threads": kernel_threads(),
        "cpu": cpu_name(), "logical_cpus": len(_affinity()), "cpu_flags": cpu_flags(),
        "torch": torch.__version__, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "read_bandwidth_gb_s": bw, "read_bandwidth_all": bandwidth, "rows": rows,
    }
    if "float32" in tokens_of and "q4_1-native" in tokens_of:
        out["q4_1_greedy_equals_float32"] = tokens_of["q4_1-native"] == tokens_of["float32"]
    return out


def _affinity() -> set[int]:
    import os

    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def table(result: dict[str, Any]) -> str:
    lines = [f"{result['model']} on {result['cpu']}, {result['threads']} threads, torch {result['torch']}, "
             f"median of {result['rounds']} rounds of {result['new_tokens']} tokens; "
             f"read bandwidth {result['read_bandwidth_gb_s']:.1f} GB/s",
             "| weights | decode tok/s | vs float32 | MB read / token | % of read bandwidth | TTFT ms |",
             "|---|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        ratio = f"{row['vs_float32']:.2f}x" if row["vs_float32"] else "-"
        lines.append(f"| {row['config']} | {row['decode_tok_s']:.1f} | {ratio} | {row['bytes_per_token'] / 1e6:.0f} | "
                     f"{row['bandwidth_share']:.0%} | {row['ttft_ms']:.0f} |")
    if "q4_1_greedy_equals_float32" in result:
        lines.append(f"native Q4_1 greedy tokens == float32 dequantization's: {result['q4_1_greedy_equals_float32']}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="demo (SmolLM2-135M from its GGUF) or a registry name")
    p.add_argument("--configs", default=None, help="comma-separated subset (default: all for the model)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=32, help="new tokens per generation")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the physical cores)")
    p.add_argument("--read_mb", type=int, default=1024, help="size of the bandwidth read, MB")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--prompt-tokens", type=int, default=None, help="a registry model's prompt length (default 5)")
    p.add_argument("--layers", type=int, default=None, help="a registry model's first N layers only (its real layer "
                   "shapes in less memory)")
    ns = p.parse_args(argv)
    every = DEMO_CONFIGS if ns.model == "demo" else REGISTRY_CONFIGS
    configs = tuple(ns.configs.split(",")) if ns.configs else every
    unknown = [c for c in configs if c not in every]
    if unknown:
        p.error(f"unknown configs {unknown}; choose from {', '.join(every)}")
    if ns.rounds < 1 or ns.tokens < 2 or ns.read_mb < 1 or (ns.threads is not None and ns.threads < 1):
        p.error("--rounds, --read_mb and --threads must be positive and --tokens at least 2")
    if ns.layers is not None and (ns.model == "demo" or ns.layers < 1):
        p.error("--layers takes a positive number of a registry model's layers (not the demo model's)")
    if ns.prompt_tokens is not None and (ns.model == "demo" or ns.prompt_tokens < 1):
        p.error("--prompt-tokens takes a positive length for a registry model (the demo model has its text prompt)")
    ns.configs = configs
    return ns


def main(argv: list[str] | None = None) -> int:
    from redline.options import physical_cores

    ns = parse_args(argv)
    try:
        result = run(ns.model, ns.configs, ns.rounds, ns.tokens, ns.read_mb, ns.threads or physical_cores(), ns.layers,
                     ns.prompt_tokens)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table(result))
    if ns.out is not None:
        from redline.checkpoint import write_atomically

        write_atomically(ns.out, lambda tmp: tmp.write_text(json.dumps(result, indent=1) + "\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
