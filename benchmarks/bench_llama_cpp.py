"""Redline and llama.cpp side by side on the CPU: the same GGUF file, the same threads, alternating in one process.

python -m redline.benchmarks.bench_llama_cpp [--gguf FILE] [--rounds 5] [--tokens 128] [--threads 2] [--busy 1]
    [--compiled] [--redline NAME=CHECKPOINT ...] [--simd avx2] [--out FILE.json]

llama.cpp runs through llama-cpp-python (`pip install redline[llamacpp]`; build it with CMAKE_ARGS="-DGGML_NATIVE=ON"
for this CPU's instructions). Redline runs through its documented path, `LLM.load(path, device="cpu",
threads=N).generate`, and its own stats. Default file: the demo model's Q4_1 GGUF (scripts/demo_model.py); Redline
runs it as the native Q4_1 import (int4 g32, no re-quantizing) and as its float32 dequantization.

Every round runs each engine once, greedy, --tokens new tokens from the same prompt (llama.cpp's prompt cache reset
first; neither stops at the end of text, so both decode the same positions), and records decode tok/s (tokens after
the first over the time after the first), prefill tok/s (prompt tokens over the time to the first token) and the
1-minute load average at that moment. Medians over the rounds.
--redline adds Redline checkpoints of the same model to the comparison (for example quantize.py's int8 of a Q8_0
file's conversion). With --compiled, each Redline checkpoint also runs with its decode step compiled
(LLM.load(..., compile=True): torch.compile's CPU backend; the compile happens in the warm-up, outside the rates, and
its seconds are recorded).
With --busy N, the rounds run again with N CPU-bound processes on the same cores, and the table adds each engine's
decode rate there as a share of its own idle rate (the same run). --simd runs Redline's CPU kernels on a lower
instruction set than the CPU's best (an AVX2 machine's paths on an AVX-512 one; give llama.cpp the same with a build
of its own, CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=OFF ..."); the JSON records both engines' instruction sets.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from redline.benchmarks.bench_cpu import cpu_name
from redline.kernels import cpu_linear

PROMPT = "The capital of France is"
# The instruction sets the table names (from /proc/cpuinfo's flags).
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_tile", "neon", "asimd")


def cpu_instruction_sets() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines()
                      if line.startswith(("flags", "Features"))), []))
    return [f for f in ISA_FLAGS if f in flags]


def llama_cpp_runner(gguf: Path, threads: int, tokens: int) -> Callable[[], dict[str, float]]:
    try:
        from llama_cpp import Llama
    except ImportError:
        raise RuntimeError("llama-cpp-python is not installed; pip install 'redline[llamacpp]' (it builds llama.cpp "
                           "from source: CMAKE_ARGS=\"-DGGML_NATIVE=ON\")") from None
    llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
    prompt = llm.tokenize(PROMPT.encode())

    def once() -> dict[str, float]:
        # Llama.generate: llama.cpp's greedy sampler with no end-of-text stop, so both engines decode `tokens` tokens
        # (create_completion stops at the demo's end of text after about 30); each token is detokenized, as
        # create_completion and Redline's generate do.
        llm.reset()  # no prompt cache between rounds
        start = time.perf_counter()
        times = []
        for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            llm.detokenize([token])
            times.append(time.perf_counter())
            if len(times) == tokens:
                break
        return {"decode_tok_s": (len(times) - 1) / (times[-1] - times[0]),
                "prefill_tok_s": len(prompt) / (times[0] - start), "new_tokens": len(times)}

    return once


def redline_runner(path: Path, threads: int, tokens: int, compile: bool = False) -> Callable[[], dict[str, float]]:
    from redline.generate import LLM

    llm = LLM.load(path, device="cpu", threads=threads, compile=compile)

    def once() -> dict[str, float]:
        stats = llm.generate(PROMPT, max_new_tokens=tokens, temperature=0, ignore_eos=True).stats
        return {"decode_tok_s": stats.decode_tok_s, "prefill_tok_s": stats.prefill_tok_s,
                "new_tokens": stats.new_tokens, "compile_s": stats.compile_s}

    return once


def rounds(runners: dict[str, Callable[[], dict[str, float]]], count: int) -> dict[str, list[dict[str, float]]]:
    out: dict[str, list[dict[str, float]]] = {name: [] for name in runners}
    for _ in range(count):
        for name, once in runners.items():
            load = os.getloadavg()[0]
            out[name].append({**once(), "load_avg": load})
    return out


def llama_cpp_features() -> list[str]:
    """The CPU features llama.cpp was built with ("AVX2", "AVX512", ...), from its own system info."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()  # "CPU : SSE3 = 1 | ... | AVX512 = 0 | ..."
    pairs = (part.partition("=") for part in info.split("|"))
    return [name.split(":")[-1].strip() for name, _, value in pairs if value.strip() == "1"]


def busy_processes(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def summary(runs: list[dict[str, float]]) -> dict[str, Any]:
    return {"decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
            "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in runs),
            "load_avg": [round(r["load_avg"], 2) for r in runs], "all": runs}


def run(gguf: Path, redline_paths: dict[str, Path], rounds_n: int, tokens: int, threads: int,
        busy: int, compiled: bool = False, simd: str | None = None) -> dict[str, Any]:
    """The rounds, idle and then (busy > 0) beside busy processes; simd: Redline's kernels' instruction set."""
    with cpu_linear.forced_simd(simd) if simd else contextlib.nullcontext():
        return measured(gguf, redline_paths, rounds_n, tokens, threads, busy, compiled)


def measured(gguf: Path, redline_paths: dict[str, Path], rounds_n: int, tokens: int, threads: int,
             busy: int, compiled: bool) -> dict[str, Any]:
    runners = {"llama.cpp": llama_cpp_runner(gguf, threads, tokens)}
    runners.update({f"redline {name}": redline_runner(p, threads, tokens) for name, p in redline_paths.items()})
    if compiled:
        runners.update({f"redline {name}, compiled": redline_runner(p, threads, tokens, compile=True)
                        for name, p in redline_paths.items()})
    # Warm-up: pages touched, kernels built, decode steps compiled (their seconds recorded).
    warm_up = {name: once() for name, once in runners.items()}
    idle = {name: summary(r) for name, r in rounds(runners, rounds_n).items()}
    result: dict[str, Any] = {"gguf": str(gguf), "cpu": cpu_name(), "instruction_sets": cpu_instruction_sets(),
                              "redline_simd": cpu_linear.simd(), "llama_cpp_features": llama_cpp_features(),
                              "threads": threads, "new_tokens": tokens, "rounds": rounds_n, "prompt": PROMPT,
                              "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "idle": idle,
                              "compile_s": {name: w["compile_s"] for name, w in warm_up.items() if "compile_s" in w}}
    if busy:
        hogs = busy_processes(busy)
        try:
            loaded = {name: summary(r) for name, r in rounds(runners, rounds_n).items()}
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
        result["busy_processes"] = busy
        result["busy"] = loaded
    return result


def table(result: dict[str, Any]) -> str:
    base = result["idle"]["llama.cpp"]
    lines = [f"{Path(result['gguf']).name} on {result['cpu']} ({', '.join(result['instruction_sets'])}), "
             f"{result['threads']} threads, greedy, {result['new_tokens']} new tokens, median of {result['rounds']} "
             f"alternated rounds; Redline's kernels on {result.get('redline_simd', '?')}, llama.cpp built with "
             f"{', '.join(result.get('llama_cpp_features', [])) or '?'}",
             "| engine | decode tok/s | vs llama.cpp | prefill tok/s | vs llama.cpp | load avg (each round) |"
             + (" decode with busy cores, share of idle |" if "busy" in result else ""),
             "|---|---:|---:|---:|---:|---|" + ("---:|" if "busy" in result else "")]
    for name, row in result["idle"].items():
        line = (f"| {name} | {row['decode_tok_s']:.1f} | {row['decode_tok_s'] / base['decode_tok_s']:.2f}x | "
                f"{row['prefill_tok_s']:.1f} | {row['prefill_tok_s'] / base['prefill_tok_s']:.2f}x | "
                f"{', '.join(f'{v:.1f}' for v in row['load_avg'])} |")
        if "busy" in result:
            loaded = result["busy"][name]["decode_tok_s"]
            line += f" {loaded:.1f} ({loaded / row['decode_tok_s']:.0%}) |"
        lines.append(line)
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, default=None, help="a GGUF file (default: the demo model's Q4_1 file)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128, help="new tokens per generation")
    p.add_argument("--threads", type=int, default=None, help="threads for both engines (default: the physical cores)")
    p.add_argument("--busy", type=int, default=0, help="then repeat with this many CPU-bound processes running")
    p.add_argument("--redline", action="append", default=[], metavar="NAME=CHECKPOINT",
                   help="also run this Redline checkpoint under NAME (repeatable)")
    p.add_argument("--compiled", action="store_true", help="also run each Redline checkpoint with its decode compiled")
    p.add_argument("--simd", choices=cpu_linear.SIMD_LEVELS, default=None,
                   help="run Redline's CPU kernels on this instruction set (default: the CPU's best)")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ns = p.parse_args(argv)
    if ns.rounds < 1 or ns.tokens < 2 or ns.busy < 0 or (ns.threads is not None and ns.threads < 1):
        p.error("--rounds and --threads must be positive, --tokens at least 2, --busy not negative")
    if ns.gguf is not None and not ns.gguf.is_file():
        p.error(f"--gguf {ns.gguf} is not a file")
    extra = {}
    for item in ns.redline:
        name, sep, path = item.partition("=")
        if not sep or not name or not Path(path).is_file():
            p.error(f"--redline takes NAME=CHECKPOINT with an existing checkpoint file, got {item!r}")
        extra[name] = Path(path)
    ns.redline = extra
    return ns


def redline_checkpoints(gguf: Path | None) -> tuple[Path, dict[str, Path]]:
    """The GGUF file and Redline's checkpoints of it: the demo's native Q4_1 import and float32 dequantization, or
    a given file's conversion."""
    from redline.scripts.demo_model import DEFAULT_DIR, demo_checkpoint, gguf_path

    if gguf is None:
        return gguf_path(DEFAULT_DIR), {"q4_1 (native import)": demo_checkpoint(DEFAULT_DIR, int4=True),
                                        "float32 (dequantized)": demo_checkpoint(DEFAULT_DIR)}
    converted = float32_conversion(gguf)
    return gguf, {conversion_name(converted): converted}


def conversion_name(checkpoint: Path) -> str:
    """What a GGUF file's conversion holds, as its metadata says: one float dtype throughout, or int4 projections (a
    Q4_0/Q4_1 file's, kept as they are) beside embeddings and norms of that dtype. A reused conversion written with
    another --dtype is named for what it is."""
    from redline.checkpoint import dtype_name, read_checkpoint_info

    info = read_checkpoint_info(checkpoint)
    if info.scheme == "int4":
        return f"converted (int4 projections, {dtype_name(info.dtype)} rest)"
    return f"converted ({dtype_name(info.dtype)})"


def float32_conversion(gguf: Path) -> Path:
    """The float32 checkpoint of a GGUF file beside it (convert_gguf's default name): a conversion newer than the
    file is reused (a second run converts nothing, and never overwrites one), else it is written now."""
    from redline.scripts.convert_gguf import convert_gguf

    out = gguf.with_suffix(".redline.safetensors")
    if out.is_file() and out.stat().st_mtime >= gguf.stat().st_mtime:
        print(f"reusing {out} (converted after {gguf.name} was written)", flush=True)
        return out
    return convert_gguf(gguf, out, dtype="float32")


def main(argv: list[str] | None = None) -> int:
    from redline.options import physical_cores

    ns = parse_args(argv)
    try:
        gguf, paths = redline_checkpoints(ns.gguf)
        paths.update(ns.redline)
        result = run(gguf, paths, ns.rounds, ns.tokens, ns.threads or physical_cores(), ns.busy, ns.compiled,
                     ns.simd)
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
