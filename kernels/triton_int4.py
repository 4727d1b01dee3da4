"""The int4 matrix-vector kernel (batch-1 decode): y = x @ W.T with W in quantize.py's packed int4 layout.

W is uint8 (N, K/2) read as int32 words, 8 consecutive inputs per word (input 8j + i in bits 4i..4i+3 of word j);
`sz` is fp16 (N, K/G, 2) read as one int32 per (row, group): the scale in the low half, the offset in the high
half, so a weight is scale * q + offset. Every packed byte is read once, like the bf16/int8 GEMV in
triton_linear.py, whose fusions (RMSNorm prologue, SwiGLU or residual epilogue, sums of squares, PDL) this kernel
has too.

Nibbles become floats without integer-to-float conversions (the magic-exponent trick, in plain Triton integer ops
on bitcast tensors, so it runs on any GPU Triton targets): a word shifted so that two neighbouring nibbles sit in
bits 15..18 and 19..22 gives, after one AND with the two-nibble mask and one OR with a fixed exponent,
  - bits 15..18 under the exponent of 256 (0x43800000): the float 256 + q (its mantissa unit there is 1),
  - bits 19..22 under the exponent of 16  (0x41800000): the float 16 + q.
So 8 weights cost 4 shifts and 8 AND-ORs (one LOP3 each), and no subtraction: the kernel multiplies the biased
values by x and removes the bias once per 32 inputs, with sums of x that every row shares:
  sum_k x_k (scale q_k + offset) = scale * (sum_k x_k v_k - sum_k x_k bias_k) + offset * sum_k x_k.
The biases (16 and 256) are small, so the fp32 sums keep all but a few of their bits.

Tiles are (BLOCK_N rows, BLOCK_K / 32 chunks, 4 words): a chunk of 32 inputs lies in one group (G >= 32), so one
(scale, offset) load serves a thread's 16-byte weight load.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import GemvConfig, gemv_int4_config
from .device import device_caps
from .triton_common import gdc_launch_dependents, gdc_wait, pdl_default

# Inputs per chunk: four 32-bit words of 8 nibbles, the unit that shares one (scale, offset).
CHUNK = 32
_CHUNK = tl.constexpr(CHUNK)  # the same, for the kernels


@triton.jit
def _nibble_pair(w, SHIFT: tl.constexpr):
    """Two nibbles of each int32 word as floats: the one SHIFT moves to bits 15..18 as 256 + q, the next as 16 + q."""
    if SHIFT > 0:
        v = w << SHIFT
    elif SHIFT < 0:
        v = w >> (-SHIFT)  # arithmetic: the sign bits are masked off below
    else:
        v = w
    lo = ((v & 0x00078000) | 0x43800000).to(tl.float32, bitcast=True)
    hi = ((v & 0x00780000) | 0x41800000).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _word_to_biased_f32(w, PTX: tl.constexpr):
    """int32 words (C, R) -> fp32 (C, R, 8) in input order: 256 + q at even inputs, 16 + q at odd ones.

    PTX: one lop3 per weight in inline PTX (ptxas splits the plain form's AND and OR, which take two immediates,
    into two instructions); otherwise the same in Triton integer ops, for any GPU and the interpreter."""
    if PTX:
        f0, f1, f2, f3, f4, f5, f6, f7 = tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 a, b, c, d, lo, hi, mlo, mhi;
            mov.b32 lo, 0x00078000;
            mov.b32 hi, 0x00780000;
            mov.b32 mlo, 0x43800000;
            mov.b32 mhi, 0x41800000;
            shl.b32 a, $8, 15;
            shl.b32 b, $8, 7;
            shr.u32 c, $8, 1;
            shr.u32 d, $8, 9;
            lop3.b32 $0, a, lo, mlo, 0xEA;
            lop3.b32 $1, a, hi, mhi, 0xEA;
            lop3.b32 $2, b, lo, mlo, 0xEA;
            lop3.b32 $3, b, hi, mhi, 0xEA;
            lop3.b32 $4, c, lo, mlo, 0xEA;
            lop3.b32 $5, c, hi, mhi, 0xEA;
            lop3.b32 $6, d, lo, mlo, 0xEA;
            lop3.b32 $7, d, hi, mhi, 0xEA;
            }
            """,
            constraints="=r,=r,=r,=r,=r,=r,=r,=r,r",
            args=[w],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )
    else:
        f0, f1 = _nibble_pair(w, 15)
        f2, f3 = _nibble_pair(w, 7)
        f4, f5 = _nibble_pair(w, -1)
        f6, f7 = _nibble_pair(w, -9)
    # Nested joins add axes (a, b, c) holding input 4a + 2b + c of the word, so the reshape keeps input order.
    f = tl.join(tl.join(tl.join(f0, f4), tl.join(f2, f6)), tl.join(tl.join(f1, f5), tl.join(f3, f7)))
    return tl.reshape(f, (w.shape[0], w.shape[1], 8))


@triton.jit
def _load_w(ptrs, kw0, KW, offs_w, MASK: tl.constexpr):
    # Weights are read once: evict_first keeps them from pushing x and y out of L2.
    if MASK:
        return tl.load(ptrs + kw0, mask=(kw0 + offs_w) < KW, other=0, eviction_policy="evict_first")
    return tl.load(ptrs + kw0, eviction_policy="evict_first")


@triton.jit
def _load_x8(x_ptrs, g_ptrs, k0, K, offs_x, MASK: tl.constexpr, NORM: tl.constexpr):
    """x[k0 + offs_x] (C, 1, 8) as fp32 (times the norm weight with NORM), and its squares."""
    if MASK:
        x = tl.load(x_ptrs + k0, mask=(k0 + offs_x) < K, other=0).to(tl.float32)
    else:
        x = tl.load(x_ptrs + k0).to(tl.float32)
    sq = x * x
    if NORM > 0:
        if MASK:
            x = x * tl.load(g_ptrs + k0, mask=(k0 + offs_x) < K, other=0).to(tl.float32)
        else:
            x = x * tl.load(g_ptrs + k0).to(tl.float32)
    return x, sq


@triton.jit
def _word_dot(wv, x_ptrs, g_ptrs, k0, K, offs_x, MASK: tl.constexpr, NORM: tl.constexpr, PTX: tl.constexpr):
    """One word of each chunk: (sum of x * (bias + q) (C, R), sum of x * bias (C, 1), sum of x (C, 1), squares)."""
    x, sq = _load_x8(x_ptrs, g_ptrs, k0, K, offs_x, MASK, NORM)  # (C, 1, 8)
    dot = tl.sum(_word_to_biased_f32(wv, PTX) * x, axis=2)  # (C, R)
    xe, xo = tl.split(tl.reshape(x, (x.shape[0], x.shape[1], 4, 2)))  # (C, 1, 4): even and odd inputs
    se = tl.sum(xe, axis=2)
    so = tl.sum(xo, axis=2)
    return dot, 256.0 * se + 16.0 * so, se + so, tl.sum(sq, axis=2)


@triton.jit
def _int4_step(acc, ss, w, x_ptrs, g_ptrs, sz_ptrs, k0, K, KG, offs_x, offs_c,
               MASK: tl.constexpr, NORM: tl.constexpr, G: tl.constexpr, PTX: tl.constexpr):
    """acc (C, R) += the block of words w (C, R, 4) at input k0 times x, one (scale, offset) per chunk of 32
    inputs; ss (C, 1) += the squares of x with NORM == 1."""
    wl, wh = tl.split(tl.reshape(w, (w.shape[0], w.shape[1], 2, 2)))  # words 0, 2 | 1, 3 of each chunk
    w0, w2 = tl.split(wl)
    w1, w3 = tl.split(wh)
    d0, b0, s0, q0 = _word_dot(w0, x_ptrs, g_ptrs, k0, K, offs_x, MASK, NORM, PTX)
    d1, b1, s1, q1 = _word_dot(w1, x_ptrs + 8, g_ptrs + 8, k0, K, offs_x + 8, MASK, NORM, PTX)
    d2, b2, s2, q2 = _word_dot(w2, x_ptrs + 16, g_ptrs + 16, k0, K, offs_x + 16, MASK, NORM, PTX)
    d3, b3, s3, q3 = _word_dot(w3, x_ptrs + 24, g_ptrs + 24, k0, K, offs_x + 24, MASK, NORM, PTX)
    if NORM == 1:
        ss += (q0 + q1) + (q2 + q3)
    group = (k0 + _CHUNK * offs_c) // G  # (C, 1): each chunk's group
    if MASK:
        sz = tl.load(sz_ptrs + group, mask=group < KG, other=0)
    else:
        sz = tl.load(sz_ptrs + group)  # (C, R) int32: fp16 scale | fp16 offset << 16
    scale = (sz & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    offset = (sz >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    dot = (d0 + d1) + (d2 + d3)
    acc += scale * (dot - ((b0 + b1) + (b2 + b3))) + offset * ((s0 + s1) + (s2 + s3))
    return acc, ss


@triton.jit
def _gemv_int4_kernel(
    x_ptr, w_ptr, sz_ptr, y_ptr, g_ptr, r_ptr, sq_in_ptr, sq_out_ptr,
    N, K, KW, KG, eps,
    G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DEPTH: tl.constexpr,
    EVEN_K: tl.constexpr, NO_MASK: tl.constexpr, USE_PDL: tl.constexpr, PTX: tl.constexpr,
    NORM: tl.constexpr, RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr, SQ_OUT: tl.constexpr,
    SQ_LANES: tl.constexpr,
):
    """y[n] = sum_k x[k] * (scale[n, k // G] * q[n, k] + offset[n, k // G]), fp32 accumulation, with the fusions
    of triton_linear._gemv_kernel (NORM 1/2, SQ_OUT, SWIGLU, RESIDUAL: the same meanings and roundings).

    x: (K,) contiguous, K % 32 == 0; w: (N or 2N, KW = K/8) int32 words, contiguous; sz: (N or 2N, KG = K/G)
    int32. (KW and KG are arguments rather than computed from K so that Triton sees their divisibility by 16
    and loads 16-byte vectors.)
    EVEN_K: K % BLOCK_K == 0; NO_MASK: EVEN_K and K >= DEPTH * BLOCK_K.
    Grid: (cdiv(N, BLOCK_N),), or (cdiv(N, BLOCK_N // 2),) with SWIGLU.
    """
    C: tl.constexpr = BLOCK_K // _CHUNK
    BKW: tl.constexpr = BLOCK_K // 8
    pid = tl.program_id(0)
    offs_b = tl.arange(0, BLOCK_N)
    if SWIGLU:
        HALF: tl.constexpr = BLOCK_N // 2
        offs_n = pid * HALF + tl.arange(0, HALF)  # (HALF,) outputs
        rows = tl.minimum(pid * HALF + offs_b % HALF, N - 1) + (offs_b // HALF) * N  # (BLOCK_N,) gate then up rows
    else:
        offs_n = pid * BLOCK_N + offs_b
        rows = tl.minimum(offs_n, N - 1)  # rows past N re-read row N-1; they are not stored
    # A thread holds one chunk (4 words, one 16-byte load) of every row of the block; its threads and warps lie
    # along the chunks (the first axis: with the chunks' contiguity hidden, Triton lays threads along it rather
    # than along the rows), so each thread's x values (16-byte vectors of 8) serve all of its rows, with nothing
    # exchanged between threads until the final sum.
    offs_c = tl.max_contiguous(tl.arange(0, C), 1)[:, None, None]  # (C, 1, 1)
    offs_w = offs_c * 4 + tl.arange(0, 4)[None, None, :]  # (C, 1, 4): words of a block
    offs_x = offs_c * _CHUNK + tl.arange(0, 8)[None, None, :]  # (C, 1, 8): the first word's inputs
    w_ptrs = w_ptr + rows.to(tl.int64)[None, :, None] * KW + offs_w  # (C, BLOCK_N, 4)
    sz_ptrs = sz_ptr + rows.to(tl.int64)[None, :] * KG  # (1, BLOCK_N)
    x_ptrs = x_ptr + offs_x
    g_ptrs = g_ptr + offs_x
    offs_c = tl.reshape(offs_c, (C, 1))
    acc = tl.zeros((C, BLOCK_N), dtype=tl.float32)
    ss = tl.zeros((C, 1), dtype=tl.float32)
    nb = (K + BLOCK_K - 1) // BLOCK_K

    # Prologue: the first DEPTH weight blocks, which do not depend on the kernel before (PDL overlaps them with it).
    wa = _load_w(w_ptrs, 0, KW, offs_w, not NO_MASK)
    if DEPTH == 2:
        wb = _load_w(w_ptrs, BKW, KW, offs_w, not NO_MASK)
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    if NORM == 2:
        sq_in = tl.sum(tl.load(sq_in_ptr + tl.arange(0, SQ_LANES)))
    if RESIDUAL:
        res = tl.load(r_ptr + offs_n, mask=offs_n < N, other=0).to(tl.float32)

    if DEPTH == 2:
        for kb in range(2, nb):
            wc = _load_w(w_ptrs, kb * BKW, KW, offs_w, not EVEN_K)
            acc, ss = _int4_step(acc, ss, wa, x_ptrs, g_ptrs, sz_ptrs, (kb - 2) * BLOCK_K, K, KG, offs_x, offs_c,
                                 False, NORM, G, PTX)
            wa = wb
            wb = wc
        ka = tl.maximum(nb - 2, 0) * BLOCK_K
        acc, ss = _int4_step(acc, ss, wa, x_ptrs, g_ptrs, sz_ptrs, ka, K, KG, offs_x, offs_c, not NO_MASK, NORM, G, PTX)
        acc, ss = _int4_step(acc, ss, wb, x_ptrs, g_ptrs, sz_ptrs, ka + BLOCK_K, K, KG, offs_x, offs_c,
                             not NO_MASK, NORM, G, PTX)
    else:
        for kb in range(1, nb):
            wc = _load_w(w_ptrs, kb * BKW, KW, offs_w, not EVEN_K)
            acc, ss = _int4_step(acc, ss, wa, x_ptrs, g_ptrs, sz_ptrs, (kb - 1) * BLOCK_K, K, KG, offs_x, offs_c,
                                 False, NORM, G, PTX)
            wa = wc
        acc, ss = _int4_step(acc, ss, wa, x_ptrs, g_ptrs, sz_ptrs, (nb - 1) * BLOCK_K, K, KG, offs_x, offs_c,
                             not NO_MASK, NORM, G, PTX)

    out = tl.sum(acc, axis=0)  # (BLOCK_N,)
    if NORM == 1:
        out = out * tl.rsqrt(tl.sum(ss) / K + eps)
    if NORM == 2:
        out = out * tl.rsqrt(sq_in / K + eps)
    out_ty = y_ptr.dtype.element_ty
    if SWIGLU:
        gate, up = tl.split(tl.trans(tl.reshape(out, (2, HALF))))  # (HALF,) each
        gate = gate.to(out_ty).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(out_ty).to(tl.float32)
        out = act * up.to(out_ty).to(tl.float32)
    if RESIDUAL:
        out = out.to(out_ty).to(tl.float32) + res
    tl.store(y_ptr + offs_n, out.to(out_ty), mask=offs_n < N)
    if SQ_OUT:
        y = tl.where(offs_n < N, out.to(out_ty).to(tl.float32), 0.0)
        tl.atomic_add(sq_out_ptr + pid % SQ_LANES, tl.sum(y * y), sem="relaxed")


def gemv_int4(x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor, out: torch.Tensor | None = None,
              config: GemvConfig | None = None, pdl: bool | None = None,
              norm_weight: torch.Tensor | None = None, eps: float = 0.0,
              residual: torch.Tensor | None = None, swiglu: bool = False,
              sq_in: torch.Tensor | None = None, sq_out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequantize_int4(w, sz).T for one row of x, with triton_linear.gemv's decode fusions (same arguments).

    x: (1, K) or (K,) contiguous; w: uint8 (N, K/2) contiguous; sz: fp16 (N, K/G, 2) contiguous, G a power of
    two >= 32 dividing K. `config` and `pdl` override the defaults (benchmarks and tests use this).
    """
    k = x.shape[-1]
    rows = w.shape[0]
    n = rows // 2 if swiglu else rows
    groups = sz.shape[1]
    if x.numel() != k:
        raise ValueError(f"gemv_int4 takes one row of x, got shape {tuple(x.shape)}")
    if w.shape != (rows, k // 2) or sz.shape != (rows, groups, 2) or groups == 0 or k % groups:
        raise ValueError(f"gemv_int4: weight {tuple(w.shape)} / scales {tuple(sz.shape)} do not fit K={k}")
    group_size = k // groups
    if group_size < CHUNK or group_size & (group_size - 1):
        raise ValueError(f"gemv_int4 needs a power-of-two group size >= {CHUNK}, got {group_size}")
    if out is None:
        out = torch.empty((*x.shape[:-1], n), device=x.device, dtype=x.dtype)
    if n == 0:
        return out
    cfg = config or gemv_int4_config(rows, k, group_size, fused_input=norm_weight is not None, swiglu=swiglu,
                                     residual=residual is not None)
    if swiglu and cfg.block_n % 2:
        raise ValueError(f"a SwiGLU GEMV needs an even block_n (gate and up rows), got {cfg.block_n}")
    if cfg.block_k % CHUNK:
        raise ValueError(f"gemv_int4 needs block_k a multiple of {CHUNK}, got {cfg.block_k}")
    caps = device_caps(x.device)
    if pdl is None:
        pdl = pdl_default(caps)
    even_k = k % cfg.block_k == 0
    extra = {"launch_pdl": True} if pdl else {}
    rows_per_program = cfg.block_n // 2 if swiglu else cfg.block_n
    words = w.view(torch.int32)  # (N, K/8)
    sz_words = sz.view(torch.int32).view(rows, groups)  # (N, K/G)
    lanes = sq_in if sq_in is not None else sq_out
    _gemv_int4_kernel[(triton.cdiv(n, rows_per_program),)](
        x, words, sz_words, out,
        norm_weight if norm_weight is not None else x, residual if residual is not None else x,
        sq_in if sq_in is not None else out, sq_out if sq_out is not None else out,
        n, k, k // 8, groups, eps,
        G=group_size, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DEPTH=cfg.depth,
        EVEN_K=even_k, NO_MASK=even_k and k >= cfg.depth * cfg.block_k, USE_PDL=pdl,
        PTX=caps.inline_ptx,
        NORM=0 if norm_weight is None else (2 if sq_in is not None else 1), RESIDUAL=residual is not None,
        SWIGLU=swiglu, SQ_OUT=sq_out is not None, SQ_LANES=lanes.numel() if lanes is not None else 1,
        num_warps=cfg.num_warps, num_stages=1, **extra,
    )
    return out
