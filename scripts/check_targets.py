"""Cross-compile every Triton kernel configuration the dispatcher can choose, for GPUs this machine does not have.

    PYTHONPATH=$PWD python scripts/check_targets.py [--targets sm80,gfx90a,...] [--jobs N] [--failures-only]

For each target (kernels.device.TARGETS: sm80, sm86, sm89, sm90, gfx90a, gfx942, gfx1100 by default) the
project's own launchers run on meta tensors under that target's capability description
(kernels.device.simulated(target_caps(name))) and a Triton driver that reports the target's GPU: every op, dtype
(bf16, fp16, fp32; int8 and int4 weights, int4 in group sizes 32-256), row count 1-256, decode batch, cache length and prompt length up to 2048, for the
shapes of the demo model (SmolLM2-135M), Llama-2-7B, Llama-3-8B and Llama-3-70B. A Triton JIT hook records each
launch instead of compiling it (nothing runs); identical configurations are kept once. Each one is then compiled
for the target (Triton's own compiler: ptxas for NVIDIA, the LLVM AMDGPU backend for AMD) and its shared memory
(LDS on AMD) and registers are checked against the target's limits, and its shared memory against the dispatcher's
estimate (which is what keeps configurations within the limit at run time).

Prints one line per kernel configuration and target, and exits 1 if any fails (2 on bad arguments).
Compiled kernels land in Triton's cache (TRITON_CACHE_DIR), so a second run is fast.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import json
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

from kernels import configs
from kernels.device import DEFAULT_TARGETS, DeviceCaps, simulated, target_caps

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
MAX_ROWS = 256  # the most rows of x the linear ops hand to Triton (kernels.linear.SMALL_M)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CACHE_LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
MAX_PROMPT = 2048
# Fused batch-1 decode GEMVs (kernels.fused_decode): (projection, norm: 0 none / 1 computed / 2 handed on, swiglu,
# residual with a sum of squares out).
FUSED_GEMVS = (("wqkv", 1, False, False), ("wqkv", 2, False, False), ("wo", 0, False, True),
               ("w13", 2, True, False), ("w2", 0, False, True), ("output", 2, False, False))
NORM_SUM_LANES = 32
INT4_GROUP_SIZES = (32, 64, 128, 256)  # the int4 group sizes quantize.py offers


@dataclass
class Launch:
    """One kernel configuration the dispatcher chose, with the calls that chose it."""

    kernel: str  # module path of the JIT function, "kernels.triton_linear._gemv_kernel"
    spec: str  # Triton's specialization data (JSON): signature, constexprs, options
    summary: str  # the constexprs and launch options that tell configurations apart
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


# Constexprs that only index (head counts, the combine kernel's split vector): configurations that differ in
# nothing else compile to the same tiles, shared memory and registers, so one of them is compiled.
SHAPE_ONLY_CONSTEXPRS = {"N_KV_HEADS", "GROUP", "N_HEADS", "SPLITS_P2"}


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
    """The kernel, its pointer dtypes, the constexprs that shape its code, and its launch options."""
    constants = {jit.arg_names[path[0]]: value for path, value in compile["constants"].items() if len(path) == 1}
    dtypes = ",".join(str(t)[1:] for t in compile["signature"].values() if str(t).startswith("*"))
    shown = " ".join(f"{k}={v}" for k, v in constants.items() if k.isupper() and k not in SHAPE_ONLY_CONSTEXPRS)
    pdl = " pdl" if json.loads(compile["specialization_data"])["options"].get("launch_pdl") else ""
    return f"{jit.fn.__name__}({dtypes}) {shown} warps={compile['num_warps']} stages={compile['num_stages']}{pdl}"


# --- what the dispatcher chooses ---


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, device="meta", dtype=dtype)


def _linear_calls(record: _Recorder, caps: DeviceCaps, models: tuple[ModelShape, ...]) -> list[str]:
    """Every linear op row count and dtype on every model shape; returns the calls that fell back to BLAS."""
    from kernels import triton_linear

    fallbacks = []
    weights = [(dt, dt) for dt in FLOAT_DTYPES] + [(dt, torch.int8) for dt in FLOAT_DTYPES]
    for model, (x_dtype, w_dtype) in itertools.product(models, weights):
        for proj, (n, k) in model.projections().items():
            w = _meta(n, k, dtype=w_dtype)
            scales = _meta(n, dtype=x_dtype) if w_dtype == torch.int8 else None
            record.call = f"{model.name} {proj} {str(x_dtype)[6:]}x{str(w_dtype)[6:]} rows=1"
            triton_linear.gemv(_meta(1, k, dtype=x_dtype), w, scales)
            tried = set()
            for m in range(2, MAX_ROWS + 1):
                record.call = f"{model.name} {proj} {str(x_dtype)[6:]}x{str(w_dtype)[6:]} rows={m}"
                cfg = configs.fitted_dot_config(n, k, w.element_size(), x_dtype.itemsize, m, caps)
                if cfg is None:
                    fallbacks.append(record.call)
                elif (cfg, configs.dot_block_m(cfg, m)) not in tried:
                    # (row counts with the same config and tile height launch the same kernel)
                    tried.add((cfg, configs.dot_block_m(cfg, m)))
                    triton_linear.small_m_dot(_meta(m, k, dtype=x_dtype), w, scales)
            _fused_gemv_calls(record, model, proj, x_dtype, w_dtype)
    return fallbacks + _int4_dot_calls(record, caps, models)


def _int4_dot_calls(record: _Recorder, caps: DeviceCaps, models: tuple[ModelShape, ...]) -> list[str]:
    """The int4 tensor-core kernel for 2-256 rows, every dtype and group size; returns the calls that fall back to
    dequantizing for BLAS."""
    from kernels import triton_int4_dot

    fallbacks = []
    for model, x_dtype, group_size in itertools.product(models, FLOAT_DTYPES, INT4_GROUP_SIZES):
        for proj, (n, k) in model.projections().items():
            if k % group_size:
                continue
            w = _meta(n, k // 2, dtype=torch.uint8)
            scales = _meta(n, k // group_size, 2, dtype=torch.float16)
            tried = set()
            for m in range(2, MAX_ROWS + 1):
                record.call = f"{model.name} {proj} {str(x_dtype)[6:]}xint4-g{group_size} rows={m}"
                cfg = configs.fitted_int4_dot_config(n, k, group_size, x_dtype.itemsize, m, caps)
                if cfg is None:
                    fallbacks.append(record.call)
                elif (cfg, configs.dot_block_m(cfg, m)) not in tried:
                    tried.add((cfg, configs.dot_block_m(cfg, m)))
                    triton_int4_dot.int4_dot(_meta(m, k, dtype=x_dtype), w, scales)
    return fallbacks


def _fused_gemv_calls(record: _Recorder, model: ModelShape, proj: str, x_dtype, w_dtype) -> None:
    from kernels import triton_linear

    n, k = model.projections()[proj]
    for name, norm, swiglu, residual in FUSED_GEMVS:
        if name != proj:
            continue
        record.call = f"{model.name} fused {proj} norm={norm} {str(x_dtype)[6:]}x{str(w_dtype)[6:]}"
        lanes = _meta(NORM_SUM_LANES, dtype=torch.float32)
        triton_linear.gemv(
            _meta(1, k, dtype=x_dtype), _meta(n, k, dtype=w_dtype),
            _meta(n, dtype=x_dtype) if w_dtype == torch.int8 else None,
            norm_weight=_meta(k, dtype=x_dtype) if norm else None, eps=1e-5,
            residual=_meta(n, dtype=x_dtype) if residual else None, swiglu=swiglu,
            sq_in=lanes if norm == 2 else None, sq_out=lanes if residual else None)


def _attention_calls(record: _Recorder, caps: DeviceCaps, models: tuple[ModelShape, ...]) -> list[str]:
    """Decode attention (rotated q, and the fused qkv form) and the prefill rope kernel on every model shape."""
    from kernels import attention, triton_attention

    fallbacks = []
    for model, dtype in itertools.product(models, FLOAT_DTYPES):
        h, hkv, d = model.n_heads, model.n_kv_heads, model.head_dim
        rope = _meta(max(CACHE_LENGTHS), 2, d // 2, dtype=torch.float32)
        for batch, seq_len in itertools.product(DECODE_BATCHES, CACHE_LENGTHS):
            record.call = f"{model.name} attention {str(dtype)[6:]} batch={batch} cache={seq_len}"
            cache = _meta(batch, hkv, seq_len, d, dtype=dtype)
            if attention.attention_kernel_config(batch, h, cache) is None:
                fallbacks.append(record.call)
                continue
            pos = _meta(1, dtype=torch.int64)
            triton_attention.decode_attention(_meta(batch, h, 1, d, dtype=dtype), cache, cache, pos)
            triton_attention.decode_attention_qkv(_meta(batch, 1, (h + 2 * hkv) * d, dtype=dtype), cache, cache,
                                                  rope, pos)
        for length in sorted({2 ** i for i in range(12)} | {2 ** i + 1 for i in range(11)} | {MAX_PROMPT}):
            record.call = f"{model.name} prefill rope {str(dtype)[6:]} tokens={length}"
            cache = _meta(1, hkv, MAX_PROMPT, d, dtype=dtype)
            triton_attention.prefill_rope_cache(_meta(1, length, (h + 2 * hkv) * d, dtype=dtype), cache, cache,
                                                rope[:length])
    return fallbacks


def target_launches(name: str, device_index: int = 1000,
                    models: tuple[ModelShape, ...] = MODELS) -> tuple[list[Launch], list[str]]:
    """The distinct kernel configurations the dispatcher chooses on target `name` for these models, and the calls
    that take a fallback (cuBLAS/hipBLAS or the reference attention) because no configuration fits."""
    from triton import knobs

    caps = target_caps(name)
    record = _Recorder()
    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = record
    try:
        with active_driver(target_driver(caps, device_index)), simulated(caps):
            fallbacks = _linear_calls(record, caps, models) + _attention_calls(record, caps, models)
    finally:
        knobs.runtime.jit_cache_hook = previous
    return list(record.launches.values()), fallbacks


# --- compiling one configuration and reading its resources ---


def _nvidia_registers(cubin: bytes, arch: int) -> tuple[int, int]:
    """(registers per thread, local memory bytes per thread: spills and stack) of a cubin, from the cuobjdump
    that Triton ships beside its ptxas."""
    from triton.backends.nvidia.compiler import get_ptxas

    tool = os.path.join(os.path.dirname(get_ptxas(arch).path), "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", text)
    local = re.search(r"LOCAL:(\d+)", text)
    return int(regs.group(1)) if regs else -1, int(local.group(1)) if local else 0


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
    args = importlib.import_module(launch.kernel.rsplit(".", 1)[0])
    names = getattr(args, kernel).arg_names
    named = {names[k[0]]: v for k, v in constants.items() if len(k) == 1}
    signature = spec["signature"]
    if kernel == "_small_m_dot_kernel":
        x_bytes = _pointer_bytes(signature["x_ptr"])
        w_bytes = _pointer_bytes(signature["w_ptr"])
        return configs.dot_smem_bytes(named["BLOCK_M"], named["BLOCK_N"], named["BLOCK_K"], options["num_stages"],
                                      x_bytes, w_bytes, caps)
    if kernel == "_int4_dot_kernel":
        return configs.int4_dot_smem_bytes(named["BLOCK_M"], named["BLOCK_N"], named["BLOCK_K"], options["num_stages"],
                                           _pointer_bytes(signature["x_ptr"]), named["G"], named["SWAP"], caps)
    if kernel == "_split_kernel":
        return configs.attention_smem_bytes(named["BLOCK_G"], named["BLOCK_S"], named["HEAD_DIM"],
                                            _pointer_bytes(signature["k_ptr"]), options["num_stages"], caps)
    return None


def _pointer_bytes(pointer_type: str) -> int:
    bits = int(re.search(r"(\d+)$", pointer_type).group(1))
    return bits // 8


def check_launch(target: str, launch: Launch, device_index: int) -> Result:
    """Compile one configuration for its target and check it against the target's limits."""
    caps = target_caps(target)
    module, kernel = launch.kernel.rsplit(".", 1)
    jit = getattr(importlib.import_module(module), kernel)
    start = time.perf_counter()
    try:
        with active_driver(target_driver(caps, device_index)):
            compiled = jit.preload(launch.spec)
    except Exception as e:  # a compile error is this configuration's result, reported on its line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return Result(target, launch, False, f"compile error: {type(e).__name__}: {first[:200]}",
                      seconds=time.perf_counter() - start, problems=["compile"])
    seconds = time.perf_counter() - start
    shared = compiled.metadata.shared
    problems = []
    if shared > caps.shared_memory_per_block:
        problems.append(f"shared {shared} B > {caps.shared_memory_per_block} B")
    estimate = _estimate(launch, caps)
    if estimate is not None and shared > estimate:
        problems.append(f"shared {shared} B above the dispatcher's estimate {estimate} B")
    threads = compiled.metadata.num_warps * caps.warp_size
    if caps.vendor == "nvidia":
        regs, spill = _nvidia_registers(compiled.asm["cubin"], int(caps.arch[2:]))
        if regs > NVIDIA_REGISTERS_PER_THREAD or regs * threads > NVIDIA_REGISTERS_PER_BLOCK:
            problems.append(f"{regs} registers x {threads} threads over the register file")
        detail = f"shared {shared} B, {regs} regs/thread, local {spill} B"
    else:
        regs, spill = _amd_registers(compiled.asm["amdgcn"])
        if regs > AMD_VGPRS_PER_LANE.get(caps.arch, 256):
            problems.append(f"{regs} VGPRs over {AMD_VGPRS_PER_LANE.get(caps.arch, 256)}")
        detail = f"LDS {shared} B, {regs} VGPRs, {spill} spilled"
    return Result(target, launch, not problems, detail, shared, seconds, problems)


def _check_job(job: tuple[str, Launch, int]) -> Result:
    return check_launch(*job)


# --- the command line ---


@dataclass(frozen=True)
class CheckArgs:
    """Validated command-line arguments."""

    targets: tuple[str, ...]
    jobs: int
    failures_only: bool

    def __post_init__(self) -> None:
        for name in self.targets:
            target_caps(name)  # raises ValueError naming the known targets
        if self.jobs < 1:
            raise ValueError(f"--jobs must be at least 1, got {self.jobs}")


def parse_args(argv: list[str] | None) -> CheckArgs:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                        help=f"comma-separated targets (default {','.join(DEFAULT_TARGETS)})")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiler processes (default: CPUs)")
    parser.add_argument("--failures-only", action="store_true", help="print only the configurations that fail")
    ns = parser.parse_args(argv)
    targets = tuple(t.strip() for t in ns.targets.split(",") if t.strip())
    if not targets:
        raise ValueError("--targets is empty; name at least one, e.g. --targets sm80,gfx90a")
    return CheckArgs(targets, ns.jobs, ns.failures_only)


def format_result(r: Result) -> str:
    status = "ok  " if r.ok else "FAIL"
    why = "" if r.ok else f" -- {'; '.join(p for p in r.problems if p != 'compile')}"
    return (f"{status} {r.target:8s} {r.launch.summary} | {r.detail}{why} | {r.seconds:.1f} s | {r.launch.calls} "
            f"calls, e.g. {r.launch.first_call}")


def run(args: CheckArgs) -> int:
    start = time.perf_counter()
    jobs, fallbacks = [], {}
    for index, target in enumerate(args.targets):
        launches, fallbacks[target] = target_launches(target, 1000 + index)
        jobs += [(target, launch, 1000 + index) for launch in launches]
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    with ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        results = list(pool.map(_check_job, jobs))
    failed = [r for r in results if not r.ok]
    for r in results:
        if r.ok and args.failures_only:
            continue
        print(format_result(r))
    for target in args.targets:
        print(f"{target}: {sum(r.target == target for r in results)} configurations, "
              f"{sum(r.target == target for r in failed)} failed, {len(fallbacks[target])} calls take the BLAS or "
              f"reference fallback" + (f" (e.g. {fallbacks[target][0]})" if fallbacks[target] else ""))
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
    sys.exit(main())
