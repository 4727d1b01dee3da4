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
So 8 weights cost 4 shifts and 8 AND-ORs (ptxas makes each two instructions: the mask and the exponent are both
immediates), and no subtraction: the kernel multiplies the biased values by x and removes the bias once per 32
inputs, with sums of x that every row shares:
  sum_k x_k (scale q_k + offset) = scale * (sum_k x_k v_k - sum_k x_k bias_k) + offset * sum_k x_k.
The biases (16 and 256) are small, so the fp32 sums keep all but a few of their bits.

Where the GPU takes inline PTX (NVIDIA) the products are fp16x2 instead, two weights per instruction: per word,
one shift and four LOP3s give the pairs (1024 + q) and (1024 + 16 q) of inputs (i, i + 4) in the two halves of a
register (fp16's mantissa unit at 1024 is 1), one fp16x2 subtract or FMA per pair makes q - 8 exactly (centred, so
the sums carry no common part that the offsets cancel later), and one fp16x2 FMA per pair accumulates (q - 8) * x:
13 instructions per 8 weights against 28 above. x enters as fp16 pairs scaled by a power of two per chunk (its
largest magnitude to 64..128), so the 16 products a half sums stay within 16384, with fp16's 11 bits relative to
the chunk; each chunk's sum leaves in fp32 and is scaled back there:
  sum_k x_k (scale q_k + offset) = scale * 2^-e * (sum_k (2^e x_k) (q_k - 8)) + (offset + 8 scale) * sum_k x_k.

Tiles are (BLOCK_N rows, BLOCK_K / 32 chunks, 4 words): a chunk of 32 inputs lies in one group (G >= 32), so one
(scale, offset) load serves a thread's 16-byte weight load.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import GemvConfig, gemv_int4_config
from .device import device_caps
from .triton_common import gated, gdc_launch_dependents, gdc_wait, pdl_default

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
def _word_to_biased_f32(w):
    """int32 words (C, R) -> fp32 (C, R, 8) in input order: 256 + q at even inputs, 16 + q at odd ones."""
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
def _bf16_pairs_f32(v):
    """int32 words of two bf16 each (C, 1, 4) -> fp32 (C, 1, 8) in memory order, by bit operations."""
    lo = (v << 16).to(tl.float32, bitcast=True)
    hi = (v & -65536).to(tl.float32, bitcast=True)
    return tl.reshape(tl.join(lo, hi), (v.shape[0], v.shape[1], 8))


@triton.jit
def _load_x8_bf16(xw_ptr, gw_ptr, k0, K, offs_p, MASK: tl.constexpr, NORM: tl.constexpr):
    """_load_x8 for bf16 x and norm weight read as int32 pairs (offs_p (C, 1, 4): words from k0 / 2): one
    instruction per value to widen them, where the compiler's bf16 conversion takes one or two."""
    kw = k0 // 2
    if MASK:
        x = _bf16_pairs_f32(tl.load(xw_ptr + kw + offs_p, mask=(k0 + 2 * offs_p) < K, other=0))
    else:
        x = _bf16_pairs_f32(tl.load(xw_ptr + kw + offs_p))
    sq = x * x
    if NORM > 0:
        if MASK:
            x = x * _bf16_pairs_f32(tl.load(gw_ptr + kw + offs_p, mask=(k0 + 2 * offs_p) < K, other=0))
        else:
            x = x * _bf16_pairs_f32(tl.load(gw_ptr + kw + offs_p))
    return x, sq


@triton.jit
def _word_dot(wv, x_ptrs, g_ptrs, k0, K, offs_x, MASK: tl.constexpr, NORM: tl.constexpr):
    """One word of each chunk: (sum of x * (bias + q) (C, R), sum of x * bias (C, 1), sum of x (C, 1), squares)."""
    x, sq = _load_x8(x_ptrs, g_ptrs, k0, K, offs_x, MASK, NORM)  # (C, 1, 8)
    dot = tl.sum(_word_to_biased_f32(wv) * x, axis=2)  # (C, R)
    xe, xo = tl.split(tl.reshape(x, (x.shape[0], x.shape[1], 4, 2)))  # (C, 1, 4): even and odd inputs
    se = tl.sum(xe, axis=2)
    so = tl.sum(xo, axis=2)
    return dot, 256.0 * se + 16.0 * so, se + so, tl.sum(sq, axis=2)


@triton.jit
def _chunk_scales(sz_ptrs, k0, KG, offs_c, MASK: tl.constexpr, G: tl.constexpr):
    """(scale, offset) (C, R) fp32 of the group of each chunk of the block at input k0."""
    group = (k0 + _CHUNK * offs_c) // G  # (C, 1): each chunk's group
    if MASK:
        sz = tl.load(sz_ptrs + group, mask=group < KG, other=0)
    else:
        sz = tl.load(sz_ptrs + group)  # (C, R) int32: fp16 scale | fp16 offset << 16
    scale = (sz & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    offset = (sz >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return scale, offset


def _half2_chunk_asm() -> str:
    """PTX of one 32-input chunk: $1..$4 the chunk's words, $(5 + 4w + i) the fp16x2 pair (x[8w + i], x[8w + 4 + i])
    (low half first); $0 the fp32 sum of (q - 8) * x over the chunk, accumulated as fp16x2."""
    lines = ["{", ".reg .b32 t, v0, v1, v2, v3, acc, mlo, mhi, magic, bias, sixteenth, m72;", ".reg .b16 l, h;",
             ".reg .f32 a, b;",
             "mov.b32 mlo, 0x000F000F;", "mov.b32 mhi, 0x00F000F0;",
             "mov.b32 magic, 0x64006400;",  # 1024 in both halves: the exponent the nibbles are ORed under
             "mov.b32 bias, 0x64086408;",  # 1032 = 1024 + 8
             "mov.b32 sixteenth, 0x2C002C00;", "mov.b32 m72, 0xD480D480;",  # 1/16 and -72 = -(1024 / 16 + 8)
             "mov.b32 acc, 0;"]
    for w in range(4):
        word = f"${1 + w}"
        lines += [f"shr.u32 t, {word}, 8;",
                  f"lop3.b32 v0, {word}, mlo, magic, 0xEA;",  # inputs 0, 4: 1024 + q
                  f"lop3.b32 v1, {word}, mhi, magic, 0xEA;",  # inputs 1, 5: 1024 + 16 q
                  "lop3.b32 v2, t, mlo, magic, 0xEA;",  # inputs 2, 6
                  "lop3.b32 v3, t, mhi, magic, 0xEA;",  # inputs 3, 7
                  "sub.rn.f16x2 v0, v0, bias;",  # q - 8
                  "fma.rn.f16x2 v1, v1, sixteenth, m72;",
                  "sub.rn.f16x2 v2, v2, bias;",
                  "fma.rn.f16x2 v3, v3, sixteenth, m72;"]
        lines += [f"fma.rn.f16x2 acc, v{i}, ${5 + 4 * w + i}, acc;" for i in range(4)]
    lines += ["mov.b32 {l, h}, acc;", "cvt.f32.f16 a, l;", "cvt.f32.f16 b, h;", "add.f32 $0, a, b;", "}"]
    return "\n".join(lines)


_HALF2_CHUNK_ASM = tl.constexpr(_half2_chunk_asm())


@triton.jit
def _split4(t):
    """The four entries of the last axis (size 4) of t, in order."""
    a, b = tl.split(tl.reshape(t, (t.shape[0], t.shape[1], 2, 2)))  # entries 0, 2 | 1, 3
    e0, e2 = tl.split(a)
    e1, e3 = tl.split(b)
    return e0, e1, e2, e3


@triton.jit
def _x_half2_pairs(x8, up):
    """x8 (C, 1, 8) fp32 times up (C, 1) as four fp16x2 words (C, 1): (x[i], x[i + 4]) for i = 0..3."""
    xs = tl.permute(tl.reshape(x8 * up[:, :, None], (x8.shape[0], 1, 2, 4)), (0, 1, 3, 2))  # (C, 1, 4, 2)
    lo, hi = tl.split(xs)  # (C, 1, 4): x[i], x[i + 4]
    packed = tl.inline_asm_elementwise(asm="cvt.rn.f16x2.f32 $0, $2, $1;", constraints="=r,r,r", args=[lo, hi],
                                       dtype=tl.int32, is_pure=True, pack=1)
    return _split4(packed)


@triton.jit
def _int4_step_half2(acc, ss, w, x_ptrs, g_ptrs, sz_ptrs, k0, K, KG, offs_x, offs_c, xw_ptr, gw_ptr,
                     MASK: tl.constexpr, NORM: tl.constexpr, G: tl.constexpr, X_BF16: tl.constexpr):
    """_int4_step with fp16x2 products (inline PTX): the same sums, x scaled per chunk by a power of two.
    X_BF16: x (and the norm weight) are bf16, read as int32 pairs at xw_ptr (gw_ptr)."""
    w0, w1, w2, w3 = _split4(w)  # (C, R) each
    if X_BF16:
        offs_p = offs_c[:, :, None] * (_CHUNK // 2) + tl.arange(0, 4)[None, None, :]  # (C, 1, 4): first word's pairs
        x0, q0 = _load_x8_bf16(xw_ptr, gw_ptr, k0, K, offs_p, MASK, NORM)  # (C, 1, 8)
        x1, q1 = _load_x8_bf16(xw_ptr, gw_ptr, k0, K, offs_p + 4, MASK, NORM)
        x2, q2 = _load_x8_bf16(xw_ptr, gw_ptr, k0, K, offs_p + 8, MASK, NORM)
        x3, q3 = _load_x8_bf16(xw_ptr, gw_ptr, k0, K, offs_p + 12, MASK, NORM)
    else:
        x0, q0 = _load_x8(x_ptrs, g_ptrs, k0, K, offs_x, MASK, NORM)  # (C, 1, 8)
        x1, q1 = _load_x8(x_ptrs + 8, g_ptrs + 8, k0, K, offs_x + 8, MASK, NORM)
        x2, q2 = _load_x8(x_ptrs + 16, g_ptrs + 16, k0, K, offs_x + 16, MASK, NORM)
        x3, q3 = _load_x8(x_ptrs + 24, g_ptrs + 24, k0, K, offs_x + 24, MASK, NORM)
    if NORM == 1:
        ss += tl.sum((q0 + q1) + (q2 + q3), axis=2)
    sx = tl.sum((x0 + x1) + (x2 + x3), axis=2)  # (C, 1)
    mx = tl.max(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3))), axis=2)
    # 2^e with e = 133 - (mx's biased exponent) brings mx to 64..128; clamped so that both powers stay normal
    # (0 and NaN chunks included: NaN keeps its exponent of 255 and stays NaN).
    eb = tl.minimum(tl.maximum(260 - (mx.to(tl.int32, bitcast=True) >> 23), 1), 253)  # (C, 1): e + 127
    up = (eb << 23).to(tl.float32, bitcast=True)
    down = ((254 - eb) << 23).to(tl.float32, bitcast=True)
    p00, p01, p02, p03 = _x_half2_pairs(x0, up)
    p10, p11, p12, p13 = _x_half2_pairs(x1, up)
    p20, p21, p22, p23 = _x_half2_pairs(x2, up)
    p30, p31, p32, p33 = _x_half2_pairs(x3, up)
    dot = tl.inline_asm_elementwise(
        asm=_HALF2_CHUNK_ASM, constraints="=r" + ",r" * 20,
        args=[w0, w1, w2, w3, p00, p01, p02, p03, p10, p11, p12, p13, p20, p21, p22, p23, p30, p31, p32, p33],
        dtype=tl.float32, is_pure=True, pack=1)  # (C, R): sum of (q - 8) * 2^e x over the chunk
    scale, offset = _chunk_scales(sz_ptrs, k0, KG, offs_c, MASK, G)  # (C, R) each
    acc += scale * (dot * down) + (offset + 8.0 * scale) * sx
    return acc, ss


@triton.jit
def _int4_step(acc, ss, w, x_ptrs, g_ptrs, sz_ptrs, k0, K, KG, offs_x, offs_c, xw_ptr, gw_ptr,
               MASK: tl.constexpr, NORM: tl.constexpr, G: tl.constexpr, HALF2: tl.constexpr, X_BF16: tl.constexpr):
    """acc (C, R) += the block of words w (C, R, 4) at input k0 times x, one (scale, offset) per chunk of 32
    inputs; ss (C, 1) += the squares of x with NORM == 1. HALF2: fp16x2 products (inline PTX), else fp32."""
    if HALF2:
        return _int4_step_half2(acc, ss, w, x_ptrs, g_ptrs, sz_ptrs, k0, K, KG, offs_x, offs_c, xw_ptr, gw_ptr,
                                MASK, NORM, G, X_BF16)
    wl, wh = tl.split(tl.reshape(w, (w.shape[0], w.shape[1], 2, 2)))  # words 0, 2 | 1, 3 of each chunk
    w0, w2 = tl.split(wl)
    w1, w3 = tl.split(wh)
    d0, b0, s0, q0 = _word_dot(w0, x_ptrs, g_ptrs, k0, K, offs_x, MASK, NORM)
    d1, b1, s1, q1 = _word_dot(w1, x_ptrs + 8, g_ptrs + 8, k0, K, offs_x + 8, MASK, NORM)
    d2, b2, s2, q2 = _word_dot(w2, x_ptrs + 16, g_ptrs + 16, k0, K, offs_x + 16, MASK, NORM)
    d3, b3, s3, q3 = _word_dot(w3, x_ptrs + 24, g_ptrs + 24, k0, K, offs_x + 24, MASK, NORM)
    if NORM == 1:
        ss += (q0 + q1) + (q2 + q3)
    scale, offset = _chunk_scales(sz_ptrs, k0, KG, offs_c, MASK, G)  # (C, R) each
    dot = (d0 + d1) + (d2 + d3)
    acc += scale * (dot - ((b0 + b1) + (b2 + b3))) + offset * ((s0 + s1) + (s2 + s3))
    return acc, ss


@triton.jit
def _gemv_int4_kernel(
    x_ptr, w_ptr, sz_ptr, y_ptr, g_ptr, r_ptr, sq_in_ptr, sq_out_ptr,
    N, K, KW, KG, eps,
    G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DEPTH: tl.constexpr,
    EVEN_K: tl.constexpr, NO_MASK: tl.constexpr, USE_PDL: tl.constexpr, HALF2: tl.constexpr, X_BF16: tl.constexpr,
    NORM: tl.constexpr, RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr, GELU: tl.constexpr, SQ_OUT: tl.constexpr,
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
    xw_ptr = x_ptr.to(tl.pointer_type(tl.int32))  # with X_BF16: x and the norm weight as pairs
    gw_ptr = g_ptr.to(tl.pointer_type(tl.int32))
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
                                 xw_ptr, gw_ptr, False, NORM, G, HALF2, X_BF16)
            wa = wb
            wb = wc
        ka = tl.maximum(nb - 2, 0) * BLOCK_K
        acc, ss = _int4_step(acc, ss, wa, x_ptrs, g_ptrs, sz_ptrs, ka, K, KG, offs_x, offs_c, xw_ptr, gw_ptr,
                             not NO_MASK, NORM, G, HALF2, X_BF16)
        acc, ss = _int4_step(acc, ss, wb, x_ptrs, g_ptrs, sz_ptrs, ka + BLOCK_K, K, KG, offs_x, offs_c, xw_ptr,
                             gw_ptr, not NO_MASK, NORM, G, HALF2, X_BF16)
    else:
        for kb in range(1, nb):
            wc = _load_w(w_ptrs, kb * BKW, KW, offs_w, not EVEN_K)
            acc, ss = _int4_step(acc, ss, wa, x_ptrs, g_ptrs, sz_ptrs, (kb - 1) * BLOCK_K, K, KG, offs_x, offs_c,
                                 xw_ptr, gw_ptr, False, NORM, G, HALF2, X_BF16)
            wa = wc
        acc, ss = _int4_step(acc, ss, wa, x_ptrs, g_ptrs, sz_ptrs, (nb - 1) * BLOCK_K, K, KG, offs_x, offs_c, xw_ptr,
                             gw_ptr, not NO_MASK, NORM, G, HALF2, X_BF16)

    out = tl.sum(acc, axis=0)  # (BLOCK_N,)
    if NORM == 1:
        out = out * tl.rsqrt(tl.sum(ss) / K + eps)
    if NORM == 2:
        out = out * tl.rsqrt(sq_in / K + eps)
    out_ty = y_ptr.dtype.element_ty
    if SWIGLU:
        gate, up = tl.split(tl.trans(tl.reshape(out, (2, HALF))))  # (HALF,) each
        out = gated(gate, up, GELU, out_ty)
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
              sq_in: torch.Tensor | None = None, sq_out: torch.Tensor | None = None,
              half2: bool | None = None, gelu: bool = False) -> torch.Tensor:
    """y = x @ dequantize_int4(w, sz).T for one row of x, with triton_linear.gemv's decode fusions (same arguments).

    x: (1, K) or (K,) contiguous; w: uint8 (N, K/2) contiguous; sz: fp16 (N, K/G, 2) contiguous, G a power of
    two >= 32 dividing K. `config`, `pdl` and `half2` (fp16x2 products in inline PTX; default: where the GPU takes
    PTX) override the defaults (benchmarks and tests use this).
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
        HALF2=caps.inline_ptx if half2 is None else half2,
        X_BF16=x.dtype == torch.bfloat16 and (norm_weight is None or norm_weight.dtype == torch.bfloat16),
        NORM=0 if norm_weight is None else (2 if sq_in is not None else 1), RESIDUAL=residual is not None,
        SWIGLU=swiglu, GELU=gelu, SQ_OUT=sq_out is not None, SQ_LANES=lanes.numel() if lanes is not None else 1,
        num_warps=cfg.num_warps, num_stages=1, **extra,
    )
    return out
