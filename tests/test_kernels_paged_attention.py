"""kernels/paged_attention.py: the references against dense SDPA, the ops' dispatch and validation, the configs, the
Triton kernels against the references in Triton's interpreter (a child process, as tests/test_kernels_interpreter.py
runs them), and on a GPU."""
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from redline.kernels import configs
from redline.kernels import paged_attention as pa
from redline.kernels.device import target_caps
from redline.model import rms_norm, split_rotated_qkv

from conftest import captured_graph, interpreted_errors_of

ROOT = Path(__file__).resolve().parents[1]
INTERPRETER_TOLERANCE = {"float32": 1e-4, "float16": 2e-3}


@dataclass
class PagedBatch:
    """Sequences of given lengths stored in a shuffled page pool, with each one's dense K/V for the comparison."""

    k_cache: torch.Tensor  # (num_pages, page_size, Hkv, D)
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # (S, max_pages) int32, padding entries -1
    seq_lens: torch.Tensor  # (S,) int32
    dense_k: list[torch.Tensor]  # per sequence (Hkv, L, D)
    dense_v: list[torch.Tensor]


def paged_batch(lengths, n_kv_heads, head_dim, page_size, dtype=torch.float32, device="cpu", spare_pages=3,
                seed=0) -> PagedBatch:
    """Random K/V for sequences of `lengths`, each page of each sequence placed at a random slot of the pool
    (spare pages hold NaN garbage that must never be read); table padding is -1 (never dereferenced)."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [math.ceil(n / page_size) for n in lengths]
    max_pages = max(max(pages_per_seq), 1) + 1  # a padded column
    num_pages = sum(pages_per_seq) + spare_pages
    shape = (num_pages, page_size, n_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    order = torch.randperm(num_pages, generator=gen).tolist()
    tables = torch.full((len(lengths), max_pages), -1, dtype=torch.int32)
    dense_k, dense_v = [], []
    for i, (n, n_pages) in enumerate(zip(lengths, pages_per_seq)):
        k = torch.randn(n_kv_heads, n, head_dim, generator=gen)
        v = torch.randn(n_kv_heads, n, head_dim, generator=gen)
        dense_k.append(k.to(dtype).to(device))
        dense_v.append(v.to(dtype).to(device))
        for p in range(n_pages):
            page = order.pop()
            tables[i, p] = page
            rows = slice(p * page_size, min((p + 1) * page_size, n))
            used = rows.stop - rows.start
            k_cache[page, :used] = k[:, rows].transpose(0, 1)
            v_cache[page, :used] = v[:, rows].transpose(0, 1)
    return PagedBatch(k_cache.to(dtype).to(device), v_cache.to(dtype).to(device), tables.to(device),
                      torch.tensor(lengths, dtype=torch.int32, device=device), dense_k, dense_v)


def dense_decode(q, batch: PagedBatch, scale):
    """Each row's query against its dense keys with SDPA (enable_gqa), fp32; (B, H, D)."""
    outs = []
    for b, (k, v) in enumerate(zip(batch.dense_k, batch.dense_v)):
        if k.shape[1] == 0:
            outs.append(torch.zeros_like(q[b].float()))
            continue
        out = F.scaled_dot_product_attention(q[b, :, None].float()[None], k.float()[None], v.float()[None],
                                             scale=scale, enable_gqa=True)  # (1, H, 1, D)
        outs.append(out[0, :, 0])
    return torch.stack(outs)


def dense_prefill(q, cu, batch: PagedBatch, scale):
    """Each chunk's queries, at the last q_len positions of their sequence, against its dense keys (causal), fp32."""
    out = torch.zeros_like(q, dtype=torch.float32)
    for s, (k, v) in enumerate(zip(batch.dense_k, batch.dense_v)):
        start, end = int(cu[s]), int(cu[s + 1])
        n, q_len = k.shape[1], end - start
        if q_len == 0:
            continue
        pos = torch.arange(n - q_len, n)[:, None]
        mask = torch.arange(n)[None, :] <= pos  # (q_len, n)
        qs = q[start:end].float().transpose(0, 1)[None]  # (1, H, q_len, D)
        o = F.scaled_dot_product_attention(qs, k.float()[None], v.float()[None], attn_mask=mask, scale=scale,
                                           enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
    return out


def prefill_inputs(lengths, q_lens, n_heads, batch: PagedBatch, dtype=torch.float32, extra_rows=0, seed=1):
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    head_dim = batch.k_cache.shape[-1]
    q = torch.randn(int(cu[-1]) + extra_rows, n_heads, head_dim, generator=gen).to(dtype)
    return q.to(batch.k_cache.device), cu.to(batch.k_cache.device)


def qkv_batch(lengths, n_heads, n_kv_heads, head_dim, page_size, rotary=None, dtype=torch.float32, device="cpu",
              seed=0):
    """A paged batch whose rows each bring one new token at position seq_lens - 1, its slot NaN until written, with
    the raw projections qkv (B, (H + 2 Hkv) D), each row's rope rows (B, 2, R/2) at its position (R: rotary, or D)
    and two per-head norm weights (2, D)."""
    batch = paged_batch(lengths, n_kv_heads, head_dim, page_size, dtype=dtype, device=device, seed=seed)
    for b, n in enumerate(lengths):
        if n:
            page = int(batch.block_tables[b, (n - 1) // page_size])
            batch.k_cache[page, (n - 1) % page_size] = float("nan")
            batch.v_cache[page, (n - 1) % page_size] = float("nan")
    gen = torch.Generator().manual_seed(seed + 1)
    qkv = torch.randn(len(lengths), (n_heads + 2 * n_kv_heads) * head_dim, generator=gen)
    half = (rotary or head_dim) // 2
    angles = (torch.tensor(lengths) - 1).clamp(min=0)[:, None] * 10000.0 ** -(torch.arange(half) / half)  # (B, R/2)
    rope = torch.stack([angles.cos(), angles.sin()], dim=1)  # (B, 2, R/2)
    norms = torch.randn(2, head_dim, generator=gen) * 0.5 + 1
    return batch, qkv.to(dtype).to(device), rope.to(device), norms.to(dtype).to(device)


def unfused_decode_qkv(qkv, rope, batch: PagedBatch, n_heads, scale, window=0, norms=None, eps=1e-6):
    """The steps the op fuses, row by row: model.split_rotated_qkv (per-head model.rms_norm first, with norms), k and v
    written to the row's slot, then the decode reference; (out (B, H, D), k_cache, v_cache) on copies of the pool."""
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    page_size, n_kv_heads, head_dim = k_cache.shape[1:]
    normed = None if norms is None else (lambda q, k: (rms_norm(q, norms[0], eps), rms_norm(k, norms[1], eps)))
    queries = []
    for b, n in enumerate(batch.seq_lens.tolist()):
        q, k, v = split_rotated_qkv(qkv[b].view(1, 1, -1), rope[b:b + 1], n_heads, n_kv_heads, head_dim, normed)
        queries.append(q[0, 0])  # (H, D)
        if n:
            page = int(batch.block_tables[b, (n - 1) // page_size])
            k_cache[page, (n - 1) % page_size] = k[0, 0]
            v_cache[page, (n - 1) % page_size] = v[0, 0]
    out = pa.paged_decode_attention_reference(torch.stack(queries), k_cache, v_cache, batch.block_tables,
                                              batch.seq_lens, scale, window)
    return out, k_cache, v_cache


def rel_err(got, want) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()


# --- the references against dense SDPA ---

LAYOUTS = {"mha": (4, 4), "gqa4": (8, 2), "gqa8": (8, 1)}  # (H, Hkv): GQA ratios 1, 4, 8


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("page_size", [8, 16])
def test_decode_reference_matches_dense_sdpa(layout, page_size):
    n_heads, n_kv_heads = LAYOUTS[layout]
    lengths = [1, 15, 16, 17, 100, 333]  # within one page, page boundaries, many pages
    batch = paged_batch(lengths, n_kv_heads, 32, page_size)
    q = torch.randn(len(lengths), n_heads, 32)
    got = pa.paged_decode_attention_reference(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                              0.17)
    assert torch.allclose(got, dense_decode(q, batch, 0.17), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_prefill_reference_matches_dense_sdpa(layout):
    n_heads, n_kv_heads = LAYOUTS[layout]
    lengths = [5, 40, 300, 17]
    q_lens = [5, 9, 130, 1]  # a whole prompt, chunks after cached prefixes, one token
    batch = paged_batch(lengths, n_kv_heads, 32, 16)
    q, cu = prefill_inputs(lengths, q_lens, n_heads, batch, extra_rows=3)
    got = pa.paged_prefill_attention_reference(q, batch.k_cache, batch.v_cache, batch.block_tables, cu,
                                               batch.seq_lens, 0.2)
    want = dense_prefill(q, cu, batch, 0.2)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert (got[-3:] == 0).all()  # rows past cu_seqlens_q[S]


def test_reference_row_without_keys_is_zero_and_reads_no_page():
    batch = paged_batch([20, 0, 7], 2, 16, 8)
    q = torch.randn(3, 4, 16)
    got = pa.paged_decode_attention_reference(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                              0.25)
    assert (got[1] == 0).all() and torch.isfinite(got).all()
    assert torch.allclose(got, dense_decode(q, batch, 0.25), atol=1e-5)


def test_reference_chunks_rows_like_one_pass(monkeypatch):
    batch = paged_batch([30, 64, 5, 129], 2, 16, 16)
    q = torch.randn(4, 4, 16)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.3)
    whole = pa.paged_decode_attention_reference(*args)
    monkeypatch.setattr(pa, "REFERENCE_CHUNK_ELEMENTS", 1)  # one row per step
    assert torch.allclose(pa.paged_decode_attention_reference(*args), whole, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_low_precision_accumulates_in_fp32(dtype):
    batch = paged_batch([50, 9], 2, 32, 16, dtype=dtype)
    q = torch.randn(2, 4, 32).to(dtype)
    got = pa.paged_decode_attention_reference(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                              0.1)
    assert got.dtype == dtype
    assert torch.allclose(got.float(), dense_decode(q, batch, 0.1), atol=1e-2, rtol=1e-2)


# --- the ops on the CPU: dispatch, validation, torch.compile ---


def test_ops_run_the_references_on_cpu():
    batch = paged_batch([12, 70], 2, 64, 16)
    q = torch.randn(2, 8, 64)
    args = (batch.k_cache, batch.v_cache, batch.block_tables)
    assert pa.paged_decode_config(q, batch.k_cache, batch.v_cache, batch.block_tables) is None
    got = torch.ops.redline.paged_decode_attention(q, *args, batch.seq_lens, 0.125)
    assert torch.equal(got, pa.paged_decode_attention_reference(q, *args, batch.seq_lens, 0.125))
    qp, cu = prefill_inputs([12, 70], [4, 70], 8, batch)
    got = torch.ops.redline.paged_prefill_attention(qp, *args, cu, batch.seq_lens, 0.125)
    assert torch.equal(got, pa.paged_prefill_attention_reference(qp, *args, cu, batch.seq_lens, 0.125))


def _decode_args(**change):
    batch = paged_batch([10, 20], 2, 16, 8)
    args = dict(q=torch.randn(2, 4, 16), k_cache=batch.k_cache, v_cache=batch.v_cache,
                block_tables=batch.block_tables, seq_lens=batch.seq_lens)
    args.update(change)
    return args


@pytest.mark.parametrize("change,match", [
    (dict(q=torch.randn(2, 4, 1, 16)), "must be \\(rows, H, D\\)"),
    (dict(v_cache=torch.randn(5, 8, 2, 16)), "v_cache"),
    (dict(q=torch.randn(2, 4, 32)), "head_dim 32 must match"),
    (dict(q=torch.randn(2, 3, 16)), "multiple of the cache's 2 KV heads"),
    (dict(q=torch.randn(2, 4, 16).half()), "one dtype"),
    (dict(block_tables=torch.zeros(2, 3, dtype=torch.int64)), "block_tables must be an int32"),
    (dict(seq_lens=torch.tensor([1, 2, 3], dtype=torch.int32)), "one length per block-table row"),
    (dict(seq_lens=torch.tensor([1, 2])), "seq_lens must be int32"),
    (dict(q=torch.randn(3, 4, 16)), "3 queries"),
    (dict(k_cache=torch.randn(0, 8, 2, 16), v_cache=torch.randn(0, 8, 2, 16)), "holds no pages"),
])
def test_decode_validation_errors(change, match):
    args = _decode_args(**change)
    with pytest.raises(ValueError, match=match):
        torch.ops.redline.paged_decode_attention(*args.values(), 0.25)


def test_prefill_validation_errors():
    args = _decode_args()
    with pytest.raises(ValueError, match="cu_seqlens_q must be int32 of shape \\(3,\\)"):
        torch.ops.redline.paged_prefill_attention(args["q"], args["k_cache"], args["v_cache"], args["block_tables"],
                                                  torch.tensor([0, 2], dtype=torch.int32), args["seq_lens"], 0.25)


def test_a_negative_window_is_refused_by_both_ops_in_one_line():
    args = _decode_args()
    calls = (lambda: torch.ops.redline.paged_decode_attention(*args.values(), 0.25, -1),
             lambda: torch.ops.redline.paged_prefill_attention(
                 args["q"], args["k_cache"], args["v_cache"], args["block_tables"],
                 torch.tensor([0, 1, 2], dtype=torch.int32), args["seq_lens"], 0.25, -1))
    for call in calls:
        with pytest.raises(ValueError, match="window must be 0 \\(none\\) or a positive number of keys, got -1") as info:
            call()
        assert "\n" not in str(info.value)


def test_opcheck_cpu():
    batch = paged_batch([10, 33], 2, 16, 8)
    q = torch.randn(2, 4, 16)
    torch.library.opcheck(torch.ops.redline.paged_decode_attention.default,
                          (q, batch.k_cache.nan_to_num(), batch.v_cache.nan_to_num(), batch.block_tables,
                           batch.seq_lens, 0.25))
    qp, cu = prefill_inputs([10, 33], [3, 33], 4, batch)
    torch.library.opcheck(torch.ops.redline.paged_prefill_attention.default,
                          (qp, batch.k_cache.nan_to_num(), batch.v_cache.nan_to_num(), batch.block_tables, cu,
                           batch.seq_lens, 0.25))


def test_torch_compile_fullgraph_cpu():
    batch = paged_batch([10, 33], 2, 16, 8)
    q = torch.randn(2, 4, 16)

    @torch.compile(fullgraph=True, backend="eager")
    def step(q, k, v, tables, lens):
        return torch.ops.redline.paged_decode_attention(q * 2, k, v, tables, lens, 0.25) + 1

    got = step(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    want = pa.paged_decode_attention_reference(q * 2, batch.k_cache, batch.v_cache, batch.block_tables,
                                               batch.seq_lens, 0.25) + 1
    assert torch.equal(got, want)


# --- the fused decode op (rope, page write, attention from the raw qkv) on the CPU ---

QKV_VARIANTS = {"gqa": (8, 2, None), "mha": (4, 4, None), "partial": (8, 2, 24), "norms": (8, 2, None),
                "window": (8, 2, None)}  # (H, Hkv, rotated features)


@pytest.mark.parametrize("variant", sorted(QKV_VARIANTS))
def test_qkv_op_on_cpu_is_the_unfused_steps(variant):
    n_heads, n_kv_heads, rotary = QKV_VARIANTS[variant]
    lengths = [1, 8, 9, 17, 33, 16]  # pages of 8: a first slot, a page's last slot, the next page's first, ...
    batch, qkv, rope, norms = qkv_batch(lengths, n_heads, n_kv_heads, 32, 8, rotary)
    window = 10 if variant == "window" else 0
    norm_args = (norms[0], norms[1], 1e-6) if variant == "norms" else (None, None, 0.0)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    got = torch.ops.redline.paged_decode_attention_qkv(qkv, k_cache, v_cache, rope, batch.block_tables,
                                                       batch.seq_lens, 0.2, window, *norm_args)
    want, want_k, want_v = unfused_decode_qkv(qkv, rope, batch, n_heads, 0.2, window,
                                              norms if variant == "norms" else None)
    assert got.shape == (len(lengths), n_heads, 32) and torch.isfinite(got).all()  # each NaN slot written first
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_cache, want_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, want_v, atol=0, rtol=0, equal_nan=True)


def test_qkv_op_rows_without_keys_write_nothing_and_scale_0_is_the_default():
    batch, qkv, rope, _ = qkv_batch([0, 5, 0, 9], 4, 2, 16, 8)
    pool = batch.k_cache.clone(), batch.v_cache.clone()
    args = (rope, batch.block_tables, batch.seq_lens)
    got = torch.ops.redline.paged_decode_attention_qkv(qkv, *pool, *args, 0.0)
    want, want_k, want_v = unfused_decode_qkv(qkv, rope, batch, 4, 16 ** -0.5)
    assert (got[0] == 0).all() and (got[2] == 0).all()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(pool, (want_k, want_v), atol=0, rtol=0, equal_nan=True)
    idle = torch.zeros(4, dtype=torch.int32)  # no row writes: the pool stays as it was
    torch.ops.redline.paged_decode_attention_qkv(qkv, *pool, rope, batch.block_tables, idle, 0.0)
    torch.testing.assert_close(pool, (want_k, want_v), atol=0, rtol=0, equal_nan=True)


def _qkv_args(**change):
    batch, qkv, rope, _ = qkv_batch([10, 20], 4, 2, 16, 8)
    args = dict(qkv=qkv, k_cache=batch.k_cache, v_cache=batch.v_cache, rope=rope, block_tables=batch.block_tables,
                seq_lens=batch.seq_lens, scale=0.25, window=0, q_norm=None, k_norm=None, norm_eps=0.0)
    args.update(change)
    return args


@pytest.mark.parametrize("change,match", [
    (dict(qkv=torch.randn(2, 1, 128)), "qkv must be \\(B, \\(H \\+ 2 Hkv\\) D\\) with H a multiple of Hkv=2"),
    (dict(qkv=torch.randn(2, 80)), "qkv must be"),
    (dict(qkv=torch.randn(2, 128).half()), "qkv and the caches must share one dtype"),
    (dict(v_cache=torch.randn(5, 8, 2, 16)), "k_cache and v_cache must be"),
    (dict(k_cache=torch.randn(5, 8, 2, 32)[..., ::2], v_cache=torch.randn(5, 8, 2, 32)[..., ::2]), "unit stride"),
    (dict(rope=torch.randn(2, 2, 8).double()), "rope must be the fp32 cos/sin rows \\(2, 2, R/2\\)"),
    (dict(rope=torch.randn(3, 2, 8)), "rope must be"),
    (dict(rope=torch.randn(2, 2, 9)), "R <= 16"),
    (dict(q_norm=torch.ones(16)), "both q_norm and k_norm"),
    (dict(q_norm=torch.ones(8), k_norm=torch.ones(8), norm_eps=1e-6), "q_norm must be \\(16,\\)"),
    (dict(q_norm=torch.ones(16), k_norm=torch.ones(16)), "norm_eps must be positive"),
    (dict(scale=-1.0), "scale must be a finite factor"),
    (dict(scale=float("nan")), "scale must be a finite factor"),
    (dict(window=-1), "window must be 0"),
    (dict(block_tables=torch.zeros(3, 3, dtype=torch.int32), seq_lens=torch.ones(3, dtype=torch.int32)),
     "3 rows for qkv's 2 rows"),
    (dict(seq_lens=torch.tensor([1, 2])), "seq_lens must be int32"),
])
def test_qkv_validation_errors(change, match):
    with pytest.raises(ValueError, match=match) as info:
        torch.ops.redline.paged_decode_attention_qkv(*_qkv_args(**change).values())
    assert "\n" not in str(info.value)


def test_qkv_opcheck_cpu():
    batch, qkv, rope, norms = qkv_batch([10, 33], 4, 2, 16, 8)
    args = (qkv, batch.k_cache.nan_to_num(), batch.v_cache.nan_to_num(), rope, batch.block_tables, batch.seq_lens)
    torch.library.opcheck(torch.ops.redline.paged_decode_attention_qkv.default, (*args, 0.25))
    torch.library.opcheck(torch.ops.redline.paged_decode_attention_qkv.default,
                          (*args, 0.25, 12, norms[0], norms[1], 1e-6))


# --- the configs ---


@pytest.mark.parametrize("target", ["sm80", "sm86", "sm90", "gfx90a", "gfx942", "gfx1100"])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", pa.PAGED_HEAD_DIMS)
@pytest.mark.parametrize("elt_bytes", [2, 4])
def test_prefill_config_fits_every_target(target, group, head_dim, elt_bytes):
    caps = target_caps(target)
    cfg = configs.fitted_paged_prefill_config(group, head_dim, elt_bytes, caps)
    assert cfg is not None
    assert cfg.block_m >= 1 << (group - 1).bit_length()
    assert configs.paged_prefill_smem_bytes(cfg.block_m, cfg.block_n, head_dim, elt_bytes, cfg.num_stages,
                                            caps) <= caps.shared_memory_per_block


def test_prefill_config_none_when_nothing_fits():
    tiny = configs.DeviceCaps("nvidia", "sm80", 4096, 32, 108, True, False, True)
    assert configs.fitted_paged_prefill_config(8, 128, 2, tiny) is None


def test_prefill_config_validation():
    with pytest.raises(ValueError, match="power of two"):
        configs.PagedPrefillConfig(48, 64)


# --- the Triton kernels in the interpreter ---

# (name, dtype): every case the child runs. The interpreter's tl.dot is wrong for bf16: fp16 and fp32 only.
INTERPRETER_CASES = [(f"{op}_{v}", d) for op, variants in (("decode", ("split", "single", "gqa8", "page128", "window",
                                                                        "windowsingle")),
                                                            ("prefill", ("mha", "gqa4", "group3", "many", "window")),
                                                            ("qkv", ("split", "single", "gqa8", "partial", "norms",
                                                                     "window")))
                     for v in variants for d in ("float32", "float16")]


def run_interpreted_case(name: str, dtype_name: str) -> float:
    """The largest relative error of one kernel case against its reference (run under TRITON_INTERPRET=1)."""
    from redline.kernels import triton_paged_attention as tpa

    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    op, _, variant = name.partition("_")
    n_heads, n_kv_heads = {"mha": (2, 2), "gqa4": (8, 2), "gqa8": (8, 1), "group3": (3, 1)}.get(variant, (4, 2))
    page_size = 128 if variant == "page128" else 8
    if op == "qkv":  # the fused form: its output, and both pools after its page writes
        lengths = [0, 1, 37, 150, 8, 9]  # no keys, one, ..., a page's last slot, the next page's first
        batch, qkv, rope, norms = qkv_batch(lengths, n_heads, n_kv_heads, 64, page_size,
                                            48 if variant == "partial" else None, dtype)
        cfg = configs.AttentionConfig(num_splits=1 if variant == "single" else 5, block_s=16, num_warps=4,
                                      num_stages=1)
        window = 21 if variant == "window" else 0
        extra = (norms[0], norms[1], 1e-6) if variant == "norms" else (None, None, 0.0)
        pools, want_pools = [batch.k_cache.clone(), batch.v_cache.clone()], [batch.k_cache, batch.v_cache]
        got = tpa.paged_decode_attention_qkv(qkv, *pools, rope, batch.block_tables, batch.seq_lens, 0.125, cfg,
                                             window, *extra)
        want = pa.paged_decode_attention_qkv_reference(qkv, *want_pools, rope, batch.block_tables, batch.seq_lens,
                                                       0.125, window, *extra)
        errs = [rel_err(got, want)] + [rel_err(p.nan_to_num(), w.nan_to_num()) for p, w in zip(pools, want_pools)]
        return float("inf") if any(math.isnan(e) for e in errs) else max(errs)  # NaN: a slot read before written
    if op == "decode":
        lengths = [0, 1, 37, 150, 8] if variant != "page128" else [200, 3]
        batch = paged_batch(lengths, n_kv_heads, 64, page_size, dtype=dtype)
        q = torch.randn(len(lengths), n_heads, 64).to(dtype)
        splits = 1 if variant.endswith("single") else 5
        cfg = configs.AttentionConfig(num_splits=splits, block_s=16 if variant != "page128" else 32, num_warps=4,
                                      num_stages=1)
        args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125)
        window = 21 if variant.startswith("window") else 0  # rows of 37 and 150 keys start inside a block
        got = tpa.paged_decode_attention(*args, config=cfg, window=window)
        return rel_err(got, pa.paged_decode_attention_reference(*args, window))
    lengths, q_lens = [40, 9, 70], [40, 3, 21]  # whole, short tail, chunk after a cached prefix
    if variant == "many":  # the binary search over 7 chunks, one of them empty
        lengths, q_lens = [3, 20, 1, 50, 9, 33, 16], [3, 0, 1, 17, 9, 2, 16]
    batch = paged_batch(lengths, n_kv_heads, 64, page_size, dtype=dtype)
    q, cu = prefill_inputs(lengths, q_lens, n_heads, batch, dtype=dtype, extra_rows=2)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, cu, batch.seq_lens, 0.125)
    window = 13 if variant == "window" else 0  # shorter than the chunks: rows of one tile start in other blocks
    got = tpa.paged_prefill_attention(*args, config=configs.PagedPrefillConfig(16, 16, 4, 1), window=window)
    if not (got[-2:] == 0).all():
        return float("inf")
    return rel_err(got, pa.paged_prefill_attention_reference(*args, window))


@pytest.fixture(scope="module")
def interpreted_errors() -> dict[str, float]:
    return interpreted_errors_of(__file__, timeout=900)


@pytest.mark.parametrize("name,dtype", INTERPRETER_CASES, ids=[f"{n}-{d}" for n, d in INTERPRETER_CASES])
def test_kernel_matches_reference_in_interpreter(interpreted_errors, name, dtype):
    err = interpreted_errors[f"{name}/{dtype}"]
    assert err <= INTERPRETER_TOLERANCE[dtype], f"{name} in {dtype}: relative error {err:.2e}"


# --- on a GPU ---

GPU_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-4}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", pa.PAGED_HEAD_DIMS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("page_size", [8, 16, 128])
def test_gpu_decode_matches_reference(page_size, layout, head_dim, dtype):
    n_heads, n_kv_heads = LAYOUTS[layout]
    lengths = [0, 1, 17, 255, 1000, 4097, 16, 33]
    batch = paged_batch(lengths, n_kv_heads, head_dim, page_size, dtype=dtype, device="cuda")
    q = torch.randn(len(lengths), n_heads, head_dim, device="cuda").to(dtype)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, head_dim ** -0.5)
    assert pa.paged_decode_config(q, batch.k_cache, batch.v_cache, batch.block_tables) is not None
    got = torch.ops.redline.paged_decode_attention(*args)
    assert rel_err(got, pa.paged_decode_attention_reference(*args)) <= GPU_TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", pa.PAGED_HEAD_DIMS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("variant", ["plain", "partial", "norms", "window"])
def test_gpu_decode_qkv_matches_reference(variant, layout, head_dim, dtype):
    """The fused form's output and both pools after its page writes (the written slots NaN before) against the
    reference's."""
    n_heads, n_kv_heads = LAYOUTS[layout]
    lengths = [0, 1, 17, 255, 1000, 4097, 16, 33]
    batch, qkv, rope, norms = qkv_batch(lengths, n_heads, n_kv_heads, head_dim, 16,
                                        3 * head_dim // 4 if variant == "partial" else None, dtype, "cuda")
    extra = (norms[0], norms[1], 1e-6) if variant == "norms" else (None, None, 0.0)
    window = 100 if variant == "window" else 0
    args = (rope, batch.block_tables, batch.seq_lens, head_dim ** -0.5, window, *extra)
    pools, want_pools = (batch.k_cache.clone(), batch.v_cache.clone()), (batch.k_cache, batch.v_cache)
    assert pa.paged_decode_qkv_config(qkv, *pools, batch.block_tables) is not None
    got = torch.ops.redline.paged_decode_attention_qkv(qkv, *pools, *args)
    want = pa.paged_decode_attention_qkv_reference(qkv, *want_pools, *args)
    assert torch.isfinite(got).all()  # each new slot (NaN) was written before it was read
    assert rel_err(got, want) <= GPU_TOLERANCE[dtype]
    for pool, want_pool in zip(pools, want_pools):
        assert rel_err(pool.nan_to_num(), want_pool.nan_to_num()) <= GPU_TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", pa.PAGED_HEAD_DIMS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("page_size", [16, 64])
def test_gpu_prefill_matches_reference(page_size, layout, head_dim, dtype):
    n_heads, n_kv_heads = LAYOUTS[layout]
    lengths, q_lens = [600, 45, 1, 2000, 130], [600, 13, 1, 300, 0]
    batch = paged_batch(lengths, n_kv_heads, head_dim, page_size, dtype=dtype, device="cuda")
    q, cu = prefill_inputs(lengths, q_lens, n_heads, batch, dtype=dtype, extra_rows=5)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, cu, batch.seq_lens, head_dim ** -0.5)
    assert pa.paged_prefill_config(q, batch.k_cache, batch.v_cache) is not None
    got = torch.ops.redline.paged_prefill_attention(*args)
    assert rel_err(got, pa.paged_prefill_attention_reference(*args)) <= GPU_TOLERANCE[dtype]
    assert (got[-5:] == 0).all()


@pytest.mark.gpu
def test_gpu_strided_inputs():
    """q, the block table and the lengths as strided views (a slice of wider buffers) give the contiguous result."""
    batch = paged_batch([40, 300, 7], 2, 64, 16, dtype=torch.float16, device="cuda")
    q = torch.randn(3, 8, 2, 64, device="cuda", dtype=torch.float16)[:, :, 0]  # (B, H, D), stride 128 along H
    tables = torch.cat([batch.block_tables, batch.block_tables], dim=0).t().contiguous().t()[:3]  # column-major
    lens = torch.stack([batch.seq_lens, batch.seq_lens], dim=1)[:, 0]  # stride 2
    got = torch.ops.redline.paged_decode_attention(q, batch.k_cache, batch.v_cache, tables, lens, 0.125)
    want = pa.paged_decode_attention_reference(q.contiguous(), batch.k_cache, batch.v_cache, batch.block_tables,
                                               batch.seq_lens, 0.125)
    assert rel_err(got, want) <= 3e-3
    cu = torch.tensor([0, 0, 2, 2, 5, 5], dtype=torch.int32, device="cuda")[::2]  # [0, 2, 5], stride 2
    qp = torch.randn(5, 8, 2, 64, device="cuda", dtype=torch.float16)[:, :, 1]
    tables2 = tables[:2]  # still column-major
    lens2 = lens[:2]
    got = torch.ops.redline.paged_prefill_attention(qp, batch.k_cache, batch.v_cache, tables2, cu, lens2, 0.125)
    want = pa.paged_prefill_attention_reference(qp.contiguous(), batch.k_cache, batch.v_cache,
                                                batch.block_tables[:2], cu.contiguous(), batch.seq_lens[:2], 0.125)
    assert rel_err(got, want) <= 3e-3


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_changing_lengths_and_tables():
    batch = paged_batch([300, 900, 64, 5], 8, 128, 16, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(4, 32, 128, device="cuda", dtype=torch.bfloat16)
    lens = batch.seq_lens.clone()
    tables = batch.block_tables.clone()

    def call():
        return torch.ops.redline.paged_decode_attention(q, batch.k_cache, batch.v_cache, tables, lens, 0.088)

    graph, out = captured_graph(call)
    for new_lens in ([1, 2, 3, 4], [5, 64, 900, 300], [0, 17, 64, 2]):  # within the flipped rows' pages
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        tables.copy_(batch.block_tables.flip(0))
        graph.replay()
        want = pa.paged_decode_attention_reference(q, batch.k_cache, batch.v_cache, tables, lens, 0.088)
        assert rel_err(out, want) <= 2e-2


@pytest.mark.gpu
def test_gpu_prefill_cuda_graph_replay_with_changing_chunks():
    lengths = [300, 900, 64, 5]
    batch = paged_batch(lengths, 8, 128, 16, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(256, 32, 128, device="cuda", dtype=torch.bfloat16)  # (T, H, D), a padded bucket of 256 rows
    cu = torch.zeros(5, dtype=torch.int32, device="cuda")
    lens = batch.seq_lens.clone()

    def call():
        return torch.ops.redline.paged_prefill_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, cu,
                                                         lens, 0.088)

    graph, out = captured_graph(call)
    chunks = (([100, 50, 64, 5], lengths), ([1, 1, 1, 1], [1, 2, 3, 4]), ([0, 200, 0, 3], [7, 900, 0, 3]))
    for q_lens, new_lens in chunks:
        cu.copy_(torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32))
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        graph.replay()
        want = pa.paged_prefill_attention_reference(q, batch.k_cache, batch.v_cache, batch.block_tables, cu, lens,
                                                    0.088)
        assert rel_err(out, want) <= 2e-2
        assert (out[sum(q_lens):] == 0).all()


@pytest.mark.gpu
def test_gpu_torch_compile_reduce_overhead():
    batch = paged_batch([100, 2000], 8, 128, 16, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(2, 32, 128, device="cuda", dtype=torch.bfloat16)

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def step(q, k, v, tables, lens):
        return torch.ops.redline.paged_decode_attention(q * 2, k, v, tables, lens, 0.088) + 1

    for _ in range(3):  # warm-up, recording, replay
        got = step(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    want = pa.paged_decode_attention_reference(q * 2, batch.k_cache, batch.v_cache, batch.block_tables,
                                               batch.seq_lens, 0.088) + 1
    assert rel_err(got, want) <= 2e-2


@pytest.mark.gpu
def test_gpu_decode_qkv_cuda_graph_replay_with_changing_lengths_and_tables():
    batch, qkv, rope, norms = qkv_batch([300, 900, 64, 5], 32, 8, 128, 16, dtype=torch.bfloat16, device="cuda")
    pools = batch.k_cache.nan_to_num(), batch.v_cache.nan_to_num()
    lens, tables = batch.seq_lens.clone(), batch.block_tables.clone()

    def call():
        return torch.ops.redline.paged_decode_attention_qkv(qkv, *pools, rope, tables, lens, 0.088, 0, norms[0],
                                                            norms[1], 1e-6)

    graph, out = captured_graph(call)
    for new_lens in ([1, 2, 3, 4], [5, 64, 900, 300], [0, 17, 64, 2]):  # within the flipped rows' pages
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        tables.copy_(batch.block_tables.flip(0))
        want_pools = tuple(p.clone() for p in pools)
        graph.replay()
        want = pa.paged_decode_attention_qkv_reference(qkv, *want_pools, rope, tables, lens, 0.088, 0, norms[0],
                                                       norms[1], 1e-6)
        assert rel_err(out, want) <= 2e-2
        assert all(rel_err(p, w) <= 2e-2 for p, w in zip(pools, want_pools))


@pytest.mark.gpu
def test_gpu_decode_qkv_torch_compile_reduce_overhead():
    batch, qkv, rope, _ = qkv_batch([100, 2000], 32, 8, 128, 16, dtype=torch.bfloat16, device="cuda")
    pools = batch.k_cache.nan_to_num(), batch.v_cache.nan_to_num()
    want_pools = tuple(p.clone() for p in pools)

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def step(qkv, k, v, rope, tables, lens):
        return torch.ops.redline.paged_decode_attention_qkv(qkv * 2, k, v, rope, tables, lens, 0.088) + 1

    for _ in range(3):  # warm-up, recording, replay: each writes the same keys and values
        got = step(qkv, *pools, rope, batch.block_tables, batch.seq_lens)
    want = pa.paged_decode_attention_qkv_reference(qkv * 2, *want_pools, rope, batch.block_tables, batch.seq_lens,
                                                   0.088) + 1
    assert rel_err(got, want) <= 2e-2
    assert all(rel_err(p, w) <= 2e-2 for p, w in zip(pools, want_pools))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (the kernels run in Triton's interpreter)")
    sys.path.insert(0, str(ROOT / "tests"))
    from test_kernels_interpreter import _allow_one_element_loop_bounds

    _allow_one_element_loop_bounds()
    print(json.dumps({f"{n}/{d}": run_interpreted_case(n, d) for n, d in INTERPRETER_CASES}))
