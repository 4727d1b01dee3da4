"""The machine the numbers come from: software versions, the device, the git commit, and its read bandwidth."""
from __future__ import annotations

import os
import platform
import shlex
import subprocess
from collections.abc import Sequence
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from redline.profiling import read_bandwidth_gb_s

# The checkout, whose git commit the record names.
ROOT = Path(__file__).resolve().parents[1]
# Timed reads behind the bandwidth figure: their median is reported, so one slow read does not move it.
BANDWIDTH_REPEATS = 20


def measure_read_bandwidth(device: torch.device, gib: float, repeats: int = BANDWIDTH_REPEATS) -> list[float]:
    """GB/s of a bf16 `sum` over `gib` GiB, timed with CUDA events, one figure per repeat (after a warm-up)."""
    with torch.cuda.device(device):
        return read_bandwidth_gb_s(gib, repeats)


def environment(device: torch.device, argv: Sequence[str]) -> dict[str, Any]:
    """Where and how the numbers were taken: the command, versions (CUDA or HIP), the device and the git commit."""
    env: dict[str, Any] = {
        "command": shlex.join(["python", "benchmarks/bench.py", *argv]),
        "argv": list(argv),
        "timestamp_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "hip_version": torch.version.hip,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "device_type": device.type,
        "git_commit": _git_commit(),
    }
    for package in ("triton", "transformers"):
        try:
            env[f"{package}_version"] = metadata.version(package)
        except metadata.PackageNotFoundError:
            env[f"{package}_version"] = None
    return env


def _git_commit() -> str | None:
    """The checkout's commit (with -dirty for uncommitted changes), or $REDLINE_GIT_COMMIT when set: a copy of the
    working tree on another machine may carry stale git metadata, so whoever copies it names the commit."""
    if os.environ.get("REDLINE_GIT_COMMIT"):
        return os.environ["REDLINE_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")

