"""model.py's paged path: many sequences flattened into one row give the static cache's logits."""
from __future__ import annotations

import math

import torch

from redline.model import (ModelArgs, PagedContext, PagedKVCache, Transformer, paged_decode_attention,
                           paged_prefill_attention)


def tiny_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelArgs.from_name("debug-tiny")).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def static_logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    """(T, vocab) of one sequence through the static cache, one prefill."""
    model.setup_caches(1, 64)
    return model(torch.tensor([ids]), torch.arange(len(ids)), from_start=True)[0]


def context_for(chunks: list[tuple[int, int]], pages: dict[int, list[int]], kv: PagedKVCache,
                decode: bool = False) -> PagedContext:
    """chunks: (sequence, [start, end) of its positions computed now) per sequence, in row order."""
    positions, slots, lens, cu = [], [], [], [0]
    for s, (start, end) in chunks:
        for p in range(start, end):
            positions.append(p)
            slots.append(pages[s][p // kv.page_size] * kv.page_size + p % kv.page_size)
        lens.append(end)
        cu.append(cu[-1] + end - start)
    width = max(len(pages[s]) for s, _ in chunks)
    tables = [pages[s] + [0] * (width - len(pages[s])) for s, _ in chunks]
    i32 = dict(dtype=torch.int32)
    return PagedContext(torch.tensor(positions), torch.tensor(slots), torch.tensor(tables, **i32),
                        torch.tensor(lens, **i32), torch.tensor(cu, **i32), kv, decode=decode)


def test_paged_chunks_and_decode_rows_match_the_static_cache():
    model = tiny_model()
    seqs = {0: list(range(5, 22)), 1: list(range(40, 47)), 2: list(range(100, 133))}
    want = {s: static_logits(model, ids) for s, ids in seqs.items()}
    kv = PagedKVCache(model.args, num_pages=16, page_size=4, dtype=torch.float32, device=None)
    # Scattered, out-of-order pages, so a wrong page lookup cannot pass by luck.
    pages = {0: [3, 9, 1, 12, 5], 1: [7, 2], 2: [15, 0, 11, 4, 6, 8, 10, 13, 14]}
    # Step 1: sequence 0 in two chunks (0..9 now), sequence 1 whole; step 2: the rest of 0, sequence 2's start, and
    # sequence 1 decoding its last token as a one-token row.
    steps = [[(0, (0, 9)), (1, (0, 6))], [(1, (6, 7)), (0, (9, 17)), (2, (0, 20))], [(2, (20, 33))]]
    got = {s: [] for s in seqs}
    for chunks in steps:
        ctx = context_for(chunks, pages, kv)
        ids = torch.tensor([[seqs[s][p] for s, (a, b) in chunks for p in range(a, b)]])
        logits = model(ids, ctx.positions, context=ctx)[0]  # (N, vocab)
        at = 0
        for s, (a, b) in chunks:
            got[s].append(logits[at:at + b - a])
            at += b - a
    for s in seqs:
        torch.testing.assert_close(torch.cat(got[s]), want[s], atol=1e-4, rtol=1e-4)


def test_decode_reference_is_prefill_with_one_query_each():
    torch.manual_seed(1)
    k_cache, v_cache = torch.randn(6, 4, 2, 8), torch.randn(6, 4, 2, 8)
    q = torch.randn(3, 4, 8)
    tables = torch.tensor([[2, 5, 0], [1, 0, 0], [4, 3, 0]], dtype=torch.int32)
    lens = torch.tensor([7, 3, 8], dtype=torch.int32)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.3)
    for b in range(3):  # by hand: the sequence's keys gathered, every one visible to its last position
        keys = torch.cat([k_cache[p] for p in tables[b].tolist()])[:lens[b]].repeat_interleave(2, dim=1)  # (K, H, D)
        values = torch.cat([v_cache[p] for p in tables[b].tolist()])[:lens[b]].repeat_interleave(2, dim=1)
        weights = torch.softmax(torch.einsum("hd,khd->hk", q[b], keys) * 0.3, dim=-1)
        torch.testing.assert_close(out[b], torch.einsum("hk,khd->hd", weights, values))
    cu = torch.arange(4, dtype=torch.int32)
    torch.testing.assert_close(paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.3), out)
    assert math.isfinite(out.sum().item())
