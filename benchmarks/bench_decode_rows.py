"""The engine's decode step at several row counts: time, roofline, and where the GPU time goes.

Each row count R is one decode graph of the paged model (the step the engine replays when R sequences decode
together), every row at the same context length. The step is timed with CUDA events over repeated replays
(median of --repeats, the host filling the staging buffers each time as the engine does), and set against its
roofline: max(bytes read / measured read bandwidth, FLOPs / measured matmul peak, the FP8 one for --quant fp8), both
measured in the same run.
Then a few replays run under torch.profiler, and each row count's GPU time is split by kernel (the top --top kernels
and four groups: cuBLAS matmuls, Redline's Triton matmuls, attention, the rest).

    python benchmarks/bench_decode_rows.py --model Llama-3-8B --rows 128,256,384,512 --context 192 --json rows.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from redline.benchmarks.bench_env import environment
from redline.benchmarks.bench_model import QUANT_CHOICES, build_random_model
from redline.benchmarks.bench_serving import StepCosts, step_peak_flops
from redline.checkpoint import dtype_from_name, write_atomically
from redline.model import ModelArgs
from redline.runner import Runner
from redline.runner.paged import PagedModel

PAGE_SIZE = 16
# Substrings of kernel names, by group (the first group that matches wins; lower case).
KERNEL_GROUPS = (
    ("attention", ("paged", "attend", "_split_kernel", "_combine_kernel", "flash", "fmha", "sdpa")),
    ("triton matmul", ("_small_m_dot", "_gemv", "_dot_kernel", "gate_up", "_down_")),
    ("cublas matmul", ("nvjet", "gemm", "xmma", "cutlass", "sm90_", "sm80_", "cublas")),
)


def kernel_group(name: str) -> str:
    """The group a kernel's name puts it in: attention, triton matmul, cublas matmul, or other."""
    low = name.lower()
    return next((group for group, keys in KERNEL_GROUPS if any(k in low for k in keys)), "other")


def step_costs(args: ModelArgs, weight_bytes: int, kv_element: int, rows: int, context: int) -> tuple[float, float]:
    """(bytes read, FLOPs) of one decode step of `rows` sequences, each with `context` tokens before its new one,
    counted as the serving benchmark counts a step (bench_serving.StepCosts)."""
    keys = rows * (context + 1)
    return StepCosts(args, weight_bytes, kv_element).counted_bytes_and_flops(tokens=rows, rows=rows, keys_read=keys,
                                                                             visible=keys)


def step_inputs(rows: int, context: int, vocab: int) -> tuple[list[int], list[int], list[list[int]], list[tuple]]:
    """Tokens, positions, block tables (distinct pages from page 0) and greedy settings of `rows` sequences that
    each hold `context` tokens and decode the next."""
    per_row = context // PAGE_SIZE + 1
    pages = [list(range(r * per_row, (r + 1) * per_row)) for r in range(rows)]
    tokens = [(7919 * r + 13) % vocab for r in range(rows)]
    return tokens, [context] * rows, pages, [(0.0, 1, 1.0, 0)] * rows


def timed_steps(paged: PagedModel, inputs: tuple, repeats: int, device: torch.device) -> list[float]:
    """Seconds of each of `repeats` decode steps (the first run, which captures the graph, is not counted)."""
    paged.launch_decode(*inputs)
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            paged.launch_decode(*inputs)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            paged.launch_decode(*inputs)
            seconds.append(time.perf_counter() - begin)
    return seconds


def kernel_split(paged: PagedModel, inputs: tuple, steps: int, top: int) -> dict[str, Any]:
    """GPU microseconds per step of each kernel group and of the `top` costliest kernels, over `steps` steps run
    under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            paged.launch_decode(*inputs)
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] = kernels.get(event.name, 0.0) + event.device_time / steps
    groups: dict[str, float] = {}
    for name, us in kernels.items():
        groups[kernel_group(name)] = groups.get(kernel_group(name), 0.0) + us
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
    return {"groups_us": groups, "total_us": sum(kernels.values()),
            "top": [{"kernel": name[:120], "group": kernel_group(name), "us": us} for name, us in ranked]}


def measure(ns: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    device = torch.device(ns.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args = ModelArgs.from_name(ns.model)
    rows_list = row_counts(ns.rows)
    model = build_random_model(args, device, dtype_from_name(ns.dtype), ns.quant, seed=0)
    runner = Runner(model, device, compile=True)
    num_pages = rows_list[-1] * (ns.context // PAGE_SIZE + 1) + 1
    paged = PagedModel(runner, num_pages, PAGE_SIZE, num_pages - 1, compile_prefill=False, prefill_graphs=False,
                       max_rows=rows_list[-1])
    report: dict[str, Any] = {"env": environment(device, argv), "model": ns.model, "dtype": ns.dtype,
                              "quant": ns.quant, "context": ns.context, "rows": {}}
    report["env"]["command"] = "python benchmarks/bench_decode_rows.py " + " ".join(argv)
    bandwidth = peak = None
    if device.type == "cuda":
        from redline.profiling import read_bandwidth_gb_s

        bandwidth = statistics.median(read_bandwidth_gb_s(2.0)) * 1e9
        peak = step_peak_flops(device, dtype_from_name(ns.dtype), ns.quant)
        report["measured"] = {"read_gb_s": bandwidth / 1e9, "matmul_tflops": peak / 1e12}
    for rows in rows_list:
        inputs = step_inputs(rows, ns.context, args.vocab_size)
        seconds = statistics.median(timed_steps(paged, inputs, ns.repeats, device))
        nbytes, flops = step_costs(args, runner.bytes_per_token, paged.kv.k[0].element_size(), rows, ns.context)
        entry: dict[str, Any] = {"step_ms": 1e3 * seconds, "tok_s": rows / seconds, "gbytes": nbytes / 1e9,
                                 "tflop": flops / 1e12}
        if bandwidth is not None:
            floor = max(nbytes / bandwidth, flops / peak)
            entry.update(roofline_ms=1e3 * floor, roofline_pct=100 * floor / seconds,
                         bound="compute" if flops / peak > nbytes / bandwidth else "memory",
                         kernels=kernel_split(paged, inputs, ns.profile_steps, ns.top))
        report["rows"][rows] = entry
        print(row_line(rows, entry), flush=True)
    return report


def row_counts(text: str) -> list[int]:
    """The sorted row counts of a comma-separated list, each 1..512 (the decode graphs' buckets)."""
    try:
        rows = sorted({int(r) for r in text.split(",")})
    except ValueError:
        rows = []
    if not rows or rows[0] < 1 or rows[-1] > 512:
        raise ValueError(f"--rows takes comma-separated integers in 1..512, got {text!r}")
    return rows


def row_line(rows: int, entry: dict[str, Any]) -> str:
    line = f"{rows:4d} rows: {entry['step_ms']:7.2f} ms/step, {entry['tok_s']:9.0f} tok/s"
    if "roofline_ms" in entry:
        split = entry["kernels"]
        groups = ", ".join(f"{g} {us / 1e3:.2f}" for g, us in sorted(split["groups_us"].items(), key=lambda x: -x[1]))
        line += (f", roofline {entry['roofline_ms']:.2f} ms ({entry['bound']}-bound, {entry['roofline_pct']:.1f}%);"
                 f" GPU ms by group: {groups}")
        line += "".join(f"\n       {k['us']:9.1f} us  {k['group']:14s} {k['kernel']}" for k in split["top"])
    return line


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="Llama-3-8B", help="a registry name (model.MODEL_REGISTRY)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quant", choices=QUANT_CHOICES, default="none")
    p.add_argument("--device", default=None)
    p.add_argument("--rows", default="128,256,384,512", help="comma-separated row counts, each 1..512")
    p.add_argument("--context", type=int, default=192, help="tokens each row holds before the one it decodes")
    p.add_argument("--repeats", type=int, default=30, help="timed steps per row count (median)")
    p.add_argument("--profile-steps", type=int, default=5, help="steps run under torch.profiler per row count")
    p.add_argument("--top", type=int, default=8, help="kernels listed per row count")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = parse_args(argv)
    try:
        report = measure(ns, argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if ns.json is not None:
        write_atomically(ns.json, lambda tmp: Path(tmp).write_text(json.dumps(report, indent=1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
