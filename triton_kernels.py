"""Triton kernels for small-M (decode) linear layers: y = x @ W.T with W row-major (N, K).

At batch 1 a linear layer is a matrix-vector product: each weight byte is read once and used for
one multiply-add, so the kernel is bound by memory bandwidth. The kernel here:

- gives each program BLOCK_N whole rows of W and walks K in BLOCK_K steps, so every weight byte is
  read exactly once, with wide coalesced vector loads, and no cross-program reduction is needed
  (the shapes that matter have N >= 4096: thousands of programs without split-K);
- keeps one (BLOCK_N, BLOCK_K) fp32 accumulator per row of x (up to 8 rows) in the same register
  layout as the weight tile, and reduces over K once at the end, so the hot loop is loads,
  converts and FMAs with no shuffles and no shared memory;
- dequantizes int8 weights in registers (no bf16 copy of the weight), with a bit trick instead of
  the slow int->float conversion, and applies the per-row scale once per output after the reduction;
- can use programmatic dependent launch (PDL, sm_90+): each program loads its first weight block
  before `griddepcontrol.wait`, so the kernel streams its constant weights while the kernel
  before it drains; x is read and y written only after the wait.

Configs come from a deterministic table (`pick_config`), never from autotuning, so nothing
compiles or benchmarks inside CUDA-graph capture or torch.compile tracing (the first eager call
compiles; capture then only replays launches).

Only kernels.py imports this module, lazily, from the CUDA implementation of its custom ops.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.3 exposes grid dependency control (PDL)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - old Triton: PDL is never requested then
    gdc_launch_dependents = gdc_wait = None

MAX_BLOCK_M = 8  # rows of x one program handles (one accumulator each)

# int8 -> fp32 conversion without I2F (a quarter of the FP32 rate on Hopper: it would cap an int8
# GEMV near the memory rate). For s in [-128, 127], the float whose bits are 0x4B000000 | (s + 128)
# is exactly 2**23 + 128 + s; subtracting 8388736.0 (2**23 + 128) leaves s. The weights are loaded
# as int32 words (4 int8 each, so the raw data kept in flight takes 1 register per 4 weights) and
# each word is expanded to 4 floats (INT8_MODE):
#   2: PTX: one xor (s + 128 == s ^ 0x80 per byte), then per byte one prmt (the byte under the
#      0x4B exponent) and one float subtract.
#   1: the same in Triton integer ops (portable: HIP).
INT8_MODE_DEFAULT = 2


@triton.jit
def _int8_words_to_f32(wq, INT8_MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(BLOCK_N, BLOCK_K // 4) int32 words (little-endian int8 x 4) -> (BLOCK_N, BLOCK_K) float32."""
    if INT8_MODE == 2:
        f0, f1, f2, f3 = tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 t;
            xor.b32 t, $4, 0x80808080;
            prmt.b32 $0, t, 0x4B000000, 0x7440;
            prmt.b32 $1, t, 0x4B000000, 0x7441;
            prmt.b32 $2, t, 0x4B000000, 0x7442;
            prmt.b32 $3, t, 0x4B000000, 0x7443;
            sub.f32 $0, $0, 0f4B000080;
            sub.f32 $1, $1, 0f4B000080;
            sub.f32 $2, $2, 0f4B000080;
            sub.f32 $3, $3, 0f4B000080;
            }
            """,
            constraints="=r,=r,=r,=r,r",
            args=[wq],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )
    else:
        t = wq ^ -2139062144  # 0x80808080
        f0 = ((t & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
        f1 = (((t >> 8) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
        f2 = (((t >> 16) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
        f3 = (((t >> 24) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
    # join stacks on a new last axis: [[f0, f1], [f2, f3]] per word, flattened to k order.
    f = tl.join(tl.join(f0, f2), tl.join(f1, f3))  # (BLOCK_N, BLOCK_K // 4, 2, 2)
    return tl.reshape(f, (BLOCK_N, BLOCK_K))


@triton.jit
def _weight_to_f32(w, W_INT8: tl.constexpr, WORDS: tl.constexpr, INT8_MODE: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    if W_INT8 and WORDS:
        return _int8_words_to_f32(w, INT8_MODE, BLOCK_N, BLOCK_K)
    elif W_INT8:  # single bytes (K or the row stride not a multiple of 4): same trick, one per byte
        wi = w.to(tl.int32) + 0x4B000080
        return wi.to(tl.float32, bitcast=True) - 8388736.0
    else:
        return w.to(tl.float32)


@triton.jit
def _x_row(x_ptrs, r: tl.constexpr, M, stride_xm, k_mask, MASK_K: tl.constexpr):
    # Rows past M re-read row M-1 (in bounds); their results are never stored.
    p = x_ptrs + tl.minimum(M - 1, r) * stride_xm
    if MASK_K:
        v = tl.load(p, mask=k_mask, other=0)
    else:
        v = tl.load(p)
    return v.to(tl.float32)


@triton.jit
def _fma_rows(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, wf, x_ptrs, M, stride_xm, k_mask,
              MASK_K: tl.constexpr, BLOCK_M: tl.constexpr):
    acc0 += wf * _x_row(x_ptrs, 0, M, stride_xm, k_mask, MASK_K)
    if BLOCK_M > 1:
        acc1 += wf * _x_row(x_ptrs, 1, M, stride_xm, k_mask, MASK_K)
    if BLOCK_M > 2:
        acc2 += wf * _x_row(x_ptrs, 2, M, stride_xm, k_mask, MASK_K)
        acc3 += wf * _x_row(x_ptrs, 3, M, stride_xm, k_mask, MASK_K)
    if BLOCK_M > 4:
        acc4 += wf * _x_row(x_ptrs, 4, M, stride_xm, k_mask, MASK_K)
        acc5 += wf * _x_row(x_ptrs, 5, M, stride_xm, k_mask, MASK_K)
        acc6 += wf * _x_row(x_ptrs, 6, M, stride_xm, k_mask, MASK_K)
        acc7 += wf * _x_row(x_ptrs, 7, M, stride_xm, k_mask, MASK_K)
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@triton.jit
def _store_row(y_ptr, acc, r: tl.constexpr, M, stride_ym, offs_n, n_mask, scale, W_INT8: tl.constexpr):
    out = tl.sum(acc, axis=1)  # (BLOCK_N,)
    if W_INT8:
        out = out * scale
    tl.store(y_ptr + r * stride_ym + offs_n, out.to(y_ptr.dtype.element_ty), mask=n_mask & (r < M))


@triton.jit
def _load_w(w_ptrs, k0, K, offs_k, MASK: tl.constexpr):
    # k0, K and offs_k count loaded elements (int32 words in the packed int8 path).
    # Weights are read once: evict_first keeps them from pushing x and y out of L2.
    if MASK:
        return tl.load(w_ptrs + k0, mask=(k0 + offs_k)[None, :] < K, other=0, eviction_policy="evict_first")
    else:
        return tl.load(w_ptrs + k0, eviction_policy="evict_first")


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DEPTH: tl.constexpr,
    EVEN_K: tl.constexpr, W_INT8: tl.constexpr, WORDS: tl.constexpr, INT8_MODE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """y[m, n] = sum_k x[m, k] * w[n, k] (times s[n] when W_INT8), fp32 accumulation.

    x: (M, K), w: (N, K), both unit stride along K; y: (M, N), unit stride along N; M <= BLOCK_M <= 8;
    K >= 1; EVEN_K: K % BLOCK_K == 0; WORDS (int8 only): K, stride_wn and w's address are multiples
    of 4, so w is read as int32 words. Grid: (cdiv(N, BLOCK_N),).

    The K loop is software-pipelined DEPTH (1 or 2) blocks deep: the raw weight block kb is loaded
    while block kb - DEPTH is converted and multiplied, so each warp keeps loads in flight during
    its arithmetic (raw int8/bf16 data is compact in registers; the fp32 expansion is not kept).
    """
    PACK: tl.constexpr = 4 if (W_INT8 and WORDS) else 1  # weights per loaded element
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # Clamp instead of masking: rows past N re-read row N-1 (in bounds); they are not stored.
    rows = tl.minimum(offs_n, N - 1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kw = tl.arange(0, BLOCK_K // PACK)
    if W_INT8:
        # Show the compiler a contiguity of 8 bytes, not the whole block: each thread then loads
        # 8 weights (one 8-byte load), the register layout of the 16-bit x (8 per 16-byte load),
        # so the loop needs no layout conversion through shared memory.
        offs_kw = (offs_kw // (8 // PACK)) * (8 // PACK) + offs_kw % (8 // PACK)
    if PACK == 4:
        w_base = w_ptr.to(tl.pointer_type(tl.int32))
    else:
        w_base = w_ptr
    w_ptrs = w_base + rows.to(tl.int64)[:, None] * (stride_wn // PACK) + offs_kw[None, :]  # (BLOCK_N, BLOCK_K/PACK)
    x_ptrs = x_ptr + offs_k[None, :]  # (1, BLOCK_K), row 0 of x
    KW = K // PACK
    acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    acc4 = acc0
    acc5 = acc0
    acc6 = acc0
    acc7 = acc0
    nb = tl.cdiv(K, BLOCK_K)

    # Prologue: the first DEPTH weight blocks (masked: K may be shorter). They do not depend on the
    # previous kernel, so with PDL they stream in while it drains; x is read only after the wait.
    wa = _load_w(w_ptrs, 0, KW, offs_kw, True)
    if DEPTH == 2:
        wb = _load_w(w_ptrs, BLOCK_K // PACK, KW, offs_kw, True)
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()

    if DEPTH == 2:
        for kb in range(2, nb):
            k0 = kb * BLOCK_K
            wc = _load_w(w_ptrs, kb * (BLOCK_K // PACK), KW, offs_kw, not EVEN_K)
            # block kb - 2 < nb - 1 is a full block: no mask on x
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _fma_rows(
                acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, _weight_to_f32(wa, W_INT8, WORDS, INT8_MODE, BLOCK_N, BLOCK_K),
                x_ptrs + (k0 - 2 * BLOCK_K), M, stride_xm, None, False, BLOCK_M)
            wa = wb
            wb = wc
        ka = tl.maximum(nb - 2, 0) * BLOCK_K  # wa holds block max(nb-2, 0), wb the one after
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _fma_rows(
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, _weight_to_f32(wa, W_INT8, WORDS, INT8_MODE, BLOCK_N, BLOCK_K),
            x_ptrs + ka, M, stride_xm, (ka + offs_k)[None, :] < K, True, BLOCK_M)
        kb_last = ka + BLOCK_K
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _fma_rows(
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, _weight_to_f32(wb, W_INT8, WORDS, INT8_MODE, BLOCK_N, BLOCK_K),
            x_ptrs + kb_last, M, stride_xm, (kb_last + offs_k)[None, :] < K, True, BLOCK_M)
    else:
        for kb in range(1, nb):
            k0 = kb * BLOCK_K
            wc = _load_w(w_ptrs, kb * (BLOCK_K // PACK), KW, offs_kw, not EVEN_K)
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _fma_rows(
                acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, _weight_to_f32(wa, W_INT8, WORDS, INT8_MODE, BLOCK_N, BLOCK_K),
                x_ptrs + (k0 - BLOCK_K), M, stride_xm, None, False, BLOCK_M)
            wa = wc
        ka = (nb - 1) * BLOCK_K
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _fma_rows(
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, _weight_to_f32(wa, W_INT8, WORDS, INT8_MODE, BLOCK_N, BLOCK_K),
            x_ptrs + ka, M, stride_xm, (ka + offs_k)[None, :] < K, True, BLOCK_M)

    scale = 1.0
    if W_INT8:
        scale = tl.load(s_ptr + rows).to(tl.float32)
    _store_row(y_ptr, acc0, 0, M, stride_ym, offs_n, n_mask, scale, W_INT8)
    if BLOCK_M > 1:
        _store_row(y_ptr, acc1, 1, M, stride_ym, offs_n, n_mask, scale, W_INT8)
    if BLOCK_M > 2:
        _store_row(y_ptr, acc2, 2, M, stride_ym, offs_n, n_mask, scale, W_INT8)
        _store_row(y_ptr, acc3, 3, M, stride_ym, offs_n, n_mask, scale, W_INT8)
    if BLOCK_M > 4:
        _store_row(y_ptr, acc4, 4, M, stride_ym, offs_n, n_mask, scale, W_INT8)
        _store_row(y_ptr, acc5, 5, M, stride_ym, offs_n, n_mask, scale, W_INT8)
        _store_row(y_ptr, acc6, 6, M, stride_ym, offs_n, n_mask, scale, W_INT8)
        _store_row(y_ptr, acc7, 7, M, stride_ym, offs_n, n_mask, scale, W_INT8)


@triton.jit
def _small_m_dot_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, W_INT8: tl.constexpr, IEEE: tl.constexpr,
):
    """The same product for 2..16 rows of x on the tensor cores: y = x @ w.T (times s), fp32 acc.

    x rows are padded to BLOCK_M = 16 (rows past M re-read row M-1, never stored), so each weight
    tile is read once and used for all rows; the software pipeliner (num_stages) keeps several
    weight tiles in flight through shared memory. Grid: (cdiv(N, BLOCK_N),).
    """
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tl.minimum(offs_m, M - 1)[:, None] * stride_xm + offs_k[None, :]  # (BLOCK_M, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # (BLOCK_N, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs + k0)
            w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
        else:
            k_mask = (k0 + offs_k)[None, :] < K
            x = tl.load(x_ptrs + k0, mask=k_mask, other=0)
            w = tl.load(w_ptrs + k0, mask=k_mask, other=0, eviction_policy="evict_first")
        if W_INT8:
            w = w.to(x.dtype)  # exact: |w| <= 128 fits bf16/fp16/fp32
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if W_INT8:
        acc = acc * tl.load(s_ptr + rows).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@dataclass(frozen=True)
class DotConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def small_m_dot(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor | None = None,
                out: torch.Tensor | None = None, config: DotConfig | None = None) -> torch.Tensor:
    """y = x @ w.T (times scales[n] for int8 w) on the tensor cores, for 2 <= M <= 16 rows of x."""
    m, k = x.shape
    n = w.shape[0]
    if m > 16:
        raise ValueError(f"small_m_dot handles at most 16 rows of x, got {m}")
    if out is None:
        out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if k == 0:
        return out.zero_()
    cfg = config or DotConfig(32, 256, 4, 4)
    w_int8 = w.dtype == torch.int8
    _small_m_dot_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, w, scales if w_int8 else w, out,
        m, n, k,
        x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0, W_INT8=w_int8, IEEE=x.dtype == torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # rows of w per program
    block_k: int  # K elements per loop step
    num_warps: int
    depth: int = 2  # weight blocks in flight per program (software pipeline depth, 1 or 2)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pick_config(m: int, n: int, k: int, w_bytes: int) -> GemvConfig:
    """The config table: deterministic, from the shape alone (BLOCK_M = next_pow2(m) is implied)."""
    if m > 1:  # BLOCK_M accumulators of BLOCK_N * BLOCK_K / threads fp32 registers each
        return GemvConfig(1, 1024, 4)
    if w_bytes == 1:
        return GemvConfig(2, 2048, 4)
    return GemvConfig(1, 2048, 4)


def _pdl_default() -> bool:
    if os.environ.get("REDLINE_PDL", "1") == "0" or gdc_wait is None or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability()[0] >= 9


_PDL: bool | None = None


def gemv(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor | None = None,
         out: torch.Tensor | None = None, config: GemvConfig | None = None,
         pdl: bool | None = None, int8_mode: int | None = None) -> torch.Tensor:
    """y = x @ w.T (times scales[n] for int8 w).

    x: (M, K), M <= 8, unit stride along K; w: (N, K) contiguous; out: (M, N) in x.dtype.
    `config`, `pdl` and `int8_mode` override the defaults (benchmarks and tests use this).
    """
    global _PDL
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_BLOCK_M:
        raise ValueError(f"gemv handles at most {MAX_BLOCK_M} rows of x, got {m}")
    if out is None:
        out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if k == 0:
        return out.zero_()
    cfg = config or pick_config(m, n, k, w.element_size())
    if pdl is None:
        if _PDL is None:
            _PDL = _pdl_default()
        pdl = _PDL
    if int8_mode is None:  # mode 2 is PTX: NVIDIA only
        int8_mode = 1 if torch.version.hip is not None else INT8_MODE_DEFAULT
    w_int8 = w.dtype == torch.int8
    words = w_int8 and k % 4 == 0 and w.stride(0) % 4 == 0 and w.data_ptr() % 4 == 0
    grid = (triton.cdiv(n, cfg.block_n),)
    extra = {"launch_pdl": True} if pdl else {}
    _gemv_kernel[grid](
        x, w, scales if w_int8 else w, out,
        m, n, k,
        x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=next_pow2(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DEPTH=cfg.depth,
        EVEN_K=k % cfg.block_k == 0, W_INT8=w_int8, WORDS=words, INT8_MODE=int8_mode, USE_PDL=pdl,
        num_warps=cfg.num_warps, num_stages=1, **extra,
    )
    return out
