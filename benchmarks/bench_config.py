"""The benchmark's settings (BenchConfig) and its command line, apart from the code that runs it, so the modules that
time one part take the settings without importing the runner (benchmarks/bench.py)."""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._dynamo

from redline import tensor_parallel
from redline.checkpoint import dtype_from_name
from redline.model import ModelArgs
from redline.options import MAX_SPECULATE_K
from redline.benchmarks.bench_model import QUANT_CHOICES


# What --compare can time next to Redline: transformers' LlamaForCausalLM (benchmarks/bench_hf.py).
COMPARE_CHOICES = ("hf",)
# HF's decode rate is the difference of a long and a short generation; the short one has this many tokens at most.
HF_SHORT_TOKENS = 10


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


def start_ranks(cfg: BenchConfig) -> tuple[BenchConfig, tensor_parallel.TPWorld | None]:
    """For --tp N, join the torchrun launch (tensor_parallel.start resolves --device to this rank's cuda:LOCAL_RANK)
    and return the settings this rank measures with, its own device in place of --device, and its world."""
    if cfg.tp == 1:
        return cfg, None
    world = tensor_parallel.start(cfg.device)
    return dataclasses.replace(cfg, device=str(world.device)), world


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def parse_args(argv: Sequence[str]) -> BenchConfig:
    p = BenchArgumentParser(prog="benchmarks/bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="comma-separated registry names, e.g. Llama-2-7B,Llama-3-8B")
    p.add_argument("--quant", default="none", help="comma-separated: none, int8, int4, fp8 (int4 also times torch's "
                                                   "int4 kernel, tinygemm, on the model's GEMV shapes; fp8 needs an "
                                                   "sm89+ GPU)")
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
    # Under torchrun this stays "cuda" (or "cpu"): tensor_parallel.start picks each rank's GPU, cuda:LOCAL_RANK, and
    # start_ranks puts the device it chose in the rank's config; resolving it twice would refuse its own cuda:N.
    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
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


