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

import argparse
import dataclasses
import gc
import importlib.util
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch._dynamo

from redline import tensor_parallel
from redline.checkpoint import dtype_from_name
from redline.model import ModelArgs
from redline.options import MAX_SPECULATE_K
from redline.benchmarks.bench_compile_time import CompileTimeRecord, measure_compile_times, run_ttft_probe
from redline.benchmarks.bench_env import BANDWIDTH_REPEATS, environment, measure_read_bandwidth
from redline.benchmarks.bench_int4 import tinygemm_anchor
from redline.benchmarks.bench_hf import HF_SHORT_TOKENS, HFRecord, attach_ratios, bench_hf
from redline.benchmarks.bench_model import QUANT_CHOICES
from redline.benchmarks.bench_redline import RedlineRecord, bench_redline, median
from redline.benchmarks.bench_report import NOTES, format_report, merge_reports, write_json, write_plot
from redline.benchmarks.bench_speculative import bench_speculative, format_speculative

# What --compare can time next to Redline: transformers' LlamaForCausalLM (benchmarks/bench_hf.py).
COMPARE_CHOICES = ("hf",)


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
    group_size: int = 128  # int4: inputs per (scale, offset) group
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
    speculate_ks: tuple[int, ...] = ()  # measure speculative decoding at these k instead of the usual runs
    argv: tuple[str, ...] = ()
    tp: int = 1  # tensor-parallel ranks: the WORLD_SIZE of the torchrun launch
    all_reduce_modes: tuple[str, ...] = ()  # --tp: measure each model with each of these; () = REDLINE_ALL_REDUCE's

    def __post_init__(self) -> None:
        self._check_tp()
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
        if "int4" in self.quants:
            from redline.quantize import check_group_size

            check_group_size(self.group_size, self.group_size)
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
        if any(k > MAX_SPECULATE_K for k in self.speculate_ks):
            raise ValueError(f"--speculate-k values must be in 1..{MAX_SPECULATE_K}, got {self.speculate_ks}")
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

    def _check_tp(self) -> None:
        if self.tp < 1:
            raise ValueError(f"--tp must be a positive integer, got {self.tp}")
        ranks = tensor_parallel.env_ranks()
        world = ranks[1] if ranks is not None else 1
        if self.tp != world:
            raise ValueError(f"--tp {self.tp} but this launch has {world} process(es); run "
                             f"torchrun --nproc_per_node {self.tp} benchmarks/bench.py --tp {self.tp} ...")
        if self.tp > 1 and (self.compile_time or self.compare or self.merge or self.speculate_ks):
            raise ValueError("--tp measures Redline's decode itself; drop --compile-time, --compare, --merge and "
                             "--speculate-k")
        for name in self.models if self.tp > 1 else ():
            local = tensor_parallel.shard_args(ModelArgs.from_name(name), self.tp)  # one line when it does not divide
            if "int4" in self.quants:  # a rank's slices must hold whole groups
                from redline.quantize import check_group_size, model_input_features

                for k in model_input_features(local):
                    check_group_size(self.group_size, k)
        if self.all_reduce_modes and self.tp == 1:
            raise ValueError("--all-reduce picks the all-reduce of a --tp run; add --tp N under torchrun, or drop it")
        for mode in self.all_reduce_modes:
            tensor_parallel.check_all_reduce(mode, torch.device(self.device), self.tp, f"--all-reduce {mode}",
                                             f"drop {mode} from --all-reduce")

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
    return importlib.util.find_spec(module) is not None


def parse_args(argv: Sequence[str]) -> BenchConfig:
    p = BenchArgumentParser(prog="benchmarks/bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="comma-separated registry names, e.g. Llama-2-7B,Llama-3-8B")
    p.add_argument("--quant", default="none", help="comma-separated: none, int8, int4 (int4 also times torch's "
                                                   "int4 kernel, tinygemm, on the model's GEMV shapes)")
    p.add_argument("--groupsize", type=int, default=128, help="int4 group size: 32, 64, 128 or 256")
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
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (run under torchrun --nproc_per_node N)")
    p.add_argument("--all-reduce", default="", help="--tp: comma-separated all-reduces to run each model with, "
                   "nccl and/or oneshot (default: REDLINE_ALL_REDUCE's, nccl when unset)")
    p.add_argument("--speculate-k", default="", help="comma-separated k: time verify steps and the replay-draft "
                   "ceiling instead of the usual runs")
    p.add_argument("--ttft-probe", action="store_true", help="internal: child process of --compile-time")
    p.add_argument("--start-time", type=float, default=None, help=argparse.SUPPRESS)
    ns = p.parse_args(list(argv))
    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    ranks = tensor_parallel.env_ranks()
    if ranks is not None:  # each rank its own GPU
        device = str(tensor_parallel.rank_device(device, ranks[2]))
    return BenchConfig(
        models=_split(ns.model), quants=_split(ns.quant), group_size=ns.groupsize, batch_sizes=_positive_ints(ns.batch_size, "--batch-size"),
        prompt_lengths=_positive_ints(ns.prompt_lengths, "--prompt-lengths"), new_tokens=ns.new_tokens,
        runs=ns.runs, compare=_split(ns.compare), compile_time=ns.compile_time or ns.compile_time_only,
        compile_time_only=ns.compile_time_only, compile_prefill=ns.compile_prefill, compile=ns.compile,
        kernels=ns.kernels, fuse=ns.fuse,
        device=device, dtype=ns.dtype, json_path=ns.json_path, plot_path=ns.plot_path,
        merge=tuple(Path(p) for p in _split(ns.merge)), bandwidth_gib=ns.bandwidth_gib,
        probe_new_tokens=ns.probe_new_tokens, seed=ns.seed, ttft_probe=ns.ttft_probe, start_time=ns.start_time,
        profile_dir=ns.profile_dir, profile_steps=ns.profile_steps, argv=tuple(argv), tp=ns.tp,
        speculate_ks=_positive_ints(ns.speculate_k, "--speculate-k") if ns.speculate_k else (),
        all_reduce_modes=tuple(mode.lower() for mode in _split(ns.all_reduce)),
    )


# ---------------------------------------------------------------------------------------------------------------------
# The run.


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
        world = tensor_parallel.start(cfg.device) if cfg.tp > 1 else None
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

    sys.exit(package_main())
