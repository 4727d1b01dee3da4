"""Chrome-trace export for a generation run (open the result in https://ui.perfetto.dev).

The generation engine uses it like this (its compile warm-up runs BEFORE the recorder):

    rec = TraceRecorder(ProfileConfig.default_for("llama-3.2-1b"), device)
    with rec:
        with rec.region("prefill"):
            ...                       # prefill
        rec.step()
        for i in range(max_new_tokens - 1):
            with rec.region("decode_step"):
                ...                   # one decode step
            rec.step()
    rec.write(stats, step_seconds)    # -> traces/llama-3.2-1b-<timestamp>.json.gz

Recorded: the prefill and the first `record_steps` decode steps; later steps are not.
Schedule: torch.profiler.schedule(wait=0, warmup=1, active=1 + record_steps, repeat=1).
The single warmup step is an empty step that the recorder takes itself in __enter__, so the
tracer (Kineto/CUPTI) is fully set up before the prefill starts and its start-up cost does not
land inside the prefill slice (and torch does not warn about a warmup of 0).  Profiler steps:

    0            WARMUP   (empty; taken in __enter__)
    1            RECORD   prefill                 <- engine: step()
    2..R         RECORD   decode steps 0..R-2     <- engine: step() after each
    R+1          RECORD_AND_SAVE  decode step R-1 (R = record_steps)
    R+2...       NONE     trace stopped (on_trace_ready); later steps are not recorded;
                          write() exports the recorded cycle (export_chrome_trace)

If the generation ends earlier, __exit__ stops the profiler and the shorter trace is exported.

Timing: the step() call right after the last recorded decode step stops the profiler (a
device synchronize + Kineto shutdown: ~2-8 ms on an H200), and recorded steps carry some
profiler overhead. Measure each decode step's duration before calling step() so that the
stop does not land in step_seconds; write() places step_seconds[i] on the counter track as
1/step_seconds[i] at the end of the i-th recorded redline.decode_step slice.
The trace is kept small: no stacks, no shapes, no memory profiling.
"""
from __future__ import annotations

import contextlib
import gzip
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch

REGION_PREFIX = "redline."
TRACE_FORMAT = 1
TOKENS_PER_SEC = "tokens/sec"


@dataclass
class ProfileConfig:
    path: Path  # where the trace goes: .json.gz (gzipped) or .json (plain)
    record_steps: int = 16  # decode steps recorded after the prefill

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        if not (self.path.name.endswith(".json.gz") or self.path.name.endswith(".json")):
            raise ValueError(f"trace path must end with .json.gz or .json, got {str(self.path)!r}")
        if isinstance(self.record_steps, bool) or not isinstance(self.record_steps, int):
            raise ValueError(f"record_steps must be an int >= 1, got {self.record_steps!r}")
        if self.record_steps < 1:
            raise ValueError(f"record_steps must be >= 1, got {self.record_steps}")

    @classmethod
    def default_for(cls, name: str, record_steps: int = 16) -> "ProfileConfig":
        """traces/<name>-<timestamp>.json.gz (relative to the working directory)."""
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", str(name)).strip("._") or "trace"
        stamp = time.strftime("%Y%m%d-%H%M%S")
        return cls(Path("traces") / f"{safe}-{stamp}.json.gz", record_steps)


def _json_value(value: Any) -> Any:
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (torch.dtype, torch.device, Path)):
        return str(value)
    if hasattr(value, "item") and callable(value.item):  # 0-d tensors / numpy scalars
        try:
            return _json_value(value.item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(value)


# Lines torch's native profiler writes straight to file descriptor 2 when it starts and stops recording
# ("USDT:... profiler_start", "STAGE:... Completed Stage"); on a terminal they would land inside the generated text.
NATIVE_MARKERS = ("USDT:", "STAGE:")


@contextlib.contextmanager
def native_markers_dropped() -> Iterator[None]:
    """Run the block with file descriptor 2 captured, then pass on whatever it wrote except the profiler's markers."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr at all: nothing to keep clean
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().decode("utf-8", errors="replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not line.startswith(NATIVE_MARKERS))
            if kept:
                os.write(2, kept.encode())


class TraceRecorder:
    """Records the prefill and the first `record_steps` decode steps as a Chrome trace."""

    def __init__(self, config: ProfileConfig, device: torch.device | str):
        self.config = config
        self.device = torch.device(device)
        self._profiler: torch.profiler.profile | None = None
        self._trace_ready = False  # the recorded cycle is complete (exported later, in write())
        self._running = False

    # -- profiler lifecycle -------------------------------------------------------------
    def _activities(self) -> list:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda" and torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        return activities

    def _on_trace_ready(self, prof: torch.profiler.profile) -> None:
        # Called inside the engine's step() right after the last recorded step. Exporting here
        # would put the (slow) JSON export inside the generation loop, so only mark the cycle
        # complete; write() exports this recorded cycle with prof.export_chrome_trace later.
        self._trace_ready = True

    def __enter__(self) -> "TraceRecorder":
        if self._profiler is not None:
            raise RuntimeError("a TraceRecorder can only be entered once")
        self._profiler = torch.profiler.profile(
            activities=self._activities(),
            schedule=torch.profiler.schedule(
                wait=0, warmup=1, active=1 + self.config.record_steps, repeat=1
            ),
            on_trace_ready=self._on_trace_ready,
            record_shapes=False,
            profile_memory=False,
            with_stack=False,
            with_flops=False,
            with_modules=False,
            # One recorded cycle only (repeat=1), so there is nothing to accumulate or clear;
            # True just avoids torch's "Profiler clears events at the end of each cycle" warning.
            acc_events=True,
        )
        with native_markers_dropped():
            self._profiler.start()  # step 0: WARMUP (tracer prepared)
        self._running = True
        if self.device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize(self.device)
        with native_markers_dropped():
            self._profiler.step()  # step 1: RECORD -> the prefill is the first recorded step
        return self

    def _stop(self) -> None:
        if self._running and self._profiler is not None:
            self._running = False
            if self.device.type == "cuda" and torch.cuda.is_available():
                torch.cuda.synchronize(self.device)  # let recorded kernels finish
            with native_markers_dropped():
                self._profiler.stop()

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop()

    @property
    def recording(self) -> bool:
        """True while steps are still being recorded."""
        return self._running and not self._trace_ready

    def region(self, name: str) -> ContextManager:
        """A labelled slice `redline.<name>` (the engine uses "prefill" and "decode_step")."""
        if not self.recording:
            return contextlib.nullcontext()
        return torch.profiler.record_function(REGION_PREFIX + name)

    def step(self) -> None:
        """Called by the engine after the prefill and after every decode step."""
        if self.recording:
            with native_markers_dropped():
                self._profiler.step()

    # -- export ---------------------------------------------------------------------------
    def write(self, stats: dict, step_seconds: list[float]) -> Path:
        """Post-process the exported trace (counter track, redline.generate slice, stats) and
        write it atomically to config.path. Returns the path."""
        if self._profiler is None:
            raise RuntimeError("TraceRecorder.write() called before the recorder was used")
        self._stop()  # no-op when the context already exited
        if not self._trace_ready:
            raise RuntimeError("no trace was recorded (was any step run inside the recorder?)")
        with tempfile.TemporaryDirectory(prefix="redline-trace-") as tmp:
            raw = os.path.join(tmp, "raw.json")
            self._profiler.export_chrome_trace(raw)
            with open(raw, "rb") as f:
                trace = json.loads(f.read().decode("utf-8", errors="replace"))
        if isinstance(trace, list):
            trace = {"traceEvents": trace}
        stats = {str(k): _json_value(v) for k, v in dict(stats).items()}
        add_redline_annotations(trace, stats, [float(s) for s in step_seconds])
        return write_trace_atomic(trace, self.config.path)


def _slices(events: list, name: str) -> list[dict]:
    out = [
        e
        for e in events
        if isinstance(e, dict)
        and e.get("ph") == "X"
        and e.get("name") == name
        and e.get("cat") != "gpu_user_annotation"
        and "ts" in e
    ]
    out.sort(key=lambda e: float(e["ts"]))
    return out


def add_redline_annotations(trace: dict, stats: dict, step_seconds: list[float]) -> dict:
    """Add the tokens/sec counter track, the redline.generate slice and top-level stats."""
    events = trace.setdefault("traceEvents", [])
    decode = _slices(events, REGION_PREFIX + "decode_step")
    prefill = _slices(events, REGION_PREFIX + "prefill")
    anchor = (prefill or decode or [None])[0]

    for i, ev in enumerate(decode[: len(step_seconds)]):
        seconds = step_seconds[i]
        if not seconds or seconds <= 0 or not math.isfinite(seconds):
            continue
        events.append(
            {
                "ph": "C",
                "name": TOKENS_PER_SEC,
                "pid": ev.get("pid"),
                "tid": ev.get("tid"),
                "ts": float(ev["ts"]) + float(ev.get("dur", 0.0)),
                "args": {TOKENS_PER_SEC: 1.0 / seconds},
            }
        )

    # Recorded activity: complete slices, without Kineto's own "PyTorch Profiler" window span.
    complete = [
        e
        for e in events
        if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e and e.get("cat") != "Trace"
    ]
    if complete:
        start = min(float(e["ts"]) for e in complete)
        end = max(float(e["ts"]) + float(e.get("dur", 0.0)) for e in complete)
        generate = {
            "ph": "X",
            "name": REGION_PREFIX + "generate",
            "cat": "user_annotation",
            "ts": start,
            # rounded up to the ns so that it still encloses the last slice
            "dur": math.ceil((end - start) * 1000.0) / 1000.0,
            "args": dict(stats),
        }
        if anchor is not None:
            generate["pid"] = anchor.get("pid")
            generate["tid"] = anchor.get("tid")
        else:
            generate["pid"] = complete[0].get("pid")
            generate["tid"] = complete[0].get("tid")
        events.append(generate)

    trace["redline"] = {"stats": dict(stats), "format": TRACE_FORMAT}
    return trace


def is_trace_file(path: Path) -> bool:
    """Whether `path` looks like a trace a profiler wrote (gzip, or JSON with traceEvents in its first kilobytes):
    the only existing file a trace output may replace, and only with --overwrite."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    if Path(path).name.endswith(".json.gz"):
        return head[:2] == b"\x1f\x8b"
    return head.lstrip()[:1] in (b"{", b"[") and b"traceEvents" in head


def write_trace_atomic(trace: dict, path: str | os.PathLike) -> Path:
    """Write `trace` as JSON (gzipped when the name ends with .gz) via a temp file + rename."""
    from redline.checkpoint import write_atomically

    path = Path(path)
    data = json.dumps(trace, separators=(",", ":")).encode("utf-8")
    if path.name.endswith(".gz"):
        data = gzip.compress(data, compresslevel=6, mtime=0)
    write_atomically(path, lambda tmp: tmp.write_bytes(data))
    return path


# --- GPU timing shared by the benchmark scripts ---


def cuda_event_ms(fn: Callable[[], object], repeats: int) -> list[float]:
    """Milliseconds of each of `repeats` calls of fn, timed with CUDA events on the current stream."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def read_bandwidth_gb_s(gib: float = 4.0, repeats: int = 20) -> list[float]:
    """GB/s of a bf16 `sum` over `gib` GiB on the current GPU, one figure per repeat after a warm-up."""
    x = torch.empty(int(gib * 2**30) // 2, dtype=torch.bfloat16, device="cuda").normal_()  # random, never zeros
    for _ in range(3):
        x.sum()
    torch.cuda.synchronize()
    rates = [x.numel() * 2 / (ms / 1e3) / 1e9 for ms in cuda_event_ms(x.sum, repeats)]
    del x
    torch.cuda.empty_cache()
    return rates


def cuda_graph_us_per_call(calls: list[Callable[[], object]], repeats: int) -> float:
    """Median µs per call of a CUDA graph that runs `calls` in order (warmed up outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(3):
        graph.replay()
    ms = statistics.median(cuda_event_ms(graph.replay, repeats))
    del graph
    return ms * 1000 / len(calls)
