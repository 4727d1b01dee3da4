"""Triton attention over a paged KV cache: one decode token per sequence, and flattened query chunks (prefill).

The cache is a pool of pages, k_cache and v_cache (num_pages, page_size, Hkv, D); a sequence's keys 0..L-1 live
in the pages its block-table row names, key s at slot s % page_size of page block_tables[b, s // page_size]. The
kernels address every key through its page: a tile of BLOCK_S keys loads its page numbers (one per key, from L1
after the first) and gathers rows of D contiguous elements, so a tile may span pages and any power-of-two page
size serves any tile size.

`paged_decode_attention` (flash-decoding, the structure of triton_attention.decode_attention):

- one program takes ALL query heads of one KV group (rows padded to 16 for tl.dot), so each page is read once per
  group, and the row's valid keys 0..seq_lens[b]-1 are split over NUM_SPLITS programs (grid (B * Hkv, NUM_SPLITS));
  each keeps a running max, sum and fp32 accumulator (online softmax in exp2 units) and writes its partial; it
  loads each key block's page numbers one block ahead, so the K/V loads never wait on the table;
- NUM_SPLITS comes from the shapes alone (configs.attention_config over the block table's key capacity
  max_pages * page_size), never from seq_lens, so one CUDA graph serves every length; each row divides only its
  own valid keys among the splits, and splits left without keys store nothing;
- a second kernel (one program per query row) combines the partials, or the split kernel stores the output when
  there is one split. (Launching the combine kernel with programmatic dependent launch measured no faster on an
  H200, and slower at B=1: 12.2 against 10.6 us over 2048 keys.)

`paged_decode_attention_qkv` (the fused decode of the engine's one-row step) takes the raw qkv projection instead,
as triton_attention.decode_attention_qkv does over the static cache: every program rotates its queries with the
row's rope (and per-head norms), and the split that owns the row's new position seq_lens[b] - 1 rotates the new
key and stores it and the value in their page slot before it reads the cache: one split launch instead of the rope
kernels, two page writes and the attention's own.

`paged_prefill_attention`: the queries of S sequences flattened into T rows, sequence s owning rows
cu_seqlens_q[s]..cu_seqlens_q[s+1]-1; query j of sequence s sits at position seq_lens[s] - q_len + j and attends
causally to keys 0..that position. A program takes a tile of BLOCK_T tokens x the GROUP query heads of one KV head
(BLOCK_M rows, a tensor-core tile) and walks the key blocks up to its last token's position, without masks below
its first token's position. The grid is fixed by T and S: sequence s's tiles are numbered from
cu_seqlens_q[s] // BLOCK_T + s, which leaves room for each chunk's tiles whatever the split of T into S chunks, so
T // BLOCK_T + S + 1 tiles cover them all; each program finds its sequence by a binary search of cu_seqlens_q on
the device, and the few numbers that fall between chunks exit.

An e4m3 cache (KV_FP8) holds codes with one fp32 scale per KV head for k and for v: a program reads one KV head, so
it loads its two scales once, converts each loaded K/V tile to the queries' dtype through fp32 (exact: every e4m3
value is a bf16, fp16 and fp32 value) and multiplies the scores by the key scale (folded into qk_scale, in fp32)
and its output by the value scale: the dequantized cache's math, with one multiply per score instead of one per
element. The qkv decode writes its new key and value as model.quantized_kv does (divided by the scale, clamped to
+-448, rounded).

All read lengths and tables on the device only (no host sync), so all are CUDA-graph capturable. A query row with
no keys (seq_lens 0: a padding row of a batch bucket) gets zeros (and writes no key), as in the references. Configs
come from configs.py, fitted to the GPU's shared memory; only kernels/paged_attention.py imports this module, lazily.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .configs import AttentionConfig, PagedPrefillConfig, fitted_attention_config, fitted_paged_prefill_config
from .device import device_caps
from .triton_fp8 import _round_to_e4m3
from .triton_attention import (COMBINE_SPLIT_TILE, DOT_MIN_ROWS, LOG2E, _rope_row, _seen, _token_key_value,
                               _token_queries)


@triton.jit
def _row_blocks(length, num_splits, first_block, BLOCK_S: tl.constexpr):
    """(blocks of keys per split, splits that hold keys) for one row of `length` valid keys (0 gives 0 splits),
    counted from block first_block (a sliding window's first)."""
    n_blocks = tl.cdiv(length, BLOCK_S) - first_block
    per_split = tl.maximum(tl.cdiv(n_blocks, num_splits), 1)
    return per_split, tl.cdiv(n_blocks, per_split)


@triton.jit
def _window_start(length, window, WINDOW: tl.constexpr):
    """The first key a row of `length` keys sees: 0, or with WINDOW the first of its last `window`."""
    if WINDOW:
        return tl.maximum(length - window, 0)
    return 0


@triton.jit
def _page_rows(table_row, s_idx, s_ok, stride_p, stride_s, PAGE_SIZE: tl.constexpr):
    """Element offsets (BLOCK_S,) of keys s_idx in the pool: page table_row[s // PAGE_SIZE], slot s % PAGE_SIZE
    (s_ok None: every key is in range)."""
    if s_ok is None:
        page = tl.load(table_row + s_idx // PAGE_SIZE).to(tl.int64)
    else:
        page = tl.load(table_row + s_idx // PAGE_SIZE, mask=s_ok, other=0).to(tl.int64)
    return page * stride_p + (s_idx % PAGE_SIZE) * stride_s


@triton.jit
def _kv_scales(ks_ptr, vs_ptr, kvh, KV_FP8: tl.constexpr):
    """KV head kvh's key and value scales of an e4m3 cache; 1.0 each for a cache of the queries' dtype."""
    if KV_FP8:
        return tl.load(ks_ptr + kvh), tl.load(vs_ptr + kvh)
    return 1.0, 1.0


@triton.jit
def _tile(x, dtype: tl.constexpr):
    """A loaded K/V tile in the queries' dtype; e4m3 codes through fp32 (exact either way: sm89 has no direct e4m3 to
    bf16 conversion, which Triton lowers through an fp16 to bf16 one that only sm90 has)."""
    if x.dtype == tl.float8e4nv:
        return x.to(tl.float32).to(dtype)
    return x.to(dtype)


@triton.jit
def _fp8_codes(x, scale):
    """x / scale (an IEEE division, as torch's) clamped to the finite e4m3 range and rounded to e4m3 (ties to even,
    in fp32 first: the cast is then exact, as torch's in model.quantized_kv, on the GPU and in the interpreter)."""
    return _round_to_e4m3(tl.clamp(tl.div_rn(x.to(tl.float32), scale), -448.0, 448.0)).to(tl.float8e4nv)


@triton.jit
def _online_softmax_step(q, k, v, keep, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr):
    """One key block into the online softmax of q's rows; keep (rows, BLOCK_S) marks the keys each row attends to.
    A row without any key so far keeps m_i = -inf, l_i = 0 and acc = 0 (nothing here computes -inf - -inf); keep
    None: every key counts."""
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (rows, BLOCK_S)
    if keep is not None:
        scores = tl.where(keep, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])  # (rows, BLOCK_S); 0 where masked
    l_i = l_i * alpha + tl.sum(p, axis=1)
    pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)  # (rows, D)
    return m_new, l_i, acc * alpha[:, None] + pv


# Sizes that change from step to step are not specialized on (Triton compiles a variant per value of 1 and per
# multiple of 16 otherwise, each a pause of a second or two the first time a step meets it).
@triton.jit(do_not_specialize=("stride_tb", "max_keys", "num_splits"))
def _paged_split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, rope_ptr, qn_ptr, kn_ptr, ks_ptr, vs_ptr,
    stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_tb,
    stride_ob, stride_oh, max_keys, num_splits, qk_scale, window, norm_eps,
    N_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, SINGLE_SPLIT: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr, ROPE_QKV: tl.constexpr, QK_NORM: tl.constexpr, ROT: tl.constexpr, KV_FP8: tl.constexpr,
):
    """ROPE_QKV: q_ptr is the raw qkv projection (B, (H + 2 Hkv) D) of each row's new token, at position
    seq_lens[b] - 1; rope_ptr holds each row's cos/sin (B, 2, ROT/2) fp32. The kernel rotates the first ROT features
    of the queries and the new key (QK_NORM: RMS-normalized per head first, weights qn_ptr / kn_ptr (D,), eps
    norm_eps), and the split that owns the position stores the key and value in their page slot before it reads the
    cache (no other program reads that slot). A row without keys writes nothing. KV_FP8: the caches hold e4m3
    codes, ks_ptr / vs_ptr (Hkv,) fp32 their scales."""
    pid_group = tl.program_id(0)  # b * Hkv + kv head
    split = tl.program_id(1)
    b = (pid_group // N_KV_HEADS).to(tl.int64)
    kvh = (pid_group % N_KV_HEADS).to(tl.int64)
    length = tl.minimum(tl.maximum(tl.load(lens_ptr + b).to(tl.int32), 0), max_keys)  # never past the table
    lo = _window_start(length, window, WINDOW)  # keys before lo are outside the window: never read
    per_split, active = _row_blocks(length, num_splits, lo // BLOCK_S, BLOCK_S)
    first = lo // BLOCK_S + split * per_split
    last = tl.minimum(first + per_split, tl.cdiv(length, BLOCK_S))

    offs_g = tl.arange(0, BLOCK_G)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_g < GROUP
    heads = kvh * GROUP + offs_g  # (BLOCK_G,) the query heads of this KV head
    table_row = table_ptr + b * stride_tb
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    k_scale, v_scale = _kv_scales(ks_ptr, vs_ptr, kvh, KV_FP8)
    if ROPE_QKV:
        HALF: tl.constexpr = ROT // 2
        cos, sin = _rope_row(rope_ptr + b * ROT, offs_d, HALF, ROT == HEAD_DIM)  # (D,) each
        qkv_row = q_ptr + b * stride_qb
        q = _token_queries(qkv_row, heads, row_ok, offs_d, cos, sin, HALF, QK_NORM, qn_ptr, norm_eps,
                           N_KV_HEADS * GROUP, HEAD_DIM, q_ptr.dtype.element_ty)  # (BLOCK_G, D)
        if split == active - 1:  # this split holds the row's position: store its key and value first
            pos = length - 1
            k_new, v_new = _token_key_value(qkv_row, kvh, offs_d, cos, sin, HALF, QK_NORM, kn_ptr, norm_eps,
                                            N_KV_HEADS * GROUP, N_KV_HEADS, HEAD_DIM, q_ptr.dtype.element_ty)  # (D,)
            if KV_FP8:
                k_new, v_new = _fp8_codes(k_new, k_scale), _fp8_codes(v_new, v_scale)
            pos_page = tl.load(table_row + pos // PAGE_SIZE).to(tl.int64)
            tl.store(k_base + pos_page * stride_kp + (pos % PAGE_SIZE) * stride_ks + offs_d, k_new)
            tl.store(v_base + pos_page * stride_vp + (pos % PAGE_SIZE) * stride_vs + offs_d, v_new)
        tl.debug_barrier()  # the stores above are seen by every thread of this program that reads the cache
    else:
        # Padded rows load zeros (finite scores, never stored); a split without keys loads nothing.
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=(row_ok & (first < last))[:, None], other=0.0)  # (BLOCK_G, D)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    # Each block's page numbers are loaded one block ahead, so the K/V loads of a block never wait on the table.
    s_idx = first * BLOCK_S + offs_s  # (BLOCK_S,)
    page = tl.load(table_row + s_idx // PAGE_SIZE, mask=s_idx < length, other=0).to(tl.int64)
    for _ in range(first, last):
        s_ok = _seen(s_idx, length, lo, WINDOW)  # the row's keys (in its window) only are loaded
        slot = s_idx % PAGE_SIZE
        k = _tile(tl.load(k_base + (page * stride_kp + slot * stride_ks)[:, None] + offs_d[None, :],
                          mask=s_ok[:, None], other=0.0), q.dtype)  # (BLOCK_S, D)
        v = _tile(tl.load(v_base + (page * stride_vp + slot * stride_vs)[:, None] + offs_d[None, :],
                          mask=s_ok[:, None], other=0.0), q.dtype)
        s_next = s_idx + BLOCK_S
        page = tl.load(table_row + s_next // PAGE_SIZE, mask=s_next < length, other=0).to(tl.int64)
        m_i, l_i, acc = _online_softmax_step(q, k, v, s_ok[None, :], m_i, l_i, acc, qk_scale * k_scale,
                                             DOT_PRECISION)
        s_idx = s_next
    if KV_FP8:
        acc = acc * v_scale  # the codes' weighted sum times the head's value scale

    if SINGLE_SPLIT:
        out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)  # no keys: zeros
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        keep = row_ok & (split < active)  # a split without keys stores nothing; combine skips it
        row = (b * (N_KV_HEADS * GROUP) + heads) * num_splits + split  # (BLOCK_G,)
        tl.store(m_ptr + row, m_i, mask=keep)
        tl.store(l_ptr + row, l_i, mask=keep)
        tl.store(acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=keep[:, None])


@triton.jit(do_not_specialize=("max_keys", "num_splits"))
def _paged_combine_kernel(
    m_ptr, l_ptr, acc_ptr, lens_ptr, out_ptr, stride_ob, stride_oh, max_keys, num_splits, window,
    N_HEADS: tl.constexpr, SPLITS_P2: tl.constexpr, SPLIT_TILE: tl.constexpr, BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr, WINDOW: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # b * H + h
    b = row // N_HEADS
    h = row % N_HEADS
    length = tl.minimum(tl.maximum(tl.load(lens_ptr + b).to(tl.int32), 0), max_keys)
    _, active = _row_blocks(length, num_splits, _window_start(length, window, WINDOW) // BLOCK_S, BLOCK_S)
    base = row * num_splits
    offs = tl.arange(0, SPLITS_P2)
    m = tl.load(m_ptr + base + offs, mask=offs < active, other=float("-inf"))  # (SPLITS_P2,)
    l = tl.load(l_ptr + base + offs, mask=offs < active, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # a row without keys: every weight below is 0
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
    out = tl.where(denom > 0, acc / tl.maximum(denom, 1e-30), 0.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _chunk_of_tile(cu_ptr, pid, n_seqs, n_steps, BLOCK_T: tl.constexpr):
    """(sequence, tile within its chunk) of tile pid. Sequence s's tiles start at cu_seqlens_q[s] // BLOCK_T + s:
    strictly increasing, and at least ceil(q_len_s / BLOCK_T) apart, so no two chunks' tiles overlap; a binary
    search of n_steps (>= log2(n_seqs)) halvings finds the last sequence starting at or before pid."""
    lo = n_seqs * 0  # an int32 scalar, like hi
    hi = n_seqs
    for _ in range(n_steps):
        mid = (lo + hi) // 2
        before = tl.load(cu_ptr + mid) // BLOCK_T + mid <= pid
        lo = tl.where(before, mid, lo)
        hi = tl.where(before, hi, mid)
    return lo, pid - (tl.load(cu_ptr + lo) // BLOCK_T + lo)


@triton.jit(do_not_specialize=("stride_tb", "n_seqs", "n_steps", "max_keys"))
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, cu_ptr, lens_ptr, out_ptr, ks_ptr, vs_ptr,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_tb,
    stride_ot, stride_oh, n_seqs, n_steps, max_keys, qk_scale, window,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    BLOCK_T: tl.constexpr = BLOCK_M // GROUP_P2  # query tokens per tile
    kvh = tl.program_id(1).to(tl.int64)
    s, tile = _chunk_of_tile(cu_ptr, tl.program_id(0), n_seqs, n_steps, BLOCK_T)
    q_start = tl.load(cu_ptr + s).to(tl.int64)
    q_len = tl.load(cu_ptr + s + 1).to(tl.int32) - q_start.to(tl.int32)
    if tile * BLOCK_T < q_len:  # else a gap between chunks' tiles, or past the last: nothing to do
        length = tl.minimum(tl.maximum(tl.load(lens_ptr + s).to(tl.int32), 0), max_keys)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        tok = tile * BLOCK_T + offs_m // GROUP_P2  # (BLOCK_M,) query index within the chunk
        g = offs_m % GROUP_P2
        row_ok = (tok < q_len) & (g < GROUP)
        q_pos = length - q_len + tok  # (BLOCK_M,) the query's position in its sequence
        heads = kvh * GROUP + g
        q_rows = (q_start + tok.to(tl.int64)) * stride_qt + heads * stride_qh
        q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)  # (BLOCK_M, D)
        # Keys below the tile's first query position are visible to every row: those blocks need no mask. The
        # blocks after, up to the tile's last query position (clamped into the row's valid keys), are masked.
        first_pos = tl.maximum(length - q_len + tile * BLOCK_T, 0)
        last_tok = tl.minimum((tile + 1) * BLOCK_T, q_len) - 1
        hi = tl.minimum(length - q_len + last_tok + 1, length)
        full_blocks = tl.minimum(first_pos, hi) // BLOCK_N
        table_row = table_ptr + s.to(tl.int64) * stride_tb
        k_base = k_ptr + kvh * stride_kh
        v_base = v_ptr + kvh * stride_vh
        k_scale, v_scale = _kv_scales(ks_ptr, vs_ptr, kvh, KV_FP8)
        qk_scale = qk_scale * k_scale  # an e4m3 cache: the scores of the codes times the head's key scale

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        if WINDOW:  # each row sees (its position - window, its position]: every block is masked, none before the
            # first row's window is read
            full_blocks = 0
            first_block = tl.maximum(first_pos - window + 1, 0) // BLOCK_N
        else:
            first_block = full_blocks
        for blk in range(0, full_blocks):
            s_idx = blk * BLOCK_N + offs_n  # (BLOCK_N,) all valid, all visible
            k_rows = _page_rows(table_row, s_idx, None, stride_kp, stride_ks, PAGE_SIZE)
            v_rows = _page_rows(table_row, s_idx, None, stride_vp, stride_vs, PAGE_SIZE)
            k = _tile(tl.load(k_base + k_rows[:, None] + offs_d[None, :]), q.dtype)  # (BLOCK_N, D)
            v = _tile(tl.load(v_base + v_rows[:, None] + offs_d[None, :]), q.dtype)
            m_i, l_i, acc = _online_softmax_step(q, k, v, None, m_i, l_i, acc, qk_scale, DOT_PRECISION)
        for blk in range(first_block, tl.cdiv(hi, BLOCK_N)):
            s_idx = blk * BLOCK_N + offs_n
            s_ok = s_idx < hi
            k_rows = _page_rows(table_row, s_idx, s_ok, stride_kp, stride_ks, PAGE_SIZE)
            v_rows = _page_rows(table_row, s_idx, s_ok, stride_vp, stride_vs, PAGE_SIZE)
            k = _tile(tl.load(k_base + k_rows[:, None] + offs_d[None, :], mask=s_ok[:, None], other=0.0), q.dtype)
            v = _tile(tl.load(v_base + v_rows[:, None] + offs_d[None, :], mask=s_ok[:, None], other=0.0), q.dtype)
            keep = (s_idx[None, :] <= q_pos[:, None]) & s_ok[None, :]  # causal, within the valid keys
            if WINDOW:
                keep = keep & (s_idx[None, :] > q_pos[:, None] - window)
            m_i, l_i, acc = _online_softmax_step(q, k, v, keep, m_i, l_i, acc, qk_scale, DOT_PRECISION)

        if KV_FP8:
            acc = acc * v_scale
        out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
        out_rows = (q_start + tok.to(tl.int64)) * stride_ot + heads * stride_oh
        tl.store(out_ptr + out_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])


def _dot_precision(dtype: torch.dtype, caps) -> str:
    """tf32 where the operands are 16-bit anyway and the GPU takes it, else full fp32 (ieee) dots."""
    return "tf32" if dtype != torch.float32 and caps.supports_tf32 else "ieee"


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """t itself where its last dim has unit stride (the kernels index rows by their strides), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _device_context(t: torch.Tensor):
    """Launch on t's GPU (Triton uses the current device); the nullcontext serves Triton's CPU interpreter."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, config: AttentionConfig | None = None,
                           window: int = 0, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(scale q k^T) v over each row's keys 0..seq_lens[b]-1; q (B, H, D), caches (num_pages, page_size, Hkv,
    D) with unit stride along D (e4m3 codes with k_scale, v_scale (Hkv,) fp32), block_tables (B, max_pages),
    seq_lens (B,). Returns (B, H, D) contiguous. The caller (kernels/paged_attention.py) validates."""
    q = _unit_stride(q)
    return _launch_decode(q, q.shape[1], q.stride(1), k_cache, v_cache, block_tables, seq_lens, scale, config, window,
                          kv_scales=_scales(k_scale, v_scale))


def paged_decode_attention_qkv(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               rope_rows: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float, config: AttentionConfig | None = None, window: int = 0,
                               q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                               norm_eps: float = 0.0, k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Rope, page write and attention of each row's new token: qkv (B, (H + 2 Hkv) D) raw projections at positions
    seq_lens - 1, rope_rows (B, 2, R/2) fp32 their cos/sin (the first R <= D features of each head rotate). Writes
    the rotated key and the value of row b at slot (seq_lens[b] - 1) % page_size of page
    block_tables[b, (seq_lens[b] - 1) // page_size] and returns the attention over its keys 0..seq_lens[b]-1,
    (B, H, D) contiguous. q_norm, k_norm (D,): per-head RMS norms (eps norm_eps) of q and k before rope. k_scale,
    v_scale (Hkv,) fp32: e4m3 caches. The caller (kernels/paged_attention.py) validates."""
    head_dim, n_kv_heads = k_cache.shape[3], k_cache.shape[2]
    qkv = _unit_stride(qkv)  # each row's H + 2 Hkv heads of D elements, back to back
    norms = (q_norm.contiguous(), k_norm.contiguous(), norm_eps) if q_norm is not None else None
    return _launch_decode(qkv, qkv.shape[1] // head_dim - 2 * n_kv_heads, head_dim, k_cache, v_cache, block_tables,
                          seq_lens, scale, config, window, rope_rows.contiguous(), norms, _scales(k_scale, v_scale))


def _scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An e4m3 cache's (k_scale, v_scale), contiguous fp32 (Hkv,) each; None for a cache of the queries' dtype."""
    return None if k_scale is None else (k_scale.float().contiguous(), v_scale.float().contiguous())


def _launch_decode(q: torch.Tensor, n_heads: int, stride_qh: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, config: AttentionConfig | None,
                   window: int, rope: torch.Tensor | None = None,
                   qk_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                   kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Run the split (and combine) kernels; returns (B, H, D). q is (B, H, D) queries (stride_qh apart), or with
    rope given the raw (B, (H + 2 Hkv) D) projections (rope_rows (B, 2, R/2) contiguous). kv_scales: the (Hkv,)
    scales of e4m3 caches."""
    batch, head_dim = q.shape[0], k_cache.shape[3]
    page_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_keys = block_tables.shape[1] * page_size
    group = n_heads // n_kv_heads
    caps = device_caps(q.device)
    if config is None:
        config = fitted_attention_config(batch, n_heads, n_kv_heads, max_keys, head_dim, q.element_size(), caps,
                                         kv_bytes=k_cache.element_size())
    if config is None:  # kernels.paged_attention checks first and takes the reference
        raise ValueError(f"no paged decode-attention config fits this GPU's shared memory for head_dim {head_dim}")
    block_tables, seq_lens = _unit_stride(block_tables), seq_lens.contiguous()
    out = torch.empty((batch, n_heads, head_dim), device=q.device, dtype=q.dtype)  # (B, H, D)
    if out.numel() == 0:
        return out
    splits = config.num_splits
    if splits > 1:
        rows = batch * n_heads
        m = torch.empty((rows, splits), device=q.device, dtype=torch.float32)  # per-split max, log2 units
        l = torch.empty((rows, splits), device=q.device, dtype=torch.float32)  # per-split sum
        acc = torch.empty((rows, splits, head_dim), device=q.device, dtype=torch.float32)
    else:
        m = l = acc = out  # unused by the kernel when there is one split
    with _device_context(q):
        _paged_split_kernel[(batch * n_kv_heads, splits)](
            q, k_cache, v_cache, block_tables, seq_lens, out, m, l, acc, q if rope is None else rope,
            *(qk_norms[:2] if qk_norms else (q, q)), *(kv_scales or (q, q)),
            q.stride(0), stride_qh, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
            out.stride(0), out.stride(1), max_keys, splits, scale * LOG2E, window, qk_norms[2] if qk_norms else 0.0,
            N_KV_HEADS=n_kv_heads, GROUP=group, SINGLE_SPLIT=splits == 1, WINDOW=window > 0,
            BLOCK_G=max(DOT_MIN_ROWS, triton.next_power_of_2(group)), BLOCK_S=config.block_s, PAGE_SIZE=page_size,
            HEAD_DIM=head_dim, DOT_PRECISION=_dot_precision(q.dtype, caps), ROPE_QKV=rope is not None,
            QK_NORM=qk_norms is not None, ROT=head_dim if rope is None else 2 * rope.shape[-1],
            KV_FP8=kv_scales is not None, num_warps=config.num_warps, num_stages=config.num_stages,
        )
        if splits > 1:
            _paged_combine_kernel[(batch * n_heads,)](
                m, l, acc, seq_lens, out, out.stride(0), out.stride(1), max_keys, splits, window,
                N_HEADS=n_heads, SPLITS_P2=triton.next_power_of_2(splits), SPLIT_TILE=COMBINE_SPLIT_TILE,
                BLOCK_S=config.block_s, HEAD_DIM=head_dim, WINDOW=window > 0, num_warps=2,
            )
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                            config: PagedPrefillConfig | None = None, window: int = 0,
                            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of S flattened query chunks over their paged keys (window > 0: each query over the last
    `window` positions up to its own); q (T, H, D), block_tables (S, max_pages), cu_seqlens_q (S + 1,), seq_lens
    (S,); k_scale, v_scale (Hkv,) fp32 with e4m3 caches. Returns (T, H, D); rows past cu_seqlens_q[S] are zeros. The
    caller (kernels/paged_attention.py) validates."""
    n_tokens, n_heads, head_dim = q.shape
    page_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    n_seqs = block_tables.shape[0]
    group = n_heads // n_kv_heads
    caps = device_caps(q.device)
    if config is None:
        config = fitted_paged_prefill_config(group, head_dim, max(q.element_size(), k_cache.element_size()), caps)
    if config is None:
        raise ValueError(f"no paged prefill-attention config fits this GPU's shared memory for head_dim {head_dim}")
    group_p2 = triton.next_power_of_2(group)
    if config.block_m < group_p2:
        raise ValueError(f"PagedPrefillConfig.block_m {config.block_m} must hold a KV group's {group_p2} rows")
    q, block_tables = _unit_stride(q), _unit_stride(block_tables)
    cu_seqlens_q, seq_lens = cu_seqlens_q.contiguous(), seq_lens.contiguous()
    out = torch.zeros((n_tokens, n_heads, head_dim), device=q.device, dtype=q.dtype)  # (T, H, D)
    if out.numel() == 0 or n_seqs == 0:
        return out
    block_t = config.block_m // group_p2
    with _device_context(q):
        # sequence s's tiles start at cu_seqlens_q[s] // block_t + s (_chunk_of_tile): this grid covers them all
        _paged_prefill_kernel[(n_tokens // block_t + n_seqs + 1, n_kv_heads)](
            q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out, *(_scales(k_scale, v_scale) or (q, q)),
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
            out.stride(0), out.stride(1), n_seqs, n_seqs.bit_length(), block_tables.shape[1] * page_size,
            scale * LOG2E, window, GROUP=group, GROUP_P2=group_p2, BLOCK_M=config.block_m,
            BLOCK_N=config.block_n, PAGE_SIZE=page_size, HEAD_DIM=head_dim,
            DOT_PRECISION=_dot_precision(q.dtype, caps), WINDOW=window > 0, KV_FP8=k_scale is not None,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return out
