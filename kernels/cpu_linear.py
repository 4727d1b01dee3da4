"""The CPU side of Redline's linears: cpu_gemv.cpp's ops (torch.ops.redline_cpu.*), their build, threads and
instruction-set controls, and the CPU branch of redline::int8_linear / int4_linear / exact_head_linear.

cpu_gemv.cpp reads the checkpoint's own int8 / packed int4 weight (or an fp32 one, or the fp16 form of an fp32 weight
whose values fp16 holds exactly: exact_half, CpuHalfLinear, HalfHead) once per block of up to 4 rows of x: int8 and
int4 codes multiply x's int16 codes per block of 32 inputs in exact integer sums scaled in fp32 (each input rounded
by at most half a code step, 1/65534 of its block's largest |x|), an fp32 or fp16 weight accumulates in fp32 (the
reference's arithmetic, to fp32 rounding); its layout is quantize.py's, so nothing is repacked. One row
(decode) is a matrix-vector product, a prompt a blocked matrix product. Its loops (cpu_gemv_simd.h) are compiled
for AVX-512, AVX2 and portable C++ and picked at run time (simd, detected_simd, forced_simd). It runs on its own
thread pool (use_threads says why). A float output head whose table is exactly int8 codes times fp16 scales per 32
inputs (GGUF's Q8_0), or int8 codes times fp32 scales per 16 (GGUF's Q6_K), runs on that int8 form
(exact_int8_groups, exact_int8_groups16, redline_cpu::int8_group_linear). A decode step's
attention runs there too, over only the cache positions it reads: redline_cpu::decode_attention
(attention.CpuAttention, generate's own cache) and paged_decode_attention (the batching engine's fp32 pages,
through PagedKVCache.ops: paged_ops).

Why not torch's kernels: `aten._weight_int8pack_mm` and `aten._weight_int4pack_mm_for_cpu` (torch 2.6-2.13) are
fast only in bf16 (their fp32 paths are scalar loops, 6-30x slower than an fp32 F.linear on this AVX-512 machine),
and their bf16 rounding of x, of the scales and of the result (about 0.3% relative) made the demo model's greedy
text leave its float32 text after 28 tokens on 2 of 4 prompts.

cpu_gemv.cpp is compiled once per machine on first use with torch's C++ extension builder (a C++ compiler and ninja
are needed; the build lands in torch's extension cache, ~/.cache/torch_extensions) and loaded as torch ops
(torch.ops.redline_cpu.*). A failed build raises a one-line error; there is no slow fallback.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

SOURCE = Path(__file__).with_name("cpu_gemv.cpp")
# The loops, included by SOURCE once per instruction set.
SIMD_SOURCE = Path(__file__).with_name("cpu_gemv_simd.h")
EXTENSION_NAME = "redline_cpu_gemv"
# No -march=native: the AVX2 and AVX-512 loops carry their own target pragmas and are picked at run time, so one
# build runs on any x86-64 CPU (and a cache shared between machines holds no instruction a CPU lacks).
CFLAGS = ["-O3", "-std=c++17", "-fopenmp"]
# Instruction sets of redline_cpu::simd(), by level.
SIMD_LEVELS = ("portable", "avx2", "avx512", "neon")
# The builds this process has loaded, by name.
LOADED: set[str] = set()


@functools.cache
def cpu_ops() -> None:
    """Build (once per machine) and load cpu_gemv.cpp, which registers torch.ops.redline_cpu.int8_linear,
    int4_linear, int8_group_linear, decode_attention, paged_decode_attention and the instruction-set controls."""
    from torch.utils.cpp_extension import load

    try:
        # The sources' hash names the build: two checkouts of different versions on one machine share torch's
        # extension cache without rebuilding over each other.
        digest = hashlib.sha256(SOURCE.read_bytes() + SIMD_SOURCE.read_bytes()).hexdigest()[:12]
        name = f"{EXTENSION_NAME}_{digest}"
        if name in LOADED:  # loaded already (a second load would register the ops twice)
            return
        # Resolved paths: the package imported through a link and through its real path builds one library.
        source = SOURCE.resolve()
        load(name=name, sources=[str(source)], extra_cflags=CFLAGS, extra_include_paths=[str(source.parent)],
             is_python_module=False, verbose=bool(os.environ.get("REDLINE_VERBOSE_BUILD")))
        LOADED.add(name)
    except (RuntimeError, OSError, ImportError) as exc:
        last = str(exc).strip().splitlines()[-1:] or [type(exc).__name__]
        raise RuntimeError(f"could not build Redline's CPU int8/int4 kernel ({SOURCE.name}): {last[0]}; install a "
                           f"C++ compiler and ninja (or REDLINE_VERBOSE_BUILD=1 to see the build)") from None


def simd() -> str:
    """The instruction set the CPU kernels run now: "avx512", "avx2", "neon" or "portable"."""
    cpu_ops()
    return SIMD_LEVELS[torch.ops.redline_cpu.simd()]


def detected_simd() -> str:
    """The best instruction set of this CPU that the kernels have a path for."""
    cpu_ops()
    return SIMD_LEVELS[torch.ops.redline_cpu.detected_simd()]


def available_simd() -> list[str]:
    """The instruction sets this CPU runs the kernels on: the portable one, and the detected one with (on x86) every
    lower one."""
    cpu_ops()
    return [name for level, name in enumerate(SIMD_LEVELS) if torch.ops.redline_cpu.simd_available(level)]


@contextlib.contextmanager
def forced_simd(name: str) -> Iterator[None]:
    """Run the CPU kernels on instruction set `name` (one of available_simd()) inside the block: the tests compare
    every path with the references this way. Process-wide, not per thread."""
    if name not in SIMD_LEVELS:
        raise ValueError(f"unknown instruction set {name!r}; choose from {', '.join(SIMD_LEVELS)}")
    if name not in available_simd():
        raise ValueError(f"this CPU lacks {name} (it runs {', '.join(available_simd())})")
    previous = torch.ops.redline_cpu.force_simd(SIMD_LEVELS.index(name))
    try:
        yield
    finally:
        torch.ops.redline_cpu.force_simd(previous)


def use_threads(count: int) -> None:
    """Run the CPU kernels on `count` threads (their own pool: the caller and count - 1 helpers) and torch's own
    ops on one (torch.set_num_threads(1)), process-wide.

    Why one torch thread: torch's OpenMP ops (attention, elementwise, F.linear) end each parallel region when every
    thread has finished its fixed share, so on cores that other processes also use each region waits for a thread
    the OS has parked. Measured on the 2-core machine with other jobs on it (load average 13-16): the demo model's
    Q4_1 decode ran at 0.7-0.8 tok/s with 2 torch threads and 7.0-9.5 tok/s with 1 torch thread and the kernels on
    2 threads; float32 0.6 and 2.1-2.3. A decode step's other ops are small, so one thread costs them little."""
    cpu_ops()
    torch.ops.redline_cpu.set_threads(count)
    torch.set_num_threads(1)


def kernel_threads() -> int:
    """The CPU kernels' thread count (use_threads; before it, torch's intra-op thread count)."""
    cpu_ops()
    return torch.ops.redline_cpu.threads()


def x_codes_error_bound(x: Tensor, weight: Tensor) -> Tensor:
    """The most that the int8 and int4 kernels' rounding of x to int16 codes moves x @ weight.T, (..., N): half a code
    step (the block's largest |x| / 65534) per input, times |w|, summed. weight (N, K): the dequantized weight. Zero
    where the kernel keeps x in fp32 (K not a multiple of 32); fp32 summation adds its own rounding beside this."""
    k = x.shape[-1]
    if k % 32:
        return torch.zeros(*x.shape[:-1], weight.shape[0], dtype=torch.float64)
    blocks = x.double().reshape(*x.shape[:-1], k // 32, 32)
    half_steps = (blocks.abs().amax(-1, keepdim=True) / 65534).expand_as(blocks).reshape(x.shape)  # (..., K)
    return half_steps @ weight.double().abs().T


def int8_linear_cpu(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """(x @ weight.T) * scales on the CPU in x.dtype, fp32 accumulation; x (..., K), weight int8 (N, K), scales (N,)."""
    cpu_ops()
    return torch.ops.redline_cpu.int8_linear(x, weight.contiguous(), scales.float().contiguous())


def int4_linear_cpu(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """x @ dequantize_int4(weight, scales).T on the CPU in x.dtype, fp32 accumulation; weight uint8 (N, K/2), scales
    fp16 (N, K/G, 2)."""
    cpu_ops()
    return torch.ops.redline_cpu.int4_linear(x, weight.contiguous(), scales.contiguous())


def paged_decode_attention_cpu(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                               scale: float, window: int = 0) -> Tensor:
    """model.paged_decode_attention for fp32 pages on the CPU kernels: each row's keys read from its pages, none past
    its length; q (B, H, D) -> (B, H, D). A PagedKVCache's decode op (paged_ops); cpu_ops() must have run (this is
    called inside compiled steps)."""
    return torch.ops.redline_cpu.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, window)


def paged_ops(prefill: Any, pages_dtype: torch.dtype) -> tuple[Any, Any] | None:
    """A CPU engine's PagedKVCache.ops: its prefill op (None: model.py's reference) and, for fp32 pages, the C++
    decode attention (else the reference); None when neither is set."""
    if pages_dtype != torch.float32:
        return None if prefill is None else (prefill, None)
    cpu_ops()
    return prefill, paged_decode_attention_cpu


# The group of an exact int8 form of a float output head: GGUF's Q8_0 block (32 codes under one fp16 scale).
HEAD_GROUP = 32
# Rows of the head checked at a time (bounds the temporaries to a few MB per row block).
HEAD_CHECK_ROWS = 4096
# A float head's exact int8 form in groups of 16 (exact_int8_groups16): the largest |code| a group's scale is searched
# for (GGUF's Q6_K codes lie in -32..31), and the rows checked first, alone.
GROUP16_MAX_CODE = 32
GROUP16_PROBE_ROWS = 64


def exact_int8_groups(weight: Tensor, group: int = HEAD_GROUP) -> tuple[Tensor, Tensor] | None:
    """weight (N, K) as int8 codes (N, K) and fp16 scales (N, K/group) with codes * scale == weight exactly for
    every element (in fp32), or None when the weight has no such form. A table dequantized from GGUF's Q8_0 (the
    demo model's embedding) has one; a trained float table does not, and stays as it is."""
    n, k = weight.shape
    if k % group or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    codes = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, k // group, dtype=torch.float16)
    for r0 in range(0, n, HEAD_CHECK_ROWS):
        w = weight[r0:r0 + HEAD_CHECK_ROWS].view(-1, k // group, group)  # (R, K/G, G)
        scale = (w.abs().amax(dim=-1) / 127).to(torch.float16)  # (R, K/G)
        s = scale.float().unsqueeze(-1)
        q = torch.where(s > 0, torch.round(w / s.clamp(min=torch.finfo(torch.float32).tiny)), 0.0).clamp(-127, 127)
        if not torch.equal(q * s, w):
            return None
        codes[r0:r0 + HEAD_CHECK_ROWS] = q.view(-1, k).to(torch.int8)
        scales[r0:r0 + HEAD_CHECK_ROWS] = scale
    return codes, scales


def exact_int8_groups16(weight: Tensor) -> tuple[Tensor, Tensor] | None:
    """weight (N, K) as int8 codes (N, K) and fp32 scales (N, K/16) with codes * scale == weight exactly for every
    element, or None when the weight has no such form. A table dequantized from GGUF's Q6_K (d * scale_j * (q - 32),
    q a 6-bit code, in groups of 16) has one, at a third of the fp32 bytes. Each group's scale is its largest |value|
    over its largest |code|, which is tried from GROUP16_MAX_CODE down; the first rows are checked alone first, so a
    trained float table is turned down at once."""
    n, k = weight.shape
    if k % 16 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    if group16_form(weight[:GROUP16_PROBE_ROWS]) is None:
        return None
    codes = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, k // 16, dtype=torch.float32)
    for r0 in range(0, n, HEAD_CHECK_ROWS):
        form = group16_form(weight[r0:r0 + HEAD_CHECK_ROWS])
        if form is None:
            return None
        codes[r0:r0 + HEAD_CHECK_ROWS], scales[r0:r0 + HEAD_CHECK_ROWS] = form
    return codes, scales


def group16_form(w: Tensor) -> tuple[Tensor, Tensor] | None:
    """(codes int8 (R, K), scales fp32 (R, K/16)) of rows w (R, K) fp32 per group of 16 inputs, exact, or None."""
    groups = w.reshape(-1, 16)  # (G, 16)
    amax = groups.abs().amax(dim=-1)  # (G,)
    # The first candidate over every group at once (most groups hold a code of the largest magnitude), the others
    # over the groups left.
    scales, codes, exact = scaled_codes(groups, amax, GROUP16_MAX_CODE)  # (G,), (G, 16), (G,)
    todo = torch.nonzero(~exact).squeeze(1)  # (T,) groups without a form yet
    for top in range(GROUP16_MAX_CODE - 1, 0, -1):
        if todo.numel() == 0:
            break
        scale, q, exact = scaled_codes(groups[todo], amax[todo], top)  # (T,), (T, 16), (T,)
        done = todo[exact]
        scales[done], codes[done] = scale[exact], q[exact]
        todo = todo[~exact]
    if todo.numel():
        return None
    return codes.view(w.shape).to(torch.int8), scales.view(w.shape[0], -1)


def scaled_codes(groups: Tensor, amax: Tensor, top: int) -> tuple[Tensor, Tensor, Tensor]:
    """(scales (G,), codes (G, 16), exact (G,)) of groups (G, 16) with largest |values| amax (G,): each group's scale
    amax / top, its values rounded to codes of that scale (|code| <= top), and whether codes * scale gives every value
    back exactly (an all-zero group: scale 0, codes 0, exact)."""
    scales = amax / top
    codes = torch.round(groups / torch.where(scales > 0, scales, 1.0)[:, None])
    return scales, codes, (codes * scales[:, None] == groups).all(dim=-1)


def exact_half(weight: Tensor) -> Tensor | None:
    """weight (N, K) fp32 as fp16 when every element converts exactly (a table read from an F16 GGUF file or an fp16
    checkpoint), else None. redline_cpu::float_linear on the fp16 form gives the fp32 weight's bits from half the
    bytes: the conversion back is exact and the products and sums are the same, in the same order."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    half = torch.empty(weight.shape, dtype=torch.float16)
    for r0 in range(0, weight.shape[0], HEAD_CHECK_ROWS):
        rows = weight[r0:r0 + HEAD_CHECK_ROWS]
        half[r0:r0 + HEAD_CHECK_ROWS] = rows
        if not torch.equal(half[r0:r0 + HEAD_CHECK_ROWS].float(), rows):
            return None
    return half


# The float modules of kernels.linear.use_cpu_kernels, on redline_cpu::float_linear straight from the model (no
# Python op wrapper between: a 135M model's decode step makes some 200 of these calls).


class CpuLinear(nn.Linear):
    """An fp32 nn.Linear (no bias) on redline_cpu::float_linear: the kernels' own threads and loops (cpu_gemv.cpp)."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.redline_cpu.float_linear(x, self.weight)


class CpuHalfLinear(nn.Linear):
    """An fp32 nn.Linear (no bias) whose weight fp16 holds exactly (exact_half), stored as that fp16 form
    and run on redline_cpu::float_linear: the fp32 products and sums of CpuLinear from half the bytes. Not a tied
    head (the embedding needs its fp32 table: HalfHead)."""

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type != "cpu":
            return F.linear(x, self.weight.to(x.dtype))
        return torch.ops.redline_cpu.float_linear(x, self.weight)


class HalfHead(nn.Linear):
    """A float output head tied to the embedding whose fp32 table fp16 holds exactly (an F16 GGUF file's table):
    decode reads the fp16 form (a plain attribute, not a buffer: the state dict, the checkpoint and the tying stay as
    they were) with fp32 arithmetic, the same bits as the fp32 table's."""

    half_weight: Tensor  # fp16 (N, K)

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type != "cpu":
            return F.linear(x, self.weight)
        return torch.ops.redline_cpu.float_linear(x, self.half_weight)

    def read_bytes(self) -> int:
        """Bytes one decode step reads for this head (its fp16 form), in place of the fp32 table's."""
        return self.half_weight.numel() * self.half_weight.element_size()


def router_linears(model: nn.Module) -> set[int]:
    """ids of the mixtures' routers (their gate), which stay fp32 modules: the experts take their dtype."""
    return {id(module.gate) for module in model.modules()
            if isinstance(getattr(module, "gate", None), nn.Linear) and hasattr(module, "n_experts")}


def exact_head_linear_cpu(x: Tensor, weight: Tensor, codes: Tensor, scales: Tensor) -> Tensor:
    """F.linear(x, weight) for a weight that equals codes * scales exactly (exact_int8_groups, exact_int8_groups16),
    read in its int8 form (a quarter to a third of the fp32 bytes) on the CPU; F.linear elsewhere (a model moved to a
    GPU)."""
    if x.device.type != "cpu":
        return F.linear(x, weight)
    cpu_ops()
    return torch.ops.redline_cpu.int8_group_linear(x, codes, scales)
