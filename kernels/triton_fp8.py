"""Triton kernels of the FP8 (e4m3) W8A8 linear for two or more rows of x (prefill, decode batches).

`quantize_rows` quantizes x per token in one launch (one program a row: the row's max |x| in a first pass over K,
then x / scale rounded to e4m3 in a second, the row being in L1/L2 by then), so a decode step pays one small kernel
a linear for it rather than the four that torch's amax / div / clamp / cast would launch.

`fp8_dot` multiplies the e4m3 rows by the e4m3 weight on the tensor cores (an fp8 x fp8 dot, fp32 accumulation) and
scales the result: by each row's activation scale and each output channel's weight scale (SCALE_BLOCK False), or,
for weights scaled per 128 x 128 block (SCALE_BLOCK), each K step of 128 inputs is one dot whose fp32 partial is
multiplied by its block's weight scale before it is added (BLOCK_K divides 128, so a step never spans two blocks).
Per-channel weights with bf16 x go to torch._scaled_mm (cuBLAS's row-wise FP8 GEMM) on Hopper instead
(kernels/linear.py decides); this kernel takes every other case (block scales, fp16/fp32 x, shapes cuBLAS refuses).

Configs come from configs.fp8_dot_config; only kernels/linear.py imports this module, lazily, on a GPU with FP8.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import Fp8DotConfig, fp8_dot_config
from .device import device_caps

# The largest finite e4m3fn value (quantize.FP8_MAX).
FP8_MAX = 448.0
# Inputs per loop step of quantize_rows.
QUANT_BLOCK = 1024


@triton.jit
def _round_to_e4m3(q):
    """fp32 q, |q| <= 448 -> the nearest e4m3fn value (ties to even), still in fp32: the spacing of e4m3 values at
    q's binade (8 per power of two, 2**-9 below the smallest normal 2**-6) is a power of two, and adding then
    subtracting 1.5 * 2**23 rounds q / spacing (|q / spacing| <= 16) to an integer in fp32's own round-to-even. The
    cast that follows is then exact, so this equals torch's and the GPU's rounding casts (Triton's interpreter
    rounds the cast itself wrongly when the mantissa carries into the exponent)."""
    exponent = ((q.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2|q|) for normal fp32 q
    spacing = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2 ** (max(e, -6) - 3)
    return ((q / spacing + 12582912.0) - 12582912.0) * spacing


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK: tl.constexpr):
    """One row: s = max(max|x| / 448, smallest normal fp32); q = clamp(x / s, +-448) as e4m3. x (M, K) float,
    q (M, K) float8_e4m3fn, s (M,) fp32. Grid: (M,)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    top = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0).to(tl.float32)
        top = tl.maximum(top, tl.abs(x))
    scale = tl.maximum(tl.div_rn(tl.max(top), 448.0), 1.1754943508222875e-38)  # IEEE division, as torch's
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0).to(tl.float32)
        q = _round_to_e4m3(tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0))  # IEEE division, as torch
        tl.store(q_ptr + row * stride_qm + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=k0 + offs < K)
    tl.store(s_ptr + row, scale)


@triton.jit
def _fp8_dot_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ym, stride_sn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, SCALE_BLOCK: tl.constexpr, PROMOTE: tl.constexpr = True,
):
    """y = (x @ w.T) * xs[:, None] * ws, fp32 accumulation, one (BLOCK_M, BLOCK_N) tile per program.

    x: (M, K) e4m3 codes (unit stride along K), xs: (M,) fp32; w: (N, K) e4m3 (unit stride along K); ws: (N,) fp32,
    or with SCALE_BLOCK (ceil(N/128), ceil(K/128)) fp32 with row stride stride_sn (BLOCK_K divides 128);
    y: (M, N), unit stride along N. Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)).
    """
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)  # weight rows past N re-read row N-1; they are not stored
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m[:, None] < M
    # x and w come as their uint8 bytes, so that masked lanes read 0 (a zero e4m3) before the bitcast
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]  # (BLOCK_M, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # (BLOCK_N, BLOCK_K)
    sb_ptrs = ws_ptr + (rows // 128) * stride_sn  # (BLOCK_N,): each row's block row of scales (SCALE_BLOCK)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs + k0, mask=m_mask, other=0)
            w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
        else:
            k_mask = (k0 + offs_k)[None, :] < K
            x = tl.load(x_ptrs + k0, mask=k_mask & m_mask, other=0)
            w = tl.load(w_ptrs + k0, mask=k_mask, other=0, eviction_policy="evict_first")
        x = x.to(tl.float8e4nv, bitcast=True)
        w = w.to(tl.float8e4nv, bitcast=True)
        if SCALE_BLOCK:
            part = tl.dot(x, tl.trans(w))  # (BLOCK_M, BLOCK_N) fp32, this K block's products
            acc += part * tl.load(sb_ptrs + k0 // 128)[None, :]
        elif PROMOTE:  # each K step's partial sums added in fp32 (Hopper's FP8 dots keep fewer bits in their sums)
            acc += tl.dot(x, tl.trans(w))
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    acc = acc * tl.load(xs_ptr + offs_m, mask=offs_m < M, other=0)[:, None]
    if not SCALE_BLOCK:
        acc = acc * tl.load(ws_ptr + rows)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask & (offs_n[None, :] < N))


def quantize_rows(x: torch.Tensor, codes: torch.Tensor | None = None,
                  scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float, unit stride along K -> (e4m3 codes (M, K), fp32 scales (M,)): quantize.quantize_activations_fp8
    in one launch."""
    m, k = x.shape
    codes = torch.empty((m, k), device=x.device, dtype=torch.float8_e4m3fn) if codes is None else codes
    scales = torch.empty((m,), device=x.device, dtype=torch.float32) if scales is None else scales
    if m:
        _quantize_rows_kernel[(m,)](x, codes, scales, k, x.stride(0), codes.stride(0),
                                    BLOCK=min(QUANT_BLOCK, triton.next_power_of_2(max(k, 16))), num_warps=4)
    return codes, scales


def fp8_dot(codes: torch.Tensor, row_scales: torch.Tensor, w: torch.Tensor, w_scales: torch.Tensor,
            out: torch.Tensor, config: Fp8DotConfig | None = None, promote: bool = True) -> torch.Tensor:
    """out = (codes @ w.T) * row_scales[:, None] * w's scales (per output channel (N,), or (ceil(N/128),
    ceil(K/128)) blocks), fp32 accumulation, rounded to out's dtype.

    codes: (M, K) e4m3, unit stride along K; row_scales: (M,) fp32; w: (N, K) e4m3, unit stride along K; out: (M, N)
    contiguous. promote (per-channel w): the K steps' partial dot products are summed in fp32 by the kernel, not in
    the tensor cores' accumulator (benchmarks compare both)."""
    m, k = codes.shape
    n = w.shape[0]
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    block = w_scales.dim() == 2
    cfg = config or fp8_dot_config(m, n, k, device_caps(codes.device))
    _fp8_dot_kernel[(triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))](
        codes.view(torch.uint8), row_scales, w.view(torch.uint8), w_scales, out,
        m, n, k,
        codes.stride(0), w.stride(0), out.stride(0), w_scales.stride(0) if block else 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0, SCALE_BLOCK=block, PROMOTE=promote,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
