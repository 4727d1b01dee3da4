#!/usr/bin/env python3
"""Serving throughput of the batching engine (engine/) on a random-weight model, offline.

    python benchmarks/bench_serving.py --model Llama-3-8B --workload fixed --num-requests 1024 [--compare hf]
    python benchmarks/bench_serving.py --model Llama-3-8B --workload mixed [--compare hf --hf-requests 64]
    python benchmarks/bench_serving.py --model debug-tiny --device cpu --dtype float32 --num-requests 16
    python benchmarks/bench_serving.py --model Llama-3-8B --workload fixed --quant fp8
    python benchmarks/bench_serving.py --model Llama-3.1-8B --workload long --kv-cache-dtype fp8 --max-running 4
    torchrun --nproc_per_node 2 benchmarks/bench_serving.py --model Llama-3.1-70B --workload fixed  # tensor parallel

Workloads (EOS ignored, so every request makes exactly its output length):
- fixed: N requests of 128 prompt tokens and 128 output tokens each;
- mixed: 256 requests (or N), prompt and output lengths uniform in 100..1024;
- single: one request of 128 prompt and 256 output tokens through the engine, against LLM.generate (the static
  path, compiled and fused as the LLM is) in the same process: decode tok/s after the first token, median of 3;
- prefix: a 4,000-token first turn, then a second turn that repeats it with a reply and 64 new tokens: time to
  first token of each (median of 3 pairs), after the same graph capture and warm-up as serve.py's start-up;
- long: N requests (default 4) of --prompt-tokens (default 32,000) prompt tokens and 128 output tokens: the decode
  inter-token latency at that context, the median of the steps that only decode (every row past its prefill).
--kv-cache-dtype fp8 stores the pages as e4m3 (twice the tokens in the same memory); the report names the pool's
capacity in tokens either way.
All requests are queued at once. Reported: output tok/s and total tok/s (prompt + output) over the wall time from
the first add_request to the last result; the step time distribution; peak KV pages in use; preemptions; and the
roofline of the run: the sum over its steps of max(bytes read / measured read bandwidth, FLOPs / measured bf16
matmul peak), over the measured time of those steps. With --quant fp8 (W8A8) the compute ceiling is the measured FP8
peak instead (torch._scaled_mm with row-wise scales, about twice bf16's on Hopper), applied to every FLOP of the step
(attention's included, which stays bf16: a ceiling that is if anything too high, so the % is not flattered). A step's bytes: the weights once, the keys and values its
attention reads and writes; its FLOPs: 2 x block matmul params x tokens, 2 x head params x logits rows, and
attention (4 x n_layer x n_head x head_dim x visible keys per query). --compare hf times transformers'
continuous batching (generate_batch's manager, per-request max_new_tokens) on the first --hf-requests requests,
and Redline on the same subset in the same process. Under torchrun (tensor parallel) each rank builds random weights
in its slice shapes, rank 0's engine runs the workload and the other ranks follow its steps; the roofline is one
GPU's (every rank reads its slices in parallel; the all-reduces count as time off it).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from redline import tensor_parallel
from redline.benchmarks.bench_env import environment
from redline.benchmarks.bench_model import QUANT_CHOICES, build_random_model, param_counts
from redline.checkpoint import dtype_from_name, dtype_name, write_atomically
from redline.engine import Engine
from redline.engine.core import COMPILE_PREFILL_HELP, KV_CACHE_DTYPE_HELP, PREFILL_GRAPHS_HELP
from redline.engine.batch import Chunk
from redline.engine.scheduler import DEFAULT_PREFILL_CHUNK
from redline.generate import LLM
from redline.model import ModelArgs
from redline.options import GenerationOptions
from redline.runner import expert_bytes

WORKLOADS = ("fixed", "mixed", "single", "prefix", "long")
# The "long" workload: requests of this many prompt tokens by default (--prompt-tokens), each making this many.
LONG_PROMPT_TOKENS = 32000
LONG_OUTPUT_TOKENS = 128
LONG_DEFAULT_REQUESTS = 4
# The "prefix" workload: a first chat turn of this many tokens, then a second turn that repeats it and adds a reply
# and a new message (the prefix cache should serve the shared part).
PREFIX_TOKENS = 4000
PREFIX_REPLY_TOKENS = 16
SECOND_TURN_NEW_TOKENS = 64
PREFIX_TURN_TOKENS = 2 * (PREFIX_REPLY_TOKENS + SECOND_TURN_NEW_TOKENS)  # the longest sequence past the prefix
MIXED_RANGE = (100, 1024)
MIXED_DEFAULT_REQUESTS = 256


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int


def make_requests(workload: str, count: int, vocab: int, seed: int,
                  prompt_tokens: int = LONG_PROMPT_TOKENS) -> list[Request]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        if workload == "fixed":
            prompt_len, output_len = 128, 128
        elif workload == "long":
            prompt_len, output_len = prompt_tokens, LONG_OUTPUT_TOKENS
        else:
            prompt_len, output_len = torch.randint(MIXED_RANGE[0], MIXED_RANGE[1] + 1, (2,), generator=gen).tolist()
        out.append(Request(torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(), output_len))
    return out


@dataclass
class StepLog:
    """What each step computed and how long it took."""

    seconds: list[float] = field(default_factory=list)
    min_seconds: list[float] = field(default_factory=list)  # the roofline of each step
    pages_used: list[int] = field(default_factory=list)
    decode_only: list[bool] = field(default_factory=list)  # every chunk of the step is one decoded token
    shapes: list[tuple[int, int]] = field(default_factory=list)  # (chunks, tokens) of each step

    def slowest(self, count: int = 5) -> list[dict[str, Any]]:
        """The slowest steps, in order: their index, ms, chunks and tokens (a one-time cost shows here)."""
        order = sorted(range(len(self.seconds)), key=lambda i: -self.seconds[i])[:count]
        return [{"step": i, "ms": 1e3 * self.seconds[i], "chunks": self.shapes[i][0], "tokens": self.shapes[i][1]}
                for i in order]

    def by_kind(self) -> dict[str, dict[str, Any]]:
        """Decode-only steps and steps that prefill (a prompt or a preempted sequence's recompute): count,
        seconds, and roofline % when known."""
        out = {}
        for kind, mine in (("decode", self.decode_only), ("with_prefill", [not d for d in self.decode_only])):
            secs = [x for x, m in zip(self.seconds, mine) if m]
            floor = sum(x for x, m in zip(self.min_seconds, mine) if m)
            out[kind] = {"steps": len(secs), "seconds": sum(secs),
                         "roofline_pct": 100 * floor / sum(secs) if secs and floor else None}
        return out


class StepCosts:
    """Bytes and FLOPs of one step of a model (the roofline's inputs). In a mixture of experts a step reads the
    experts its tokens choose: with T tokens routed uniformly, a share 1 - (1 - top_k / n_experts) ** T of them."""

    def __init__(self, args: ModelArgs, weight_bytes: int, element: int, bandwidth: float = 0.0,
                 peak_flops: float = 0.0, expert_bytes: int = 0) -> None:
        """bandwidth (bytes/s) and peak_flops: the ceilings min_seconds divides by (not needed for bytes_and_flops)."""
        counts = param_counts(args)
        self.block, self.head = counts["block_matmuls"], counts["head"]
        self.kv_token_bytes = 2 * args.n_layer * args.n_kv_heads * args.head_dim * element
        self.attn_unit = 4 * args.n_layer * args.n_head * args.head_dim
        self.chosen = args.n_experts_per_tok / args.n_experts if args.n_experts else 0.0
        self.expert_bytes = expert_bytes  # all experts of all sparse layers
        self.dense_bytes = weight_bytes - expert_bytes * self.chosen  # weight_bytes: what one token reads
        self.bandwidth, self.peak_flops = bandwidth, peak_flops

    def bytes_and_flops(self, chunks: list[Chunk]) -> tuple[float, float]:
        """What a step computing these chunks reads (weights, the keys and values before its tokens and its tokens'
        own) and its FLOPs (matmuls of every token, the head of every sampling row, attention over visible keys)."""
        return self.counted_bytes_and_flops(
            tokens=sum(c.length for c in chunks), rows=sum(1 for c in chunks if c.samples),
            keys_read=sum(c.start + c.length for c in chunks),
            visible=sum(c.length * c.start + c.length * (c.length + 1) // 2 for c in chunks))

    def counted_bytes_and_flops(self, tokens: int, rows: int, keys_read: int, visible: int) -> tuple[float, float]:
        """bytes_and_flops from a step's counts: tokens computed, rows sampled, keys read, (query, key) pairs."""
        weights = self.dense_bytes + self.expert_bytes * (1 - (1 - self.chosen) ** tokens)
        nbytes = weights + (keys_read + tokens) * self.kv_token_bytes
        return nbytes, 2 * self.block * tokens + 2 * self.head * rows + self.attn_unit * visible

    def min_seconds(self, chunks: list[Chunk]) -> float:
        nbytes, flops = self.bytes_and_flops(chunks)
        return max(nbytes / self.bandwidth, flops / self.peak_flops)


class TimedEngine(Engine):
    """The engine with each step timed: from its launch (or the step before it reaching the host, when later) to
    its tokens reaching the host."""

    log: StepLog
    costs: StepCosts | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.core.step_listener = self._log_step

    def _log_step(self, chunks: list[Chunk], seconds: float) -> None:
        self.log.seconds.append(seconds)
        self.log.min_seconds.append(self.costs.min_seconds(chunks) if self.costs is not None else 0.0)
        self.log.pages_used.append(self.pool.num_used)
        self.log.decode_only.append(all(c.length == 1 for c in chunks))
        self.log.shapes.append((len(chunks), sum(c.length for c in chunks)))


def run_redline(engine: TimedEngine, requests: list[Request]) -> dict[str, Any]:
    engine.log = StepLog()
    followed = engine.steps_followed
    start = time.perf_counter()
    handles = [engine.add_request(r.prompt, GenerationOptions(max_new_tokens=r.output_len, ignore_eos=True))
               for r in requests]
    results = [h.result() for h in handles]
    wall = time.perf_counter() - start
    made = sum(len(r.token_ids) for r in results)
    expected = sum(min(r.output_len, engine.block_size - len(r.prompt)) for r in requests)  # capped by the context
    if made != expected:
        raise RuntimeError(f"the engine made {made} tokens, {expected} were asked for")
    log = engine.log
    prompt_tokens = sum(len(r.prompt) for r in requests)
    ms = sorted(s * 1e3 for s in log.seconds)
    stepped = sum(log.seconds)
    decode_ms = [s * 1e3 for s, d in zip(log.seconds, log.decode_only) if d]  # each: one token of every row

    def pct(p: float) -> float:
        return ms[min(len(ms) - 1, int(p * len(ms)))]

    return {
        "requests": len(requests), "prompt_tokens": prompt_tokens, "output_tokens": made, "wall_s": wall,
        "output_tok_s": made / wall, "total_tok_s": (made + prompt_tokens) / wall, "steps": len(ms),
        "step_ms": {"mean": statistics.fmean(ms), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "max": ms[-1]},
        "peak_kv_pages": max(log.pages_used), "kv_pages_total": engine.pool.num_pages,
        "kv_capacity_tokens": engine.pool.capacity_tokens, "kv_cache_dtype": dtype_name(engine.core.kv_dtype),
        "decode_itl_ms_p50": statistics.median(decode_ms) if decode_ms else None,
        "preemptions": engine.stats().preemptions,
        "roofline_pct": 100 * sum(log.min_seconds) / stepped if stepped and engine.costs else None,
        "step_time_share_of_wall": stepped / wall, "steps_by_kind": log.by_kind(),
        "steps_launched_ahead": engine.steps_followed - followed, "slowest_steps": log.slowest(),
    }


def run_hf(args: ModelArgs, device: torch.device, dtype: torch.dtype, requests: list[Request]) -> dict[str, Any]:
    """transformers' continuous batching on the same requests: one manager, each request its own max_new_tokens."""
    from transformers import GenerationConfig

    from redline.benchmarks.bench_hf import build_hf_model

    model = build_hf_model(args, device, dtype)
    config = GenerationConfig(max_new_tokens=max(r.output_len for r in requests), do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=config)
    # transformers' paged SDPA failed inside cuDNN's attention graph on an H200 (torch 2.11); flash and
    # memory-efficient SDPA remain.
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    manager.start()
    try:
        start = time.perf_counter()
        ids = [manager.add_request(r.prompt, max_new_tokens=r.output_len) for r in requests]
        made, done = 0, 0
        while done < len(ids):
            out = manager.get_result(timeout=600)
            if out is None:
                raise RuntimeError("transformers' batching manager stopped before every request finished")
            if out.is_finished():
                made += len(out.generated_tokens)
                done += 1
        wall = time.perf_counter() - start
    finally:
        manager.stop(block=True)
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
    del model
    expected = sum(r.output_len for r in requests)
    if made != expected:
        raise RuntimeError(f"transformers made {made} tokens, {expected} were asked for: its run failed (see above)")
    return {"requests": len(requests), "output_tokens": made, "wall_s": wall, "output_tok_s": made / wall}


def matmul_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large square matmul (median of 10), the roofline's compute ceiling."""
    n = 8192
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n ** 3 / statistics.median(times)


def fp8_matmul_peak_flops(device: torch.device) -> float:
    """FLOP/s of a large e4m3 x e4m3 matmul with row-wise fp32 scales and bf16 output (torch._scaled_mm, cuBLAS), median
    of 10: the compute ceiling of an FP8 (W8A8) model's roofline."""
    n = 8192
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    sa, sb = torch.ones(n, 1, device=device), torch.ones(1, n, device=device)

    def product() -> torch.Tensor:
        return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    for _ in range(3):
        product()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        product()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n ** 3 / statistics.median(times)


def step_peak_flops(device: torch.device, dtype: torch.dtype, quant: str) -> float:
    """The compute ceiling of a step's roofline: the FP8 matmul's for W8A8 weights (they multiply on the FP8 tensor
    cores), else the float matmul's in the activations' dtype."""
    return fp8_matmul_peak_flops(device) if quant == "fp8" else matmul_peak_flops(device, dtype)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Serving throughput of Redline's batching engine on random weights.")
    p.add_argument("--model", default="Llama-3-8B", help="a registry name (model.MODEL_REGISTRY)")
    p.add_argument("--workload", choices=WORKLOADS, default="fixed")
    p.add_argument("--num-requests", type=int, default=None, help="default: 1024 (fixed), 256 (mixed), 4 (long)")
    p.add_argument("--prompt-tokens", type=int, default=LONG_PROMPT_TOKENS, help="the long workload's prompts")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quant", choices=QUANT_CHOICES, default="none",
                   help="weights: none (the --dtype), int8, int4 or fp8 (W8A8 e4m3; an sm89+ GPU)")
    p.add_argument("--max-kv-tokens", type=int, default=None, help="default: from free GPU memory")
    p.add_argument("--kv-cache-dtype", default="auto", help=KV_CACHE_DTYPE_HELP)
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                   help="prompt tokens a step computes at most")
    p.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--compile-prefill", action=argparse.BooleanOptionalAction, help=COMPILE_PREFILL_HELP)
    p.add_argument("--prefill-graphs", action="store_true", help=PREFILL_GRAPHS_HELP)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="decode steps as CUDA graphs (default: on for a GPU)")
    p.add_argument("--compare", choices=("hf",), default=None)
    p.add_argument("--hf-requests", type=int, default=None, help="time both engines on the first N requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    ns = p.parse_args(argv)
    if ns.num_requests is None:
        ns.num_requests = {"fixed": 1024, "long": LONG_DEFAULT_REQUESTS}.get(ns.workload, MIXED_DEFAULT_REQUESTS)
    if ns.num_requests < 1 or ns.prompt_tokens < 1 or (ns.hf_requests is not None and ns.hf_requests < 1):
        raise ValueError("--num-requests, --prompt-tokens and --hf-requests must be positive")
    return ns


def run_single(llm: LLM, engine: Engine, vocab: int, seed: int) -> dict[str, Any]:
    """Batch 1: decode tok/s of one request through the engine and through LLM.generate, median of 3 each."""
    prompt = make_requests("fixed", 1, vocab, seed)[0].prompt
    options = GenerationOptions(max_new_tokens=256, ignore_eos=True)
    engine.add_request(prompt, options).result()  # warm-up (graph capture)
    llm.generate(prompt, options)
    engine_rates, static_rates = [], []
    for _ in range(3):
        engine_rates.append(engine.add_request(prompt, options).result().stats.decode_tok_s)
        static_rates.append(llm.generate(prompt, options).stats.decode_tok_s)
    e, st = statistics.median(engine_rates), statistics.median(static_rates)
    return {"engine_decode_tok_s": e, "static_decode_tok_s": st, "ratio": e / st}


def first_token_seconds(engine: Engine, prompt: list[int]) -> tuple[float, list[int], int]:
    """(seconds from add_request to the first new token, the reply's ids, prompt tokens served from the cache)."""
    start = time.perf_counter()
    handle = engine.add_request(prompt, GenerationOptions(max_new_tokens=PREFIX_REPLY_TOKENS, ignore_eos=True))
    outputs = iter(handle)
    first = next(outputs)
    seconds = time.perf_counter() - start
    ids = list(first.token_ids) + [t for out in outputs for t in out.token_ids]
    return seconds, ids, first.cached_tokens


def run_prefix(engine: Engine, vocab: int, context: int, seed: int) -> dict[str, Any]:
    """A second turn sharing a PREFIX_TOKENS-token first turn (half the context, if that is less): time to first
    token of each, median of 3 pairs (each pair with its own random prefix, after one warm-up pair)."""
    length = min(PREFIX_TOKENS, context // 2)
    gen = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(4):
        first = torch.randint(0, vocab, (length,), generator=gen).tolist()
        first_s, reply, _ = first_token_seconds(engine, first)
        turn = torch.randint(0, vocab, (SECOND_TURN_NEW_TOKENS,), generator=gen).tolist()
        second_s, _, cached = first_token_seconds(engine, first + reply + turn)
        pairs.append((first_s, second_s, cached))
    pairs = pairs[1:]  # the first pair warms up
    first_s = statistics.median(p[0] for p in pairs)
    second_s = statistics.median(p[1] for p in pairs)
    return {"prefix_tokens": length, "first_turn_ttft_s": first_s, "second_turn_ttft_s": second_s,
            "ratio": second_s / first_s, "second_turn_cached_tokens": [p[2] for p in pairs]}


def random_llm(ns: argparse.Namespace, world: tensor_parallel.TPWorld | None) -> LLM:
    """The random-weight model of --model, or under torchrun this rank's slices of it (each rank's own random
    weights in its slice shapes), as an LLM."""
    device = torch.device(ns.device or ("cuda" if torch.cuda.is_available() else "cpu")) if world is None \
        else world.device
    dtype = dtype_from_name(ns.dtype)
    args = ModelArgs.from_name(ns.model)
    if world is None:
        model = build_random_model(args, device, dtype, ns.quant, seed=ns.seed)
    else:
        from redline.benchmarks.bench_tp import build_random_tp_model

        model = build_random_tp_model(args, world, dtype, ns.quant, seed=ns.seed)
    return LLM(model, None, device, compile=ns.compile if ns.compile is not None else device.type == "cuda",
               kernels=ns.kernels)


def run(ns: argparse.Namespace, argv: Sequence[str], world: tensor_parallel.TPWorld | None = None) -> dict[str, Any]:
    """The workload on rank 0 (or one process); under torchrun every other rank follows rank 0's engine steps and
    returns an empty report."""
    llm = random_llm(ns, world)  # a rank's model: its share of heads and features
    engine = TimedEngine(llm, max_kv_tokens=ns.max_kv_tokens, max_running=ns.max_running, page_size=ns.page_size,
                         prefill_chunk=ns.prefill_chunk, compile_prefill=ns.compile_prefill,
                         prefill_graphs=ns.prefill_graphs, kv_cache_dtype=ns.kv_cache_dtype)
    if world is not None and world.rank != 0:
        engine.follow()
        return {}
    try:
        return measure(ns, argv, world, llm, engine)
    finally:  # also after an error: with tensor parallel, the other ranks' follow() returns
        engine.shutdown()


def measure(ns: argparse.Namespace, argv: Sequence[str], world: tensor_parallel.TPWorld | None, llm: LLM,
            engine: TimedEngine) -> dict[str, Any]:
    """Rank 0's (or the one process's) report of the workload on the engine."""
    model, device, args = llm.model, llm.device, llm.model.args
    dtype = dtype_from_name(ns.dtype)
    engine.log = StepLog()
    if device.type == "cuda":  # with tensor parallel, one GPU's roofline: each reads its slices in parallel
        from redline.profiling import read_bandwidth_gb_s

        bandwidth = statistics.median(read_bandwidth_gb_s(2.0)) * 1e9
        peak = step_peak_flops(device, dtype, ns.quant)
        engine.costs = StepCosts(args, llm.bytes_per_token, engine.core.kv_dtype.itemsize, bandwidth,
                                 peak, sum(b for _, b in expert_bytes(model)))
    report: dict[str, Any] = {"env": environment(device, argv), "model": ns.model, "workload": ns.workload,
                              "settings": {k: v for k, v in vars(ns).items() if k != "json"},
                              "tp": world.world_size if world is not None else 1}
    launcher = "python" if world is None else f"torchrun --nproc_per_node {world.world_size}"
    report["env"]["command"] = f"{launcher} benchmarks/bench_serving.py " + " ".join(argv)
    if ns.workload == "single":
        report["single"] = run_single(llm, engine, args.vocab_size, ns.seed)
        return report
    requests = make_requests(ns.workload, ns.num_requests, args.vocab_size, ns.seed,
                             ns.prompt_tokens) if ns.workload != "prefix" else []
    longest = max((len(r.prompt) + r.output_len for r in requests), default=PREFIX_TOKENS + PREFIX_TURN_TOKENS)
    start = time.perf_counter()
    graphs = engine.capture_graphs(longest)
    report["graph_capture"] = {"graphs": graphs, "seconds": time.perf_counter() - start}
    print(f"captured {graphs} decode graphs in {report['graph_capture']['seconds']:.1f} s", flush=True)
    engine.warm_up()  # as serve.py does before it says ready
    if ns.workload == "prefix":
        report["prefix"] = run_prefix(engine, args.vocab_size, args.block_size, ns.seed)
        return report
    if engine.costs is not None:
        costs = engine.costs
        report["measured"] = {"read_gb_s": costs.bandwidth / 1e9, "matmul_tflops": costs.peak_flops / 1e12}
    report["redline"] = run_redline(engine, requests)
    if ns.compare == "hf":
        subset = requests[:ns.hf_requests] if ns.hf_requests else requests
        if ns.hf_requests:
            report["redline_subset"] = run_redline(engine, subset)
        engine.shutdown()
        engine.paged.kv = engine.paged.graphs = None  # the page pool (most of the free memory) and the graphs, for transformers'
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        report["hf"] = run_hf(args, device, dtype, subset)
        base = report.get("redline_subset", report["redline"])
        report["speedup_vs_hf"] = base["output_tok_s"] / report["hf"]["output_tok_s"]
    return report


def format_report(report: dict[str, Any]) -> str:
    if "prefix" in report:
        x = report["prefix"]
        return (f"{report['model']} prefix cache: first turn ({x['prefix_tokens']} tokens) TTFT "
                f"{1e3 * x['first_turn_ttft_s']:.1f} ms, second turn {1e3 * x['second_turn_ttft_s']:.1f} ms "
                f"({100 * x['ratio']:.1f}%), cached {x['second_turn_cached_tokens']}")
    if "single" in report:
        one = report["single"]
        return (f"{report['model']} batch 1: engine {one['engine_decode_tok_s']:.1f} decode tok/s, static path "
                f"{one['static_decode_tok_s']:.1f} ({100 * one['ratio']:.1f}%)")
    r = report["redline"]
    s = r["step_ms"]
    roof = f", {r['roofline_pct']:.1f}% of the run's roofline" if r["roofline_pct"] is not None else ""
    quant = report["settings"].get("quant", "none")
    weights = f" {quant}" if quant != "none" else ""
    lines = [f"{report['model']}{weights} {report['workload']}: {r['requests']} requests, {r['output_tokens']} output "
             f"tokens in {r['wall_s']:.2f} s",
             f"  output {r['output_tok_s']:.0f} tok/s, total {r['total_tok_s']:.0f} tok/s{roof}",
             f"  {r['steps']} steps, ms: mean {s['mean']:.2f}, p50 {s['p50']:.2f}, p90 {s['p90']:.2f}, "
             f"p99 {s['p99']:.2f}, max {s['max']:.2f}",
             f"  peak KV pages {r['peak_kv_pages']} of {r['kv_pages_total']}, preemptions {r['preemptions']}, "
             f"decode steps launched before the step before them was read: {r.get('steps_launched_ahead', 0)}",
             f"  KV cache {r['kv_cache_dtype']}: {r['kv_capacity_tokens']} tokens"]
    if report["workload"] == "long" and r["decode_itl_ms_p50"] is not None:
        lines.append(f"  decode ITL p50 {r['decode_itl_ms_p50']:.2f} ms at {r['prompt_tokens'] // r['requests']} "
                     f"prompt tokens x {r['requests']} rows (the steps that only decode)")
    for kind, k in r["steps_by_kind"].items():
        roof_k = f", {k['roofline_pct']:.1f}% of roofline" if k["roofline_pct"] is not None else ""
        lines.append(f"  {kind.replace('_', ' ')} steps: {k['steps']}, {k['seconds']:.2f} s{roof_k}")
    if "measured" in report:
        m = report["measured"]
        lines.append(f"  measured: read {m['read_gb_s']:.0f} GB/s, {'fp8' if quant == 'fp8' else 'dense'} matmul "
                     f"{m['matmul_tflops']:.0f} TFLOP/s (the roofline's ceilings)")
    if "hf" in report:
        h = report["hf"]
        mine = report.get("redline_subset", r)
        lines.append(f"  transformers generate_batch on {h['requests']} requests: {h['output_tok_s']:.0f} output "
                     f"tok/s; Redline on the same: {mine['output_tok_s']:.0f} ({report['speedup_vs_hf']:.1f}x)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        ns = parse_args(argv)
        world = tensor_parallel.start(ns.device)  # None unless torchrun launched several ranks
        if world is not None and (ns.compare is not None or ns.workload == "single"):
            raise ValueError("--compare hf and --workload single run a model outside the engine, on one GPU; drop "
                             "them under torchrun")
        report = run(ns, argv, world)
    except (ValueError, FileNotFoundError) as exc:
        tensor_parallel.report_error(f"error: {exc}")
        return 2
    finally:
        tensor_parallel.stop()
    if not report:  # a rank other than 0: rank 0 reports
        return 0
    print(format_report(report))
    if ns.json is not None:
        write_atomically(ns.json, lambda tmp: Path(tmp).write_text(json.dumps(report, indent=2)))
        print(f"JSON written to {ns.json}")
    return 0


if __name__ == "__main__":
    from redline.benchmarks.bench_serving import main as package_main

    tensor_parallel.exit_process(package_main())
