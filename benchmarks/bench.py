#!/usr/bin/env python3
"""Benchmark Redline on random-weight models: decode against the GPU's read bandwidth, prefill, compile time, and HF.

    python benchmarks/bench.py --model Llama-2-7B,Llama-3-8B --quant none,int8 --batch-size 1 \\
        --prompt-lengths 8,512,2048 --new-tokens 200 --runs 5 [--compare hf] [--compile-prefill] \\
        [--compile-time | --compile-time-only] [--device cuda|cpu] [--dtype bfloat16] [--json FILE] [--plot FILE.png]
    python benchmarks/bench.py --merge a.json,b.json [--json all.json] [--plot all.png]   # re-report saved runs
    torchrun --nproc_per_node 2 benchmarks/bench.py --tp 2 --model Llama-2-70B [--all-reduce nccl,oneshot]  # 2 GPUs
    python benchmarks/bench.py --model Llama-2-7B --quant none,int8 --speculate-k 1,2,3,4,5,6,7,8 [--json FILE]

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
- --tp N (under torchrun with N processes): each rank builds random weights in its slices' shapes (int8/int4 drawn
  directly, no float copy); bytes per token, bandwidth and the limit are one GPU's (each reads its slices in
  parallel); the all-reduce time per token is a CUDA graph of just the 2 x n_layer all-reduces of one decode step,
  NCCL and one-shot. The model runs the all-reduce REDLINE_ALL_REDUCE names, or each of --all-reduce nccl,oneshot
  in turn. A run that also has 1-GPU records of the same models (--merge) gets a table of TP against one GPU.
  Rank 0 alone prints and writes the JSON.
- --speculate-k (instead of the runs above): one decode step's time, a verify step's time for each k against it, and
  the ceiling with a replay draft that is always right (benchmarks/bench_speculative.py says how);
  benchmarks/speculative_projection.py combines these with measured acceptance.

This file is the CLI and the run; each measurement has its own module: bench_redline (Redline), bench_hf
(transformers), bench_compile_time (the child processes), bench_model (random weights and the counts), bench_env
(versions and read bandwidth), bench_report (tables, JSON, plot, --merge).
"""
from __future__ import annotations

import dataclasses
import gc
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch
import torch._dynamo

from redline import tensor_parallel
from redline.benchmarks.bench_compile_time import CompileTimeRecord, measure_compile_times, run_ttft_probe
from redline.benchmarks.bench_env import BANDWIDTH_REPEATS, environment, measure_read_bandwidth
from redline.benchmarks.bench_int4 import tinygemm_anchor
from redline.benchmarks.bench_hf import HFRecord, attach_ratios, bench_hf
from redline.benchmarks.bench_redline import RedlineRecord, bench_redline, median
from redline.benchmarks.bench_report import NOTES, format_report, merge_reports, write_json, write_plot
from redline.benchmarks.bench_speculative import bench_speculative, format_speculative
from redline.benchmarks.bench_config import (BenchConfig, parse_args,  # noqa: F401 (bench.parse_args is the CLI's)
                                             start_ranks)


def run_benchmark(cfg: BenchConfig, log: Any, save: Any = None,
                  world: tensor_parallel.TPWorld | None = None) -> dict[str, Any]:
    """Every measurement the config asks for. A failed configuration is logged and recorded under "errors" and the
    run goes on; `save(report)` is called after each step, so a run cut short still leaves its results. With a
    world (--tp), every rank runs all of it and the models are that rank's slices."""
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
    report: dict[str, Any] = {"env": environment(device, cfg.argv), "bandwidth_gb_s": bandwidth,
                              "bandwidth_runs_gb_s": bandwidth_runs, "errors": [], "notes": NOTES}
    if cfg.tp > 1:
        report["env"]["command"] = report["env"]["command"].replace("python ", f"torchrun --nproc_per_node {cfg.tp} ",
                                                                    1)

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
            if world is not None:  # the other ranks wait in this configuration's collectives: stop them all
                raise
            return None
        finally:
            torch._dynamo.reset()  # drop this configuration's compiled graphs and CUDA graph pools
            gc.collect()  # the traceback held the failed run's tensors until here
            if device.type == "cuda":
                torch.cuda.empty_cache()
            refresh()

    refresh()
    if cfg.speculate_ks:
        report["speculative"] = {"decode": [], "verify": [], "ceiling": []}
        for name in cfg.models:
            for quant in cfg.quants:  # rows land in the report as they are measured, a failure keeps the earlier ones
                attempt(f"{name} {quant} speculative", lambda: bench_speculative(cfg, name, quant, log,
                                                                                  report["speculative"]))
        refresh()
        return report
    if not cfg.compile_time_only:
        worlds = [world]  # --tp: the ranks' world once per all-reduce of --all-reduce
        if world is not None and cfg.all_reduce_modes:
            worlds = [dataclasses.replace(world, all_reduce=mode) for mode in cfg.all_reduce_modes]
        all_reduce_cache: dict[tuple, dict[str, Any]] = {}  # NCCL and one-shot, timed once per model shape
        for name in cfg.models:
            for quant in cfg.quants:
                for batch in cfg.batch_sizes:
                    for rank_world in worlds:
                        mode = f" {rank_world.all_reduce}" if rank_world is not None else ""
                        record = attempt(f"{name} {quant} batch {batch}{mode}",
                                         lambda: bench_redline(cfg, name, quant, batch, bandwidth, log, rank_world,
                                                               all_reduce_cache))
                        records += [record] if record is not None else []
            if "int4" in cfg.quants and device.type == "cuda":
                anchor = attempt(f"{name} tinygemm", lambda: tinygemm_anchor(name, cfg.group_size, device, log))
                report.setdefault("tinygemm", []).extend([anchor] if anchor else [])
            if "hf" in cfg.compare:
                hf_records += attempt(f"{name} HF", lambda: bench_hf(cfg, name, log)) or []
    if cfg.compile_time:
        compile_times += attempt("compile time", lambda: measure_compile_times(cfg, log)) or []
    refresh()
    return report


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
        cfg, world = start_ranks(cfg)
        main_rank = tensor_parallel.is_main_process()
        json_path = cfg.json_path if main_rank else None
        save = (lambda partial: write_json(partial, json_path)) if json_path is not None else None
        log = make_logger() if main_rank else (lambda message: None)
        report = merge_reports(cfg.merge) if cfg.merge else run_benchmark(cfg, log, save, world)
        if not main_rank:
            return 1 if report.get("errors") else 0
        print(format_speculative(report["speculative"]) if "speculative" in report else format_report(report))
        if json_path is not None:
            write_json(report, json_path)
            print(f"\nJSON written to {json_path}")
        if cfg.plot_path is not None:
            write_plot(report, cfg.plot_path)
            print(f"plot written to {cfg.plot_path}")
    except (ValueError, FileNotFoundError) as exc:
        tensor_parallel.report_error(f"error: {exc}")
        return 2
    finally:
        tensor_parallel.stop()
    return 1 if report.get("errors") else 0


if __name__ == "__main__":
    # Run the package's copy of this module, so the classes it defines are the ones every other module imports.
    from redline.benchmarks.bench import main as package_main

    tensor_parallel.exit_process(package_main())
