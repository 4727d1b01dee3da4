"""Redline on one random-weight model: decode tok/s against the bandwidth limit, TTFT and prefill TFLOP/s per prompt
length, memory, compile time, and optionally a profiler trace."""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from redline import generate, runner
from redline.model import ModelArgs
from redline.benchmarks.bench_model import (build_random_model, kv_cache_bytes, param_counts, prefill_flops, random_prompts,
                                 weights_bytes)
from redline.benchmarks.bench_tp import all_reduce_timings, build_random_tp_model

if TYPE_CHECKING:
    from redline.benchmarks.bench_config import BenchConfig
    from redline.tensor_parallel import TPWorld


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
    tp: int = 1  # tensor-parallel ranks; bytes, weights, KV cache, memory and the limit are then one rank's
    all_reduce_mode: str | None = None  # the all-reduce the model ran (REDLINE_ALL_REDUCE), with --tp
    all_reduce: dict[str, Any] | None = None  # benchmarks.bench_tp.all_reduce_timings, with --tp

    def __post_init__(self) -> None:
        if self.batch_size <= 0 or self.decode_tok_s < 0 or self.bytes_per_token <= 0:
            raise ValueError(f"invalid record for {self.model} {self.quant} batch {self.batch_size}")


def timed_generation(llm: generate.LLM, prompts: Tensor, new_tokens: int) -> Timing:
    """One greedy generation of prompts (B, T). Batch 1 goes through `LLM.generate`; larger batches through
    `generate_token_batches`, timed the same way (first token on the host, then the steps after it)."""
    device = llm.device
    batch = prompts.shape[0]
    runner.sync(device)
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
    CUDA graph, 15-20 ms longer than a replay, which would otherwise land in the first timed run."""
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


def bench_redline(cfg: BenchConfig, name: str, quant: str, batch: int, bandwidth: float | None,
                  log: Any, world: TPWorld | None = None,
                  all_reduce_cache: dict[tuple, dict[str, Any]] | None = None) -> RedlineRecord:
    """One model x quant x batch: decode, prefill per prompt length, memory and, with --profile, a trace. With a
    world, this rank's slices of the model, and the all-reduce time per token (taken from all_reduce_cache when
    a record of the same shapes timed it already: it depends on the hidden size, layers, dtype and batch only)."""
    device = torch.device(cfg.device)
    args = ModelArgs.from_name(name)
    ranks = f" (rank 0 of {world.world_size}, {world.all_reduce} all-reduce)" if world else ""
    log(f"{name} {quant} batch {batch}: building random weights{ranks}")
    model = (build_random_model(args, device, cfg.torch_dtype, quant, cfg.seed, cfg.group_size) if world is None
             else build_random_tp_model(args, world, cfg.torch_dtype, quant, cfg.seed, cfg.group_size))
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

    label = f"{name}-{quant}-b{batch}" + (f"-tp{world.world_size}-{world.all_reduce}-rank{world.rank}" if world
                                           else "")
    trace_path, trace_rate = profile_generation(cfg, llm, decode_prompts, label, log) \
        if cfg.profile_dir is not None else (None, None)

    all_reduce = None
    if world is not None:
        key = (args.dim, args.n_layer, cfg.dtype, batch)
        cache = {} if all_reduce_cache is None else all_reduce_cache
        if key not in cache:  # every rank takes the same branch: the all-reduces are collective
            log(f"{name} {quant} batch {batch}: timing the all-reduces of one token")
            cache[key] = all_reduce_timings(world, args, cfg.torch_dtype, batch)
        all_reduce = {**cache[key], "trace": trace_all_reduce(trace_path) if trace_path is not None else None}
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
        profile_decode_tok_s=trace_rate, tp=cfg.tp, all_reduce_mode=world.all_reduce if world else None,
        all_reduce=all_reduce,
    )


def trace_all_reduce(path: str) -> dict[str, float | None]:
    """The all-reduce kernels of a decode step in a rank's trace (scripts/trace_summary.py): per decode step, which
    is one token at batch 1, their summed duration and the time they add to the GPU timeline."""
    from redline.scripts.trace_summary import summarize_trace

    summary = summarize_trace(path)
    return {"calls_per_token": summary.all_reduce_calls_per_step, "us_per_token": summary.all_reduce_us_per_step,
            "exclusive_us_per_token": summary.all_reduce_exclusive_us_per_step}


def profile_generation(cfg: BenchConfig, llm: generate.LLM, prompts: Tensor, label: str,
                       log: Any) -> tuple[str, float]:
    """One more generation under the profiler; returns the trace path and that run's aggregate decode tok/s.

    Batch 1 goes through `LLM.generate(profile=...)`; larger batches drive the same token loop with a recorder.
    """
    from redline.profiling import ProfileConfig, TraceRecorder

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
        device_name = torch.cuda.get_device_name() if llm.device.type == "cuda" else "cpu"
        recorder.write({"model": label, "batch_size": batch, "decode_tok_s": rate, "device": device_name,
                        "torch_version": torch.__version__},
                       generate.step_seconds(times))
    log(f"{label}: trace {path} ({path.stat().st_size / 1e6:.2f} MB), decode {rate:.1f} tok/s while profiled")
    return str(path), rate

