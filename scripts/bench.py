#!/usr/bin/env python3
"""Benchmark Redline on random-weight models: decode against the GPU's read bandwidth, prefill, compile time, and HF.

    python scripts/bench.py --model Llama-2-7B,Llama-3-8B --quant none,int8 --batch-size 1 \\
        --prompt-lengths 8,512,2048 --new-tokens 200 --runs 5 [--compare hf] [--compile-prefill] \\
        [--compile-time | --compile-time-only] [--device cuda|cpu] [--dtype bfloat16] [--json FILE] [--plot FILE.png]
    python scripts/bench.py --merge a.json,b.json [--json all.json] [--plot all.png]   # re-report saved runs

Models come from the registry (`model.ModelArgs.from_name`) and get random weights of a realistic scale, so nothing
is downloaded. What each number means:
- decode tok/s: tokens after the first over the time after the first (batch B: B x that, the aggregate), median of
  --runs generations after one warm-up generation (two per prompt length for compiled prefill on a GPU); measured
  with the shortest prompt and the smallest cache.
- limit tok/s: B x read bandwidth / bytes each decode step reads (weights, the embedding table excluded); the
  bandwidth is a large bf16 `sum` timed with CUDA events in the same process (median of 20).
- TTFT: start of `generate` to the first new token on the host. Prefill TFLOP/s = useful FLOPs / TTFT, with
  FLOPs = B x (2 x block matmul params x T + 2 x lm_head params + 4 x n_layer x T^2/2 x n_head x head_dim)
  (the engine computes logits at the last prompt position only, so the head counts once).
- HF decode tok/s = (N - n_short) / (t(N) - t(n_short)) from two `generate` calls, so prefill cancels out.
- compile time: time to first token after process start, measured around child processes with a fresh
  (cold) and then the same (warm) TORCHINDUCTOR_CACHE_DIR.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import generate
from checkpoint import dtype_from_name, write_atomically
from model import ModelArgs, Transformer
from profiling import read_bandwidth_gb_s

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
QUANT_CHOICES = ("none", "int8")
COMPARE_CHOICES = ("hf",)
# HF's decode rate is the difference of a long and a short generation; the short one has this many tokens at most.
HF_SHORT_TOKENS = 10
# Compiled HF generate keeps getting faster for a few calls (compile, then CUDA graph recording): warm it up until
# two calls in a row agree within this fraction, or this many calls.
HF_STEADY_TOLERANCE = 0.05
HF_MAX_WARMUP_CALLS = 6
BANDWIDTH_REPEATS = 20
PROBE_TIMEOUT_S = 900
WEIGHT_STD = 0.02  # the initializer scale of Llama-family checkpoints; norm gains are drawn around 1
SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


class BenchArgumentParser(argparse.ArgumentParser):
    """argparse that raises ValueError (one line via main) instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(message)


# ---------------------------------------------------------------------------------------------------------------------
# Configuration.


def _split(text: str | None) -> tuple[str, ...]:
    return tuple(part.strip() for part in (text or "").split(",") if part.strip())


def _positive_ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in _split(text))
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated positive integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{flag} takes comma-separated positive integers, got {text!r}")
    return values


@dataclass(frozen=True)
class BenchConfig:
    models: tuple[str, ...] = ()
    quants: tuple[str, ...] = ("none",)
    batch_sizes: tuple[int, ...] = (1,)
    prompt_lengths: tuple[int, ...] = (8,)
    new_tokens: int = 200
    runs: int = 5
    compare: tuple[str, ...] = ()
    compile_time: bool = False
    compile_time_only: bool = False
    compile_prefill: bool = False
    compile: bool | None = None  # None: compile on the GPU, not on the CPU
    kernels: bool | None = None  # None: Redline's Triton GEMVs where they run (the GPU); False: cuBLAS via inductor
    fuse: bool | None = None  # None: the fused batch-1 decode path wherever the kernels run
    device: str = "cpu"
    dtype: str = "bfloat16"
    json_path: Path | None = None
    plot_path: Path | None = None
    merge: tuple[Path, ...] = ()
    bandwidth_gib: float = 4.0
    probe_new_tokens: int = 8
    seed: int = 0
    ttft_probe: bool = False
    profile_dir: Path | None = None  # write one Perfetto trace per configuration here
    profile_steps: int = 16
    start_time: float | None = None  # the parent's time.time() when it started a --ttft-probe child
    argv: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.merge:
            if self.models:
                raise ValueError("--merge re-reports saved JSON results; drop --model (or drop --merge to measure)")
            for path in self.merge:
                if not path.is_file():
                    raise FileNotFoundError(f"--merge file {path} does not exist; pass JSON files written by --json")
            self._check_plot()
            return
        if not self.models:
            raise ValueError("--model is required: one or more registry names, e.g. --model Llama-2-7B")
        for name in self.models:
            ModelArgs.from_name(name)  # raises the registry's one-line ValueError listing the known names
        for quant in self.quants:
            if quant not in QUANT_CHOICES:
                raise ValueError(f"unknown --quant mode {quant!r}; choose from {', '.join(QUANT_CHOICES)}")
        for what in self.compare:
            if what not in COMPARE_CHOICES:
                raise ValueError(f"unknown --compare target {what!r}; choose from {', '.join(COMPARE_CHOICES)}")
        if self.new_tokens < 2:
            raise ValueError(f"--new-tokens must be >= 2 (decode speed needs two tokens), got {self.new_tokens}")
        if self.runs < 1:
            raise ValueError(f"--runs must be a positive integer, got {self.runs}")
        if self.profile_steps < 1 or (self.profile_dir is not None and self.profile_steps >= self.new_tokens):
            raise ValueError(f"--profile-steps must be between 1 and --new-tokens - 1, got {self.profile_steps}")
        if self.probe_new_tokens < 1:
            raise ValueError(f"--probe-new-tokens must be a positive integer, got {self.probe_new_tokens}")
        if not self.bandwidth_gib > 0:
            raise ValueError(f"--bandwidth-gib must be positive, got {self.bandwidth_gib}")
        dtype_from_name(self.dtype)
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for, but no CUDA/ROCm GPU is visible; use --device cpu")
        if self.compile_prefill and not self.compiled:
            raise ValueError("--compile-prefill needs compilation; on the CPU add --compile")
        longest = max(self.prompt_lengths) + self.new_tokens
        for name in self.models:
            context = ModelArgs.from_name(name).block_size
            if longest > context:
                raise ValueError(f"{name} has a context of {context} tokens, but the longest prompt plus --new-tokens "
                                 f"is {longest}; use shorter --prompt-lengths or fewer --new-tokens")
        if "hf" in self.compare and not _importable("transformers"):
            raise ValueError("--compare hf needs transformers; pip install transformers")
        self._check_plot()

    def _check_plot(self) -> None:
        if self.plot_path is not None and not _importable("matplotlib"):
            raise ValueError("--plot needs matplotlib; pip install matplotlib (or drop --plot)")

    @property
    def compiled(self) -> bool:
        return self.compile if self.compile is not None else self.device.startswith("cuda")

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def decode_prompt_length(self) -> int:
        return min(self.prompt_lengths)

    @property
    def hf_short_tokens(self) -> int:
        return max(1, min(HF_SHORT_TOKENS, self.new_tokens // 2))


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def parse_args(argv: Sequence[str]) -> BenchConfig:
    p = BenchArgumentParser(prog="scripts/bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="comma-separated registry names, e.g. Llama-2-7B,Llama-3-8B")
    p.add_argument("--quant", default="none", help="comma-separated: none, int8")
    p.add_argument("--batch-size", default="1", help="comma-separated batch sizes (aggregate tok/s is reported)")
    p.add_argument("--prompt-lengths", default="8", help="comma-separated prompt lengths; decode uses the shortest")
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--runs", type=int, default=5, help="timed generations per measurement (median reported)")
    p.add_argument("--compare", default="", help="hf: time transformers' LlamaForCausalLM in the same process")
    p.add_argument("--compile-time", action="store_true",
                   help="also measure time to first token after process start, cold and warm inductor cache")
    p.add_argument("--compile-time-only", action="store_true", help="only the --compile-time measurement")
    p.add_argument("--compile-prefill", action="store_true", help="also measure prefill compiled (extra rows)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile decode (default: on for the GPU, off for the CPU)")
    p.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=None,
                   help="Redline's Triton GEMVs for the bf16 linears (default: on the GPU); --no-kernels uses cuBLAS")
    p.add_argument("--fuse", action=argparse.BooleanOptionalAction, default=None,
                   help="fused batch-1 decode (norms, rope, cache write, SwiGLU, residuals in the kernels; "
                        "default: with --kernels)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 | float16 | float32")
    p.add_argument("--json", dest="json_path", type=Path, default=None, help="write all numbers here")
    p.add_argument("--plot", dest="plot_path", type=Path, default=None, help="write a PNG bar chart of decode tok/s")
    p.add_argument("--merge", default="", help="comma-separated JSON files from earlier runs to report together")
    p.add_argument("--bandwidth-gib", type=float, default=4.0, help="size of the tensor read to measure bandwidth")
    p.add_argument("--probe-new-tokens", type=int, default=8, help="tokens the --compile-time children generate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", dest="profile_dir", type=Path, default=None,
                   help="folder: also trace one generation per configuration (Perfetto .json.gz)")
    p.add_argument("--profile-steps", type=int, default=16, help="decode steps recorded in each trace")
    p.add_argument("--ttft-probe", action="store_true", help="internal: child process of --compile-time")
    p.add_argument("--start-time", type=float, default=None, help=argparse.SUPPRESS)
    ns = p.parse_args(list(argv))
    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return BenchConfig(
        models=_split(ns.model), quants=_split(ns.quant), batch_sizes=_positive_ints(ns.batch_size, "--batch-size"),
        prompt_lengths=_positive_ints(ns.prompt_lengths, "--prompt-lengths"), new_tokens=ns.new_tokens,
        runs=ns.runs, compare=_split(ns.compare), compile_time=ns.compile_time or ns.compile_time_only,
        compile_time_only=ns.compile_time_only, compile_prefill=ns.compile_prefill, compile=ns.compile,
        kernels=ns.kernels, fuse=ns.fuse,
        device=device, dtype=ns.dtype, json_path=ns.json_path, plot_path=ns.plot_path,
        merge=tuple(Path(p) for p in _split(ns.merge)), bandwidth_gib=ns.bandwidth_gib,
        probe_new_tokens=ns.probe_new_tokens, seed=ns.seed, ttft_probe=ns.ttft_probe, start_time=ns.start_time,
        profile_dir=ns.profile_dir, profile_steps=ns.profile_steps, argv=tuple(argv),
    )


# ---------------------------------------------------------------------------------------------------------------------
# Results.


@dataclass(frozen=True)
class Timing:
    """One generation, timed on the host."""

    ttft_s: float
    decode_tok_s: float  # aggregate over the batch
    wall_s: float
    new_tokens: int
    peak_bytes: int | None  # None on the CPU
    engine_compile_s: float | None  # GenerationStats.compile_s (batch 1 only)


@dataclass(frozen=True)
class PrefillRecord:
    prompt_tokens: int
    compiled_prefill: bool
    cache_len: int
    ttft_s: float  # median
    ttft_runs_s: list[float]
    flops: float
    tflops: float  # flops / ttft
    decode_tok_s: float  # median decode rate after this prompt, with this cache
    warmup_s: float  # wall time of the warm-up generations (two for compiled prefill on a GPU)

    def __post_init__(self) -> None:
        if self.prompt_tokens <= 0 or self.ttft_s <= 0:
            raise ValueError(f"invalid prefill record: prompt {self.prompt_tokens}, TTFT {self.ttft_s}")


@dataclass(frozen=True)
class RedlineRecord:
    model: str
    quant: str
    dtype: str
    batch_size: int
    compiled: bool
    prompt_tokens: int  # of the decode measurement
    new_tokens: int
    runs: int
    decode_tok_s: float  # median, aggregate over the batch
    decode_tok_s_runs: list[float]
    ttft_s: float  # median, at prompt_tokens
    cache_len: int  # KV cache positions during the decode measurement
    n_params: int
    bytes_per_token: int  # weights read per decode step (embedding excluded)
    weights_bytes: int  # all weights in memory
    kv_cache_bytes: int  # the whole KV cache during the decode measurement (SDPA reads all of it each step)
    bandwidth_gb_s: float | None
    limit_tok_s: float | None  # B x bandwidth / bytes_per_token
    pct_of_limit: float | None
    limit_with_kv_tok_s: float | None  # B x bandwidth / (bytes_per_token + kv_cache_bytes)
    peak_memory_bytes: int | None  # max over the timed generations
    peak_memory_warmup_bytes: int | None  # the warm-up generation (compile and graph capture included)
    overhead_bytes: int | None  # peak - weights - KV cache
    compile_s: float  # decode compile + graph capture, kept out of every rate
    warmup_s: float  # wall time of the warm-up generation
    prefill: list[PrefillRecord] = field(default_factory=list)
    kernels: bool = False  # the bf16 linears ran Redline's Triton GEMVs (else cuBLAS via inductor)
    fused: bool = False  # batch-1 decode ran the fused path (kernels.FusedDecode)
    profile_path: str | None = None  # --profile: a trace of one more generation
    profile_decode_tok_s: float | None = None  # that generation's decode rate (profiler overhead = vs decode_tok_s)

    def __post_init__(self) -> None:
        if self.batch_size <= 0 or self.decode_tok_s < 0 or self.bytes_per_token <= 0:
            raise ValueError(f"invalid record for {self.model} {self.quant} batch {self.batch_size}")


@dataclass(frozen=True)
class HFRecord:
    model: str
    mode: str  # "eager" (dynamic cache) | "static+compiled"
    dtype: str
    cache_implementation: str
    compiled: bool
    fullgraph: bool | None
    prompt_tokens: int
    new_tokens: int
    short_tokens: int
    runs: int
    t_long_s: float  # median wall time of generate(new_tokens)
    t_short_s: float  # median wall time of generate(short_tokens)
    t_long_runs_s: list[float]
    t_short_runs_s: list[float]
    decode_tok_s: float | None  # (new - short) / (t_long - t_short); None if the difference is not positive
    first_call_s: float
    warmup_calls_s: list[float]
    redline_tok_s: dict[str, float] = field(default_factory=dict)  # quant -> Redline batch-1 decode tok/s
    ratio: dict[str, float] = field(default_factory=dict)  # quant -> Redline / HF


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    first_token_s: float | None  # process start to the first new token on the host
    main_s: float | None  # process start to main() (interpreter + imports)
    built_s: float | None  # process start to the model built on the device
    end_s: float | None  # process start to the end of the probe generation
    wall_s: float  # the child's whole life, measured by the parent
    error: str | None = None


@dataclass(frozen=True)
class CompileTimeRecord:
    model: str
    quant: str
    compiled: bool
    compile_prefill: bool
    prompt_tokens: int
    cold: ProbeResult
    warm: ProbeResult


# ---------------------------------------------------------------------------------------------------------------------
# Models with random weights.


def param_counts(args: ModelArgs) -> dict[str, int]:
    """Parameter counts from the config: the embedding, the matmuls inside the blocks, the output head, and all."""
    per_layer = (args.dim * (args.q_size + 2 * args.kv_size) + args.q_size * args.dim
                 + args.dim * 2 * args.intermediate_size + args.intermediate_size * args.dim)
    embedding = args.vocab_size * args.dim
    head = args.vocab_size * args.dim
    norms = (2 * args.n_layer + 1) * args.dim
    total = embedding + args.n_layer * per_layer + norms + (0 if args.tie_word_embeddings else head)
    return {"embedding": embedding, "block_matmuls": args.n_layer * per_layer, "head": head, "total": total}


def prefill_flops(args: ModelArgs, prompt_tokens: int, batch: int = 1) -> float:
    """Useful FLOPs of one prefill: block matmuls over every token, the head once, causal attention."""
    counts = param_counts(args)
    t = prompt_tokens
    attention = 4 * args.n_layer * (t * t / 2) * args.n_head * args.head_dim
    return float(batch * (2 * counts["block_matmuls"] * t + 2 * counts["head"] + attention))


@torch.no_grad()
def fill_random_(model: torch.nn.Module, seed: int) -> None:
    """Matrices ~ N(0, 0.02), norm gains ~ N(1, 0.02): never zeros, so speed is measured on real-looking data."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for _, p in model.named_parameters():  # a tied table appears once
        mean = 0.0 if p.dim() >= 2 else 1.0
        p.normal_(mean, WEIGHT_STD, generator=gen)


def build_random_model(args: ModelArgs, device: torch.device, dtype: torch.dtype, quant: str,
                       seed: int = 0) -> Transformer:
    """The registry model on `device` in `dtype` with random weights, quantized in place when asked."""
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to(dtype=dtype)
    model.to_empty(device=device)
    if args.tie_word_embeddings:  # to_empty gives each module its own tensor; tie them again
        model.output.weight = model.tok_embeddings.weight
    fill_random_(model, seed)
    if quant != "none":
        from quantize import quantize_

        quantize_(model, quant)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the bf16 matrices are gone; give their blocks back
    return model.eval()


def weight_tensors(model: Transformer) -> list[Tensor]:
    """Every weight in memory once (parameters and quantized buffers; not the KV cache or the rope table)."""
    seen: set[int] = set()
    out = []
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in seen or "kv_cache" in name or name == "rope":
            continue
        seen.add(id(t))
        out.append(t)
    return out


def weights_bytes(model: Transformer) -> int:
    return sum(t.numel() * t.element_size() for t in weight_tensors(model))


def kv_cache_bytes(model: Transformer) -> int:
    total = 0
    for layer in model.layers:
        cache = layer.attention.kv_cache
        if cache is not None:
            total += cache.k.numel() * cache.k.element_size() + cache.v.numel() * cache.v.element_size()
    return total


def random_prompts(vocab_size: int, batch: int, length: int, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=gen)  # (B, T)


# ---------------------------------------------------------------------------------------------------------------------
# Measurements.


def measure_read_bandwidth(device: torch.device, gib: float, repeats: int = BANDWIDTH_REPEATS) -> list[float]:
    """GB/s of a bf16 `sum` over `gib` GiB, timed with CUDA events, one figure per repeat (after a warm-up)."""
    with torch.cuda.device(device):
        return read_bandwidth_gb_s(gib, repeats)


def timed_generation(llm: generate.LLM, prompts: Tensor, new_tokens: int) -> Timing:
    """One greedy generation of prompts (B, T). Batch 1 goes through `LLM.generate`; larger batches through
    `generate_token_batches`, timed the same way (first token on the host, then the steps after it)."""
    device = llm.device
    batch = prompts.shape[0]
    generate.sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if batch == 1:
        start = time.perf_counter()
        result = llm.generate(prompts[0].tolist(), max_new_tokens=new_tokens, ignore_eos=True)
        wall = time.perf_counter() - start
        stats = result.stats
        ttft, rate, n, compile_s = stats.ttft_s, stats.decode_tok_s, stats.new_tokens, stats.compile_s
    else:
        times: list[float] = []
        start = time.perf_counter()
        for _, arrived in llm.generate_token_batches(prompts, new_tokens, generate.SamplingParams()):
            times.append(arrived)
        wall = time.perf_counter() - start
        ttft = times[0] - start
        span = times[-1] - times[0]
        rate = batch * (len(times) - 1) / span if len(times) > 1 and span > 0 else 0.0
        n, compile_s = len(times), None
    if n != new_tokens:
        raise RuntimeError(f"asked for {new_tokens} new tokens, got {n}; the benchmark needs fixed-length runs")
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return Timing(ttft_s=ttft, decode_tok_s=rate, wall_s=wall, new_tokens=n, peak_bytes=peak,
                  engine_compile_s=compile_s)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def measure_prefill(llm: generate.LLM, args: ModelArgs, prompts: Tensor, lengths: Sequence[int], new_tokens: int,
                    runs: int, compiled_prefill: bool, log: Any, what: str = "") -> list[PrefillRecord]:
    """TTFT per prompt length. The longest goes first, so the cache grows once and the others reuse it; each
    length gets a warm-up generation (cache growth recompiles decode; compiled prefill compiles per bucket), and
    compiled prefill on a GPU a second one: its first call compiles the bucket and its second records the bucket's
    CUDA graph, 15-20 ms longer than a replay (with one warm-up, one timed run in five took that long)."""
    records = []
    warmups = 2 if compiled_prefill and llm.device.type == "cuda" else 1
    for length in sorted(set(lengths), reverse=True):
        batch_prompts = prompts[:, :length]
        log(f"{what}prefill T={length}{' (compiled)' if compiled_prefill else ''}: warm-up")
        warm_s = sum(timed_generation(llm, batch_prompts, new_tokens).wall_s for _ in range(warmups))
        timings = [timed_generation(llm, batch_prompts, new_tokens) for _ in range(runs)]
        ttfts = [t.ttft_s for t in timings]
        ttft = median(ttfts)
        flops = prefill_flops(args, length, prompts.shape[0])
        records.append(PrefillRecord(
            prompt_tokens=length, compiled_prefill=compiled_prefill, cache_len=llm.model.max_seq_length,
            ttft_s=ttft, ttft_runs_s=ttfts, flops=flops, tflops=flops / ttft / 1e12,
            decode_tok_s=median([t.decode_tok_s for t in timings]), warmup_s=warm_s,
        ))
    return sorted(records, key=lambda r: r.prompt_tokens)


@contextlib.contextmanager
def isolated_compile_state(device: torch.device) -> Iterator[None]:
    """Undo global compile settings a run changes (Redline turns on inductor options that HF would otherwise
    inherit), drop compiled graphs and CUDA graph pools, and return freed memory to the device."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    modules = (inductor_config, torch._dynamo.config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reading deprecated config keys warns
        saved = [(mod, mod.get_config_copy()) for mod in modules]
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for mod, before in saved:
                changed = {k: v for k, v in before.items() if _differs(getattr(mod, k, v), v)}
                if changed:
                    mod.load_config(changed)
        torch._dynamo.reset()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _differs(a: Any, b: Any) -> bool:
    try:
        return bool(a != b)
    except Exception:  # values without a plain comparison
        return a is not b


def bench_redline(cfg: BenchConfig, name: str, quant: str, batch: int, bandwidth: float | None,
                  log: Any) -> RedlineRecord:
    device = torch.device(cfg.device)
    with isolated_compile_state(device):
        return _bench_redline(cfg, name, quant, batch, bandwidth, device, log)


def _bench_redline(cfg: BenchConfig, name: str, quant: str, batch: int, bandwidth: float | None,
                   device: torch.device, log: Any) -> RedlineRecord:
    args = ModelArgs.from_name(name)
    log(f"{name} {quant} batch {batch}: building random weights")
    model = build_random_model(args, device, cfg.torch_dtype, quant, cfg.seed)
    llm = generate.LLM(model, tokenizer=None, device=device, compile=cfg.compiled, kernels=cfg.kernels,
                       fuse=cfg.fuse, name=f"{name} (random weights)")
    weights = weights_bytes(model)
    prompts = random_prompts(args.vocab_size, batch, max(cfg.prompt_lengths), cfg.seed)  # (B, T_max)
    decode_prompts = prompts[:, :cfg.decode_prompt_length]

    log(f"{name} {quant} batch {batch}: warm-up generation (compiles decode)")
    warm = timed_generation(llm, decode_prompts, cfg.new_tokens)
    timings = [timed_generation(llm, decode_prompts, cfg.new_tokens) for _ in range(cfg.runs)]
    rate = median([t.decode_tok_s for t in timings])
    kv = kv_cache_bytes(model)
    cache_len = model.max_seq_length
    compile_s = (warm.engine_compile_s if warm.engine_compile_s is not None
                 else max(0.0, warm.wall_s - median([t.wall_s for t in timings])))
    peaks = [t.peak_bytes for t in timings if t.peak_bytes is not None]
    peak = max(peaks) if peaks else None
    log(f"{name} {quant} batch {batch}: decode {rate:.1f} tok/s (compile {compile_s:.1f} s)")

    if len(set(cfg.prompt_lengths)) == 1:  # the decode runs are the prefill runs: same prompt, same cache
        ttfts = [t.ttft_s for t in timings]
        flops = prefill_flops(args, cfg.decode_prompt_length, batch)
        prefill = [PrefillRecord(prompt_tokens=cfg.decode_prompt_length, compiled_prefill=False, cache_len=cache_len,
                                 ttft_s=median(ttfts), ttft_runs_s=ttfts, flops=flops,
                                 tflops=flops / median(ttfts) / 1e12, decode_tok_s=rate, warmup_s=warm.wall_s)]
    else:
        prefill = measure_prefill(llm, args, prompts, cfg.prompt_lengths, cfg.new_tokens, cfg.runs, False, log,
                                  f"{name} {quant} batch {batch}: ")
    if cfg.compile_prefill:
        llm_cp = generate.LLM(model, tokenizer=None, device=device, compile=True, compile_prefill=True,
                              kernels=cfg.kernels, fuse=cfg.fuse)
        prefill += measure_prefill(llm_cp, args, prompts, cfg.prompt_lengths, cfg.new_tokens, cfg.runs, True, log,
                                   f"{name} {quant} batch {batch}: ")
        del llm_cp

    trace_path, trace_rate = profile_generation(cfg, llm, decode_prompts, f"{name}-{quant}-b{batch}", log) \
        if cfg.profile_dir is not None else (None, None)

    bytes_step = llm.bytes_per_token
    limit = batch * bandwidth * 1e9 / bytes_step if bandwidth else None
    return RedlineRecord(
        model=name, quant=quant, dtype=cfg.dtype, batch_size=batch, compiled=cfg.compiled,
        prompt_tokens=cfg.decode_prompt_length, new_tokens=cfg.new_tokens, runs=cfg.runs, decode_tok_s=rate,
        decode_tok_s_runs=[t.decode_tok_s for t in timings], ttft_s=median([t.ttft_s for t in timings]),
        cache_len=cache_len, n_params=param_counts(args)["total"], bytes_per_token=bytes_step,
        weights_bytes=weights, kv_cache_bytes=kv, bandwidth_gb_s=bandwidth, limit_tok_s=limit,
        pct_of_limit=100 * rate / limit if limit else None,
        limit_with_kv_tok_s=batch * bandwidth * 1e9 / (bytes_step + kv) if bandwidth else None,
        peak_memory_bytes=peak, peak_memory_warmup_bytes=warm.peak_bytes,
        overhead_bytes=peak - weights - kv if peak is not None else None,
        compile_s=compile_s, warmup_s=warm.wall_s, prefill=prefill, kernels=llm.kernels, fused=llm.fuse,
        profile_path=trace_path,
        profile_decode_tok_s=trace_rate,
    )


def profile_generation(cfg: BenchConfig, llm: generate.LLM, prompts: Tensor, label: str,
                       log: Any) -> tuple[str, float]:
    """One more generation under the profiler; returns the trace path and that run's aggregate decode tok/s.

    Batch 1 goes through `LLM.generate(profile=...)`; larger batches drive the same token loop with a recorder.
    """
    from profiling import ProfileConfig, TraceRecorder

    path = cfg.profile_dir / f"{label}.json.gz"
    config = ProfileConfig(path=path, record_steps=cfg.profile_steps)
    batch = prompts.shape[0]
    if batch == 1:
        rate = llm.generate(prompts[0].tolist(), max_new_tokens=cfg.new_tokens, ignore_eos=True,
                            profile=config).stats.decode_tok_s
    else:  # already warm: the timed runs before this one compiled and captured the graphs
        recorder = TraceRecorder(config, llm.device)
        with recorder:
            times = [t for _, t in llm.generate_token_batches(prompts, cfg.new_tokens, generate.SamplingParams(),
                                                              recorder)]
        rate = batch * (len(times) - 1) / (times[-1] - times[0])
        recorder.write({"model": label, "batch_size": batch, "decode_tok_s": rate, "device": torch.cuda.get_device_name()
                        if llm.device.type == "cuda" else "cpu", "torch_version": torch.__version__},
                       generate.step_seconds(times))
    log(f"{label}: trace {path} ({path.stat().st_size / 1e6:.2f} MB), decode {rate:.1f} tok/s while profiled")
    return str(path), rate


# ---------------------------------------------------------------------------------------------------------------------
# Hugging Face transformers, same config, same process.


def hf_llama_config(args: ModelArgs) -> Any:
    """A transformers LlamaConfig with Redline's architecture (rope in transformers 5's `rope_parameters`)."""
    from transformers import LlamaConfig

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(args.rope_base)}
    if args.rope_scaling is not None:
        s = args.rope_scaling
        rope = {"rope_type": "llama3", "rope_theta": float(args.rope_base), "factor": s.factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings}
    return LlamaConfig(
        hidden_size=args.dim, intermediate_size=args.intermediate_size, num_hidden_layers=args.n_layer,
        num_attention_heads=args.n_head, num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim,
        vocab_size=args.vocab_size, max_position_embeddings=args.block_size, rope_parameters=rope,
        rms_norm_eps=args.norm_eps, tie_word_embeddings=args.tie_word_embeddings,
        # No EOS: every generation runs to max_new_tokens.
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )


def build_hf_model(args: ModelArgs, device: torch.device, dtype: torch.dtype) -> Any:
    """Random-weight LlamaForCausalLM built directly on the device in `dtype` (no fp32 host copy)."""
    from transformers import AutoModelForCausalLM

    config = hf_llama_config(args)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    n_hf = sum(p.numel() for p in model.parameters())
    if n_hf != param_counts(args)["total"]:
        raise RuntimeError(f"HF model has {n_hf} parameters, Redline's config {param_counts(args)['total']}: "
                           "the config mapping is wrong")
    return model


def time_hf_generate(model: Any, ids: Tensor, new_tokens: int, **kwargs: Any) -> float:
    device = ids.device
    generate.sync(device)
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)
    generate.sync(device)
    elapsed = time.perf_counter() - start
    if out.shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f"HF generated {out.shape[1] - ids.shape[1]} tokens instead of {new_tokens}")
    return elapsed


def hf_decode_record(cfg: BenchConfig, name: str, model: Any, ids: Tensor, mode: str, compiled: bool,
                     fullgraph: bool | None, warmup_calls: list[float], **kwargs: Any) -> HFRecord:
    """Times generate(N) and generate(n_short) alternately; their difference is decode alone."""
    n, short = cfg.new_tokens, cfg.hf_short_tokens
    time_hf_generate(model, ids, short, **kwargs)  # warm the short path too (same cache size: long ran first)
    longs, shorts = [], []
    for _ in range(cfg.runs):
        longs.append(time_hf_generate(model, ids, n, **kwargs))
        shorts.append(time_hf_generate(model, ids, short, **kwargs))
    t_long, t_short = median(longs), median(shorts)
    rate = (n - short) / (t_long - t_short) if t_long > t_short else None
    return HFRecord(
        model=name, mode=mode, dtype=cfg.dtype, cache_implementation=kwargs.get("cache_implementation", "dynamic"),
        compiled=compiled, fullgraph=fullgraph, prompt_tokens=ids.shape[1], new_tokens=n, short_tokens=short,
        runs=cfg.runs, t_long_s=t_long, t_short_s=t_short, t_long_runs_s=longs, t_short_runs_s=shorts,
        decode_tok_s=rate, first_call_s=warmup_calls[0], warmup_calls_s=warmup_calls,
    )


def warm_until_steady(model: Any, ids: Tensor, new_tokens: int, **kwargs: Any) -> list[float]:
    """The first compiled call compiles, the next ones record CUDA graphs: call until two calls agree."""
    calls = [time_hf_generate(model, ids, new_tokens, **kwargs)]
    while len(calls) < HF_MAX_WARMUP_CALLS:
        calls.append(time_hf_generate(model, ids, new_tokens, **kwargs))
        if len(calls) >= 3 and abs(calls[-1] - calls[-2]) <= HF_STEADY_TOLERANCE * calls[-2]:
            break
    return calls


def bench_hf(cfg: BenchConfig, name: str, log: Any) -> list[HFRecord]:
    device = torch.device(cfg.device)
    with isolated_compile_state(device):
        return _bench_hf(cfg, name, device, log)


def _bench_hf(cfg: BenchConfig, name: str, device: torch.device, log: Any) -> list[HFRecord]:
    from transformers import CompileConfig

    args = ModelArgs.from_name(name)
    log(f"{name} HF: building random weights")
    model = build_hf_model(args, device, cfg.torch_dtype)
    ids = random_prompts(args.vocab_size, 1, cfg.decode_prompt_length, cfg.seed).to(device)  # (1, T)
    records = []

    log(f"{name} HF eager (dynamic cache)")
    warm = [time_hf_generate(model, ids, cfg.new_tokens)]
    records.append(hf_decode_record(cfg, name, model, ids, "eager", False, None, warm))
    log(f"{name} HF eager: {_fmt(records[-1].decode_tok_s, '.1f')} tok/s")

    # transformers 5 compiles the decode step itself when generate gets a static cache on a GPU
    # (`compile_config`, default mode "reduce-overhead"); compiling model.forward by hand would also
    # compile prefill per prompt length. The long generation runs first so the short one reuses its cache.
    gpu = device.type == "cuda"
    kwargs: dict[str, Any] = {"cache_implementation": "static"}
    fullgraph: bool | None = None
    if gpu:
        fullgraph = True
        kwargs["compile_config"] = CompileConfig(fullgraph=True, mode="reduce-overhead")
    log(f"{name} HF static cache{' + compiled' if gpu else ' (not compiled on the CPU)'}: warm-up")
    try:
        warm = warm_until_steady(model, ids, cfg.new_tokens, **kwargs)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as exc:  # a graph break under fullgraph=True: fall back to HF's default compile config
        if not gpu:
            raise
        log(f"{name} HF fullgraph=True failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
            "retrying with fullgraph=False")
        fullgraph = False
        kwargs["compile_config"] = CompileConfig(fullgraph=False, mode="reduce-overhead")
        warm = warm_until_steady(model, ids, cfg.new_tokens, **kwargs)
    records.append(hf_decode_record(cfg, name, model, ids, "static+compiled", gpu, fullgraph, warm, **kwargs))
    log(f"{name} HF static: {_fmt(records[-1].decode_tok_s, '.1f')} tok/s (first call {warm[0]:.1f} s)")
    return records


def hf_mode_label(hf: dict[str, Any]) -> str:
    if hf["mode"] == "eager":
        return "HF eager"
    return "HF static+compiled" if hf["compiled"] else "HF static (not compiled)"


def attach_ratios(hf_records: list[HFRecord], records: list[RedlineRecord]) -> list[HFRecord]:
    out = []
    for hf in hf_records:
        redline = {r.quant: r.decode_tok_s for r in records
                   if r.model == hf.model and r.batch_size == 1 and r.dtype == hf.dtype}
        ratio = {q: v / hf.decode_tok_s for q, v in redline.items() if hf.decode_tok_s}
        out.append(HFRecord(**{**asdict(hf), "redline_tok_s": redline, "ratio": ratio}))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Time to first token after process start (child processes).


def probe_command(cfg: BenchConfig, name: str, quant: str, start: float) -> list[str]:
    cmd = [sys.executable, str(SCRIPT), "--ttft-probe", "--model", name, "--quant", quant,
           "--prompt-lengths", str(cfg.decode_prompt_length), "--new-tokens", str(max(2, cfg.probe_new_tokens)),
           "--device", cfg.device, "--dtype", cfg.dtype, "--seed", str(cfg.seed), "--start-time", repr(start),
           "--compile" if cfg.compiled else "--no-compile"]
    return cmd + (["--compile-prefill"] if cfg.compile_prefill else [])


def run_probe(cfg: BenchConfig, name: str, quant: str, env: dict[str, str]) -> ProbeResult:
    start = time.time()
    try:
        proc = subprocess.run(probe_command(cfg, name, quant, start), env=env, cwd=ROOT, capture_output=True,
                              text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return ProbeResult(ok=False, first_token_s=None, main_s=None, built_s=None, end_s=None,
                           wall_s=time.time() - start, error=f"timed out after {PROBE_TIMEOUT_S} s")
    wall = time.time() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return ProbeResult(ok=False, first_token_s=None, main_s=None, built_s=None, end_s=None, wall_s=wall,
                           error=f"exit {proc.returncode}: {tail[:300]}")
    data = json.loads(lines[-1])
    return ProbeResult(ok=True, first_token_s=data["first_token_s"], main_s=data["main_s"],
                       built_s=data["built_s"], end_s=data["end_s"], wall_s=wall)


def measure_compile_times(cfg: BenchConfig, log: Any) -> list[CompileTimeRecord]:
    records = []
    for name in cfg.models:
        for quant in cfg.quants:
            with tempfile.TemporaryDirectory(prefix="redline-bench-cache-") as tmp:
                env = dict(os.environ)
                env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")
                env["TRITON_CACHE_DIR"] = str(Path(tmp) / "triton")  # the Triton kernels start cold too
                env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
                log(f"{name} {quant}: time to first token, cold inductor cache")
                cold = run_probe(cfg, name, quant, env)
                log(f"{name} {quant}: cold {_fmt(cold.first_token_s, '.1f')} s; now warm")
                warm = run_probe(cfg, name, quant, env)
                log(f"{name} {quant}: warm {_fmt(warm.first_token_s, '.1f')} s")
            records.append(CompileTimeRecord(model=name, quant=quant, compiled=cfg.compiled,
                                             compile_prefill=cfg.compile_prefill,
                                             prompt_tokens=cfg.decode_prompt_length, cold=cold, warm=warm))
    return records


def run_ttft_probe(cfg: BenchConfig) -> int:
    """Child of --compile-time: build, compile and generate once; print times since the parent's start."""
    entered = time.time()
    origin = cfg.start_time if cfg.start_time is not None else entered
    device = torch.device(cfg.device)
    args = ModelArgs.from_name(cfg.models[0])
    model = build_random_model(args, device, cfg.torch_dtype, cfg.quants[0], cfg.seed)
    generate.sync(device)
    built = time.time()
    llm = generate.LLM(model, tokenizer=None, device=device, compile=cfg.compiled,
                       compile_prefill=cfg.compile_prefill)
    prompts = random_prompts(args.vocab_size, 1, cfg.decode_prompt_length, cfg.seed)
    first = None
    for _ in llm.generate_token_batches(prompts, cfg.new_tokens, generate.SamplingParams()):
        if first is None:
            first = time.time()
    end = time.time()
    print(json.dumps({"model": cfg.models[0], "quant": cfg.quants[0], "main_s": entered - origin,
                      "built_s": built - origin, "first_token_s": first - origin, "end_s": end - origin}))
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# The run, the report.


def environment(cfg: BenchConfig) -> dict[str, Any]:
    device = torch.device(cfg.device)
    env: dict[str, Any] = {
        "command": shlex.join(["python", "scripts/bench.py", *cfg.argv]),
        "argv": list(cfg.argv),
        "timestamp_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "device_type": device.type,
        "git_commit": _git_commit(),
    }
    for package in ("triton", "transformers"):
        try:
            env[f"{package}_version"] = metadata.version(package)
        except metadata.PackageNotFoundError:
            env[f"{package}_version"] = None
    return env


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


NOTES = [
    "decode tok/s: median over runs of (tokens after the first) / (time after the first), x batch (aggregate); "
    "measured with the shortest prompt and the smallest KV cache, after one discarded warm-up generation",
    "limit tok/s = batch x read bandwidth / bytes per decode step (weights, embedding table excluded); "
    "'limit with KV' also counts reading the whole static KV cache each step",
    "TTFT: start of generate to the first new token on the host (median, after one warm-up generation per prompt "
    "length, two with compiled prefill on a GPU: compile, then CUDA-graph recording); prefill TFLOP/s = FLOPs / "
    "TTFT with FLOPs = B x (2 x block matmul params x T + 2 x head params + 4 x n_layer x T^2/2 x n_head x head_dim)",
    "HF decode tok/s = (N - n_short) / (t(N) - t(n_short)): prefill cancels out; HF static = transformers' own "
    "compiled decode (cache_implementation='static', compile_config mode reduce-overhead)",
    "peak memory: torch.cuda.max_memory_allocated over a timed generation; overhead = peak - weights - KV cache",
]


def run_benchmark(cfg: BenchConfig, log: Any, save: Any = None) -> dict[str, Any]:
    """Every measurement the config asks for. A failed configuration is logged and recorded under "errors" and the
    run goes on; `save(report)` is called after each step, so a run cut short still leaves its results."""
    device = torch.device(cfg.device)
    bandwidth_runs: list[float] = []
    if device.type == "cuda" and not cfg.compile_time_only:
        log(f"measuring read bandwidth ({cfg.bandwidth_gib:g} GiB bf16 sum, median of {BANDWIDTH_REPEATS})")
        bandwidth_runs = measure_read_bandwidth(device, cfg.bandwidth_gib)
    bandwidth = median(bandwidth_runs) if bandwidth_runs else None
    if bandwidth:
        log(f"read bandwidth {bandwidth:.0f} GB/s")
    records: list[RedlineRecord] = []
    hf_records: list[HFRecord] = []
    compile_times: list[CompileTimeRecord] = []
    report: dict[str, Any] = {"env": environment(cfg), "bandwidth_gb_s": bandwidth,
                              "bandwidth_runs_gb_s": bandwidth_runs, "errors": [], "notes": NOTES}

    def refresh() -> None:
        report["records"] = [asdict(r) for r in records]
        report["hf"] = [asdict(h) for h in attach_ratios(hf_records, records)]
        report["compile_times"] = [asdict(c) for c in compile_times]
        if save is not None:
            save(report)

    def attempt(what: str, measure: Any) -> Any:
        try:
            return measure()
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # one failed configuration (an OOM, a compile error) must not lose the others
            log(f"{what} FAILED: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
            traceback.print_exc(file=sys.stderr)
            report["errors"].append({"what": what, "error": f"{type(exc).__name__}: {str(exc).strip()[:500]}"})
            return None
        finally:
            gc.collect()  # the traceback held the failed run's tensors until here
            if device.type == "cuda":
                torch.cuda.empty_cache()
            refresh()

    refresh()
    if not cfg.compile_time_only:
        for name in cfg.models:
            for quant in cfg.quants:
                for batch in cfg.batch_sizes:
                    record = attempt(f"{name} {quant} batch {batch}",
                                     lambda: bench_redline(cfg, name, quant, batch, bandwidth, log))
                    records += [record] if record is not None else []
            if "hf" in cfg.compare:
                hf_records += attempt(f"{name} HF", lambda: bench_hf(cfg, name, log)) or []
    if cfg.compile_time:
        compile_times += attempt("compile time", lambda: measure_compile_times(cfg, log)) or []
    refresh()
    return report


def merge_reports(paths: Sequence[Path]) -> dict[str, Any]:
    """Several saved reports as one (each record keeps the bandwidth its own run measured)."""
    merged: dict[str, Any] = {"env": {}, "bandwidth_gb_s": None, "bandwidth_runs_gb_s": [], "records": [], "hf": [],
                              "compile_times": [], "errors": [], "notes": NOTES}
    sources = []
    for path in paths:
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {path} as JSON ({exc}); pass files written by --json") from None
        if not isinstance(report, dict) or "records" not in report or "env" not in report:
            raise ValueError(f"{path} is not a bench.py report; pass files written by --json")
        for key in ("records", "hf", "compile_times", "errors"):
            merged[key] += report.get(key, [])
        sources.append({"path": str(path), "bandwidth_gb_s": report.get("bandwidth_gb_s"),
                        "command": report["env"].get("command")})
        if not merged["env"]:
            merged["env"] = dict(report["env"])
            merged["bandwidth_gb_s"] = report.get("bandwidth_gb_s")
            merged["bandwidth_runs_gb_s"] = report.get("bandwidth_runs_gb_s", [])
    merged["env"]["merged_from"] = sources
    return merged


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "–" if value is None else format(value * scale, spec)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return out + ["| " + " | ".join(row) + " |" for row in rows]


def format_report(report: dict[str, Any]) -> str:
    env = report["env"]
    lines = [f"# Redline benchmark ({env.get('device')}, torch {env.get('torch_version')})", ""]
    if env.get("command"):
        lines += [f"command: `{env['command']}`", ""]
    if report.get("bandwidth_gb_s"):
        lines.append(f"read bandwidth: {report['bandwidth_gb_s']:.0f} GB/s (bf16 sum, CUDA events, median)")
    for source in env.get("merged_from", []):
        lines.append(f"merged: {source['path']} (bandwidth {_fmt(source['bandwidth_gb_s'], '.0f')} GB/s)")
    if report["records"]:
        lines += redline_tables(report["records"])
    if report["hf"]:
        lines += hf_table(report["hf"], env.get("transformers_version"))
    if report["compile_times"]:
        lines += compile_time_table(report["compile_times"])
    if report.get("errors"):
        lines += ["", "FAILED (see the log for tracebacks):"] + [f"- {e['what']}: {e['error']}" for e in report["errors"]]
    lines += [""] + [f"- {note}" for note in report.get("notes", [])]
    return "\n".join(lines)


def _quant_label(record: dict[str, Any]) -> str:
    return SHORT_DTYPE.get(record["dtype"], record["dtype"]) if record["quant"] == "none" else record["quant"]


def redline_tables(records: list[dict[str, Any]]) -> list[str]:
    """One row per model x quant x batch, then one row per prefill measurement."""
    lengths = sorted({p["prompt_tokens"] for r in records for p in r["prefill"]})
    tag = "/".join(str(t) for t in lengths)
    has_compiled = any(p["compiled_prefill"] for r in records for p in r["prefill"])

    def per_length(prefill: list[dict[str, Any]], key: str, spec: str, scale: float = 1.0) -> str:
        by_length = {p["prompt_tokens"]: p[key] for p in prefill}
        return "/".join(_fmt(by_length.get(t), spec, scale) for t in lengths)

    header = ["model", "quant", "batch", "decode tok/s", "% of limit", "limit tok/s", "limit w/ KV", "GB/token",
              f"TTFT ms (T={tag})", f"prefill TFLOP/s (T={tag})"]
    header += [f"TTFT ms compiled prefill (T={tag})"] if has_compiled else []
    header += ["peak GB", "weights GB", "KV GB", "overhead GB", "compile s"]
    rows = []
    for r in records:
        eager = [p for p in r["prefill"] if not p["compiled_prefill"]]
        row = [r["model"], _quant_label(r), str(r["batch_size"]), f"{r['decode_tok_s']:.1f}",
               _fmt(r["pct_of_limit"], ".1f"), _fmt(r["limit_tok_s"], ".0f"), _fmt(r["limit_with_kv_tok_s"], ".0f"),
               f"{r['bytes_per_token'] / 1e9:.3g}", per_length(eager, "ttft_s", ".1f", 1e3),
               per_length(eager, "tflops", ".3g")]
        if has_compiled:
            row.append(per_length([p for p in r["prefill"] if p["compiled_prefill"]], "ttft_s", ".1f", 1e3))
        row += [_fmt(r["peak_memory_bytes"], ".2f", 1e-9), f"{r['weights_bytes'] / 1e9:.2f}",
                f"{r['kv_cache_bytes'] / 1e9:.2f}", _fmt(r["overhead_bytes"], ".2f", 1e-9), f"{r['compile_s']:.1f}"]
        rows.append(row)
    detail = [[r["model"], _quant_label(r), str(r["batch_size"]), "compiled" if p["compiled_prefill"] else "eager",
               str(p["prompt_tokens"]), str(p["cache_len"]), f"{p['ttft_s'] * 1e3:.1f}", f"{p['flops'] / 1e12:.3g}",
               f"{p['tflops']:.3g}", f"{p['decode_tok_s']:.1f}"] for r in records for p in r["prefill"]]
    lines = [""] + _table(header, rows)
    lines += ["", "Prefill (decode tok/s here runs with the cache sized for the longest prompt)", ""]
    return lines + _table(["model", "quant", "batch", "prefill", "prompt", "cache", "TTFT ms", "TFLOP", "TFLOP/s",
                           "decode tok/s"], detail)


def hf_table(hf_records: list[dict[str, Any]], version: str | None) -> list[str]:
    quants = sorted({q for h in hf_records for q in h["ratio"]}, key=QUANT_CHOICES.index)
    header = ["model", "HF mode", "HF tok/s", "first call s", "t(N) s", "t(short) s"]
    header += [f"Redline {q} / HF" for q in quants]
    rows = [[h["model"], hf_mode_label(h), _fmt(h["decode_tok_s"], ".1f"), f"{h['first_call_s']:.1f}",
             f"{h['t_long_s']:.3f}", f"{h['t_short_s']:.3f}"] + [_fmt(h["ratio"].get(q), ".2f") for q in quants]
            for h in hf_records]
    first = hf_records[0]
    lines = ["", f"HF transformers {version}: decode tok/s = (N - n_short) / (t(N) - t(n_short)) with "
             f"N={first['new_tokens']}, n_short={first['short_tokens']}, prompt {first['prompt_tokens']} tokens, "
             "batch 1: prefill cancels out", ""]
    lines += _table(header, rows)
    for h in hf_records:
        for q, ratio in h["ratio"].items():
            lines.append(f"ratio {h['model']}: Redline {q} {h['redline_tok_s'][q]:.1f} tok/s / {hf_mode_label(h)} "
                         f"{h['decode_tok_s']:.1f} tok/s = {ratio:.2f}x")
    return lines


def compile_time_table(records: list[dict[str, Any]]) -> list[str]:
    rows = []
    for c in records:
        for label in ("cold", "warm"):
            p = c[label]
            rows.append([c["model"], c["quant"], label, _fmt(p["first_token_s"], ".1f"), _fmt(p["main_s"], ".1f"),
                         _fmt(p["built_s"], ".1f"), f"{p['wall_s']:.1f}", p["error"] or ""])
    lines = ["", "Time to first token after process start (a child process per row; random weights are built on "
             "the device instead of loading a checkpoint)", ""]
    return lines + _table(["model", "quant", "inductor cache", "first token s", "imports done s", "model built s",
                           "process wall s", "error"], rows)


def write_json(report: dict[str, Any], path: Path) -> None:
    text = json.dumps(report, indent=2, default=str)
    write_atomically(path, lambda tmp: tmp.write_text(text + "\n", encoding="utf-8"))


def plot_series(report: dict[str, Any]) -> tuple[list[str], dict[str, list[float | None]], dict[str, list]]:
    """Per model: decode tok/s of each engine/mode (Redline at its smallest batch), and the bandwidth limits."""
    models = list(dict.fromkeys([r["model"] for r in report["records"]] + [h["model"] for h in report["hf"]]))
    series: dict[str, list[float | None]] = {}
    limits: dict[str, list] = {}
    for i, name in enumerate(models):
        mine = [r for r in report["records"] if r["model"] == name]
        smallest = min((r["batch_size"] for r in mine), default=1)
        for r in mine:
            if r["batch_size"] != smallest:
                continue
            label = f"Redline {_quant_label(r)}"
            series.setdefault(label, [None] * len(models))[i] = r["decode_tok_s"]
            if r["limit_tok_s"]:
                limits.setdefault(label, [None] * len(models))[i] = r["limit_tok_s"]
        for h in report["hf"]:
            if h["model"] == name:
                label = hf_mode_label(h)
                series.setdefault(label, [None] * len(models))[i] = h["decode_tok_s"]
    return models, series, limits


def write_plot(report: dict[str, Any], path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global state, no display; PNG goes through Agg

    models, series, limits = plot_series(report)
    fig = Figure(figsize=(max(6.0, 3.2 * len(models) + 2), 5.0), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(series))
    colors = {}
    for j, (label, values) in enumerate(series.items()):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(models))]
        heights = [v if v is not None else 0.0 for v in values]
        bars = ax.bar(xs, heights, width, label=label)
        colors[label] = bars.patches[0].get_facecolor() if bars.patches else None
        ax.bar_label(bars, labels=[_fmt(v, ".0f") if v is not None else "" for v in values], fontsize=8)
    for label, values in limits.items():
        legend_label: str | None = f"{label} bandwidth limit"  # one legend entry per series
        for i, limit in enumerate(values):
            if limit is None:
                continue
            ax.hlines(limit, i - 0.45, i + 0.45, colors=[colors.get(label)], linestyles="--", linewidth=1.5,
                      label=legend_label)
            legend_label = None
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("decode tok/s")
    batches = sorted({r["batch_size"] for r in report["records"]})
    bw = report.get("bandwidth_gb_s")
    ax.set_title(f"Decode tok/s (Redline batch {batches[0] if batches else 1}; HF batch 1)"
                 + (f"; dashed: limit at {bw:.0f} GB/s" if bw else ""))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: never over a bar or a line
    write_atomically(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))


def make_logger() -> Any:
    start = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f} s] {message}", file=sys.stderr, flush=True)

    return log


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = parse_args(argv)
        if cfg.ttft_probe:
            return run_ttft_probe(cfg)
        json_path = cfg.json_path
        save = (lambda partial: write_json(partial, json_path)) if json_path is not None else None
        report = merge_reports(cfg.merge) if cfg.merge else run_benchmark(cfg, make_logger(), save)
        print(format_report(report))
        if json_path is not None:
            write_json(report, json_path)
            print(f"\nJSON written to {json_path}")
        if cfg.plot_path is not None:
            write_plot(report, cfg.plot_path)
            print(f"plot written to {cfg.plot_path}")
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 1 if report.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
