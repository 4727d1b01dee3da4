"""Cross-compile every Triton kernel configuration the dispatcher can choose, for GPUs this machine does not have.

    python scripts/check_targets.py [--targets sm80,...] [--kernels paged,moe,...] [--jobs N] [--failures-only]
                                    [--sample]

For each target (kernels.device.TARGETS: sm80, sm86, sm89, sm90, gfx90a, gfx942, gfx1100 by default) the
project's own launchers run on meta tensors under that target's capability description
(kernels.device.simulated(target_caps(name))) and a Triton driver that reports the target's GPU: every op, dtype
(bf16, fp16, fp32; int8 weights, int4 weights in every group size the quantizer offers, and on targets with FP8 the
e4m3 weights with per-channel and 128 x 128 block scales, with the per-token quantizer and the FP8 tensor-core
kernel at every tile height it takes), row count 1-256,
decode batch, cache length and prompt length up to 2048, paged-attention page size and prefill layout (on targets
with FP8 also over an e4m3 KV cache; scripts/attention_target_calls.py), for the shapes of the demo model
(SmolLM2-135M), Llama-2-7B, Llama-3-8B and Llama-3-70B, and the MoE op on three MoE models
(scripts/moe_target_calls.py) (--kernels limits the check to some kernel groups: linear, attention, paged, moe).
A Triton JIT hook records each launch instead of compiling it (nothing runs). Each configuration is then compiled
for the target (Triton's own compiler: ptxas for NVIDIA, the LLVM AMDGPU backend for AMD) and its shared memory (LDS
on AMD) and registers are checked against the target's limits, and its shared memory against the dispatcher's
estimate (which keeps them within the limit at run time).

A configuration is what Triton compiles: the kernel, its argument dtypes and specialization (integers and pointers
divisible by 16 or not; on AMD, tensors within 32-bit offsets or not), its constexprs, num_warps, num_stages and
PDL. Launches that differ only in SCALAR_CONSTEXPRS or ONE_DIVISIBILITY_ARGS (below: index arithmetic, a row mask
and a split count, no tile) are compiled once.

Triton 3.6 lowers these kernels alike for sm80, sm86 and sm89 (their TTGIR, LLVM IR and PTX were equal for every
configuration of a full run, compiled in full for each): a configuration that several of them choose is compiled in
full for the first; for the others Triton runs up to its TTGIR, which must equal the first target's (else the
configuration is compiled in full), and ptxas assembles the first target's PTX for their own arch, so their
registers are their own. Compile tasks run on every CPU, the longest first.

--sample compiles about a thirteenth of it: of the configurations that share a kernel, its pointer dtypes and an IR
family, only the one the dispatcher sized largest (shared-memory estimate, then tile, then warps x stages): every
kernel in every dtype on every target, at the configuration nearest the target's limits; CI runs it (about 10
minutes on 2 cores), and a kernel or dispatcher change runs the whole check.

Prints one line per kernel configuration and target, and exits 1 if any fails (2 on bad arguments). The default
targets take about 60 minutes on 2 cores, close to half of it the int4 GEMV's configurations; compiled kernels land
in Triton's cache (TRITON_CACHE_DIR), so a second run is faster.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import json
import math
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import torch

from redline.kernels import configs
from redline.kernels.device import DEFAULT_TARGETS, DeviceCaps, simulated, target_caps
from redline.scripts.attention_target_calls import attention_calls, paged_attention_calls
from redline.scripts.linear_target_calls import fused_gemv_calls
from redline.scripts.moe_target_calls import MOE_MODELS, grouped_moe_smem, moe_calls

# Register limits the compilers must stay within: NVIDIA has 64K 32-bit registers per block and at most 255 per
# thread; an AMD wave's VGPRs (arch + accumulation registers) are limited per lane.
NVIDIA_REGISTERS_PER_BLOCK = 65536
NVIDIA_REGISTERS_PER_THREAD = 255
AMD_VGPRS_PER_LANE = {"gfx90a": 512, "gfx942": 512, "gfx1100": 256}


@dataclass(frozen=True)
class ModelShape:
    """The projection and attention shapes of one model."""

    name: str
    dim: int
    n_heads: int
    n_kv_heads: int
    intermediate: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def projections(self) -> dict[str, tuple[int, int]]:
        """(N, K) of every weight matrix: fused qkv, wo, fused gate/up, w2, the output head."""
        qkv = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        return {"wqkv": (qkv, self.dim), "wo": (self.dim, self.dim), "w13": (2 * self.intermediate, self.dim),
                "w2": (self.dim, self.intermediate), "output": (self.vocab, self.dim)}


MODELS = (
    ModelShape("smollm2-135m", 576, 9, 3, 1536, 49152),
    ModelShape("llama-2-7b", 4096, 32, 32, 11008, 32000),
    ModelShape("llama-3-8b", 4096, 32, 8, 14336, 128256),
    ModelShape("llama-3-70b", 8192, 64, 8, 28672, 128256),
)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The weight kinds of the linear ops: float (x's dtype), int8 per row, int4 in the group sizes quantize.py offers
# (--groupsize 32|64|128|256; a group size that does not divide a layer's K is refused there, so skipped here).
INT4_GROUP_SIZES = (32, 64, 128, 256)
WEIGHT_KINDS = ("float", "int8") + tuple(f"int4-g{g}" for g in INT4_GROUP_SIZES)
MAX_ROWS = 256  # the most rows of x the linear ops hand to Triton (kernels.linear.SMALL_M)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CACHE_LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
MAX_PROMPT = 2048

# Constexprs that only enter scalar index arithmetic and masks (head counts, the page size of the paged kernels'
# key addresses), never a tile shape: configurations that differ in nothing else have the same tiles, layouts and
# shared memory, so one of them is compiled (tests/test_check_targets.py compiles two page sizes alike).
SCALAR_CONSTEXPRS = {"N_KV_HEADS", "GROUP", "N_HEADS", "PAGE_SIZE"}
# Integer arguments whose divisibility by 16 is compiled once (one variant stands for both), by kernel: the split
# count of the attention kernels, whose two variants compiled to identical binaries on every default target, and
# the row counts M of the tensor-core kernel and n_pairs of the grouped MoE kernels, which only mask rows (the loads
# vectorize along K): their variants have the same TTGIR (tiles, layouts, pipelining) and shared memory and differ
# in a few predicates. tests/test_check_targets.py checks both on an NVIDIA and an AMD target; compiling every
# variant would add about 5 minutes on 2 cores.
ONE_DIVISIBILITY_ARGS = {"_small_m_dot_kernel": {"M"}, "_fp8_dot_kernel": {"M"}, "_split_kernel": {"num_splits"},
                         "_combine_kernel": {"num_splits"},
                         "_grouped_gate_up_kernel": {"n_pairs"}, "_grouped_down_kernel": {"n_pairs"},
                         "_grouped_gate_up_int4_kernel": {"n_pairs"}, "_grouped_down_int4_kernel": {"n_pairs"}}
KERNEL_GROUPS = ("linear", "attention", "paged", "moe")


@dataclass
class Launch:
    """One kernel configuration the dispatcher chose, with the calls that chose it."""

    kernel: str  # module path of the JIT function, "redline.kernels.triton_linear._gemv_kernel"
    spec: str  # Triton's specialization data (JSON): signature, constexprs, argument attributes, options
    summary: str  # what tells configurations apart: dtypes, constexprs, launch options, unspecialized arguments
    first_call: str  # the first call that chose it
    calls: int = 1


@dataclass
class Result:
    """A compiled configuration checked against its target."""

    target: str
    launch: Launch
    ok: bool
    detail: str
    shared: int = -1
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Binary:
    """What the checks read from a compiled configuration."""

    shared: int  # bytes of shared memory (LDS) per block
    num_warps: int
    asm: dict  # Triton's stage outputs: "ttgir", "ptx", "cubin" (NVIDIA) or "amdgcn" (AMD), ...
    note: str = ""  # how it was made, where not by Triton's whole pipeline


# --- a Triton driver that reports the target GPU and launches nothing ---


def target_driver(caps: DeviceCaps, device_index: int):
    """A Triton driver reporting caps' GPU; device_index keeps each target's JIT caches apart. It is never asked
    to launch: the recording hook stops every launch before that, and check_launch only compiles."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    backend = "cuda" if caps.vendor == "nvidia" else "hip"
    arch = int(caps.arch[2:]) if caps.vendor == "nvidia" else caps.arch
    gpu_target = GPUTarget(backend, arch, caps.warp_size)

    class TargetDriver(DriverBase):
        @classmethod
        def is_active(cls) -> bool:
            return False

        def map_python_to_cpp_type(self, ty: str) -> str:
            raise NotImplementedError("the target driver only compiles")

        def get_current_target(self):
            return gpu_target

        def get_active_torch_device(self):
            return torch.device("meta")

        def get_benchmarker(self):
            raise NotImplementedError("the target driver only compiles")

        def get_current_device(self) -> int:
            return device_index

        def get_current_stream(self, device=None) -> int:
            return 0

    return TargetDriver()


@contextlib.contextmanager
def active_driver(driver) -> Iterator[None]:
    """Make `driver` Triton's active driver within the block, then restore the one before (DriverConfig keeps it
    in _active, None until first use; reset_active would need a real GPU driver)."""
    import triton

    config = triton.runtime.driver
    previous = config._active
    config.set_active(driver)
    try:
        yield
    finally:
        config._active = previous


class _Recorder:
    """A jit_cache_hook that records each launch's configuration and tells Triton not to compile or run it."""

    def __init__(self) -> None:
        self.launches: dict[str, Launch] = {}
        self.call = ""

    def __call__(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled) -> bool:
        jit = fn.jit_function
        name = f"{jit.fn.__module__}.{jit.fn.__name__}"
        summary = _summary(jit, compile)
        found = self.launches.get(summary)
        if found is not None:
            found.calls += 1
        else:
            self.launches[summary] = Launch(name, compile["specialization_data"], summary, self.call)
        return True


def _summary(jit, compile: dict) -> str:
    """The kernel, its pointer dtypes, the constexprs that shape its code, its launch options, and the arguments
    Triton could not specialize (`M%16!=0`: an integer or address not divisible by 16; `w_ptr 64-bit`: on AMD, a
    tensor past 32-bit offsets), which compile to different code."""
    kernel = jit.fn.__name__
    spec = json.loads(compile["specialization_data"])
    constants = {jit.arg_names[path[0]]: value for path, value in compile["constants"].items() if len(path) == 1}
    dtypes = ",".join(str(t)[1:] for t in compile["signature"].values() if str(t).startswith("*"))
    shown = " ".join(f"{k}={v}" for k, v in constants.items() if k.isupper() and k not in SCALAR_CONSTEXPRS)
    pdl = " pdl" if spec["options"].get("launch_pdl") else ""
    return (f"{kernel}({dtypes}) {shown} warps={compile['num_warps']} stages={compile['num_stages']}{pdl}"
            f"{_unspecialized(kernel, spec)}")


def _unspecialized(kernel: str, spec: dict) -> str:
    """' [M%16!=0, w_ptr 64-bit]': the arguments Triton specialized less than the others (empty when none)."""
    names = list(spec["signature"])
    attrs = {names[path[0]]: {k: v for k, v in values}
             for path, values in zip(spec["attrs_keys"], spec["attrs_vals"]) if len(path) == 1}
    ranged = any("tt.pointer_range" in a for a in attrs.values())  # AMD: buffer ops on tensors within 2 GiB
    notes = []
    for name, ty in spec["signature"].items():
        if ty == "constexpr" or name in ONE_DIVISIBILITY_ARGS.get(kernel, ()):
            continue
        given = attrs.get(name, {})
        if (ty.startswith("*") or ty[0] in "iu") and "tt.divisibility" not in given:
            notes.append(f"{name}%16!=0")
        if ty.startswith("*") and ranged and "tt.pointer_range" not in given:
            notes.append(f"{name} 64-bit")
    return f" [{', '.join(notes)}]" if notes else ""


# --- what the dispatcher chooses ---


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, device="meta", dtype=dtype)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype)[6:]


def _weight(kind: str, n: int, k: int, x_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A meta weight (N, K) of this kind and its scales: float (x's dtype, no scales), int8 (N,) scales in x's
    dtype, int4-gG packed uint8 (N, K/2) with fp16 (N, K/G, 2) scales and offsets (quantize.py's layout)."""
    if kind == "float":
        return _meta(n, k, dtype=x_dtype), None
    if kind == "int8":
        return _meta(n, k, dtype=torch.int8), _meta(n, dtype=x_dtype)
    group = int(kind.rsplit("g", 1)[1])
    return _meta(n, k // 2, dtype=torch.uint8), _meta(n, k // group, 2, dtype=torch.float16)


def _int4_group(kind: str) -> int:
    return int(kind.rsplit("g", 1)[1]) if kind.startswith("int4") else 0


def _linear_calls(record: _Recorder, caps: DeviceCaps, models: tuple[ModelShape, ...]) -> list[str]:
    """Every linear op row count, dtype and weight kind on every model shape; returns the calls that fell back to
    BLAS (more than MAX_ROWS rows always do)."""
    fallbacks = []
    for model, kind, x_dtype in itertools.product(models, WEIGHT_KINDS, FLOAT_DTYPES):
        for proj, (n, k) in model.projections().items():
            if k % max(_int4_group(kind), 1):
                continue  # quantize.py refuses a group size that does not divide K
            label = f"{model.name} {proj} {_dtype_name(x_dtype)}x{kind}"
            _gemv_calls(record, label, n, k, x_dtype, kind, proj)
            fallbacks += _dot_calls(record, caps, label, n, k, x_dtype, kind)
    if caps.supports_fp8:
        for model, block, x_dtype in itertools.product(models, (False, True), FLOAT_DTYPES):
            for proj, (n, k) in model.projections().items():
                _fp8_calls(record, caps, f"{model.name} {proj} {_dtype_name(x_dtype)}xfp8{'-block' if block else ''}",
                           n, k, x_dtype, block, proj)
    return fallbacks


# Rows of x that give the FP8 tensor-core kernel each of its tile heights (16, 32, 64, 128; more rows tile by 128).
FP8_DOT_ROWS = (2, 17, 33, 65, 129)


def _fp8_calls(record: _Recorder, caps: DeviceCaps, label: str, n: int, k: int, x_dtype: torch.dtype, block: bool,
               projection: str) -> None:
    """FP8 weights (kernels.linear.fp8_linear): one row through triton_linear.gemv (plain and fused), more rows through
    triton_fp8.quantize_rows and triton_fp8.fp8_dot at each tile height."""
    from redline.kernels import triton_fp8, triton_linear
    from redline.quantize import fp8_block_scales_shape

    w = _meta(n, k, dtype=torch.float8_e4m3fn)
    scales = _meta(*fp8_block_scales_shape(n, k), dtype=torch.float32) if block else _meta(n, dtype=torch.float32)
    record.call = f"{label} rows=1"
    triton_linear.gemv(_meta(1, k, dtype=x_dtype), w, scales, _meta(1, n, dtype=x_dtype))
    fused_gemv_calls(record, label, triton_linear.gemv, w, scales, n, k, x_dtype, projection)
    for m in FP8_DOT_ROWS:
        record.call = f"{label} rows={m}"
        codes, row_scales = triton_fp8.quantize_rows(_meta(m, k, dtype=x_dtype))
        triton_fp8.fp8_dot(codes, row_scales, w, scales, _meta(m, n, dtype=x_dtype))


def _gemv_calls(record: _Recorder, label: str, n: int, k: int, x_dtype: torch.dtype, kind: str,
                projection: str) -> None:
    """One row of x through the launcher kernels.linear calls for this weight kind (triton_linear.gemv, or the int4
    GEMV's public launcher triton_int4.gemv_int4, which takes its config from configs.gemv_int4_config): plain,
    and in each fused decode form of this projection (scripts/linear_target_calls.py)."""
    from redline.kernels import triton_int4, triton_linear

    gemv = triton_int4.gemv_int4 if kind.startswith("int4") else triton_linear.gemv
    w, scales = _weight(kind, n, k, x_dtype)
    record.call = f"{label} rows=1"
    gemv(_meta(1, k, dtype=x_dtype), w, scales, _meta(1, n, dtype=x_dtype))
    fused_gemv_calls(record, label, gemv, w, scales, n, k, x_dtype, projection)


def _dot_calls(record: _Recorder, caps: DeviceCaps, label: str, n: int, k: int, x_dtype: torch.dtype,
               kind: str) -> list[str]:
    """Rows 2..MAX_ROWS through the tensor-core kernel of this weight kind (triton_linear.small_m_dot, or
    triton_int4_dot.int4_dot for int4); returns the calls that take cuBLAS/hipBLAS instead."""
    from redline.kernels import triton_int4_dot, triton_linear

    w, scales = _weight(kind, n, k, x_dtype)
    group = _int4_group(kind)
    fallbacks, tried = [], set()
    for m in range(2, MAX_ROWS + 1):
        record.call = f"{label} rows={m}"
        if group:
            cfg = configs.fitted_int4_dot_config(n, k, group, x_dtype.itemsize, m, caps)
        else:
            cfg = configs.fitted_dot_config(n, k, w.element_size(), x_dtype.itemsize, m, caps)
        if cfg is None:
            fallbacks.append(record.call)
        elif (cfg, configs.dot_block_m(cfg, m)) not in tried:
            # (row counts with the same config and tile height launch the same kernel, up to the divisibility of M)
            tried.add((cfg, configs.dot_block_m(cfg, m)))
            launch = triton_int4_dot.int4_dot if group else triton_linear.small_m_dot
            launch(_meta(m, k, dtype=x_dtype), w, scales)
    return fallbacks


def target_launches(name: str, device_index: int = 1000, models: tuple[ModelShape, ...] = MODELS,
                    groups: tuple[str, ...] = KERNEL_GROUPS) -> tuple[list[Launch], list[str]]:
    """The distinct kernel configurations the dispatcher chooses on target `name` for these models (MOE_MODELS for
    moe) of the kernel groups named, and the calls that take a fallback (cuBLAS/hipBLAS, a reference) because no
    configuration fits."""
    from triton import knobs

    caps = target_caps(name)
    record = _Recorder()
    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = record
    try:
        with active_driver(target_driver(caps, device_index)), simulated(caps):
            fallbacks = _linear_calls(record, caps, models) if "linear" in groups else []
            if "attention" in groups:
                fallbacks += attention_calls(record, models, FLOAT_DTYPES, DECODE_BATCHES, CACHE_LENGTHS, MAX_PROMPT)
            if "paged" in groups:
                fallbacks += paged_attention_calls(record, models, FLOAT_DTYPES, DECODE_BATCHES, CACHE_LENGTHS)
                if caps.supports_fp8:  # the e4m3 KV cache (--kv-cache-dtype fp8): the same kernels' KV_FP8 variants
                    fallbacks += paged_attention_calls(record, models, FLOAT_DTYPES, DECODE_BATCHES, CACHE_LENGTHS,
                                                       fp8_cache=True)
            if "moe" in groups:
                fallbacks += moe_calls(record, MOE_MODELS, FLOAT_DTYPES)
    finally:
        knobs.runtime.jit_cache_hook = previous
    return list(record.launches.values()), fallbacks


def _capture_job(job: tuple[str, int, tuple[str, ...]]) -> tuple[list[Launch], list[str]]:
    name, device_index, groups = job
    return target_launches(name, device_index, MODELS, groups)


# --- compiling one configuration ---


def ir_family(caps: DeviceCaps) -> str | None:
    """The targets whose Triton IR (TTGIR, LLVM IR, PTX) is the same for these kernels, so that one's PTX serves
    the others: NVIDIA sm80-sm89 (Triton 3.6 lowers them alike but for fp8, which _same_ttgir refuses)."""
    if caps.vendor == "nvidia" and 80 <= int(caps.arch[2:]) < 90:
        return "nvidia-sm8x"
    return None


class _StopAtTTGIR(Exception):
    """Raised in place of Triton's LLVM stage: carries the kernel's TTGIR text."""


def _stop_at_ttgir(backend, stages: dict, options, language, capability) -> None:
    """An add_stages_inspection_hook that ends Triton's pipeline once the TTGIR is made (nothing is cached)."""

    def stop(src, metadata):
        raise _StopAtTTGIR(str(src))

    stages["llir"] = stop


def _same_ttgir(ttgir: str, reference: str) -> bool:
    """The TTGIR texts are equal but for the target name, and hold no fp8 (lowered differently on sm89)."""
    def strip(text: str) -> str:
        return re.sub(r'"cuda:\d+"', '"cuda"', text)

    return "f8E" not in ttgir and strip(ttgir) == strip(reference)


def _jit_function(path: str):
    module, kernel = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), kernel)


def _options(launch: Launch, backend):
    """The launch's compile options parsed by the target's backend, as JITFunction.preload does."""
    options = json.loads(launch.spec)["options"]
    return backend.parse_options({k: tuple(v) if isinstance(v, list) else v for k, v in options.items()})


def _assembled(launch: Launch, caps: DeviceCaps, ttgir: str, reference: tuple[str, Binary]) -> Binary:
    """The reference target's PTX assembled by ptxas for caps' arch, as Triton's last stage would (its .target and
    .version lines are the ones Triton writes for this arch)."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptx_version_from_options
    from triton.compiler.compiler import make_backend

    arch = int(caps.arch[2:])
    backend = make_backend(GPUTarget("cuda", arch, caps.warp_size))
    options = _options(launch, backend)
    version = get_ptx_version_from_options(options, arch)
    ref_target, ref = reference
    ptx = re.sub(r"\.target sm_\d+", f".target sm_{arch}", ref.asm["ptx"])
    ptx = re.sub(r"\.version \d+\.\d+", f".version {version // 10}.{version % 10}", ptx)
    cubin = backend.make_cubin(ptx, {}, options, arch)
    return Binary(ref.shared, options.num_warps, {"ttgir": ttgir, "ptx": ptx, "cubin": cubin},
                  note=f"IR of {ref_target}")


def _compile(target: str, launch: Launch, device_index: int, reference: tuple[str, Binary] | None) -> Binary:
    """Compile the configuration for the target: in full, or with a reference of the same IR family from the
    reference's PTX once Triton's TTGIR for this target is found equal to the reference's."""
    from triton import knobs

    caps = target_caps(target)
    jit = _jit_function(launch.kernel)
    with active_driver(target_driver(caps, device_index)):
        if reference is not None and {"ttgir", "ptx"} <= reference[1].asm.keys():
            previous = knobs.runtime.add_stages_inspection_hook
            knobs.runtime.add_stages_inspection_hook = _stop_at_ttgir
            try:
                compiled = jit.preload(launch.spec)  # returns only on a hit in Triton's cache
            except _StopAtTTGIR as stop:
                ttgir = stop.args[0]
                if _same_ttgir(ttgir, reference[1].asm["ttgir"]):
                    return _assembled(launch, caps, ttgir, reference)
                compiled = None
            finally:
                knobs.runtime.add_stages_inspection_hook = previous
            if compiled is not None:
                return Binary(compiled.metadata.shared, compiled.metadata.num_warps, dict(compiled.asm))
        compiled = jit.preload(launch.spec)
    return Binary(compiled.metadata.shared, compiled.metadata.num_warps, dict(compiled.asm))


# --- checking a compiled configuration against its target ---


def _nvidia_registers(cubin: bytes, arch: int) -> tuple[int, int]:
    """(registers per thread, stack and local memory bytes per thread: spills and local arrays) of a cubin, from
    the cuobjdump that Triton ships beside its ptxas."""
    from triton.backends.nvidia.compiler import get_ptxas

    tool = os.path.join(os.path.dirname(get_ptxas(arch).path), "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", text)
    stack = sum(int(v) for v in re.findall(r"(?:STACK|LOCAL):(\d+)", text))
    return int(regs.group(1)) if regs else -1, stack


def _amd_registers(amdgcn: str) -> tuple[int, int]:
    """(VGPRs per lane, arch and accumulation registers together; spilled registers) from the AMDGPU metadata."""
    vgprs = re.search(r"\.vgpr_count:\s+(\d+)", amdgcn)  # on gfx90a/gfx942 it counts the AGPRs already
    spills = sum(int(v) for v in re.findall(r"\.[sv]gpr_spill_count:\s+(\d+)", amdgcn))
    return int(vgprs.group(1)) if vgprs else -1, spills


def _estimate(launch: Launch, caps: DeviceCaps) -> int | None:
    """The shared memory the dispatcher's tables assumed for this configuration (None: not sized from tiles)."""
    spec = json.loads(launch.spec)
    constants = dict(zip((tuple(k) for k in spec["constant_keys"]), spec["constant_vals"]))
    options = spec["options"]
    kernel = launch.kernel.rsplit(".", 1)[1]
    names = list(spec["signature"])
    named = {names[k[0]]: v for k, v in constants.items() if len(k) == 1}
    signature = spec["signature"]
    if kernel == "_small_m_dot_kernel":
        x_bytes = _pointer_bytes(signature["x_ptr"])
        w_bytes = _pointer_bytes(signature["w_ptr"])
        return configs.dot_smem_bytes(named["BLOCK_M"], named["BLOCK_N"], named["BLOCK_K"], options["num_stages"],
                                      x_bytes, w_bytes, caps)
    if kernel == "_fp8_dot_kernel":
        return configs.fp8_dot_smem(configs.Fp8DotConfig(named["BLOCK_M"], named["BLOCK_N"], named["BLOCK_K"],
                                                         options["num_warps"], options["num_stages"]))
    if kernel == "_int4_dot_kernel":
        return configs.int4_dot_smem_bytes(named["BLOCK_M"], named["BLOCK_N"], named["BLOCK_K"], options["num_stages"],
                                           _pointer_bytes(signature["x_ptr"]), named["G"], named["SWAP"], caps)
    if kernel == "_paged_prefill_kernel":  # e4m3 caches' tiles are sized as the queries' (paged_attention.tile_bytes)
        return configs.paged_prefill_smem_bytes(named["BLOCK_M"], named["BLOCK_N"], named["HEAD_DIM"],
                                                _tile_bytes(signature), options["num_stages"], caps)
    if kernel.startswith("_grouped_"):  # the float and int8 kernels, and the int4 ones (tiles converted to x's dtype)
        return grouped_moe_smem(kernel, named, options, _pointer_bytes(signature["h_ptr"]), caps)
    if kernel in ("_split_kernel", "_paged_split_kernel"):  # the queries' element size, and the cache's (e4m3: 1)
        return configs.attention_smem_bytes(named["BLOCK_G"], named["BLOCK_S"], named["HEAD_DIM"],
                                            _pointer_bytes(signature["q_ptr"]), options["num_stages"], caps,
                                            _pointer_bytes(signature["k_ptr"]))
    return None


def _pointer_bytes(pointer_type: str) -> int:
    if pointer_type.startswith("*fp8"):  # *fp8e4nv, *fp8e5, ...: one byte
        return 1
    bits = int(re.search(r"(\d+)$", pointer_type).group(1))
    return bits // 8


def _tile_bytes(signature: dict[str, str]) -> int:
    """Bytes of an attention kernel's K/V tile element: the cache's, or the queries' where larger (e4m3 tiles are
    converted to the queries' dtype for the dots)."""
    return max(_pointer_bytes(signature["q_ptr"]), _pointer_bytes(signature["k_ptr"]))


def _checked(target: str, launch: Launch, binary: Binary, seconds: float) -> Result:
    """The binary's shared memory and registers against the target's limits and the dispatcher's estimate."""
    caps = target_caps(target)
    shared = binary.shared
    problems = []
    if shared > caps.shared_memory_per_block:
        problems.append(f"shared {shared} B > {caps.shared_memory_per_block} B")
    estimate = _estimate(launch, caps)
    if estimate is not None and shared > estimate:
        problems.append(f"shared {shared} B above the dispatcher's estimate {estimate} B")
    threads = binary.num_warps * caps.warp_size
    if caps.vendor == "nvidia":
        regs, stack = _nvidia_registers(binary.asm["cubin"], int(caps.arch[2:]))
        if regs > NVIDIA_REGISTERS_PER_THREAD or regs * threads > NVIDIA_REGISTERS_PER_BLOCK:
            problems.append(f"{regs} registers x {threads} threads over the register file")
        detail = f"shared {shared} B, {regs} regs/thread, stack {stack} B"
    else:
        regs, spill = _amd_registers(binary.asm["amdgcn"])
        if regs > AMD_VGPRS_PER_LANE.get(caps.arch, 256):
            problems.append(f"{regs} VGPRs over {AMD_VGPRS_PER_LANE.get(caps.arch, 256)}")
        detail = f"LDS {shared} B, {regs} VGPRs, {spill} spilled"
    if binary.note:
        detail += f" ({binary.note})"
    return Result(target, launch, not problems, detail, shared, seconds, problems)


def _check_one(target: str, launch: Launch, device_index: int,
               reference: tuple[str, Binary] | None = None) -> tuple[Result, Binary | None]:
    start = time.perf_counter()
    try:
        binary = _compile(target, launch, device_index, reference)
    except Exception as e:  # a compile error is this configuration's result, reported on its line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return Result(target, launch, False, f"compile error: {type(e).__name__}: {first[:200]}",
                      seconds=time.perf_counter() - start, problems=["compile"]), None
    return _checked(target, launch, binary, time.perf_counter() - start), binary


def check_launch(target: str, launch: Launch, device_index: int,
                 reference: tuple[str, Binary] | None = None) -> Result:
    """Compile one configuration for its target and check it against the target's limits (with a reference
    (target, Binary) of the same IR family, from the reference's PTX where the TTGIR is the same)."""
    return _check_one(target, launch, device_index, reference)[0]


Job = tuple[int, str, Launch, int]  # (order in the report, target, configuration, the target's device index)


def _check_task(task: list[Job]) -> list[tuple[int, Result]]:
    """Check one configuration on one target, or on several targets of one IR family: the first that compiles
    is compiled in full and serves the others as their reference."""
    results, reference = [], None
    for order, target, launch, device_index in task:
        result, binary = _check_one(target, launch, device_index, reference)
        if reference is None and binary is not None and not binary.note:
            reference = (target, binary)
        results.append((order, result))
    return results


def _tasks(targets: tuple[str, ...], captured: list[list[Launch]]) -> list[list[Job]]:
    """The compile tasks, longest first: a configuration that targets of one IR family share is one task."""
    tasks: dict[tuple[str, str], list[Job]] = {}
    order = 0
    for index, (target, launches) in enumerate(zip(targets, captured)):
        family = ir_family(target_caps(target)) or target
        for launch in launches:
            tasks.setdefault((family, launch.summary), []).append((order, target, launch, 1000 + index))
            order += 1
    return sorted(tasks.values(), key=_task_seconds, reverse=True)


def sampled(tasks: list[list[Job]]) -> list[list[Job]]:
    """One task per kernel, pointer dtypes and IR family: the configuration the dispatcher sized largest
    (shared-memory estimate, then the product of its tile constexprs, then warps x stages), in tasks' order."""
    best: dict[tuple, tuple[tuple[int, int, int], list[Job]]] = {}
    for task in tasks:
        _, target, launch, _ = task[0]
        family = ir_family(target_caps(target)) or target
        key = (family, launch.kernel, launch.summary.split(")", 1)[0])  # "kernel(pointer dtypes"
        warps, stages = (int(v) for v in re.search(r" warps=(\d+) stages=(\d+)", launch.summary).groups())
        size = (_estimate(launch, target_caps(target)) or 0,
                math.prod(int(v) for v in re.findall(r" [A-Z][A-Z0-9_]*=(\d+)", launch.summary)), warps * stages)
        if key not in best or size > best[key][0]:
            best[key] = (size, task)
    kept = {id(task) for _, task in best.values()}
    return [task for task in tasks if id(task) in kept]


def _task_seconds(task: list[Job]) -> float:
    """A rough compile time of a task on one core, from the means measured per kernel (the tensor-core and
    attention kernels take longest, fp32 about twice the others, gfx1100's register spills twice again; a
    configuration assembled from a reference's PTX about 40% of a full compile)."""
    _, target, launch, _ = task[0]
    kind = launch.kernel.rsplit(".", 1)[1]
    seconds = {"_small_m_dot_kernel": 1.0, "_split_kernel": 1.2, "_paged_split_kernel": 1.2,
               "_paged_prefill_kernel": 1.5}.get(kind, 1.0 if kind.startswith("_grouped_") else 0.4)
    seconds *= (2 if "(fp32" in launch.summary else 1) * (2 if target == "gfx1100" else 1)
    return seconds * (1 + 0.4 * (len(task) - 1))


# --- the command line ---


@dataclass(frozen=True)
class CheckArgs:
    """Validated command-line arguments."""

    targets: tuple[str, ...]
    jobs: int
    failures_only: bool
    kernels: tuple[str, ...] = KERNEL_GROUPS
    sample: bool = False

    def __post_init__(self) -> None:
        for name in self.targets:
            target_caps(name)  # raises ValueError naming the known targets
        unknown = [k for k in self.kernels if k not in KERNEL_GROUPS]
        if unknown or not self.kernels:
            raise ValueError(f"--kernels takes a comma-separated list of {', '.join(KERNEL_GROUPS)}, "
                             f"got {','.join(self.kernels)!r}")
        if self.jobs < 1:
            raise ValueError(f"--jobs must be at least 1, got {self.jobs}")


def parse_args(argv: list[str] | None) -> CheckArgs:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                        help=f"comma-separated targets (default {','.join(DEFAULT_TARGETS)})")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiler processes (default: CPUs)")
    parser.add_argument("--failures-only", action="store_true", help="print only the configurations that fail")
    parser.add_argument("--kernels", default=",".join(KERNEL_GROUPS),
                        help=f"comma-separated kernel groups to check (default {','.join(KERNEL_GROUPS)})")
    parser.add_argument("--sample", action="store_true",
                        help="compile only the largest configuration of each kernel and pointer dtypes per target "
                             "family (about a thirteenth; CI runs it)")
    ns = parser.parse_args(argv)
    targets = tuple(dict.fromkeys(t.strip() for t in ns.targets.split(",") if t.strip()))
    if not targets:
        raise ValueError("--targets is empty; name at least one, e.g. --targets sm80,gfx90a")
    kernels = tuple(dict.fromkeys(k.strip() for k in ns.kernels.split(",") if k.strip()))
    return CheckArgs(targets, ns.jobs, ns.failures_only, kernels, ns.sample)


def format_result(r: Result) -> str:
    status = "ok  " if r.ok else "FAIL"
    why = "" if r.ok else f" -- {'; '.join(p for p in r.problems if p != 'compile')}"
    return (f"{status} {r.target:8s} {r.launch.summary} | {r.detail}{why} | {r.seconds:.1f} s | {r.launch.calls} "
            f"calls, e.g. {r.launch.first_call}")


def run(args: CheckArgs) -> int:
    start = time.perf_counter()
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    with ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        captured = list(pool.map(_capture_job, [(t, 1000 + i, args.kernels) for i, t in enumerate(args.targets)]))
        tasks = _tasks(args.targets, [launches for launches, _ in captured])
        if args.sample:
            every = len(tasks)
            tasks = sampled(tasks)
            print(f"--sample: {len(tasks)} of {every} compile tasks", flush=True)
        print(f"{sum(map(len, tasks))} configurations on {len(args.targets)} targets, {len(tasks)} compile tasks, "
              f"{args.jobs} processes", flush=True)
        results = [r for _, r in sorted((x for done in pool.map(_check_task, tasks) for x in done),
                                        key=lambda x: x[0])]
    failed = [r for r in results if not r.ok]
    for r in results:
        if r.ok and args.failures_only:
            continue
        print(format_result(r))
    for target, (_, fallbacks) in zip(args.targets, captured):
        print(f"{target}: {sum(r.target == target for r in results)} configurations, "
              f"{sum(r.target == target for r in failed)} failed, {len(fallbacks)} calls take the BLAS or "
              f"reference fallback" + (f" (e.g. {fallbacks[0]})" if fallbacks else ""))
    print(f"{len(results)} configurations on {len(args.targets)} targets, {len(failed)} failed, "
          f"{time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except ValueError as e:
        print(f"check_targets: {e}", file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("check_targets: Triton is not installed; pip install triton (no torch needed: --no-deps)",
              file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    # Run the package's copy of this module, so the classes it defines are the ones every other module imports.
    from redline.scripts.check_targets import main as package_main

    sys.exit(package_main())
