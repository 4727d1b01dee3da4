"""The CPU side of redline::int8_linear and redline::int4_linear.

Up to GEMV_ROWS rows of x (decode, speculative verify steps) run cpu_gemv.cpp: a matrix-vector kernel that reads
the checkpoint's own int8 / packed int4 weight once and turns each byte into fp32 in registers, with fp32
accumulation (the references' arithmetic, to fp32 rounding). Its layout is quantize.py's, so nothing is repacked.
More rows (prefills) are a matrix product: the references' own dequantize-then-F.linear, whose cost is spread over
the rows. A float output head whose table is exactly int8 codes times fp16 scales per 32 inputs (GGUF's Q8_0) runs
the same way on that int8 form (exact_int8_groups, exact_head_linear_cpu).

Why not torch's kernels: `aten._weight_int8pack_mm` and `aten._weight_int4pack_mm_for_cpu` (torch 2.6-2.13) are
fast only in bf16 (their fp32 paths are scalar loops, 6-30x slower than an fp32 F.linear on this AVX-512 machine),
and their bf16 rounding of x, of the scales and of the result (about 0.3% relative) made the demo model's greedy
text leave its float32 text after 28 tokens on 2 of 4 prompts.

cpu_gemv.cpp is compiled once per machine on first use with torch's C++ extension builder (a C++ compiler and ninja
are needed; the build lands in torch's extension cache, ~/.cache/torch_extensions) and loaded as torch ops
(torch.ops.redline_cpu.*). A failed build raises a one-line error; there is no slow fallback.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from redline.quantize import dequantize_int4

# Rows of x up to which the GEMV kernel runs (it reads the weight once and runs each row against it; more rows are
# a matrix product, where BLAS on the dequantized weight is faster).
GEMV_ROWS = 8
SOURCE = Path(__file__).with_name("cpu_gemv.cpp")
EXTENSION_NAME = "redline_cpu_gemv"
# -march=native: the build is for the machine that compiles it (the cache is per machine).
CFLAGS = ["-O3", "-march=native", "-std=c++17", "-fopenmp"]


@functools.cache
def cpu_ops() -> None:
    """Build (once per machine) and load cpu_gemv.cpp, which registers torch.ops.redline_cpu.int8_gemv / int4_gemv."""
    from torch.utils.cpp_extension import load

    try:
        load(name=EXTENSION_NAME, sources=[str(SOURCE)], extra_cflags=CFLAGS, is_python_module=False,
             verbose=bool(os.environ.get("REDLINE_VERBOSE_BUILD")))
    except (RuntimeError, OSError, ImportError) as exc:
        last = str(exc).strip().splitlines()[-1:] or [type(exc).__name__]
        raise RuntimeError(f"could not build Redline's CPU int8/int4 kernel ({SOURCE.name}): {last[0]}; install a "
                           f"C++ compiler and ninja (or REDLINE_VERBOSE_BUILD=1 to see the build)") from None


def int8_linear_cpu(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """(x @ weight.T) * scales on the CPU in x.dtype, fp32 accumulation; x (..., K), weight int8 (N, K), scales (N,)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)  # (M, K)
    if x2.shape[0] > GEMV_ROWS or x2.shape[0] == 0 or k == 0:
        out = F.linear(x2.float(), weight.float()) * scales.float()
    else:
        cpu_ops()
        out = torch.ops.redline_cpu.int8_gemv(x2.float().contiguous(), weight.contiguous(),
                                              scales.float().contiguous())  # (M, N)
    return out.to(x.dtype).view(*x.shape[:-1], n)


def int4_linear_cpu(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """x @ dequantize_int4(weight, scales).T on the CPU in x.dtype, fp32 accumulation; weight uint8 (N, K/2), scales
    fp16 (N, K/G, 2)."""
    n = weight.shape[0]
    x2 = x.reshape(-1, x.shape[-1])  # (M, K)
    if x2.shape[0] > GEMV_ROWS or x2.shape[0] == 0:
        out = F.linear(x2.float(), dequantize_int4(weight, scales))
    else:
        cpu_ops()
        out = torch.ops.redline_cpu.int4_gemv(x2.float().contiguous(), weight.contiguous(), scales.contiguous())
    return out.to(x.dtype).view(*x.shape[:-1], n)


# The group of an exact int8 form of a float output head: GGUF's Q8_0 block (32 codes under one fp16 scale).
HEAD_GROUP = 32
# Rows of the head checked at a time (bounds the temporaries to a few MB per row block).
HEAD_CHECK_ROWS = 4096


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


def exact_head_linear_cpu(x: Tensor, weight: Tensor, codes: Tensor, scales: Tensor) -> Tensor:
    """F.linear(x, weight) for a weight that equals codes * scales exactly (exact_int8_groups): up to GEMV_ROWS rows
    read the int8 form (a quarter of the fp32 bytes), more rows run F.linear on the float weight."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)  # (M, K)
    if x2.shape[0] > GEMV_ROWS or x2.shape[0] == 0 or x.device.type != "cpu":  # a model moved to a GPU: F.linear
        return F.linear(x2, weight).view(*x.shape[:-1], n)
    cpu_ops()
    out = torch.ops.redline_cpu.int8_group_gemv(x2.float().contiguous(), codes, scales)  # (M, N)
    return out.to(x.dtype).view(*x.shape[:-1], n)
