"""Time to first token after process start: child processes of benchmarks/bench.py (--ttft-probe) build a random model,
compile and generate once, first with a fresh (cold) and then with the same (warm) inductor cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from redline import generate, runner
from redline.model import ModelArgs
from redline.benchmarks.bench_model import build_random_model, random_prompts
from redline.benchmarks.bench_report import fmt

if TYPE_CHECKING:
    from redline.benchmarks.bench_config import BenchConfig

# The checkout: the children run from it, with it on PYTHONPATH.
ROOT = Path(__file__).resolve().parents[1]
# The child is bench.py itself, with --ttft-probe.
BENCH_SCRIPT = ROOT / "benchmarks" / "bench.py"
# A child still running after this long is taken to be stuck: its row records the timeout instead of the run hanging.
PROBE_TIMEOUT_S = 900


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


def probe_command(cfg: BenchConfig, name: str, quant: str, start: float) -> list[str]:
    cmd = [sys.executable, str(BENCH_SCRIPT), "--ttft-probe", "--model", name, "--quant", quant,
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
                log(f"{name} {quant}: cold {fmt(cold.first_token_s, '.1f')} s; now warm")
                warm = run_probe(cfg, name, quant, env)
                log(f"{name} {quant}: warm {fmt(warm.first_token_s, '.1f')} s")
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
    runner.sync(device)
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

