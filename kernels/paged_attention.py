"""Attention over a paged KV cache: the ops a continuous-batching engine calls, with plain-PyTorch references.

    torch.ops.redline.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)  -> (B, H, D)
    torch.ops.redline.paged_decode_attention_qkv(qkv, k_cache, v_cache, rope, block_tables, seq_lens, scale)
                                                                                                  -> (B, H, D)
    torch.ops.redline.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale)
                                                                                                  -> (T, H, D)

The cache is a pool of pages, k_cache and v_cache (num_pages, page_size, Hkv, D) of the queries' float dtype, or of
e4m3 (torch.float8_e4m3fn) codes with k_scale and v_scale, (Hkv,) fp32 per KV head: a key is then its code times its
head's scale (dequantized in fp32 after the load; a new key written by the qkv op is divided by the scale, clamped
to +-448 and rounded to e4m3, as model.quantized_kv does). Row b of
block_tables (int32, (B, max_pages)) names the pages of sequence b in order, so its key s sits at slot
s % page_size of page block_tables[b, s // page_size]. Table entries past a row's ceil(seq_lens[b] / page_size)
pages are never read (padding may hold anything); the entries before must be valid page numbers (not checked: that
would read the device).

- decode: one query per row, q (B, H, D), attending to keys 0..seq_lens[b]-1.
- decode from the projection: the raw qkv (B, (H + 2 Hkv) D) of each row's new token at position seq_lens[b] - 1 and
  rope (B, 2, R/2) fp32, its cos/sin; q and the new key are rotated (optionally RMS-normalized per head first), the
  key and value written at that position's page slot (mutating the caches), then the decode above.
- prefill: S sequences' query chunks flattened into q (T, H, D); sequence s owns rows cu_seqlens_q[s] ..
  cu_seqlens_q[s+1]-1 (int32, (S + 1,)), and its query j sits at position seq_lens[s] - q_len_s + j, attending
  causally to keys 0..that position (the chunk's own keys are already in the pages). Rows past cu_seqlens_q[S] (a
  padded bucket) are zeros.

Query head h reads KV head h // (H // Hkv) (grouped-query attention); scores are scale * q k^T, the softmax and the
accumulation run in fp32, the output comes back in q's dtype. A query with no keys (seq_lens 0: a padding row)
gets zeros. Lengths past a row's max_pages * page_size are clamped to it.

On a CUDA/HIP device, for head_dim 64 or 128, a power-of-two page_size in 8..128 and caches with unit stride along
D, where a config fits the GPU's shared memory (configs.py, fitted to device.DeviceCaps), the ops run the Triton
kernels of triton_paged_attention.py; elsewhere the references below. Neither reads a tensor on the host, so both
are CUDA-graph capturable with shapes fixed per batch bucket, and both are opaque to torch.compile (custom_op +
register_fake).
"""
from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from redline.model import FP8_KV_DTYPE, dequantized_kv, quantized_kv, rms_norm, split_rotated_qkv

from .attention import check_head_norms
from .configs import (PAGED_DECODE_STAGES, AttentionConfig, PagedPrefillConfig, fitted_attention_config,
                      fitted_paged_prefill_config)
from .device import device_caps, kv_fp8_refusal, triton_importable
from .linear import FLOAT_DTYPES

PAGED_HEAD_DIMS = (64, 128)  # the head widths the kernels take (and scripts/check_targets.py compiles)
MIN_PAGE_SIZE, MAX_PAGE_SIZE = 8, 128  # the kernels take power-of-two page sizes in this range
# Elements of gathered K (or V) the reference holds at once: it attends this many query rows' keys per step, so a
# long batch on the fallback path does not gather every row's whole context at once.
REFERENCE_CHUNK_ELEMENTS = 1 << 24


@functools.cache
def triton_paged_attention():
    """kernels.triton_paged_attention, imported on first use (it imports triton)."""
    from . import triton_paged_attention as module

    return module


# --- dispatch ---


def _kernel_supported(dtype: torch.dtype, k_cache: Tensor, v_cache: Tensor) -> bool:
    """The Triton kernels take these shapes: a float dtype, head_dim 64/128, a power-of-two page size in 8..128,
    unit stride along D, and Triton is importable (the ops also need the tensors on a CUDA/HIP device); e4m3 pages
    where the GPU converts e4m3 (device.kv_fp8_refusal)."""
    page_size, head_dim = k_cache.shape[1], k_cache.shape[3]
    if dtype not in FLOAT_DTYPES or head_dim not in PAGED_HEAD_DIMS:
        return False
    if k_cache.dtype == FP8_KV_DTYPE and kv_fp8_refusal(k_cache.device) is not None:
        return False
    if not MIN_PAGE_SIZE <= page_size <= MAX_PAGE_SIZE or page_size & (page_size - 1):
        return False
    return k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and triton_importable()


def paged_decode_config(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor) -> AttentionConfig | None:
    """The decode kernel's config on this GPU (the split count from the table's key capacity, never from the
    lengths), or None where the kernel does not take these shapes: the op then runs the reference."""
    return _decode_config(q.shape[0], q.shape[1], q.dtype, q.device, k_cache, v_cache, block_tables)


def paged_decode_qkv_config(qkv: Tensor, k_cache: Tensor, v_cache: Tensor,
                            block_tables: Tensor) -> AttentionConfig | None:
    """paged_decode_config for the queries of the projection qkv (B, (H + 2 Hkv) D): the same kernel's."""
    n_heads = qkv.shape[1] // k_cache.shape[3] - 2 * k_cache.shape[2]
    return _decode_config(qkv.shape[0], n_heads, qkv.dtype, qkv.device, k_cache, v_cache, block_tables)


def _decode_config(batch: int, n_heads: int, dtype: torch.dtype, device: torch.device, k_cache: Tensor,
                   v_cache: Tensor, block_tables: Tensor) -> AttentionConfig | None:
    """The decode kernel's config for B rows of H query heads, or None where the kernel does not take the shapes."""
    if not _kernel_supported(dtype, k_cache, v_cache):
        return None
    max_keys = block_tables.shape[1] * k_cache.shape[1]
    q_bytes = torch.empty((), dtype=dtype).element_size()
    return fitted_attention_config(batch, n_heads, k_cache.shape[2], max(max_keys, 1), k_cache.shape[3], q_bytes,
                                   device_caps(device), PAGED_DECODE_STAGES, k_cache.element_size())


def tile_bytes(dtype: torch.dtype, k_cache: Tensor) -> int:
    """Bytes an element of the prefill kernel's K/V tiles takes in shared memory: e4m3 tiles are converted to the
    queries' dtype for the dots, so they are sized as those (its configs over an fp8 cache are its query dtype's)."""
    return max(torch.empty((), dtype=dtype).element_size(), k_cache.element_size())


def paged_prefill_config(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> PagedPrefillConfig | None:
    """The prefill kernel's config on this GPU, or None where the kernel does not take these shapes (the op then
    runs the reference)."""
    if not _kernel_supported(q.dtype, k_cache, v_cache):
        return None
    return fitted_paged_prefill_config(q.shape[1] // k_cache.shape[2], q.shape[2], tile_bytes(q.dtype, k_cache),
                                       device_caps(q.device))


# --- references (plain PyTorch, fp32) ---


def _attend_pages(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, lengths: Tensor, last_pos: Tensor,
                  scale: float, window: int = 0, k_scale: Tensor | None = None,
                  v_scale: Tensor | None = None) -> Tensor:
    """Each query row n attends to keys s < lengths[n] with s <= last_pos[n] (and, window > 0, s > last_pos[n] -
    window) of the pages tables[n]; fp32 softmax, zeros for a row without keys. q (N, H, D), tables (N, max_pages),
    lengths and last_pos (N,); k_scale, v_scale (Hkv,): the scales of e4m3 caches. Returns (N, H, D) in fp32."""
    n_rows, n_heads, head_dim = q.shape
    page_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_pages = tables.shape[1]
    max_keys = max_pages * page_size
    group = n_heads // n_kv_heads
    out = q.new_zeros((n_rows, n_heads, head_dim), dtype=torch.float32)  # (N, H, D)
    step = max(1, REFERENCE_CHUNK_ELEMENTS // max(max_keys * n_kv_heads * head_dim, 1))
    positions = torch.arange(max_keys, device=q.device)  # (S,)
    for start in range(0, n_rows, step):  # fixed by the shapes: no host sync
        rows = slice(start, start + step)
        lens = lengths[rows].clamp(0, max_keys)
        valid = (positions < lens[:, None]) & (positions <= last_pos[rows, None])  # (n, S)
        if window:
            valid &= positions > last_pos[rows, None] - window
        used_pages = torch.arange(max_pages, device=q.device) * page_size < lens[:, None]  # (n, max_pages)
        pages = torch.where(used_pages, tables[rows].long(), 0)  # padding entries are never dereferenced
        keep = valid[:, :, None, None]  # (n, S, 1, 1)
        # Zero the invalid keys rather than only masking the scores: 0 * NaN garbage would leak.
        k = torch.where(keep, dequantized_kv(k_cache[pages].flatten(1, 2), k_scale, torch.float32), 0.0)  # (n, S, Hkv, D)
        v = torch.where(keep, dequantized_kv(v_cache[pages].flatten(1, 2), v_scale, torch.float32), 0.0)
        qg = q[rows].float().unflatten(1, (n_kv_heads, group))  # (n, Hkv, G, D): head h -> KV head h // G
        scores = torch.einsum("nkgd,nskd->nkgs", qg, k) * scale  # (n, Hkv, G, S)
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row without keys: all -inf -> zeros
        out[rows] = torch.einsum("nkgs,nskd->nkgd", probs, v).flatten(1, 2)
    return out


def paged_decode_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                                     seq_lens: Tensor, scale: float, window: int = 0, k_scale: Tensor | None = None,
                                     v_scale: Tensor | None = None) -> Tensor:
    """The decode op computed in fp32 with PyTorch ops, returned in q's dtype; (B, H, D)."""
    lengths = seq_lens.long()
    return _attend_pages(q, k_cache, v_cache, block_tables, lengths, lengths - 1, scale, window, k_scale,
                         v_scale).to(q.dtype)


def paged_decode_attention_qkv_reference(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, rope: Tensor,
                                         block_tables: Tensor, seq_lens: Tensor, scale: float, window: int = 0,
                                         q_norm: Tensor | None = None, k_norm: Tensor | None = None,
                                         norm_eps: float = 0.0, k_scale: Tensor | None = None,
                                         v_scale: Tensor | None = None) -> Tensor:
    """The unfused steps: split qkv, per-head RMS norms of q and k when given (model.rms_norm), rope each row with
    its own rope row (model.split_rotated_qkv), write k and v into each row's page slot at seq_lens[b] - 1 (as e4m3
    codes of k / k_scale, v / v_scale with scales), then the decode reference (scale 0: D ** -0.5); returns (B, H, D)
    in qkv's dtype."""
    n_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    n_heads = qkv.shape[1] // head_dim - 2 * n_kv_heads
    normed = None if q_norm is None else (lambda q, k: (rms_norm(q, q_norm, norm_eps), rms_norm(k, k_norm, norm_eps)))
    # The rows as the tokens of one sequence: token b is rotated with rope row b.
    q, k, v = split_rotated_qkv(qkv[None], rope, n_heads, n_kv_heads, head_dim, normed)  # (1, B, heads, D) each
    k, v = k[0], v[0]  # (B, Hkv, D) each
    if k_scale is not None:
        k, v = quantized_kv(k, k_scale), quantized_kv(v, v_scale)
    if block_tables.shape[1]:  # (a table without pages holds no keys: nothing to write)
        _write_new_keys(k_cache, v_cache, k, v, block_tables, seq_lens)
    return paged_decode_attention_reference(q[0], k_cache, v_cache, block_tables, seq_lens,
                                            scale or head_dim ** -0.5, window, k_scale, v_scale)


def _write_new_keys(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, block_tables: Tensor,
                    seq_lens: Tensor) -> None:
    """Write row b's k and v (B, Hkv, D) at its position seq_lens[b] - 1 (clamped into its table, as the kernel
    clamps lengths), page block_tables[b, pos // page_size]; a row without keys (padding) writes nothing."""
    page_size = k_cache.shape[1]
    lengths = seq_lens.long().clamp(0, block_tables.shape[1] * page_size)
    written = lengths > 0  # (B,)
    pos = (lengths - 1).clamp(min=0)
    page = torch.where(written, block_tables.long().gather(1, (pos // page_size)[:, None])[:, 0], 0)  # (B,)
    slot = torch.where(written, pos % page_size, 0)
    # A row that writes nothing repeats the first writing row's write (its slot, its values), or where no row writes
    # puts page 0's slot 0 back: no slot gets two different values, and nothing here reads the device on the host.
    src = torch.where(written, torch.arange(k.shape[0], device=k.device), written.int().argmax())  # (B,)
    page, slot, keep = page[src], slot[src], written[src][:, None, None]
    k_cache.index_put_((page, slot), torch.where(keep, k[src], k_cache[page, slot]))
    v_cache.index_put_((page, slot), torch.where(keep, v[src], v_cache[page, slot]))


def paged_prefill_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                                      cu_seqlens_q: Tensor, seq_lens: Tensor, scale: float, window: int = 0,
                                      k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> Tensor:
    """The prefill op computed in fp32 with PyTorch ops, returned in q's dtype; (T, H, D)."""
    n_tokens = q.shape[0]
    n_seqs = block_tables.shape[0]
    if n_seqs == 0:
        return torch.zeros_like(q)
    cu = cu_seqlens_q.long()
    token = torch.arange(n_tokens, device=q.device)  # (T,)
    seq = torch.searchsorted(cu[1:], token, right=True)  # (T,) the sequence of each row; n_seqs past the last
    padded = seq >= n_seqs
    seq = seq.clamp(max=n_seqs - 1)
    lengths = torch.where(padded, 0, seq_lens.long()[seq])  # (T,) a row past cu_seqlens_q[S] gets no keys: zeros
    q_len = (cu[1:] - cu[:-1])[seq]
    last_pos = lengths - q_len + (token - cu[seq])  # (T,) the row's position in its sequence
    return _attend_pages(q, k_cache, v_cache, block_tables[seq], lengths, last_pos, scale, window, k_scale,
                         v_scale).to(q.dtype)


# --- validation ---


def _check_paged_common(name: str, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                        seq_lens: Tensor, window: int, k_scale: Tensor | None = None,
                        v_scale: Tensor | None = None) -> None:
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"{name}: q must be (rows, H, D) and k_cache (num_pages, page_size, Hkv, D), "
                         f"got {tuple(q.shape)} and {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{name}: v_cache {tuple(v_cache.shape)} must have k_cache's shape {tuple(k_cache.shape)}")
    num_pages, page_size, n_kv_heads, head_dim = k_cache.shape
    if num_pages == 0 or page_size == 0:
        raise ValueError(f"{name}: the page pool {tuple(k_cache.shape)} holds no pages; allocate at least one page")
    if q.shape[2] != head_dim:
        raise ValueError(f"{name}: q's head_dim {q.shape[2]} must match the cache's {head_dim}")
    if n_kv_heads == 0 or q.shape[1] % n_kv_heads:
        raise ValueError(f"{name}: q's {q.shape[1]} heads must be a multiple of the cache's {n_kv_heads} KV heads")
    _check_cache_dtypes(name, "qkv" if name.endswith("_qkv") else "q", q.dtype, k_cache, v_cache, k_scale, v_scale)
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
        raise ValueError(f"{name}: block_tables must be an int32 (sequences, max_pages) tensor, "
                         f"got {tuple(block_tables.shape)} of {block_tables.dtype}")
    if seq_lens.dim() != 1 or seq_lens.dtype != torch.int32 or seq_lens.shape[0] != block_tables.shape[0]:
        raise ValueError(f"{name}: seq_lens must be int32 with one length per block-table row "
                         f"({block_tables.shape[0]}), got {tuple(seq_lens.shape)} of {seq_lens.dtype}")
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"{name}: all inputs must be on one device, got {sorted(map(str, devices))}")
    if window < 0:
        raise ValueError(f"{name}: window must be 0 (none) or a positive number of keys, got {window}")


def _check_cache_dtypes(name: str, queries: str, dtype: torch.dtype, k_cache: Tensor, v_cache: Tensor,
                        k_scale: Tensor | None, v_scale: Tensor | None) -> None:
    """The caches hold the queries' float dtype without scales, or e4m3 codes with (Hkv,) fp32 scales beside them."""
    fp8 = k_cache.dtype == FP8_KV_DTYPE
    if dtype not in FLOAT_DTYPES or k_cache.dtype not in (dtype, FP8_KV_DTYPE) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{name}: {queries} and the caches must share one dtype of bf16, fp16 or fp32 (or the caches "
                         f"hold float8_e4m3fn with k_scale and v_scale), got {dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if fp8 != (k_scale is not None) or (k_scale is None) != (v_scale is None):
        raise ValueError(f"{name}: pass k_scale and v_scale with float8_e4m3fn caches, and only with them")
    if fp8:
        for scale in (k_scale, v_scale):
            if scale.shape != (k_cache.shape[2],) or scale.dtype != torch.float32 or scale.device != k_cache.device:
                raise ValueError(f"{name}: k_scale and v_scale must be fp32 ({k_cache.shape[2]},) (one per KV head) on "
                                 f"{k_cache.device}, got {tuple(scale.shape)} of {scale.dtype} on {scale.device}")


def _check_paged_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                        window: int = 0, k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> None:
    name = "redline.paged_decode_attention"
    _check_paged_common(name, q, k_cache, v_cache, block_tables, seq_lens, window, k_scale, v_scale)
    if block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"{name}: block_tables has {block_tables.shape[0]} rows for q's {q.shape[0]} queries; "
                         "pass one row per query")


def _check_paged_decode_qkv(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, rope: Tensor, block_tables: Tensor,
                            seq_lens: Tensor, scale: float, window: int = 0, q_norm: Tensor | None = None,
                            k_norm: Tensor | None = None, norm_eps: float = 0.0, k_scale: Tensor | None = None,
                            v_scale: Tensor | None = None) -> None:
    name = "redline.paged_decode_attention_qkv"
    if not (scale >= 0 and math.isfinite(scale)):
        raise ValueError(f"{name}: scale must be a finite factor > 0, or 0 for head_dim ** -0.5, got {scale}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"{name}: k_cache and v_cache must be (num_pages, page_size, Hkv, D) of one shape, "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    n_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    width = qkv.shape[-1] if qkv.dim() == 2 else 0
    heads = width // max(head_dim, 1) - 2 * n_kv_heads  # H, where qkv's shape is right
    if width == 0 or n_kv_heads == 0 or head_dim == 0 or width % head_dim or heads <= 0 or heads % n_kv_heads:
        raise ValueError(f"{name}: qkv must be (B, (H + 2 Hkv) D) with H a multiple of Hkv={n_kv_heads} and "
                         f"D={head_dim}, got {tuple(qkv.shape)}")
    q = qkv[:, :heads * head_dim].unflatten(1, (heads, head_dim))  # (B, H, D): a view, for the common checks
    _check_paged_common(name, q, k_cache, v_cache, block_tables, seq_lens, window, k_scale, v_scale)
    batch = qkv.shape[0]
    if block_tables.shape[0] != batch:
        raise ValueError(f"{name}: block_tables has {block_tables.shape[0]} rows for qkv's {batch} rows; pass one "
                         "row per sequence")
    if (head_dim % 2 or rope.dim() != 3 or rope.shape[:2] != (batch, 2) or not 1 <= rope.shape[2] <= head_dim // 2
            or rope.dtype != torch.float32 or rope.device != qkv.device):
        raise ValueError(f"{name}: rope must be the fp32 cos/sin rows ({batch}, 2, R/2) of each row's position "
                         f"(R <= {head_dim} rotated features) on {qkv.device}, got {tuple(rope.shape)} of {rope.dtype} "
                         f"on {rope.device}")
    check_head_norms(name, qkv, q_norm, k_norm, norm_eps, head_dim)
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(f"{name}: the caches must have unit stride along head_dim (they are written in place)")


def _check_paged_prefill(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, cu_seqlens_q: Tensor,
                         seq_lens: Tensor, window: int = 0, k_scale: Tensor | None = None,
                         v_scale: Tensor | None = None) -> None:
    name = "redline.paged_prefill_attention"
    _check_paged_common(name, q, k_cache, v_cache, block_tables, seq_lens, window, k_scale, v_scale)
    n_seqs = block_tables.shape[0]
    if cu_seqlens_q.shape != (n_seqs + 1,) or cu_seqlens_q.dtype != torch.int32:
        raise ValueError(f"{name}: cu_seqlens_q must be int32 of shape ({n_seqs + 1},) (sequences + 1 offsets), "
                         f"got {tuple(cu_seqlens_q.shape)} of {cu_seqlens_q.dtype}")
    if cu_seqlens_q.device != q.device:
        raise ValueError(f"{name}: cu_seqlens_q is on {cu_seqlens_q.device}, q on {q.device}; put them on one device")


# --- the custom ops ---


@torch.library.custom_op("redline::paged_decode_attention", mutates_args=())
def paged_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                           scale: float, window: int = 0, k_scale: Tensor | None = None,
                           v_scale: Tensor | None = None) -> Tensor:
    """softmax(scale q k^T) v over each row's keys 0..seq_lens[b]-1 of its pages (window > 0: the last `window` of
    them); q (B, H, D) -> (B, H, D). k_scale, v_scale (Hkv,) fp32: the scales of e4m3 caches."""
    _check_paged_decode(q, k_cache, v_cache, block_tables, seq_lens, window, k_scale, v_scale)
    config = paged_decode_config(q, k_cache, v_cache, block_tables) if q.is_cuda else None
    if config is not None:
        return triton_paged_attention().paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                                                config, window, k_scale, v_scale)
    return paged_decode_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, scale, window, k_scale,
                                            v_scale).contiguous()


@paged_decode_attention.register_fake
def _paged_decode_attention_fake(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                                 scale: float, window: int = 0, k_scale: Tensor | None = None,
                                 v_scale: Tensor | None = None) -> Tensor:
    _check_paged_decode(q, k_cache, v_cache, block_tables, seq_lens, window, k_scale, v_scale)
    return q.new_empty(q.shape)  # (B, H, D), contiguous like the real output


@torch.library.custom_op("redline::paged_decode_attention_qkv", mutates_args=("k_cache", "v_cache"))
def paged_decode_attention_qkv(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, rope: Tensor, block_tables: Tensor,
                               seq_lens: Tensor, scale: float, window: int = 0, q_norm: Tensor | None = None,
                               k_norm: Tensor | None = None, norm_eps: float = 0.0, k_scale: Tensor | None = None,
                               v_scale: Tensor | None = None) -> Tensor:
    """One new token a row from its raw projection qkv (B, (H + 2 Hkv) D) at position seq_lens[b] - 1: rotates q
    and k with the row's rope (B, 2, R/2) (q_norm, k_norm (D,): per-head RMS norms of eps norm_eps first), writes k
    and v into the row's page slot, attends over keys 0..seq_lens[b]-1 (window > 0: the last `window`); scale 0:
    D ** -0.5; k_scale, v_scale (Hkv,) fp32: e4m3 caches (the new key and value written as their codes). Returns
    (B, H, D). On the GPU it is the decode kernel's launch (two with the split partials' combine)."""
    _check_paged_decode_qkv(qkv, k_cache, v_cache, rope, block_tables, seq_lens, scale, window, q_norm, k_norm,
                            norm_eps, k_scale, v_scale)
    config = paged_decode_qkv_config(qkv, k_cache, v_cache, block_tables) if qkv.is_cuda else None
    if config is not None:
        return triton_paged_attention().paged_decode_attention_qkv(
            qkv, k_cache, v_cache, rope, block_tables, seq_lens, scale or k_cache.shape[3] ** -0.5, config, window,
            q_norm, k_norm, norm_eps, k_scale, v_scale)
    return paged_decode_attention_qkv_reference(qkv, k_cache, v_cache, rope, block_tables, seq_lens, scale, window,
                                                q_norm, k_norm, norm_eps, k_scale, v_scale).contiguous()


@paged_decode_attention_qkv.register_fake
def _paged_decode_attention_qkv_fake(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, rope: Tensor,
                                     block_tables: Tensor, seq_lens: Tensor, scale: float, window: int = 0,
                                     q_norm: Tensor | None = None, k_norm: Tensor | None = None,
                                     norm_eps: float = 0.0, k_scale: Tensor | None = None,
                                     v_scale: Tensor | None = None) -> Tensor:
    _check_paged_decode_qkv(qkv, k_cache, v_cache, rope, block_tables, seq_lens, scale, window, q_norm, k_norm,
                            norm_eps, k_scale, v_scale)
    n_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    return qkv.new_empty((qkv.shape[0], qkv.shape[1] // head_dim - 2 * n_kv_heads, head_dim))  # (B, H, D)


@torch.library.custom_op("redline::paged_prefill_attention", mutates_args=())
def paged_prefill_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, cu_seqlens_q: Tensor,
                            seq_lens: Tensor, scale: float, window: int = 0, k_scale: Tensor | None = None,
                            v_scale: Tensor | None = None) -> Tensor:
    """Causal attention of flattened query chunks over their sequences' pages (window > 0: each query over the last
    `window` positions up to its own); q (T, H, D) -> (T, H, D). k_scale, v_scale (Hkv,) fp32: e4m3 caches."""
    _check_paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, window, k_scale, v_scale)
    config = paged_prefill_config(q, k_cache, v_cache) if q.is_cuda else None
    if config is not None:
        return triton_paged_attention().paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                                                 seq_lens, scale, config, window, k_scale, v_scale)
    return paged_prefill_attention_reference(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                                             scale, window, k_scale, v_scale).contiguous()


@paged_prefill_attention.register_fake
def _paged_prefill_attention_fake(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                                  cu_seqlens_q: Tensor, seq_lens: Tensor, scale: float, window: int = 0,
                                  k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> Tensor:
    _check_paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, window, k_scale, v_scale)
    return q.new_empty(q.shape)  # (T, H, D)
