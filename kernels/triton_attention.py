"""Triton flash-decoding: one query token per sequence against a static KV cache.

At decode time each sequence has one query row per head (B * H rows in all), so one program per
row would leave most of the GPU idle while each program walks the whole cache. `decode_attention`
instead:

- gives each program ALL query heads of one KV group (H // Hkv rows), so a K/V byte is read once
  per group (GQA reuse), and splits the valid key range 0..input_pos across NUM_SPLITS programs per
  group (grid (B * Hkv, NUM_SPLITS)); each keeps a running max, sum and fp32 accumulator (online
  softmax, exp2 with log2(e) folded into the scale) and writes its partial (m, l, acc);
- computes q k^T and p v with tl.dot, the group's rows padded to 16 (MHA: 1 real row of 16): the
  tensor-core path pipelines K/V tiles through shared memory and ran about 2x faster on an H200
  than FMA reductions over one row, which cannot be pipelined that way;
- reads input_pos on the device and divides only the VALID keys among the splits, so the bytes read
  follow the valid length and every split gets work at every position; splits left without keys
  (short prefixes) store nothing, and the combine kernel reads only the splits that had keys;
- fixes NUM_SPLITS from the shapes alone (never from input_pos), so a CUDA graph captured once is
  correct at every position;
- combines the partials with a second, small kernel (one program per query row), or writes the
  output directly when there is only one split;
- with `decode_attention_qkv` (the fused decode path) takes the raw qkv projection instead: it rotates
  q and the new key with rope, and the split that owns the current position writes the key and value
  into the caches before its group reads them (one launch instead of rope and cache-write kernels).

`prefill_rope_cache` serves a prefill from position 0: one pass over the qkv projection that rotates the
queries and keys and writes keys and values straight into the caches (tiles of tokens x one head).

Configs come from a deterministic table (configs.attention_config), never from autotuning, so nothing
compiles or benchmarks inside CUDA-graph capture. Only kernels/attention.py imports this module, lazily.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .configs import PIPELINE_SMEM_BYTES, AttentionConfig, fitted_attention_config
from .device import device_caps
from .triton_common import gdc_launch_dependents, gdc_wait, pdl_default

LOG2E = 1.4426950408889634  # exp(x) == exp2(x * LOG2E): the kernels fold it into the score scale
COMBINE_SPLIT_TILE = 16  # partials the combine kernel reads per step
DOT_MIN_ROWS = 16  # tl.dot needs at least 16 rows: a KV group's query heads are padded to this
PREFILL_BLOCK_ELEMENTS = 4096  # elements per tile of the prefill rope kernel (32 tokens of a 128-wide head)


@triton.jit
def _valid_blocks(pos_ptr, seq_len, num_splits, window, BLOCK_S: tl.constexpr, WINDOW: tl.constexpr):
    """(keys up to input_pos, the first key in the window, the first block holding it, blocks of keys per split,
    splits that hold keys), all from input_pos on the device. WINDOW: only the last `window` keys are seen."""
    pos = tl.load(pos_ptr).to(tl.int32)
    length = tl.minimum(tl.maximum(pos + 1, 1), seq_len)  # clamped: never read outside the cache
    lo = tl.maximum(length - window, 0) if WINDOW else 0
    first_block = lo // BLOCK_S
    n_blocks = tl.cdiv(length, BLOCK_S) - first_block
    per_split = tl.cdiv(n_blocks, num_splits)
    active = tl.cdiv(n_blocks, per_split)
    return length, lo, first_block, per_split, active


@triton.jit
def _rope_row(row_ptr, offs_d, HALF: tl.constexpr, FULL: tl.constexpr):
    """cos and sin of each feature offs_d (..., D) from one (2, HALF) table row: pair d % HALF for the first 2 HALF
    features; past them (partial rotary, FULL false) cos 1 and sin 0, so those features pass through."""
    if FULL:
        return tl.load(row_ptr + offs_d % HALF), tl.load(row_ptr + HALF + offs_d % HALF)
    rotated = offs_d < 2 * HALF
    return (tl.load(row_ptr + offs_d % HALF, mask=rotated, other=1.0),
            tl.load(row_ptr + HALF + offs_d % HALF, mask=rotated, other=0.0))


@triton.jit
def _rotated(ptr, offs_d, cos, sin, HALF: tl.constexpr):
    """Rotate-half rope of rows at ptr (offsets offs_d (..., D)) over their first 2 HALF features:
    x * cos + rotate_half(x) * sin, fp32 (features past them have cos 1 and sin 0: partial rotary)."""
    x = tl.load(ptr + offs_d).to(tl.float32)
    partner = tl.load(ptr + (offs_d + HALF) % (2 * HALF)).to(tl.float32)
    return x * cos + tl.where(offs_d < HALF, -partner, partner) * sin


@triton.jit
def _normed_rotated(ptr, offs_d, cos, sin, HALF: tl.constexpr, w_ptr, eps, HEAD_DIM: tl.constexpr,
                    ROW_AXIS: tl.constexpr, dtype: tl.constexpr):
    """_rotated of rows first normalized as model.rms_norm does over each row's HEAD_DIM features (Qwen3's per-head
    q/k norm): x * rsqrt(mean(x**2) + eps) in fp32, rounded to dtype, times the weight w_ptr (D,), rounded again.
    ROW_AXIS: the axis of offs_d that holds a row's features."""
    x = tl.load(ptr + offs_d).to(tl.float32)  # (..., D)
    inv = tl.rsqrt(tl.sum(x * x, axis=ROW_AXIS, keep_dims=True) / HEAD_DIM + eps)  # (..., 1)
    partner_d = (offs_d + HALF) % (2 * HALF)
    partner = tl.load(ptr + partner_d).to(tl.float32)
    x = ((x * inv).to(dtype).to(tl.float32) * tl.load(w_ptr + offs_d).to(tl.float32)).to(dtype).to(tl.float32)
    partner = ((partner * inv).to(dtype).to(tl.float32)
               * tl.load(w_ptr + partner_d).to(tl.float32)).to(dtype).to(tl.float32)
    return x * cos + tl.where(offs_d < HALF, -partner, partner) * sin


@triton.jit
def _token_queries(qkv_row, heads, row_ok, offs_d, cos, sin, HALF: tl.constexpr, QK_NORM: tl.constexpr, qn_ptr,
                   norm_eps, N_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, dtype: tl.constexpr):
    """Query heads `heads` (BLOCK_G,) of one token's raw qkv row (QK_NORM: normalized per head first), rotated, in
    dtype: (BLOCK_G, D). Padded rows (not row_ok) re-read the last head (in bounds, finite) and are zeroed."""
    q_rows = qkv_row + tl.minimum(heads, N_HEADS - 1)[:, None] * HEAD_DIM
    if QK_NORM:
        q = _normed_rotated(q_rows, offs_d[None, :], cos[None, :], sin[None, :], HALF, qn_ptr, norm_eps, HEAD_DIM,
                            1, dtype).to(dtype)
    else:
        q = _rotated(q_rows, offs_d[None, :], cos[None, :], sin[None, :], HALF).to(dtype)
    return tl.where(row_ok[:, None], q, 0.0)


@triton.jit
def _token_key_value(qkv_row, kvh, offs_d, cos, sin, HALF: tl.constexpr, QK_NORM: tl.constexpr, kn_ptr, norm_eps,
                     N_HEADS: tl.constexpr, N_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, dtype: tl.constexpr):
    """KV head kvh's new key (QK_NORM: normalized first), rotated, in dtype, and its value, from one token's raw qkv
    row: (D,) each."""
    new_k = qkv_row + (N_HEADS + kvh) * HEAD_DIM
    if QK_NORM:
        k = _normed_rotated(new_k, offs_d, cos, sin, HALF, kn_ptr, norm_eps, HEAD_DIM, 0, dtype).to(dtype)
    else:
        k = _rotated(new_k, offs_d, cos, sin, HALF).to(dtype)
    return k, tl.load(qkv_row + (N_HEADS + N_KV_HEADS + kvh) * HEAD_DIM + offs_d)


@triton.jit
def _seen(s_idx, length, lo, WINDOW: tl.constexpr):
    """Which keys at positions s_idx a query sees: before length, and with WINDOW from lo on."""
    if WINDOW:
        return (s_idx < length) & (s_idx >= lo)
    return s_idx < length


@triton.jit
def _attend_block(q, k, v, s_idx, length, lo, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr,
                  WINDOW: tl.constexpr):
    """One block of keys into the online softmax: k, v (BLOCK_S, D) at positions s_idx (BLOCK_S,); those below
    length are seen (and, with WINDOW, not below lo)."""
    s_ok = _seen(s_idx, length, lo, WINDOW)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_G, BLOCK_S)
    scores = tl.where(s_ok[None, :], scores * qk_scale, float("-inf"))
    # Every block in range holds a valid key, so m_new is finite and alpha never sees -inf - -inf.
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])  # (BLOCK_G, BLOCK_S)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)  # (BLOCK_G, D)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, rope_ptr, qn_ptr, kn_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh,
    seq_len, num_splits, qk_scale, norm_eps,
    N_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ROPE_QKV: tl.constexpr, USE_PDL: tl.constexpr, ROT: tl.constexpr,
    window, WINDOW: tl.constexpr, QK_NORM: tl.constexpr,
):
    """ROPE_QKV: q_ptr is the raw qkv projection (B, (H + 2 Hkv) D) of the token at input_pos; the kernel
    rotates the first ROT features of q and the new key (rope_ptr: the (S, 2, ROT/2) fp32 cos/sin table; row
    input_pos; ROT < D is partial rotary, the rest pass through), and the split that owns input_pos writes the key
    and value into the caches before any program of its group reads them. QK_NORM (with ROPE_QKV): each query and
    the new key are first RMS-normalized per head with the weights qn_ptr / kn_ptr (D,) and norm_eps (Qwen3).

    With ROPE_QKV the split's first block of keys and values is loaded before the PDL wait: those cache rows
    (before input_pos) were written by earlier steps, input_pos by the step's start and the rope table at setup, so
    the HBM reads overlap the qkv projection's last wave. The row at input_pos comes from the projection."""
    pid_group = tl.program_id(0)  # b * Hkv + kv head
    split = tl.program_id(1)
    b = (pid_group // N_KV_HEADS).to(tl.int64)
    kvh = (pid_group % N_KV_HEADS).to(tl.int64)
    length, lo, first_block, per_split, active = _valid_blocks(pos_ptr, seq_len, num_splits, window, BLOCK_S,
                                                               WINDOW)
    first = first_block + split * per_split
    last = tl.minimum(first + per_split, tl.cdiv(length, BLOCK_S))

    offs_g = tl.arange(0, BLOCK_G)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_g < GROUP
    heads = kvh * GROUP + offs_g  # (BLOCK_G,) the query heads that share this KV head
    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh
    pos = length - 1
    s_first = first * BLOCK_S + offs_s  # (BLOCK_S,) positions of the first block
    if ROPE_QKV:
        HALF: tl.constexpr = ROT // 2
        rope_row = rope_ptr + pos * ROT  # row input_pos of the table (pos is clamped into the cache)
        cos, sin = _rope_row(rope_row, offs_d, HALF, ROT == HEAD_DIM)  # (D,) each
        early = (_seen(s_first, pos, lo, WINDOW) & (first < last))[:, None]  # rows before input_pos only
        k_first = tl.load(k_base + s_first[:, None] * stride_ks + offs_d[None, :], mask=early, other=0.0)
        v_first = tl.load(v_base + s_first[:, None] * stride_vs + offs_d[None, :], mask=early, other=0.0)
    if USE_PDL:
        # Trigger first: the combine kernel, and through its own early trigger the output projection, get their
        # programs resident now, so wo streams its first weight blocks while attention runs. The wait still
        # orders every read below (input_pos, above, is set before the step).
        gdc_launch_dependents()
        gdc_wait()

    if ROPE_QKV:
        qkv_row = q_ptr + b * stride_qb
        q = _token_queries(qkv_row, heads, row_ok, offs_d, cos, sin, HALF, QK_NORM, qn_ptr, norm_eps,
                           N_KV_HEADS * GROUP, HEAD_DIM, k_ptr.dtype.element_ty)  # (BLOCK_G, D)
        if split == active - 1:  # this split holds input_pos: store the token's key and value first
            k_new, v_new = _token_key_value(qkv_row, kvh, offs_d, cos, sin, HALF, QK_NORM, kn_ptr, norm_eps,
                                            N_KV_HEADS * GROUP, N_KV_HEADS, HEAD_DIM, k_ptr.dtype.element_ty)  # (D,)
            tl.store(k_base + pos * stride_ks + offs_d, k_new)
            tl.store(v_base + pos * stride_vs + offs_d, v_new)
            at_pos = (s_first == pos)[:, None]  # all False unless the first block is the last
            k_first = tl.where(at_pos, k_new[None, :], k_first)
            v_first = tl.where(at_pos, v_new[None, :], v_first)
        tl.debug_barrier()  # the stores above are seen by every thread of this program that reads the cache
    else:
        # Padded rows load zeros (finite scores, never stored); an idle split (no keys) loads nothing.
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=(row_ok & (first < last))[:, None], other=0.0)  # (BLOCK_G, D)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    start = first
    if ROPE_QKV:
        if first < last:
            m_i, l_i, acc = _attend_block(q, k_first, v_first, s_first, length, lo, m_i, l_i, acc, qk_scale,
                                          DOT_PRECISION, WINDOW)
        start = first + 1
    for blk in range(start, last):
        s_idx = blk * BLOCK_S + offs_s  # (BLOCK_S,)
        s_ok = _seen(s_idx, length, lo, WINDOW)[:, None]  # keys past input_pos (or before a window): not loaded
        k = tl.load(k_base + s_idx[:, None] * stride_ks + offs_d[None, :], mask=s_ok, other=0.0)
        v = tl.load(v_base + s_idx[:, None] * stride_vs + offs_d[None, :], mask=s_ok, other=0.0)
        m_i, l_i, acc = _attend_block(q, k, v, s_idx, length, lo, m_i, l_i, acc, qk_scale, DOT_PRECISION,
                                      WINDOW)

    if SINGLE_SPLIT:
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        keep = row_ok & (split < active)  # a split without keys stores nothing; combine skips it
        row = (b * (N_KV_HEADS * GROUP) + heads) * num_splits + split  # (BLOCK_G,)
        tl.store(m_ptr + row, m_i, mask=keep)
        tl.store(l_ptr + row, l_i, mask=keep)
        tl.store(acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=keep[:, None])


@triton.jit
def _combine_kernel(
    m_ptr, l_ptr, acc_ptr, pos_ptr, out_ptr, stride_ob, stride_oh, seq_len, num_splits, window,
    N_HEADS: tl.constexpr, SPLITS_P2: tl.constexpr, SPLIT_TILE: tl.constexpr,
    BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, USE_PDL: tl.constexpr, WINDOW: tl.constexpr,
):
    # the split kernel never writes input_pos
    _, _, _, _, active = _valid_blocks(pos_ptr, seq_len, num_splits, window, BLOCK_S, WINDOW)
    if USE_PDL:  # trigger before the wait, like the split kernel: wo's programs start loading weights now
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)  # b * H + h
    b = row // N_HEADS
    h = row % N_HEADS
    base = row * num_splits
    offs = tl.arange(0, SPLITS_P2)
    m = tl.load(m_ptr + base + offs, mask=offs < active, other=float("-inf"))  # (SPLITS_P2,)
    l = tl.load(l_ptr + base + offs, mask=offs < active, other=0.0)
    m_max = tl.max(m, axis=0)
    denom = tl.sum(l * tl.exp2(m - m_max), axis=0)

    offs_t = tl.arange(0, SPLIT_TILE)
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for t in range(0, tl.cdiv(active, SPLIT_TILE)):
        idx = t * SPLIT_TILE + offs_t  # (SPLIT_TILE,)
        ok = idx < active
        w = tl.exp2(tl.load(m_ptr + base + idx, mask=ok, other=float("-inf")) - m_max)
        part = tl.load(acc_ptr + (base + idx)[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None], other=0.0)
        acc += tl.sum(w[:, None] * part, axis=0)
    out = acc / denom
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _prefill_rope_cache_kernel(
    qkv_ptr, q_ptr, k_ptr, v_ptr, rope_ptr, T,
    stride_xb, stride_xt, stride_qb, stride_qt, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    N_HEADS: tl.constexpr, N_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, ROT: tl.constexpr,
):
    """One (token block, head, batch row) tile of a prefill from position 0: rope on q and k heads (their first
    ROT features), then q to q_ptr (B, T, H, D) and k, v to the caches (B, Hkv, S, D) at positions 0..T-1.
    rope_ptr: (T, 2, ROT/2) fp32."""
    pid_t = tl.program_id(0)
    head = tl.program_id(1)  # [0, H): q heads, [H, H + Hkv): k heads, then v heads
    b = tl.program_id(2).to(tl.int64)
    HALF: tl.constexpr = ROT // 2
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
    d = tl.arange(0, HEAD_DIM)
    ok = (t < T)[:, None]
    t64 = t.to(tl.int64)[:, None]
    src = qkv_ptr + b * stride_xb + t64 * stride_xt + head * HEAD_DIM  # (BLOCK_T, 1) row starts
    if head < N_HEADS + N_KV_HEADS:
        x = tl.load(src + d[None, :], mask=ok, other=0.0).to(tl.float32)
        partner = tl.load(src + ((d + HALF) % ROT)[None, :], mask=ok, other=0.0).to(tl.float32)
        if ROT == HEAD_DIM:
            cos = tl.load(rope_ptr + t64 * ROT + (d % HALF)[None, :], mask=ok, other=0.0)
            sin = tl.load(rope_ptr + t64 * ROT + HALF + (d % HALF)[None, :], mask=ok, other=0.0)
        else:  # partial rotary: features past ROT pass through (cos 1, sin 0)
            rotated = ok & (d < ROT)[None, :]
            cos = tl.load(rope_ptr + t64 * ROT + (d % HALF)[None, :], mask=rotated, other=1.0)
            sin = tl.load(rope_ptr + t64 * ROT + HALF + (d % HALF)[None, :], mask=rotated, other=0.0)
        out = (x * cos + tl.where((d < HALF)[None, :], -partner, partner) * sin).to(q_ptr.dtype.element_ty)
        if head < N_HEADS:
            tl.store(q_ptr + b * stride_qb + t64 * stride_qt + head * HEAD_DIM + d[None, :], out, mask=ok)
        else:
            kh = head - N_HEADS
            tl.store(k_ptr + b * stride_kb + kh * stride_kh + t64 * stride_ks + d[None, :], out, mask=ok)
    else:
        vh = head - N_HEADS - N_KV_HEADS
        val = tl.load(src + d[None, :], mask=ok, other=0.0)
        tl.store(v_ptr + b * stride_vb + vh * stride_vh + t64 * stride_vs + d[None, :], val, mask=ok)


def prefill_rope_cache(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       rope: torch.Tensor) -> torch.Tensor:
    """Rope and cache write for a prefill from position 0: qkv (B, T, (H + 2 Hkv) D) with unit stride along the
    last dim, rope (T, 2, R/2) fp32 contiguous (the first R <= D features of each head rotate). Writes the rotated
    keys and the values into the caches at 0..T-1 and returns the rotated queries (B, T, H, D) contiguous. The
    caller (kernels/attention.py) validates."""
    batch, length, width = qkv.shape
    n_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    n_heads = width // head_dim - 2 * n_kv_heads
    q = torch.empty((batch, length, n_heads, head_dim), device=qkv.device, dtype=qkv.dtype)  # (B, T, H, D)
    if q.numel() == 0:
        return q
    block_t = max(1, min(PREFILL_BLOCK_ELEMENTS // head_dim, triton.next_power_of_2(length)))
    with torch.cuda.device(qkv.device) if qkv.is_cuda else contextlib.nullcontext():
        _prefill_rope_cache_kernel[(triton.cdiv(length, block_t), n_heads + 2 * n_kv_heads, batch)](
            qkv, q, k_cache, v_cache, rope, length,
            qkv.stride(0), qkv.stride(1), q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            N_HEADS=n_heads, N_KV_HEADS=n_kv_heads, HEAD_DIM=head_dim, BLOCK_T=block_t, ROT=2 * rope.shape[-1],
            num_warps=4,
        )
    return q


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, input_pos: torch.Tensor,
                     config: AttentionConfig | None = None, window: int = 0) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v over keys 0..input_pos (window > 0: only the last `window` of them); q (B, H, 1,
    D), caches (B, Hkv, S, D).

    The caller (kernels/attention.py) validates shapes and dtypes; returns (B, H, 1, D) contiguous.
    """
    batch, n_heads, _, head_dim = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty((batch, n_heads, 1, head_dim), device=q.device, dtype=q.dtype)  # (B, H, 1, D)
    _launch(q, k_cache, v_cache, input_pos, out, n_heads, None, config, window)
    return out


def decode_attention_qkv(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rope: torch.Tensor,
                         input_pos: torch.Tensor, config: AttentionConfig | None = None,
                         qk_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                         window: int = 0, scale: float = 0.0) -> torch.Tensor:
    """Rope, cache write and attention for one token: qkv (B, 1, (H + 2 Hkv) D) raw projections at input_pos,
    rope (S', 2, R/2) fp32, the cos/sin table of the first R <= D features of each head with S' >= the cache length
    S (row input_pos is read on the device). Writes the rotated key and the value into the caches at input_pos and
    returns (B, 1, H D) contiguous. qk_norms: (q weight (D,), k weight (D,), eps) of per-head RMS norms applied to q
    and k before rope; window > 0: attend over the last `window` keys only; scale: the scores' factor (0: D ** -0.5).
    The caller (kernels/attention.py) validates."""
    batch = qkv.shape[0]
    n_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    n_heads = qkv.shape[-1] // head_dim - 2 * n_kv_heads
    qkv = qkv.reshape(batch, -1).contiguous()
    out = torch.empty((batch, 1, n_heads * head_dim), device=qkv.device, dtype=qkv.dtype)  # (B, 1, H D)
    _launch(qkv, k_cache, v_cache, input_pos, out, n_heads, rope.contiguous(), config, window, qk_norms, scale)
    return out


def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, input_pos: torch.Tensor,
            out: torch.Tensor, n_heads: int, rope: torch.Tensor | None, config: AttentionConfig | None,
            window: int = 0, qk_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
            scale: float = 0.0) -> None:
    """Run the split (and combine) kernels into out, viewed as (B, H, D) rows of D. q is (B, H, 1, D)
    rotated queries, or with rope given the raw (B, (H + 2 Hkv) D) projections (the fused kernel)."""
    batch = q.shape[0]
    n_kv_heads, seq_len, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = n_heads // n_kv_heads
    caps = device_caps(q.device)
    if config is None:
        config = fitted_attention_config(batch, n_heads, n_kv_heads, seq_len, head_dim, k_cache.element_size(), caps)
    if config is None:  # kernels.attention checks first and takes the reference
        raise ValueError(f"no decode-attention config fits this GPU's shared memory for head_dim {head_dim}")
    if out.numel() == 0:
        return
    if rope is None and (k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1):
        k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()  # a read-only copy is fine here
    splits = config.num_splits
    if splits > 1:
        rows = batch * n_heads
        m = torch.empty((rows, splits), device=q.device, dtype=torch.float32)  # per-split max, log2 units
        l = torch.empty((rows, splits), device=q.device, dtype=torch.float32)  # per-split sum
        acc = torch.empty((rows, splits, head_dim), device=q.device, dtype=torch.float32)
    else:
        m = l = acc = out  # unused by the kernel when there is one split
    block_g = max(DOT_MIN_ROWS, triton.next_power_of_2(group))
    precision = "tf32" if q.dtype != torch.float32 and caps.supports_tf32 else "ieee"
    stage_bytes = 2 * config.block_s * head_dim * q.element_size()  # one K and one V tile per stage
    # (a no-op for fitted configs; it caps the stages of one passed in)
    stages = max(1, min(config.num_stages, min(PIPELINE_SMEM_BYTES, caps.shared_memory_per_block) // stage_bytes))
    pdl = pdl_default(caps)
    extra = {"launch_pdl": True} if pdl else {}
    stride_qh = q.stride(1) if rope is None else head_dim
    # Launch on q's GPU (Triton uses the current device); the nullcontext serves Triton's CPU interpreter.
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _split_kernel[(batch * n_kv_heads, splits)](
            q, k_cache, v_cache, input_pos, out, m, l, acc, rope if rope is not None else q,
            *(qk_norms[:2] if qk_norms else (q, q)),
            q.stride(0), stride_qh, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), n_heads * head_dim, head_dim,
            seq_len, splits, LOG2E * (scale or head_dim ** -0.5), qk_norms[2] if qk_norms else 0.0,
            N_KV_HEADS=n_kv_heads, GROUP=group, SINGLE_SPLIT=splits == 1, BLOCK_G=block_g, BLOCK_S=config.block_s,
            HEAD_DIM=head_dim, DOT_PRECISION=precision, ROPE_QKV=rope is not None, USE_PDL=pdl,
            ROT=head_dim if rope is None else 2 * rope.shape[-1], window=window, WINDOW=window > 0,
            QK_NORM=qk_norms is not None, num_warps=config.num_warps, num_stages=stages, **extra,
        )
        if splits > 1:
            _combine_kernel[(batch * n_heads,)](
                m, l, acc, input_pos, out, n_heads * head_dim, head_dim, seq_len, splits, window,
                N_HEADS=n_heads, SPLITS_P2=triton.next_power_of_2(splits),
                SPLIT_TILE=COMBINE_SPLIT_TILE, BLOCK_S=config.block_s, HEAD_DIM=head_dim, USE_PDL=pdl,
                WINDOW=window > 0,
                num_warps=2, **extra,
            )
