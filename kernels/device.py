"""What the running GPU supports, read once from torch: the one place the kernels ask about the hardware.

Every capability decision of the package (programmatic dependent launch, the tf32 dot precision, the inline-PTX
int8 conversion, the SM count that sizes the attention grid, the shared memory the config tables must fit) reads
`device_caps()` rather than querying torch.cuda itself. `target_caps("gfx90a")` describes a named GPU and
`simulated(caps)` makes device_caps() return it, so the same code paths are checked for GPUs that are not here.
Importing this module imports neither Triton nor anything that touches a GPU.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass

import torch

VENDORS = ("nvidia", "amd", "cpu")
# Shared memory a block may use when torch does not report it: 48 KiB is the limit every CUDA GPU grants
# without an opt-in, so nothing sized from it can fail to launch.
DEFAULT_SHARED_MEMORY_BYTES = 48 * 1024
# The first NVIDIA compute capability with e4m3 tensor-core dots (Ada, sm89; Hopper is sm90). AMD's MI300 FP8 is the
# e4m3 "fnuz" variant, a different encoding from the e4m3fn weights Redline stores, so no AMD GPU claims FP8 here.
FP8_MIN_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class DeviceCaps:
    """One GPU (or the CPU) as the kernels see it."""

    vendor: str  # "nvidia", "amd" or "cpu"
    arch: str  # "sm90" on NVIDIA, the gcnArchName without its feature flags ("gfx90a") on AMD, "cpu"
    shared_memory_per_block: int  # bytes a block may use (the opt-in maximum where torch reports it)
    warp_size: int  # threads per warp (32) or wavefront (64 on most AMD GPUs)
    sm_count: int  # streaming multiprocessors (NVIDIA) or compute units (AMD); 0 on the CPU
    supports_tf32: bool  # tensor-core tf32 dots (NVIDIA sm80+; on AMD only gfx942, where Triton accepts them)
    supports_pdl: bool  # programmatic dependent launch (NVIDIA sm90+)
    inline_ptx: bool  # Triton kernels may carry inline PTX (NVIDIA only)
    supports_fp8: bool = False  # e4m3 tensor-core dots and conversions (NVIDIA sm89+: Ada, Hopper)

    def __post_init__(self) -> None:
        if self.vendor not in VENDORS:
            raise ValueError(f"DeviceCaps.vendor must be one of {VENDORS}, got {self.vendor!r}")
        if self.warp_size <= 0 or self.sm_count < 0 or self.shared_memory_per_block < 0:
            raise ValueError(f"DeviceCaps needs a positive warp size and non-negative counts, got {self}")
        if self.vendor != "nvidia" and (self.supports_pdl or self.inline_ptx or self.supports_fp8):
            raise ValueError(f"PDL, inline PTX and the e4m3 (OCP fn) FP8 path are NVIDIA features here; {self.vendor} "
                             "cannot claim them")


CPU_CAPS = DeviceCaps(vendor="cpu", arch="cpu", shared_memory_per_block=0, warp_size=1, sm_count=0,
                      supports_tf32=False, supports_pdl=False, inline_ptx=False)


# AMD architectures whose Triton backend accepts tf32 (xf32) dots; every other AMD GPU refuses input_precision="tf32".
AMD_TF32_ARCHS = ("gfx942",)

# Named targets: the GPUs people run the kernels on, described without the hardware (scripts/check_targets.py
# compiles every kernel configuration for each; the CPU tests check the config tables against their limits).
# Shared memory is the per-block opt-in maximum (LDS per workgroup on AMD); SM/CU counts are one common part.
TARGETS: dict[str, DeviceCaps] = {
    "sm80": DeviceCaps("nvidia", "sm80", 166912, 32, 108, True, False, True),  # A100
    "sm86": DeviceCaps("nvidia", "sm86", 101376, 32, 82, True, False, True),  # RTX 3090
    "sm89": DeviceCaps("nvidia", "sm89", 101376, 32, 128, True, False, True, True),  # RTX 4090, L40S
    "sm90": DeviceCaps("nvidia", "sm90", 232448, 32, 132, True, True, True, True),  # H100, H200
    "gfx90a": DeviceCaps("amd", "gfx90a", 65536, 64, 104, False, False, False),  # MI210, MI250
    "gfx942": DeviceCaps("amd", "gfx942", 65536, 64, 304, True, False, False),  # MI300X
    "gfx1100": DeviceCaps("amd", "gfx1100", 65536, 32, 96, False, False, False),  # RX 7900 XTX (wave32 in Triton)
}
DEFAULT_TARGETS = tuple(TARGETS)

# The capabilities every device_caps() call returns while `simulated` is active (None: the real device).
_SIMULATED: contextvars.ContextVar[DeviceCaps | None] = contextvars.ContextVar("redline_simulated_caps",
                                                                               default=None)


def target_caps(name: str) -> DeviceCaps:
    """The capability description of a named target ("sm80", "gfx90a", ...; see TARGETS)."""
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; known targets: {', '.join(TARGETS)}")
    return TARGETS[name]


@contextlib.contextmanager
def simulated(caps: DeviceCaps) -> Iterator[DeviceCaps]:
    """Within the block, device_caps() describes `caps` whatever the device: the kernels choose their paths and
    configurations for that GPU (scripts/check_targets.py compiles them for it; tests shrink a limit with it)."""
    token = _SIMULATED.set(caps)
    try:
        yield caps
    finally:
        _SIMULATED.reset(token)


def device_caps(device: torch.device | str | int | None = None) -> DeviceCaps:
    """The capabilities of `device` (default: the current CUDA/HIP device; the CPU when no GPU is visible), or the
    simulated ones inside `simulated(caps)`."""
    if (override := _SIMULATED.get()) is not None:
        return override
    if isinstance(device, (str, int)):
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device is not None and device.type != "cuda":
        return CPU_CAPS
    if not torch.cuda.is_available():
        return CPU_CAPS
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    return _gpu_caps(index)


@functools.cache
def _gpu_caps(index: int) -> DeviceCaps:
    props = torch.cuda.get_device_properties(index)
    amd = torch.version.hip is not None
    shared = getattr(props, "shared_memory_per_block_optin", 0) or getattr(props, "shared_memory_per_block", 0)
    warp = getattr(props, "warp_size", 0) or (64 if amd else 32)
    if amd:
        arch = (getattr(props, "gcnArchName", "") or "gfx").split(":")[0]
        return DeviceCaps(vendor="amd", arch=arch, shared_memory_per_block=shared or DEFAULT_SHARED_MEMORY_BYTES,
                          warp_size=warp, sm_count=props.multi_processor_count, supports_tf32=arch in AMD_TF32_ARCHS,
                          supports_pdl=False, inline_ptx=False)
    return DeviceCaps(vendor="nvidia", arch=f"sm{props.major}{props.minor}",
                      shared_memory_per_block=shared or DEFAULT_SHARED_MEMORY_BYTES, warp_size=warp,
                      sm_count=props.multi_processor_count, supports_tf32=props.major >= 8,
                      supports_pdl=props.major >= 9, inline_ptx=True,
                      supports_fp8=(props.major, props.minor) >= FP8_MIN_CAPABILITY)


def fp8_refusal(device: torch.device | str) -> str | None:
    """Why FP8 (e4m3) weights cannot run on `device`, or None when they can: the CPU runs the dequantizing reference
    and an NVIDIA GPU of compute capability 8.9 or newer the FP8 kernels; any other GPU is refused (never a slow
    fallback)."""
    caps = device_caps(device)
    if caps.vendor == "cpu" or caps.supports_fp8:
        return None
    return (f"FP8 weights need an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper); this one is "
            f"{caps.vendor} {caps.arch}. Load the unquantized checkpoint with quantize='int8' instead, or run on the CPU")


def kv_fp8_refusal(device: torch.device | str) -> str | None:
    """Why an FP8 (e4m3) KV cache cannot run on `device`, or None when it can: the CPU runs the dequantizing
    references and an NVIDIA GPU of compute capability 8.9 or newer the paged kernels' e4m3 loads; any other GPU is
    refused (never a slow fallback)."""
    caps = device_caps(device)
    if caps.vendor == "cpu" or caps.supports_fp8:
        return None
    return (f"--kv-cache-dtype fp8 needs an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper); this one is "
            f"{caps.vendor} {caps.arch}. Use --kv-cache-dtype auto (the model's dtype) on it")


@functools.cache
def triton_importable() -> bool:
    """Triton is installed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None
