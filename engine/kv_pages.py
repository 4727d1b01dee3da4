"""The page pool of the paged KV cache: which pages are free, who holds each page, and the prefix cache.

A sequence's keys and values live in fixed-size pages listed in its block table. A full page is keyed by a hash
of its tokens and of the key of the page before it (so a key names the whole prefix up to the page's end); a later
request whose prompt starts with the same tokens takes those pages instead of computing them. Pages that no
sequence holds any more keep their contents and key in a least-recently-used list until a new page is needed.
"""
from __future__ import annotations

import hashlib
import os
import struct
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

import torch

from redline.model import FP8_KV_DTYPE, ModelArgs, check_kv_cache_dtype
from redline.sampling import is_int

# Share of the GPU memory free at start-up that the pool takes; the rest is left for activations and graphs.
GPU_MEMORY_SHARE = 0.85
# Besides, the decode graphs' memory grows with their rows: this many float32 logit rows of the vocabulary per row
# of the largest step are left free too. Two captures measured about 31: Llama-3-8B's graphs of up to 512 rows took
# 8.2 GB of graph pools (128k vocabulary, an 80 GB H100), Gemma-3-12B's of up to 256 rows 8.4 GB (262k vocabulary, an
# H200, which ran out of memory with 16 here beside 13 GB that the process held outside PyTorch's allocator).
GRAPH_LOGIT_ROWS_PER_ROW = 32
# The penalty state's bytes per row and vocabulary id: int32 token counts and the prompt's presence (bool).
PENALTY_BYTES_PER_ID = 5
# Without max_kv_tokens on the CPU the pool holds this many full contexts, within this share of the memory available
# at start-up (a checkpoint declaring a context of 2^24 tokens gets what fits, not 34 GB).
CPU_DEFAULT_CONTEXTS = 4
CPU_MEMORY_SHARE = 0.5


def page_key(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """The key of a full page: a hash of the key of the page before it (b"" for the first), its tokens, and
    `extra`: the content hashes of the images whose tokens it holds (their ids are placeholders, the same for any
    picture)."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(struct.pack(f"<{len(tokens)}q", *tokens))  # each id as 8 little-endian bytes
    if extra:
        digest.update(extra)
    return digest.digest()


def kv_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The pages' element type for --kv-cache-dtype `name`: the model's activations' dtype ("auto"), or e4m3
    ("fp8") where the device runs it (kernels/device.py; else a ValueError naming the fix)."""
    check_kv_cache_dtype(name)
    if name == "auto":
        return model_dtype
    from redline.kernels.device import kv_fp8_refusal

    if (refusal := kv_fp8_refusal(device)) is not None:
        raise ValueError(refusal)
    return FP8_KV_DTYPE


def page_bytes(args: ModelArgs, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of one page across all layers, k and v, of `dtype` elements (e4m3: one byte, so twice the tokens of
    bf16 pages fit the same memory; its per-head scales are a few bytes per layer, not counted)."""
    return 2 * args.n_layer * page_size * args.n_kv_heads * args.head_dim * torch.empty((), dtype=dtype).element_size()


def pool_pages(args: ModelArgs, page_size: int, dtype: torch.dtype, device: torch.device,
               max_kv_tokens: int | None, max_rows: int = 256) -> int:
    """How many pages the pool holds: max_kv_tokens rounded up to whole pages; else from free GPU memory (less what
    steps of up to max_rows rows need), or a few full contexts on the CPU, bounded by the memory available."""
    if max_kv_tokens is not None:
        if not is_int(max_kv_tokens) or max_kv_tokens < 1:
            raise ValueError(f"max_kv_tokens must be a positive integer, got {max_kv_tokens!r}")
        return -(-max_kv_tokens // page_size)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        graphs = GRAPH_LOGIT_ROWS_PER_ROW * max_rows * args.vocab_size * 4
        graphs += PENALTY_BYTES_PER_ID * max_rows * args.vocab_size  # runner.penalties' tables, made on first use
        pages = int(free * GPU_MEMORY_SHARE - graphs) // page_bytes(args, page_size, dtype)
        if pages < 1:
            raise ValueError(f"only {free / 1e9:.2f} GB of GPU memory is free, too little for one KV page; free "
                             "memory or pass a smaller max_kv_tokens")
        return pages
    wanted = -(-CPU_DEFAULT_CONTEXTS * args.block_size // page_size)
    available = available_memory()
    fits = int(available * CPU_MEMORY_SHARE) // page_bytes(args, page_size, dtype)
    if fits < 1:
        raise ValueError(f"only {available / 1e9:.2f} GB of memory is available, too little for one KV page; free "
                         "memory or pass a smaller max_kv_tokens")
    return min(wanted, fits)


def available_memory() -> int:
    """Bytes of memory the system can give now without swapping (MemAvailable on Linux, free pages elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class PagePool:
    """Page ids 0..num_pages-1 with reference counts, a free list and the prefix cache. Not thread-safe: the
    engine's thread alone calls it."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if not is_int(num_pages) or num_pages < 1 or not is_int(page_size) or page_size < 1:
            raise ValueError(f"a page pool needs a positive number of pages and page size, got {num_pages}, "
                             f"{page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self.ref_counts = [0] * num_pages
        self.free: deque[int] = deque(range(num_pages))  # unheld pages with no key
        self.cached: OrderedDict[int, None] = OrderedDict()  # unheld pages with a key, least recently used first
        self.key_of: dict[int, bytes] = {}
        self.page_of: dict[bytes, int] = {}
        self.reserved = 0  # pages held for good (a scratch page), never a sequence's
        self.queries = 0  # prompt tokens looked up in the prefix cache
        self.hits = 0  # of those, tokens served from it

    @property
    def num_free(self) -> int:
        """Pages a sequence can take now: free ones and cached ones nobody holds."""
        return len(self.free) + len(self.cached)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def capacity_tokens(self) -> int:
        """Tokens that sequences can hold when every page is theirs."""
        return (self.num_pages - self.reserved) * self.page_size

    def reserve(self) -> int:
        """One page held for good, outside every sequence (the decode graphs' scratch page)."""
        page = self.allocate(1)[0]
        self.reserved += 1
        return page

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def allocate(self, count: int) -> list[int]:
        """count fresh pages, each held once; evicts the least recently used cached pages when the free list is
        empty. RuntimeError when fewer than count are available (check num_free first)."""
        if count > self.num_free:
            raise RuntimeError(f"asked for {count} KV pages with {self.num_free} free")
        pages = []
        for _ in range(count):
            if self.free:
                page = self.free.popleft()
            else:
                page, _ = self.cached.popitem(last=False)
                del self.page_of[self.key_of.pop(page)]
            self.ref_counts[page] = 1
            pages.append(page)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        """Drop one hold on each page; a page nobody holds goes back to the free list, or to the cached list when
        it is keyed. Released last page first, so a sequence's last pages (the least likely to be shared) are
        evicted before its first ones."""
        for page in reversed(pages):
            self.ref_counts[page] -= 1
            if self.ref_counts[page] < 0:
                raise RuntimeError(f"KV page {page} was released more often than it was held")
            if self.ref_counts[page] == 0:
                if page in self.key_of:
                    self.cached[page] = None
                else:
                    self.free.append(page)

    def match_prefix(self, tokens: Sequence[int], root: bytes = b"",
                     extra: Callable[[int, int], bytes] | None = None) -> tuple[list[int], list[bytes]]:
        """The cached pages that hold the longest keyed prefix of tokens, each now held once more, and their keys.
        At least the last token is left out, so its logits are computed. root: the first page's parent key;
        extra(page index, page size): what each page's key mixes in (Sequence.page_extra)."""
        pages: list[int] = []
        keys: list[bytes] = []
        parent = root
        for i in range((len(tokens) - 1) // self.page_size):
            salt = extra(i, self.page_size) if extra is not None else b""
            key = page_key(parent, tokens[i * self.page_size:(i + 1) * self.page_size], salt)
            page = self.page_of.get(key)
            if page is None:
                break
            if self.ref_counts[page] == 0:
                del self.cached[page]
            self.ref_counts[page] += 1
            pages.append(page)
            keys.append(key)
            parent = key
        return pages, keys

    def record_lookup(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.queries += prompt_tokens
        self.hits += hit_tokens

    def register(self, page: int, key: bytes) -> None:
        """Key a page whose tokens are all computed, so later prompts can share it (the first page with a key keeps
        it; a page holds one key)."""
        if key in self.page_of or page in self.key_of:
            return
        self.page_of[key] = page
        self.key_of[page] = key
