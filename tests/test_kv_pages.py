"""engine/kv_pages.py: the page pool's holds, free list, prefix keys and least-recently-used eviction."""
from __future__ import annotations

import pytest
import torch

from redline.engine.kv_pages import PagePool, page_key, pool_pages
from redline.model import ModelArgs


def fill(pool: PagePool, tokens: list[int]) -> tuple[list[int], list[bytes]]:
    """Pages for tokens, every full one keyed as the scheduler does once they are computed."""
    pages = pool.allocate(pool.pages_for(len(tokens)))
    keys: list[bytes] = []
    for i in range(len(tokens) // pool.page_size):
        keys.append(page_key(keys[-1] if keys else b"", tokens[i * pool.page_size:(i + 1) * pool.page_size]))
        pool.register(pages[i], keys[-1])
    return pages, keys


def test_allocate_and_release_return_every_page():
    pool = PagePool(5, 4)
    a, b = pool.allocate(2), pool.allocate(3)
    assert sorted(a + b) == list(range(5)) and pool.num_free == 0
    with pytest.raises(RuntimeError, match="free"):
        pool.allocate(1)
    pool.release(a)
    assert pool.num_free == 2 and pool.num_used == 3
    pool.release(b)
    assert pool.num_free == 5
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([a[0]])


def test_a_key_names_the_whole_prefix():
    first = page_key(b"", [1, 2, 3, 4])
    assert page_key(b"", [1, 2, 3, 4]) == first
    assert page_key(first, [5, 6, 7, 8]) != page_key(page_key(b"", [9, 2, 3, 4]), [5, 6, 7, 8])
    assert page_key(b"", [1, 2, 3, 5]) != first


def test_prefix_hits_share_pages_and_leave_the_last_token_to_compute():
    pool = PagePool(8, 4)
    tokens = list(range(10, 22))  # three full pages
    pages, keys = fill(pool, tokens)
    pool.release(pages)
    assert pool.num_free == 8  # keyed pages nobody holds count as free
    hit, hit_keys = pool.match_prefix(tokens)  # 12 tokens: only 2 pages, so token 11 is computed again
    assert hit == pages[:2] and hit_keys == keys[:2]
    assert pool.ref_counts[hit[0]] == 1 and pool.num_free == 6
    longer, _ = pool.match_prefix(tokens + [99])
    assert longer == pages and pool.ref_counts[pages[0]] == 2  # shared by two holders
    assert pool.match_prefix([10, 11, 12, 0, 14])[0] == []  # a different first page: no hit
    pool.release(hit)
    pool.release(longer)
    assert pool.num_free == 8


def test_cached_pages_are_evicted_least_recently_used_first():
    pool = PagePool(4, 2)
    old, _ = fill(pool, [1, 2, 3, 4])
    pool.release(old)
    new, _ = fill(pool, [5, 6, 7, 8])
    pool.release(new)
    reused, _ = pool.match_prefix([1, 2, 3, 4, 0])  # touches the old prefix: now the most recent
    pool.release(reused)
    fresh = pool.allocate(2)  # evicts the [5, 6, 7, 8] pages (last page first), keeps the old ones
    assert sorted(fresh) == sorted(new)
    assert pool.match_prefix([5, 6, 0])[0] == []
    hit, _ = pool.match_prefix([1, 2, 3, 4, 0])
    assert hit == old


def test_a_key_stays_with_its_first_page():
    pool = PagePool(4, 2)
    a, keys = fill(pool, [1, 2])
    b = pool.allocate(1)
    pool.register(b[0], keys[0])  # the same tokens computed twice: the first page keeps the key
    assert pool.page_of[keys[0]] == a[0] and b[0] not in pool.key_of


def test_pool_size_from_max_kv_tokens():
    args = ModelArgs.from_name("debug-tiny")
    assert pool_pages(args, 16, torch.float32, torch.device("cpu"), 100) == 7
    assert pool_pages(args, 16, torch.float32, torch.device("cpu"), None) == 4 * args.block_size // 16
    with pytest.raises(ValueError, match="max_kv_tokens"):
        pool_pages(args, 16, torch.float32, torch.device("cpu"), 0)


def test_a_reserved_page_is_never_handed_out():
    pool = PagePool(3, 4)
    scratch = pool.reserve()
    assert pool.capacity_tokens == 8 and pool.num_free == 2
    assert scratch not in pool.allocate(2)


def test_default_cpu_pool_fits_in_the_memory_available():
    from redline.engine.kv_pages import CPU_MEMORY_SHARE, available_memory, page_bytes

    # a context of 2^24 tokens: four full contexts of this model would take 4 * 2^24 * 2 * 32 * 8 * 128 * 2 bytes
    args = ModelArgs(dim=4096, n_layer=32, n_head=32, n_kv_heads=8, head_dim=128, vocab_size=256,
                     intermediate_size=64, block_size=1 << 24)
    pages = pool_pages(args, 16, torch.bfloat16, torch.device("cpu"), None)
    assert 4 * args.block_size * page_bytes(args, 1, torch.bfloat16) > 10 * available_memory()
    assert 1 <= pages * page_bytes(args, 16, torch.bfloat16) <= available_memory() * CPU_MEMORY_SHARE
    # an explicit max_kv_tokens is taken as given
    assert pool_pages(args, 16, torch.bfloat16, torch.device("cpu"), 1 << 24) == (1 << 24) // 16


def test_a_gpu_pool_leaves_room_for_the_decode_graphs_logits(monkeypatch):
    """From free GPU memory: 85% of it, less 32 float32 vocabulary rows and the penalty tables per row of the largest
    step (Gemma-3's 262k vocabulary at 256 rows: 8.6 GB; its graphs were measured to take 8.4)."""
    from redline.engine.kv_pages import page_bytes

    args = ModelArgs.from_name("Gemma-3-12B")
    free = 100 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    pages = pool_pages(args, 16, torch.bfloat16, torch.device("cuda"), None, max_rows=256)
    reserve = 256 * args.vocab_size * (32 * 4 + 5)
    assert args.vocab_size == 262_208 and pages == int(free * 0.85 - reserve) // page_bytes(args, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="too little for one KV page"):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (reserve, 2 * free))
        pool_pages(args, 16, torch.bfloat16, torch.device("cuda"), None, max_rows=256)
