"""The linear ops (bf16/fp16/fp32, int8, and the fused decode projection) and the modules that call them.

    torch.ops.redline.linear(x, weight)               == F.linear(x, weight)
    torch.ops.redline.int8_linear(x, weight, scales)  == (x @ weight.T.float()) * scales, in x.dtype
    torch.ops.redline.int4_linear(x, weight, scales)  == x @ quantize.dequantize_int4(weight, scales).T, in x.dtype
    torch.ops.redline.fp8_linear(x, weight, scales)   == quantize.fp8_linear_reference(x, weight, scales)

On a CUDA/HIP device with few rows of x (decode, batches, short prompts; `triton_row_limit`), the ops
run the Triton kernels in triton_linear.py, which dequantize int8 weights in registers: one row (batch-1
decode) runs the matrix-vector kernel, which reads every weight byte once; more rows run the tensor-core
kernel. With more rows (long prompts) the work is a matrix product: cuBLAS does it (for int8 on the
weight dequantized in row blocks). int4: one row runs the int4 GEMV (triton_int4.py), 2..SMALL_M rows the int4
tensor-core kernel (triton_int4_dot.py, which dequantizes in registers too), more rows (or a GPU whose shared
memory fits no config) dequantize the weight in row blocks for cuBLAS. On the CPU the float op is F.linear and the
quantized ops run a C++ matrix-vector kernel on the int8 / packed int4 weights for few rows (cpu_linear.py).
fp8 (W8A8, e4m3 weights with per-channel or 128 x 128 block scales): one row runs the int8 GEMV's kernel on the FP8
bytes (the row itself unquantized); more rows are quantized per token (triton_fp8.quantize_rows) and multiplied on
the FP8 tensor cores: torch._scaled_mm (cuBLAS, row-wise scales) for per-channel weights and bf16 x on Hopper,
triton_fp8.fp8_dot otherwise. A GPU without FP8 is refused (device.fp8_refusal); the CPU runs the fp32 reference.

The ops are opaque to torch.compile (custom_op + register_fake), so `fullgraph=True` traces
through them and `mode="reduce-overhead"` captures their kernels in the model's CUDA graph.
Triton is imported lazily, on the first CUDA call: this module imports without Triton.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from redline.model import rms_norm
from redline.quantize import FP8_DTYPE, Fp8Linear, Int4Linear, Int8Linear, dequantize_int4, fp8_block_scales_shape
from redline.quantize import fp8_linear_reference as fp8_reference

from .cpu_linear import (CpuHalfLinear, CpuLinear, HalfHead, cpu_ops, exact_half, exact_head_linear_cpu,
                         exact_int8_groups, exact_int8_groups16, int4_linear_cpu, int8_linear_cpu, router_linears)
from .configs import DotConfig, Int4DotConfig, fitted_dot_config, fitted_int4_dot_config
from .device import device_caps, fp8_refusal, triton_importable

# Rows of x up to which the Triton kernels run (1 row: GEMV; 2..SMALL_M: the tensor-core kernel, in one
# tile of up to 64 rows, so each weight byte is read once, or in several); above it cuBLAS's matrix product
# does. On an H200 the 7B model decoded batches of 64-256 2.5-3.3x faster in bf16 this way than with cuBLAS,
# whose kernels ran several times slower inside the decode step than alone; for int8 the tensor-core kernel
# was 1.8-2.8x faster than dequantizing and calling cuBLAS at 256 rows, and about even at 2048.
SMALL_M = 256
# A float prompt (x (B, T, K) with T > 1 tokens) leaves the Triton kernels above this many rows: in a
# prefill cuBLAS shows no slowdown and is the faster one (7B bf16 time to first token at 128 / 256 tokens:
# 5.6-5.8 / 7.0-7.4 ms on cuBLAS, 6.8-6.9 / 9.0-9.1 ms on the tensor-core kernel; about even at 64).
PROMPT_SMALL_M = 64
# The int8 prefill path dequantizes the weight to x.dtype in row blocks of at most this many
# elements (128 MB in bf16), so a large matrix (an lm_head) never needs a full-size copy.
_DEQUANT_CHUNK_ELEMENTS = 1 << 26
# The activation dtypes the ops (and their Triton kernels) take.
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def triton_linear():
    """kernels.triton_linear, imported on first use (it imports triton)."""
    from . import triton_linear as module

    return module


@functools.cache
def triton_fp8():
    """kernels.triton_fp8, imported on first use (it imports triton)."""
    from . import triton_fp8 as module

    return module


@functools.cache
def triton_int4():
    """kernels.triton_int4, imported on first use (it imports triton)."""
    from . import triton_int4 as module

    return module


@functools.cache
def triton_int4_dot():
    """kernels.triton_int4_dot, imported on first use (it imports triton)."""
    from . import triton_int4_dot as module

    return module


def triton_row_limit(shape: tuple[int, ...], quantized: bool) -> int:
    """The most rows of an x of this shape (..., K) that the Triton kernels take: SMALL_M, or PROMPT_SMALL_M
    for float weights and a prompt (x (..., T, K) with T > 1 tokens per sequence)."""
    prompt = len(shape) >= 3 and shape[-2] > 1
    return PROMPT_SMALL_M if prompt and not quantized else SMALL_M


def gemv_supported(x: Tensor, quantized: bool = False) -> bool:
    """True when the ops run redline's Triton kernels for this x (int8 weights with quantized): a CUDA/HIP
    tensor of a float dtype with at most triton_row_limit rows (x.numel() // x.shape[-1]), with Triton
    importable."""
    if not x.is_cuda or x.dtype not in FLOAT_DTYPES or x.dim() == 0 or x.shape[-1] == 0:
        return False
    return x.numel() // x.shape[-1] <= triton_row_limit(tuple(x.shape), quantized) and triton_importable()


# --- references (plain PyTorch, fp32 accumulation) ---


def linear_reference(x: Tensor, weight: Tensor) -> Tensor:
    """F.linear computed in fp32, returned in x.dtype."""
    return F.linear(x.float(), weight.float()).to(x.dtype)


def int8_linear_reference(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """(x @ weight.T) * scales computed in fp32, returned in x.dtype."""
    return (F.linear(x.float(), weight.float()) * scales.float()).to(x.dtype)


def int4_linear_reference(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """x @ dequantize_int4(weight, scales).T computed in fp32, returned in x.dtype."""
    return F.linear(x.float(), dequantize_int4(weight, scales)).to(x.dtype)


# --- validation ---


def _check_x_and_weight(name: str, x: Tensor, weight: Tensor) -> None:
    """What both linear ops need: a 2-D weight (N, K) and a float x (..., K)."""
    if weight.dim() != 2:
        raise ValueError(f"{name}: weight must be 2-D (N, K), got shape {tuple(weight.shape)}")
    if x.dim() < 1:
        raise ValueError(f"{name}: x must have at least one dimension (..., K)")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{name}: x has K={x.shape[-1]} but weight {tuple(weight.shape)} expects K={weight.shape[1]}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: x must be bf16, fp16 or fp32, got {x.dtype}")


def _check_linear(x: Tensor, weight: Tensor) -> None:
    _check_x_and_weight("redline.linear", x, weight)
    if weight.dtype != x.dtype:
        raise ValueError(f"redline.linear: weight dtype {weight.dtype} must match x dtype {x.dtype}")


def _check_int8_linear(x: Tensor, weight: Tensor, scales: Tensor) -> None:
    if weight.dim() == 2 and weight.dtype != torch.int8:
        raise ValueError(f"redline.int8_linear: weight must be int8, got {weight.dtype}; quantize it first")
    _check_x_and_weight("redline.int8_linear", x, weight)
    if scales.dim() != 1 or scales.shape[0] != weight.shape[0]:
        raise ValueError(
            f"redline.int8_linear: scales must have shape ({weight.shape[0]},) (one per output row), "
            f"got {tuple(scales.shape)}")
    if scales.dtype not in FLOAT_DTYPES:
        raise ValueError(f"redline.int8_linear: scales must be bf16, fp16 or fp32, got {scales.dtype}")


def _check_int4_linear(x: Tensor, weight: Tensor, scales: Tensor) -> None:
    name = "redline.int4_linear"
    if weight.dim() != 2 or weight.dtype != torch.uint8:
        raise ValueError(f"{name}: weight must be packed uint8 (N, K/2), got {tuple(weight.shape)} of {weight.dtype}")
    if x.dim() < 1 or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: x must be a bf16, fp16 or fp32 tensor (..., K), got {x.dtype}")
    k = x.shape[-1]
    if k != 2 * weight.shape[1]:
        raise ValueError(f"{name}: x has K={k} but the packed weight {tuple(weight.shape)} holds K={2 * weight.shape[1]}")
    if scales.dim() != 3 or scales.shape[0] != weight.shape[0] or scales.shape[2] != 2 or scales.dtype != torch.float16:
        raise ValueError(f"{name}: scales must be fp16 (N, K/group_size, 2), got {tuple(scales.shape)} of {scales.dtype}")
    groups = scales.shape[1]
    if groups == 0 or k % groups or (k // groups) < 32 or (k // groups) & (k // groups - 1):
        raise ValueError(f"{name}: scales give {groups} groups for K={k}; the group size must be a power of two >= 32")


def _check_fp8_linear(x: Tensor, weight: Tensor, scales: Tensor) -> None:
    name = "redline.fp8_linear"
    if weight.dim() == 2 and weight.dtype != FP8_DTYPE:
        raise ValueError(f"{name}: weight must be float8_e4m3fn, got {weight.dtype}; quantize it first")
    _check_x_and_weight(name, x, weight)
    n, k = weight.shape
    if scales.dtype != torch.float32 or tuple(scales.shape) not in ((n,), fp8_block_scales_shape(n, k)):
        raise ValueError(f"{name}: scales must be fp32 ({n},) (per output row) or {fp8_block_scales_shape(n, k)} (per "
                         f"128 x 128 block), got {tuple(scales.shape)} of {scales.dtype}")
    if x.is_cuda and (refusal := fp8_refusal(x.device)) is not None:
        raise ValueError(f"{name}: {refusal}")


def _check_quantized(x: Tensor, weight: Tensor, scales: Tensor) -> None:
    """int8 (weight int8, scales (N,)), int4 (weight uint8 packed, scales (N, K/G, 2)) or fp8 (weight float8_e4m3fn,
    scales (N,) or per 128 x 128 block), told apart by the weight."""
    if weight.dtype == FP8_DTYPE:
        _check_fp8_linear(x, weight, scales)
    elif weight.dtype == torch.uint8:
        _check_int4_linear(x, weight, scales)
    else:
        _check_int8_linear(x, weight, scales)


# --- the fast path ---


def _small_m(x: Tensor, weight: Tensor, scales: Tensor | None) -> Tensor:
    """The Triton kernels on x viewed as (M, K) (_takes_triton(x, weight) holds); returns (..., N), contiguous."""
    config = _dot_config(x, weight)
    k = x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if scales is not None and scales.stride(0) != 1:
        scales = scales.contiguous()
    out = torch.empty((x2.shape[0], n), device=x.device, dtype=x.dtype)
    if out.numel():
        tk = triton_linear()
        if x2.shape[0] == 1:
            tk.gemv(x2, weight, scales, out)
        else:
            tk.small_m_dot(x2, weight, scales, out, config=config)
    return out.view(*x.shape[:-1], n)


def _dot_config(x: Tensor, weight: Tensor) -> DotConfig | None:
    """The tensor-core kernel's config for x's rows on x's GPU, or None where no config fits its shared memory
    (the ops then take cuBLAS/hipBLAS). One row of x (the GEMV) needs none."""
    rows = x.numel() // x.shape[-1]
    if rows <= 1:
        return None
    return fitted_dot_config(weight.shape[0], x.shape[-1], weight.element_size(), x.element_size(), rows,
                             device_caps(x.device))


def _takes_triton(x: Tensor, weight: Tensor, quantized: bool) -> bool:
    """gemv_supported, and for 2 or more rows a tensor-core config that fits the GPU."""
    if not gemv_supported(x, quantized):
        return False
    return x.numel() == x.shape[-1] or _dot_config(x, weight) is not None


def _int8_matmul(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """Many rows (prefill): cuBLAS on the weight dequantized to x.dtype in row blocks, then the
    scales applied in fp32 (mul_ computes in the promoted dtype and rounds once)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k).contiguous()  # row-major: see `linear`
    out = torch.empty((x2.shape[0], n), device=x.device, dtype=x.dtype)
    rows = max(1, _DEQUANT_CHUNK_ELEMENTS // max(k, 1))
    if rows >= n:
        torch.mm(x2, weight.to(x.dtype).t(), out=out)
        out.mul_(scales)
    else:
        for r0 in range(0, n, rows):
            w = weight[r0:r0 + rows].to(x.dtype)
            out[:, r0:r0 + rows] = F.linear(x2, w).mul_(scales[r0:r0 + rows])
    return out.view(*x.shape[:-1], n)


def _int4_dot_config(x: Tensor, weight: Tensor, scales: Tensor) -> Int4DotConfig | None:
    """The int4 tensor-core kernel's config for x's rows on x's GPU, or None where no config fits its shared memory."""
    k = x.shape[-1]
    return fitted_int4_dot_config(weight.shape[0], k, k // scales.shape[1], x.element_size(), x.numel() // k,
                                  device_caps(x.device))


def _int4_small_m(x: Tensor, weight: Tensor, scales: Tensor, config: Int4DotConfig) -> Tensor:
    """2..SMALL_M rows of x (viewed as (M, K)) on the int4 tensor-core kernel; returns (..., N), contiguous."""
    n = weight.shape[0]
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty((x2.shape[0], n), device=x.device, dtype=x.dtype)
    triton_int4_dot().int4_dot(x2, weight, scales, out, config=config)
    return out.view(*x.shape[:-1], n)


def _int4_matmul(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """Two or more rows: cuBLAS on the weight dequantized (fp32, rounded to x.dtype) in row blocks."""
    n = weight.shape[0]
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    out = torch.empty((x2.shape[0], n), device=x.device, dtype=x.dtype)
    rows = max(1, _DEQUANT_CHUNK_ELEMENTS // max(k, 1))
    for r0 in range(0, n, rows):
        w = dequantize_int4(weight[r0:r0 + rows], scales[r0:r0 + rows]).to(x.dtype)
        out[:, r0:r0 + rows] = F.linear(x2, w)
    return out.view(*x.shape[:-1], n)


# --- the custom ops ---


@torch.library.custom_op("redline::linear", mutates_args=())
def linear(x: Tensor, weight: Tensor) -> Tensor:
    """F.linear(x, weight) (no bias); x (..., K), weight (N, K) of x's dtype; returns (..., N)."""
    _check_linear(x, weight)
    if _takes_triton(x, weight, quantized=False):
        return _small_m(x, weight, None)
    # cuBLAS picks a 20-40x slower kernel for a column-major x (seen at batch 64: 256 µs instead of 12 for wo),
    # and inductor may hand the op one; a copy costs a few µs.
    return F.linear(x.contiguous(), weight).contiguous()


@linear.register_fake
def _linear_fake(x: Tensor, weight: Tensor) -> Tensor:
    _check_linear(x, weight)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("redline::int8_linear", mutates_args=())
def int8_linear(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """(x @ weight.T) * scales in x.dtype, fp32 accumulation; weight (N, K) int8, scales (N,).
    On the CPU: cpu_gemv.cpp on the int8 weight (cpu_linear.py)."""
    _check_int8_linear(x, weight, scales)
    if _takes_triton(x, weight, quantized=True):
        return _small_m(x, weight, scales)
    if x.is_cuda:
        return _int8_matmul(x, weight, scales)
    if x.device.type == "cpu":
        return int8_linear_cpu(x, weight, scales)
    return int8_linear_reference(x, weight, scales)


@int8_linear.register_fake
def _int8_linear_fake(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    _check_int8_linear(x, weight, scales)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _check_fused_linear(x: Tensor, weight: Tensor, scales: Tensor | None, norm_weight: Tensor | None,
                        residual: Tensor | None, swiglu: bool, sums: Tensor | None, sum_in: int, sum_out: int,
                        gelu: bool = False) -> None:
    name = "redline.fused_linear"
    if scales is None:
        _check_linear(x, weight)
    else:
        _check_quantized(x, weight, scales)
    n = weight.shape[0]
    if norm_weight is not None and (norm_weight.shape != (x.shape[-1],)
                                    or norm_weight.dtype not in (x.dtype, torch.float32)):
        raise ValueError(f"{name}: norm_weight must be ({x.shape[-1]},) of {x.dtype} (or float32: the norm scaled "
                         f"in fp32), got {tuple(norm_weight.shape)} of {norm_weight.dtype}")
    if gelu and not swiglu:
        raise ValueError(f"{name}: gelu picks GeGLU's activation for the gated pair; it needs swiglu=True")
    if norm_weight is not None and x.shape[-1] == 0:
        raise ValueError(f"{name}: an RMSNorm needs K > 0 features")
    if swiglu and n % 2:
        raise ValueError(f"{name}: swiglu needs the gate and up rows stacked (an even N), got N={n}")
    out_n = n // 2 if swiglu else n
    if residual is not None and (residual.shape != (*x.shape[:-1], out_n) or residual.dtype != x.dtype):
        raise ValueError(f"{name}: residual must have shape {(*x.shape[:-1], out_n)} and dtype {x.dtype}, "
                         f"got {tuple(residual.shape)} of {residual.dtype}")
    if sums is None:
        if sum_in >= 0 or sum_out >= 0:
            raise ValueError(f"{name}: sum_in / sum_out index the sums tensor; pass sums or use -1")
        return
    lanes = sums.shape[-1] if sums.dim() == 2 else 0
    if sums.dim() != 2 or sums.dtype != torch.float32 or lanes & (lanes - 1) or not sums.is_contiguous():
        raise ValueError(f"{name}: sums must be a contiguous (slots, lanes) fp32 tensor with a power-of-two "
                         f"number of lanes, got {tuple(sums.shape)} of {sums.dtype}")
    for what, index in (("sum_in", sum_in), ("sum_out", sum_out)):
        if not -1 <= index < sums.shape[0]:
            raise ValueError(f"{name}: {what}={index} is outside sums ({sums.shape[0]} slots; -1 for none)")
    if sum_in >= 0 and norm_weight is None:
        raise ValueError(f"{name}: sum_in is the sum of x**2 for the norm; it needs norm_weight")
    if sum_in >= 0 and x.numel() != x.shape[-1]:
        raise ValueError(f"{name}: sum_in holds one row's sum of squares; x has {x.numel() // x.shape[-1]} rows")


def fused_linear_reference(x: Tensor, weight: Tensor, scales: Tensor | None, norm_weight: Tensor | None,
                           eps: float, residual: Tensor | None, swiglu: bool, sums: Tensor | None = None,
                           sum_out: int = -1, gelu: bool = False) -> Tensor:
    """The unfused model's ops, in its order and dtypes: RMSNorm (a float32 norm_weight of a lower-precision x
    scales in fp32 and rounds once, Gemma's order), the linear op, silu(gate) * up (gelu: GeGLU), + residual; then
    sums[sum_out, 0] += sum(y**2) when asked. (The norm recomputes its sum; sum_in only saves the GPU kernel that.)"""
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps, scale_fp32=norm_weight.dtype != x.dtype)
    y = torch.ops.redline.linear(x, weight) if scales is None else _quantized_linear(x, weight, scales)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
    y = y if residual is None else residual + y
    if sums is not None and sum_out >= 0:
        sums[sum_out, 0] += y.float().pow(2).sum()
    return y


@torch.library.custom_op("redline::int4_linear", mutates_args=())
def int4_linear(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """x @ W.T in x.dtype, W = scale * q + offset per group (quantize.py's int4 layout): weight uint8 (N, K/2),
    scales fp16 (N, K/G, 2). On a GPU: one row runs the int4 GEMV, 2..SMALL_M rows the int4 tensor-core kernel (both
    dequantize in registers, fp32 accumulation); more rows, or no config that fits the GPU, cuBLAS on row blocks.
    On the CPU: cpu_gemv.cpp on the packed weight (cpu_linear.py)."""
    _check_int4_linear(x, weight, scales)
    if gemv_supported(x, quantized=True):
        if x.numel() == x.shape[-1]:
            out = torch.empty((1, weight.shape[0]), device=x.device, dtype=x.dtype)
            triton_int4().gemv_int4(x.reshape(1, -1).contiguous(), weight.contiguous(), scales.contiguous(), out)
            return out.view(*x.shape[:-1], weight.shape[0])
        config = _int4_dot_config(x, weight, scales)
        if config is not None:
            return _int4_small_m(x, weight, scales, config)
    if x.is_cuda:
        return _int4_matmul(x, weight, scales)
    if x.device.type == "cpu":
        return int4_linear_cpu(x, weight, scales)
    return int4_linear_reference(x, weight, scales)


@int4_linear.register_fake
def _int4_linear_fake(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    _check_int4_linear(x, weight, scales)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _quantized_linear(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    if weight.dtype == FP8_DTYPE:
        return torch.ops.redline.fp8_linear(x, weight, scales)
    if weight.dtype == torch.uint8:
        return torch.ops.redline.int4_linear(x, weight, scales)
    return torch.ops.redline.int8_linear(x, weight, scales)


# Where cuBLAS's row-wise FP8 GEMM (torch._scaled_mm with an (M, 1) and a (1, N) scale) runs: Hopper. It takes bf16
# output only, and K and N multiples of 16; every other FP8 product runs triton_fp8.fp8_dot.
SCALED_MM_ARCHS = ("sm90",)


def fp8_gemm_backend(x: Tensor, weight: Tensor, scales: Tensor) -> str:
    """Which kernel multiplies two or more rows of x by an FP8 weight on this GPU: "scaled_mm" (cuBLAS) or "triton"."""
    n, k = weight.shape
    cublas = (scales.dim() == 1 and x.dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0
              and device_caps(x.device).arch in SCALED_MM_ARCHS)
    return "scaled_mm" if cublas else "triton"


def fp8_matmul(x: Tensor, weight: Tensor, scales: Tensor, backend: str | None = None) -> Tensor:
    """Two or more rows of x (..., K) on a GPU with FP8: quantized per token, multiplied on the FP8 tensor cores by
    the e4m3 weight (N, K), scaled, in x.dtype (..., N). backend: fp8_gemm_backend's choice unless given (the
    benchmarks compare both)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    codes, row_scales = triton_fp8().quantize_rows(x2)  # (M, K) e4m3, (M,) fp32
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    if (backend or fp8_gemm_backend(x, weight, scales)) == "scaled_mm":
        out = torch._scaled_mm(codes, weight.t(), scale_a=row_scales.unsqueeze(1), scale_b=scales.view(1, n),
                               out_dtype=x.dtype)
    else:
        out = torch.empty((x2.shape[0], n), device=x.device, dtype=x.dtype)
        triton_fp8().fp8_dot(codes, row_scales, weight, scales.contiguous(), out)
    return out.view(*x.shape[:-1], n)


@torch.library.custom_op("redline::fp8_linear", mutates_args=())
def fp8_linear(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """quantize.fp8_linear_reference: x (..., K) times the float8_e4m3fn weight (N, K) with scales (N,) or per 128 x 128
    block, x quantized per token when it has two or more rows; (..., N) in x.dtype. On a GPU with FP8: one row runs
    the GEMV on the FP8 bytes, more rows fp8_matmul; a GPU without FP8 is refused; the CPU runs the reference."""
    _check_fp8_linear(x, weight, scales)
    if x.is_cuda and x.numel() == x.shape[-1] and gemv_supported(x, quantized=True):
        out = torch.empty((1, weight.shape[0]), device=x.device, dtype=x.dtype)
        triton_linear().gemv(x.reshape(1, -1).contiguous(), weight.contiguous(), scales.contiguous(), out)
        return out.view(*x.shape[:-1], weight.shape[0])
    if x.is_cuda and x.numel() and triton_importable():
        return fp8_matmul(x, weight, scales)
    if x.is_cuda:
        raise ValueError("redline.fp8_linear: FP8 on a GPU needs Triton installed (pip install triton)")
    return fp8_reference(x, weight, scales)


@fp8_linear.register_fake
def _fp8_linear_fake(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    _check_fp8_linear(x, weight, scales)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("redline::fused_linear", mutates_args=("sums",))
def fused_linear(x: Tensor, weight: Tensor, scales: Tensor | None, norm_weight: Tensor | None, eps: float,
                 residual: Tensor | None, swiglu: bool, sums: Tensor | None, sum_in: int, sum_out: int,
                 gelu: bool = False) -> Tensor:
    """A decode projection with its neighbours fused: [RMSNorm(x) ->] x @ W.T [* scales] [-> silu(gate) * up] [+ residual].

    weight (N, K) float, int8 with scales (N,), or packed int4 (uint8 (N, K/2) with fp16 scales (N, K/G, 2));
    norm_weight (K,) in x's dtype, or float32 (a norm scaled in fp32, such as Gemma's 1 + w); residual (..., N) or
    (..., N/2) with swiglu; gelu: the gated pair is GeGLU's (gelu, tanh approximation) instead of SwiGLU's.
    sums (optional, fp32 (slots, lanes)): sum_out >= 0 adds sum(y**2) to row sum_out (spread over its lanes),
    and sum_in >= 0 says that row sum_in already sums to sum(x**2) for the norm (the kernel that wrote x added
    it); -1 for neither.
    One row of x on a GPU runs one Triton GEMV that does all of it; otherwise the unfused ops run.
    """
    _check_fused_linear(x, weight, scales, norm_weight, residual, swiglu, sums, sum_in, sum_out, gelu)
    if not (gemv_supported(x) and x.numel() == x.shape[-1]):
        return fused_linear_reference(x, weight, scales, norm_weight, eps, residual, swiglu, sums,
                                      sum_out, gelu).contiguous()
    k = x.shape[-1]
    x1 = x.reshape(1, k).contiguous()
    weight = weight.contiguous()
    out = torch.empty((1, weight.shape[0] // 2 if swiglu else weight.shape[0]), device=x.device, dtype=x.dtype)
    gemv = triton_linear().gemv if weight.dtype != torch.uint8 else triton_int4().gemv_int4  # (fp8 too: gemv)
    gemv(
        x1, weight, scales.contiguous() if scales is not None else None, out,
        norm_weight=norm_weight.contiguous() if norm_weight is not None else None, eps=eps,
        residual=residual.reshape(-1).contiguous() if residual is not None else None, swiglu=swiglu,
        sq_in=sums[sum_in] if sums is not None and sum_in >= 0 else None,
        sq_out=sums[sum_out] if sums is not None and sum_out >= 0 else None, gelu=gelu)
    return out.view(*x.shape[:-1], out.shape[-1])


@fused_linear.register_fake
def _fused_linear_fake(x: Tensor, weight: Tensor, scales: Tensor | None, norm_weight: Tensor | None, eps: float,
                       residual: Tensor | None, swiglu: bool, sums: Tensor | None, sum_in: int, sum_out: int,
                       gelu: bool = False) -> Tensor:
    _check_fused_linear(x, weight, scales, norm_weight, residual, swiglu, sums, sum_in, sum_out, gelu)
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    return x.new_empty((*x.shape[:-1], n))


# --- the modules use_kernels swaps in ---


class KernelLinear(nn.Linear):
    """nn.Linear (no bias) whose forward runs torch.ops.redline.linear: the Triton GEMV at decode."""

    scales = None  # float weights: no int8 scales (the fused decode passes layer.scales to fused_linear)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.redline.linear(x, self.weight)


class KernelInt8Linear(Int8Linear):
    """quantize.Int8Linear whose forward runs torch.ops.redline.int8_linear: the int8 weight is dequantized in
    the Triton kernel's registers for few rows, in row blocks for cuBLAS for many."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.redline.int8_linear(x, self.weight, self.scales)


class KernelFp8Linear(Fp8Linear):
    """quantize.Fp8Linear whose forward runs torch.ops.redline.fp8_linear: the GEMV on the FP8 bytes for one row, the
    FP8 tensor cores (x quantized per token) for more."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.redline.fp8_linear(x, self.weight, self.scales)


# The CPU modules (use_cpu_kernels) call cpu_gemv.cpp's ops straight from the model, with no Python between: a 135M
# model's decode step makes 211 of these calls, and a Python op wrapper's few microseconds each add up.


class CpuInt8Linear(KernelInt8Linear):
    """quantize.Int8Linear on redline_cpu::int8_linear (the int8 weight read once, fp32 accumulation)."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.redline_cpu.int8_linear(x, self.weight, self.scales)


class KernelInt4Linear(Int4Linear):
    """quantize.Int4Linear whose forward runs torch.ops.redline.int4_linear: the int4 weight is dequantized in the
    Triton kernels' registers for up to SMALL_M rows, in row blocks for cuBLAS for more."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.redline.int4_linear(x, self.weight, self.scales)


class CpuInt4Linear(KernelInt4Linear):
    """quantize.Int4Linear on redline_cpu::int4_linear (the packed weight read once, fp32 accumulation)."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.redline_cpu.int4_linear(x, self.weight, self.scales)


def swap_linears(model: nn.Module) -> None:
    """Make every bias-free float nn.Linear a KernelLinear, every Int8Linear a KernelInt8Linear, every Int4Linear a
    KernelInt4Linear and every Fp8Linear a KernelFp8Linear, in place.

    Only the class changes, so weights (and a tied output head) stay shared."""
    for module in model.modules():
        if type(module) is nn.Linear and module.bias is None and module.weight.dtype in FLOAT_DTYPES:
            module.__class__ = KernelLinear
        elif type(module) is Int8Linear:
            module.__class__ = KernelInt8Linear
        elif type(module) is Int4Linear:
            module.__class__ = KernelInt4Linear
        elif type(module) is Fp8Linear:
            module.__class__ = KernelFp8Linear


@torch.library.custom_op("redline::exact_head_linear", mutates_args=())
def exact_head_linear(x: Tensor, weight: Tensor, codes: Tensor, scales: Tensor) -> Tensor:
    """F.linear(x, weight) where weight == codes * scales exactly (int8 (N, K) and fp16 (N, K/32), a Q8_0 table, or
    fp32 (N, K/16), a Q6_K one); on the CPU the int8 form is read (cpu_gemv.cpp)."""
    return exact_head_linear_cpu(x, weight, codes, scales)


@exact_head_linear.register_fake
def _exact_head_linear_fake(x: Tensor, weight: Tensor, codes: Tensor, scales: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class ExactInt8Head(nn.Linear):
    """A float output head tied to the embedding whose table is exactly int8 codes times fp16 scales per 32 inputs
    (GGUF's Q8_0, as in the demo model) or fp32 scales per 16 (GGUF's Q6_K, as in Llama-3.2-1B's Q4_1 files): decode
    reads the int8 form. The codes and scales are plain attributes, not buffers: the state dict, the checkpoint and
    the tying stay as they were."""

    codes: Tensor  # int8 (N, K)
    group_scales: Tensor  # fp16 (N, K/32) or fp32 (N, K/16)

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type == "cpu":  # the C++ op straight from the model (see CpuLinear)
            return torch.ops.redline_cpu.int8_group_linear(x, self.codes, self.group_scales)
        return torch.ops.redline.exact_head_linear(x, self.weight, self.codes, self.group_scales)

    def read_bytes(self) -> int:
        """Bytes one decode step reads for this head (its int8 form), in place of the float table's."""
        return self.codes.numel() + self.group_scales.numel() * self.group_scales.element_size()


def use_cpu_kernels(model: nn.Module) -> nn.Module:
    """Run a model's linears on the CPU kernels (cpu_linear.py) in place, weights shared and nothing repacked:
    Int8Linear -> CpuInt8Linear, Int4Linear -> CpuInt4Linear, a bias-free fp32 nn.Linear -> CpuLinear, or
    CpuHalfLinear with its weight replaced by the fp16 form when fp16 holds every value exactly (an F16 GGUF file's
    weights: the same bits from half the bytes; not a tied head or a router) (each with a contiguous weight: a
    tensor-parallel rank's column slice stays on the ops, which copy it); a mixture's
    experts become moe.CpuMoE, CpuInt8MoE or CpuInt4MoE (a decode step's chosen experts on their stored weights);
    model.Attention -> attention.CpuAttention (one-token steps over the valid cache positions only).
    The C++ kernel is built or loaded now rather than on the first token. In a quantized model a float output head
    tied to the embedding becomes an ExactInt8Head when its table has an exact int8 form (a Q8_0 or Q6_K table);
    else, in any model, a HalfHead when fp16 holds its table exactly (both checked element by element, else it stays
    a float head). Other linears stay as they are; applying it twice is a no-op."""
    from redline.model import Attention

    from .attention import CpuAttention, cpu_attention_fits
    from .moe import cpu_moe_class

    cpu_ops()
    quantized = False
    embedding = getattr(getattr(model, "tok_embeddings", None), "weight", None)
    routers = router_linears(model)
    for module in model.modules():
        if type(module) is Attention and cpu_attention_fits(module):
            module.__class__ = CpuAttention
        if type(module) in (Int8Linear, KernelInt8Linear) and module.weight.is_contiguous():
            module.__class__ = CpuInt8Linear
        elif type(module) in (Int4Linear, KernelInt4Linear) and module.weight.is_contiguous():
            module.__class__ = CpuInt4Linear
        elif type(module) is nn.Linear and module.bias is None and module.weight.dtype == torch.float32 \
                and module.weight.is_contiguous():  # a tensor-parallel rank's column slice stays on F.linear
            half = None if module.weight is embedding or id(module) in routers else exact_half(module.weight.detach())
            if half is None:
                module.__class__ = CpuLinear
            else:
                module.__class__ = CpuHalfLinear
                module.weight = nn.Parameter(half, requires_grad=False)
        module.__class__ = cpu_moe_class(module)
        quantized = quantized or isinstance(module, (Int8Linear, Int4Linear))
    head = getattr(model, "output", None)
    if not isinstance(head, nn.Linear) or type(head) in (ExactInt8Head, HalfHead) or head.bias is not None \
            or not getattr(model.args, "tie_word_embeddings", False):
        return model
    form = (exact_int8_groups(head.weight.detach()) or exact_int8_groups16(head.weight.detach())) if quantized \
        else None
    if form is not None:
        head.__class__ = ExactInt8Head
        head.codes, head.group_scales = form
        return model
    half = exact_half(head.weight.detach())
    if half is not None:
        head.__class__ = HalfHead
        head.half_weight = half
    return model
