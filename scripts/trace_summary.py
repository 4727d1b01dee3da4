#!/usr/bin/env python3
"""Summarize a torch.profiler Chrome trace (e.g. one written by profiling.TraceRecorder).

    python scripts/trace_summary.py TRACE [--json] [--top N]

Works on any torch.profiler / Kineto Chrome trace, gzipped or not, in object format
({"traceEvents": [...]}) or bare-list format; redline labels are used when present:

- tokens/sec: top-level redline.stats.decode_tok_s, else the mean of the "tokens/sec" counter;
- decode window: first to last `redline.decode_step` slice, GPU-side (gpu_user_annotation)
  when present, else CPU-side; without redline labels, the span of all GPU kernels;
- GPU busy % over the window: union of kernel / memcpy / memset intervals clipped to the
  window, and the idle gap time (window - busy), total and per step;
- top kernels by total time in the decode window;
- CUDA/HIP graph launches per decode step;
- all-reduce kernels (NCCL/RCCL, the one-shot over symmetric memory) per decode step, by duration and by the
  time they add to the GPU timeline (tensor parallel).

Errors (missing, empty, corrupt file, no trace events) print one line on stderr, exit 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from redline.outputs import OneLineArgumentParser, run_cli

DECODE_STEP = "redline.decode_step"
TOKENS_PER_SEC = "tokens/sec"
DEVICE_ACTIVITY_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
GPU_ANNOTATION_CAT = "gpu_user_annotation"
GRAPH_LAUNCH_PREFIXES = ("cudaGraphLaunch", "hipGraphLaunch", "cuGraphLaunch")
NAME_WIDTH = 80
# Lower-cased kernel-name pieces of an all-reduce: NCCL/RCCL's ncclDevKernel_AllReduce_*, torch's one_shot_all_reduce.
ALL_REDUCE_MARKERS = ("allreduce", "all_reduce")


# The most a trace may hold, on disk and decompressed: a summary reads a bounded amount whatever the file declares.
MAX_TRACE_BYTES = 512 << 20


class TraceError(Exception):
    """A trace that cannot be read (reported as one line, exit code 2)."""


@dataclass
class KernelStat:
    name: str
    count: int
    total_us: float
    mean_us: float
    share_pct: float
    # Time the kernel adds to the GPU timeline: its end minus the end of the kernel before it (at least 0).
    # Unlike the duration it stays meaningful when kernels overlap (programmatic dependent launch starts a
    # kernel early, and its duration then includes waiting for the one before).
    exclusive_us: float = 0.0
    exclusive_mean_us: float = 0.0


@dataclass
class RoleStat:
    role: str  # a --roles label, or "<kernel>#tail" for calls after the last whole cycle of labels
    calls_per_step: float
    exclusive_mean_us: float
    exclusive_per_step_us: float


@dataclass
class TraceSummary:
    source: str | None = None
    num_events: int = 0
    stats: dict = field(default_factory=dict)  # top-level redline.stats (empty if absent)
    tok_s: float | None = None
    tok_s_source: str | None = None  # "redline.stats" | "counter" | None (not recorded)
    window_source: str | None = None  # "gpu_user_annotation" | "cpu_annotation" | "gpu_kernels"
    window_start_us: float | None = None
    window_end_us: float | None = None
    window_ms: float | None = None
    steps: int | None = None  # decode steps in the window (None: no decode-step labels)
    step_ms_mean: float | None = None
    step_ms_median: float | None = None
    has_gpu_activity: bool = False
    gpu_busy_ms: float | None = None
    gpu_busy_pct: float | None = None
    gap_ms: float | None = None
    gap_ms_per_step: float | None = None
    kernels_scope: str = "whole trace"  # "decode window" when a window is known
    kernel_total_ms: float = 0.0
    num_kernel_names: int = 0
    top_kernels: list[KernelStat] = field(default_factory=list)
    graph_launches: int = 0
    graph_launches_per_step: float | None = None
    roles: list[RoleStat] = field(default_factory=list)  # with --roles: exclusive time per named call site
    all_reduce_calls_per_step: float | None = None  # with decode steps and all-reduce kernels in the window
    all_reduce_us_per_step: float | None = None  # their summed durations (waiting for the other ranks included)
    all_reduce_exclusive_us_per_step: float | None = None  # the time they add to the GPU timeline

    def to_dict(self) -> dict:
        """Plain JSON-ready dict; floats rounded to 6 decimals (trace timestamps are in us)."""

        def rounded(v: Any) -> Any:
            if isinstance(v, float):
                return round(v, 6)
            if isinstance(v, dict):
                return {k: rounded(x) for k, x in v.items()}
            if isinstance(v, list):
                return [rounded(x) for x in v]
            return v

        return rounded(dataclasses.asdict(self))


# --------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------


def load_trace(path: str | os.PathLike) -> dict:
    """Read a (gzipped) Chrome trace into {"traceEvents": [...], ...}. Raises TraceError."""
    p = Path(path)
    if not p.exists():
        raise TraceError(f"{p}: no such file")
    if p.is_dir():
        raise TraceError(f"{p}: is a directory, not a trace file")
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_TRACE_BYTES + 1)
    except OSError as err:
        raise TraceError(f"{p}: cannot read: {err.strerror or err}") from None
    if not raw:
        raise TraceError(f"{p}: empty file")
    if len(raw) > MAX_TRACE_BYTES:
        raise TraceError(f"{p}: larger than {MAX_TRACE_BYTES >> 20} MiB, more than a trace summary reads; record "
                         f"fewer steps")
    if raw[:2] == b"\x1f\x8b":
        raw = gunzip_bounded(raw, p)
        if not raw.strip():
            raise TraceError(f"{p}: empty trace (gzip of an empty file)")
    try:
        data = json.loads(raw.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError) as err:
        msg = " ".join(str(err).split())[:120]
        raise TraceError(f"{p}: not a gzip or JSON trace file ({msg})") from None
    return _normalize(data, str(p))


def gunzip_bounded(raw: bytes, p: Path) -> bytes:
    """The gzip members in `raw`, decompressed to at most MAX_TRACE_BYTES (a small file can expand a thousandfold)."""
    out = bytearray()
    while raw:
        stream = zlib.decompressobj(wbits=31)  # one gzip member
        try:
            out += stream.decompress(raw, MAX_TRACE_BYTES + 1 - len(out))
        except zlib.error as err:
            raise TraceError(f"{p}: corrupt gzip data ({err})") from None
        if len(out) > MAX_TRACE_BYTES:
            raise TraceError(f"{p}: expands to more than {MAX_TRACE_BYTES >> 20} MiB, more than a trace summary "
                             f"reads; record fewer steps")
        if not stream.eof:
            raise TraceError(f"{p}: corrupt gzip data (truncated)")
        raw = stream.unused_data
    return bytes(out)


def _normalize(data: Any, where: str) -> dict:
    if isinstance(data, list):
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TraceError(f"{where}: JSON has no traceEvents list (not a Chrome trace)")
    if not any(isinstance(e, dict) for e in data["traceEvents"]):
        raise TraceError(f"{where}: the trace has no events")
    return data


# --------------------------------------------------------------------------------------
# analysis
# --------------------------------------------------------------------------------------


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if f == f and f not in (float("inf"), float("-inf")) else None


def _interval(e: dict) -> tuple[float, float] | None:
    ts = _num(e.get("ts"))
    if ts is None:
        return None
    dur = _num(e.get("dur")) or 0.0
    return ts, ts + max(dur, 0.0)


def _cat(e: dict) -> str:
    return str(e.get("cat", "")).lower()


def _union_length(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi)
    total = 0.0
    cur_a = cur_b = None
    for a, b in clipped:
        if b <= a:
            continue
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def _decode_slices(events: list[dict]) -> tuple[list[dict], list[dict]]:
    """(GPU-side, CPU-side) redline.decode_step complete slices, sorted by start."""
    gpu: dict[tuple, list[dict]] = {}
    cpu: list[dict] = []
    for e in events:
        if e.get("name") != DECODE_STEP or e.get("ph", "X") != "X" or _interval(e) is None:
            continue
        if _cat(e) == GPU_ANNOTATION_CAT:
            gpu.setdefault((str(e.get("pid")), str(e.get("tid"))), []).append(e)
        else:
            cpu.append(e)
    # GPU annotations are emitted per stream; use the stream row with the most steps.
    best = max(gpu.values(), key=len) if gpu else []
    key = lambda e: _interval(e)[0]  # noqa: E731
    return sorted(best, key=key), sorted(cpu, key=key)


def _stats_of(trace: dict) -> dict:
    red = trace.get("redline")
    if isinstance(red, dict) and isinstance(red.get("stats"), dict):
        return red["stats"]
    return {}


def parse_roles(spec: str) -> tuple[str, list[str]]:
    """'KERNEL=a,b,c' -> (KERNEL, [a, b, c]): the k-th call of KERNEL in a decode step is labelled roles[k % 3]."""
    name, sep, labels = spec.partition("=")
    roles = [r for r in labels.split(",") if r]
    if not sep or not name or not roles:
        raise TraceError(f"--roles takes KERNEL=label1,label2,... (e.g. _gemv_kernel=wqkv,wo,w13,w2), got {spec!r}")
    return name, roles


def _role_stats(kernels: list[dict], steps: list[dict], name: str, labels: list[str]) -> list[RoleStat]:
    """Exclusive time (end minus the previous kernel's end) of each labelled call site, per decode step."""
    ordered = sorted(kernels, key=lambda e: _interval(e)[0])
    exclusive: list[float] = []
    last_end = None
    for e in ordered:
        a, b = _interval(e)
        exclusive.append(max(0.0, b - (a if last_end is None else max(a, last_end))))
        last_end = b if last_end is None else max(last_end, b)
    totals: dict[str, list[float]] = {}
    for step in steps:
        lo, hi = _interval(step)
        calls = [x for e, x in zip(ordered, exclusive) if lo <= _interval(e)[0] < hi and e.get("name") == name]
        whole = len(calls) - len(calls) % len(labels)
        for k, x in enumerate(calls):
            totals.setdefault(labels[k % len(labels)] if k < whole else f"{name}#tail", []).append(x)
    n = len(steps)
    return [RoleStat(role, len(xs) / n, statistics.fmean(xs), sum(xs) / n) for role, xs in totals.items()]


def summarize_trace(events_or_path: Any, top: int = 10, roles: tuple[str, list[str]] | None = None) -> TraceSummary:
    """Summarize a trace given as a path, a trace dict or a list of events; roles = parse_roles(...) also
    splits one kernel's exclusive time by call site within each decode step."""
    if isinstance(events_or_path, (str, os.PathLike)):
        trace = load_trace(events_or_path)
        source: str | None = str(events_or_path)
    else:
        trace = _normalize(events_or_path, "trace")
        source = None
    events = [e for e in trace["traceEvents"] if isinstance(e, dict)]
    s = TraceSummary(source=source, num_events=len(events), stats=dict(_stats_of(trace)))

    # tokens/sec
    tok = _num(s.stats.get("decode_tok_s"))
    if tok is not None:
        s.tok_s, s.tok_s_source = tok, "redline.stats"
    else:
        points = []
        for e in events:
            if e.get("ph") == "C" and e.get("name") == TOKENS_PER_SEC and isinstance(e.get("args"), dict):
                v = _num(e["args"].get(TOKENS_PER_SEC))
                if v is not None:
                    points.append(v)
        if points:
            s.tok_s, s.tok_s_source = statistics.fmean(points), "counter"

    # device activity and the decode window
    device = [iv for e in events if _cat(e) in DEVICE_ACTIVITY_CATS and (iv := _interval(e))]
    kernels = [e for e in events if _cat(e) == "kernel" and _interval(e) is not None]
    s.has_gpu_activity = bool(device)
    gpu_steps, cpu_steps = _decode_slices(events)
    steps = gpu_steps or cpu_steps
    if steps:
        s.window_source = "gpu_user_annotation" if gpu_steps else "cpu_annotation"
        ivs = [_interval(e) for e in steps]
        lo, hi = ivs[0][0], max(b for _, b in ivs)
        s.steps = len(steps)
        durs_ms = [(b - a) / 1000.0 for a, b in ivs]
        s.step_ms_mean = statistics.fmean(durs_ms)
        s.step_ms_median = statistics.median(durs_ms)
    elif kernels:
        s.window_source = "gpu_kernels"
        ivs = [_interval(e) for e in kernels]
        lo, hi = min(a for a, _ in ivs), max(b for _, b in ivs)
    else:
        lo = hi = None
    if lo is not None:
        s.window_start_us, s.window_end_us = lo, hi
        s.window_ms = (hi - lo) / 1000.0

    if s.has_gpu_activity and lo is not None and hi > lo:
        busy = _union_length(device, lo, hi)
        s.gpu_busy_ms = busy / 1000.0
        s.gpu_busy_pct = 100.0 * busy / (hi - lo)
        s.gap_ms = (hi - lo - busy) / 1000.0
        if s.steps:
            s.gap_ms_per_step = s.gap_ms / s.steps

    # top kernels (in the decode window when there is one; by kernel start time)
    if lo is not None and s.window_source != "gpu_kernels":
        s.kernels_scope = "decode window"
        in_scope = [e for e in kernels if lo <= _interval(e)[0] < hi]
    else:
        in_scope = kernels
    by_name: dict[str, list[float]] = {}
    exclusive: dict[str, float] = {}
    last_end = None
    for e in sorted(in_scope, key=lambda e: _interval(e)[0]):
        a, b = _interval(e)
        name = str(e.get("name", "?"))
        by_name.setdefault(name, []).append(b - a)
        exclusive[name] = exclusive.get(name, 0.0) + max(0.0, b - (a if last_end is None else max(a, last_end)))
        last_end = b if last_end is None else max(last_end, b)
    total_us = sum(sum(v) for v in by_name.values())
    reduce_names = [name for name in by_name if any(m in name.lower() for m in ALL_REDUCE_MARKERS)]
    if s.steps and reduce_names and s.kernels_scope == "decode window":
        s.all_reduce_calls_per_step = sum(len(by_name[n]) for n in reduce_names) / s.steps
        s.all_reduce_us_per_step = sum(sum(by_name[n]) for n in reduce_names) / s.steps
        s.all_reduce_exclusive_us_per_step = sum(exclusive[n] for n in reduce_names) / s.steps
    s.kernel_total_ms = total_us / 1000.0
    s.num_kernel_names = len(by_name)
    ranked = sorted(by_name.items(), key=lambda kv: (-sum(kv[1]), kv[0]))
    for name, durs in ranked[: max(top, 0)]:
        tot = sum(durs)
        s.top_kernels.append(
            KernelStat(
                name=name,
                count=len(durs),
                total_us=tot,
                mean_us=tot / len(durs),
                share_pct=100.0 * tot / total_us if total_us > 0 else 0.0,
                exclusive_us=exclusive[name],
                exclusive_mean_us=exclusive[name] / len(durs),
            )
        )

    if roles is not None:
        if not gpu_steps:
            raise TraceError("--roles needs GPU-side redline.decode_step annotations in the trace")
        s.roles = _role_stats(kernels, gpu_steps, *roles)

    # graph launches: host-side events, counted in the host-side decode window
    if cpu_steps:
        la, lb = _interval(cpu_steps[0])[0], max(_interval(e)[1] for e in cpu_steps)
    else:
        la, lb = lo, hi
    launches = {prefix: 0 for prefix in GRAPH_LAUNCH_PREFIXES}
    for e in events:
        name = str(e.get("name", ""))
        prefix = next((p for p in GRAPH_LAUNCH_PREFIXES if name.startswith(p)), None)
        if prefix is None:
            continue
        cat = _cat(e)
        if not ("runtime" in cat or "driver" in cat):
            continue
        iv = _interval(e)
        if iv is None:
            continue
        if la is None or la <= iv[0] <= lb:
            launches[prefix] += 1
    # cudaGraphLaunch calls cuGraphLaunch underneath: count driver-level launches only when
    # the trace has no runtime-level ones, so that one launch is never counted twice.
    runtime = launches["cudaGraphLaunch"] + launches["hipGraphLaunch"]
    launches = runtime if runtime else launches["cuGraphLaunch"]
    s.graph_launches = launches
    if s.steps:
        s.graph_launches_per_step = launches / s.steps
    return s


# --------------------------------------------------------------------------------------
# formatting / CLI
# --------------------------------------------------------------------------------------


def _short(name: str, width: int = NAME_WIDTH) -> str:
    name = " ".join(name.split())
    return name if len(name) <= width else name[: width - 3] + "..."


def format_summary(s: TraceSummary) -> str:
    lines: list[str] = []
    if s.source:
        lines.append(f"trace: {s.source} ({s.num_events} events)")
    meta = [f"{k}={s.stats[k]}" for k in ("model", "dtype", "quantization", "device", "torch_version") if k in s.stats]
    if meta:
        lines.append("run: " + " ".join(meta))
    if s.tok_s is not None:
        src = "redline stats" if s.tok_s_source == "redline.stats" else "mean of tokens/sec counter"
        lines.append(f"tokens/sec: {s.tok_s:.2f} ({src})")
    else:
        lines.append("tokens/sec: not recorded")

    if s.window_ms is None:
        lines.append("decode window: not found (no redline.decode_step slices and no GPU kernels)")
    elif s.steps:
        src = {"gpu_user_annotation": "GPU-side annotations", "cpu_annotation": "CPU-side annotations"}[
            s.window_source
        ]
        lines.append(
            f"decode window: {s.steps} steps, {s.window_ms:.3f} ms ({src}); "
            f"per step mean {s.step_ms_mean:.3f} ms, median {s.step_ms_median:.3f} ms"
        )
    else:
        lines.append(f"decode window: {s.window_ms:.3f} ms (span of all GPU kernels; no decode-step labels)")

    if not s.has_gpu_activity:
        lines.append("GPU: no GPU activity in trace")
    elif s.gpu_busy_pct is not None:
        per_step = f", {s.gap_ms_per_step:.3f} ms/step" if s.gap_ms_per_step is not None else ""
        lines.append(
            f"GPU busy: {s.gpu_busy_pct:.1f}% of the decode window "
            f"({s.gpu_busy_ms:.3f} ms busy); gaps {s.gap_ms:.3f} ms total{per_step}"
        )
    else:
        lines.append("GPU busy: n/a (empty decode window)")

    if s.graph_launches_per_step is not None:
        lines.append(f"graph launches: {s.graph_launches_per_step:.2f} per step ({s.graph_launches} in window)")
    else:
        lines.append(f"graph launches: {s.graph_launches}")

    if s.top_kernels:
        lines.append(
            f"top kernels ({s.kernels_scope}, {len(s.top_kernels)} of {s.num_kernel_names} names, "
            f"{s.kernel_total_ms:.3f} ms total):"
        )
        lines.append(f"  {'total ms':>10} {'count':>7} {'mean us':>10} {'share':>7} {'excl us':>9}  name")
        for k in s.top_kernels:
            lines.append(
                f"  {k.total_us / 1000.0:>10.3f} {k.count:>7d} {k.mean_us:>10.2f} {k.share_pct:>6.1f}% "
                f"{k.exclusive_mean_us:>9.2f}  {_short(k.name)}"
            )
        lines.append("  (excl us: mean time a call adds to the GPU timeline, its end minus the previous kernel's end)")
    elif s.has_gpu_activity:
        lines.append(f"top kernels: none in the {s.kernels_scope}")
    if s.all_reduce_us_per_step is not None:
        lines.append(f"all-reduce: {s.all_reduce_calls_per_step:.1f} kernels per step, {s.all_reduce_us_per_step:.1f} "
                     f"us/step ({s.all_reduce_exclusive_us_per_step:.1f} us/step added to the GPU timeline)")
    if s.roles:
        lines.append("call sites (exclusive time per decode step):")
        lines.append(f"  {'calls/step':>10} {'excl us':>9} {'us/step':>9}  role")
        for r in s.roles:
            lines.append(f"  {r.calls_per_step:>10.1f} {r.exclusive_mean_us:>9.2f} {r.exclusive_per_step_us:>9.1f}  {r.role}")
    return "\n".join(lines)


def _nonneg_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {n}")
    return n


def main(argv: list[str] | None = None) -> int:
    p = OneLineArgumentParser(description="Summarize a torch.profiler Chrome trace (.json or .json.gz).")
    p.add_argument("trace", help="trace file (.json or .json.gz)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--top", type=_nonneg_int, default=10, help="number of top kernels")
    p.add_argument("--roles", default=None, metavar="KERNEL=a,b,...",
                   help="label the calls of KERNEL within each decode step cyclically (e.g. "
                        "_gemv_kernel=wqkv,wo,w13,w2) and report each label's exclusive time; None means no labels")

    def body() -> int:
        args = p.parse_args(argv)
        try:
            roles = parse_roles(args.roles) if args.roles is not None else None
            summary = summarize_trace(args.trace, top=args.top, roles=roles)
        except TraceError as err:
            raise ValueError(str(err)) from None
        print(json.dumps(summary.to_dict(), separators=(",", ":")) if args.json else format_summary(summary))
        return 0

    return run_cli(body)


if __name__ == "__main__":
    # Run the package's copy of this module, so the classes it defines are the ones every other module imports.
    from redline.scripts.trace_summary import main as package_main

    sys.exit(package_main())
