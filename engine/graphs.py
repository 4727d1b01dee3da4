"""Decode steps replayed as CUDA graphs (torch.compile'd on the CPU), at batch-size buckets.

A step where every sequence decodes one token is padded to the next bucket (1, 2, 4, 8, then every 8 up to 256)
and to a power-of-two number of pages per row; each (bucket, pages, greedy) shape is captured once, the first time
it runs. The graph reads static input buffers of the largest size, which each step fills in place; pages live in
the pool, outside every graph. Padding rows decode token 0 at position 0 into a scratch page that no sequence
holds, with temperature 0, and their tokens are dropped.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from redline.model import PagedContext, PagedKVCache, Transformer
from redline.sampling import sample_rows

BATCH_BUCKETS = (1, 2, 4, 8) + tuple(range(16, 257, 8))
MAX_GRAPH_ROWS = BATCH_BUCKETS[-1]


def batch_bucket(rows: int) -> int | None:
    """The smallest bucket that holds rows, or None above the largest."""
    return next((b for b in BATCH_BUCKETS if b >= rows), None)


def pages_bucket(pages: int, limit: int) -> int:
    bucket = 1
    while bucket < pages:
        bucket *= 2
    return min(bucket, limit)


def decode_logits(model: Transformer, kv: PagedKVCache, vocab_bias: Tensor | None, ids: Tensor, positions: Tensor,
                  slots: Tensor, tables: Tensor, seq_lens: Tensor) -> Tensor:
    """Logits (B, V) fp32 of B decoding sequences: ids (1, B) at positions (B,), one new key each."""
    rows = ids.shape[1]
    cu_seqlens = torch.arange(rows + 1, dtype=torch.int32, device=ids.device)  # (B + 1,)
    context = PagedContext(positions, slots, tables, seq_lens, cu_seqlens, kv, decode=True)
    logits = model(ids, positions, context=context)[0].float()  # (B, V)
    return logits + vocab_bias if vocab_bias is not None else logits


def pick_tokens(logits: Tensor, greedy: bool, positions: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                seed: Tensor) -> Tensor:
    """tokens (B,) from logits (B, V) with per-row settings (B,); the new token's position is positions + 1."""
    if greedy:
        return logits.argmax(dim=-1)
    return sample_rows(logits, temperature, top_k, top_p, seed, positions + 1)


def decode_step(model: Transformer, kv: PagedKVCache, vocab_bias: Tensor | None, greedy: bool, ids: Tensor,
                positions: Tensor, slots: Tensor, tables: Tensor, seq_lens: Tensor, temperature: Tensor,
                top_k: Tensor, top_p: Tensor, seed: Tensor) -> Tensor:
    """One token for each of B decoding sequences: ids (1, B) at positions (B,) -> tokens (B,)."""
    logits = decode_logits(model, kv, vocab_bias, ids, positions, slots, tables, seq_lens)
    return pick_tokens(logits, greedy, positions, temperature, top_k, top_p, seed)


class DecodeGraphs:
    """Static buffers and the captured (CUDA) or compiled (CPU) decode steps of one engine."""

    def __init__(self, model: Transformer, kv: PagedKVCache, vocab_bias: Tensor | None, device: torch.device,
                 scratch_page: int) -> None:
        self.model, self.kv, self.vocab_bias, self.device = model, kv, vocab_bias, device
        self.max_pages = -(-model.args.block_size // kv.page_size)
        self.scratch_page = scratch_page
        n = MAX_GRAPH_ROWS
        on = dict(device=device)
        self.buffers = dict(
            ids=torch.zeros(1, n, dtype=torch.long, **on), positions=torch.zeros(n, dtype=torch.long, **on),
            slots=torch.zeros(n, dtype=torch.long, **on),
            tables=torch.full((n, self.max_pages), scratch_page, dtype=torch.int32, **on),
            seq_lens=torch.ones(n, dtype=torch.int32, **on), temperature=torch.zeros(n, **on),
            top_k=torch.ones(n, dtype=torch.long, **on), top_p=torch.ones(n, **on),
            seed=torch.zeros(n, dtype=torch.long, **on))
        self.graphs: dict[tuple[int, int, bool], tuple[Any, Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        if device.type != "cuda":  # the model's part compiled; the sampler runs eagerly (inductor's CPU code for it
            from redline.runner import CompiledStep  # crashed or drew other tokens under torch 2.13)

            self.compiled = CompiledStep(decode_logits, device)

    def fits(self, rows: int) -> bool:
        return rows <= MAX_GRAPH_ROWS

    def run(self, tokens: list[int], positions: list[int], pages: list[list[int]],
            settings: list[tuple[float, int, float, int]]) -> list[int]:
        """The next token of each decoding row: its last token, its position, its pages and sampling settings."""
        rows = len(tokens)
        bucket = batch_bucket(rows)
        width = pages_bucket(max(len(p) for p in pages), self.max_pages)
        greedy = all(s[0] == 0 for s in settings)
        self._fill(bucket, width, tokens, positions, pages, settings)
        args = self._inputs(bucket, width)
        if self.device.type != "cuda":
            logits = self.compiled(self.model, self.kv, self.vocab_bias, *args[:5])
            return pick_tokens(logits, greedy, args[1], *args[5:])[:rows].tolist()
        key = (bucket, width, greedy)
        if key not in self.graphs:
            self.graphs[key] = self._capture(greedy, args)
        graph, out = self.graphs[key]
        graph.replay()
        return out[:rows].tolist()

    def _inputs(self, bucket: int, width: int) -> tuple[Tensor, ...]:
        b = self.buffers
        return (b["ids"][:, :bucket], b["positions"][:bucket], b["slots"][:bucket], b["tables"][:bucket, :width],
                b["seq_lens"][:bucket], b["temperature"][:bucket], b["top_k"][:bucket], b["top_p"][:bucket],
                b["seed"][:bucket])

    def _fill(self, bucket: int, width: int, tokens: list[int], positions: list[int], pages: list[list[int]],
              settings: list[tuple[float, int, float, int]]) -> None:
        """Write the rows into the static buffers (host tensors copied in), padding rows after them."""
        pad = bucket - len(tokens)
        size = self.kv.page_size
        slots = [p[pos // size] * size + pos % size for p, pos in zip(pages, positions)]
        temperature, top_k, top_p, seed = (list(col) for col in zip(*settings))
        b = self.buffers
        put(b["ids"][0, :bucket], tokens + [0] * pad)
        put(b["positions"][:bucket], positions + [0] * pad)
        put(b["slots"][:bucket], slots + [self.scratch_page * size] * pad)
        put(b["tables"][:bucket, :width], [p + [self.scratch_page] * (width - len(p)) for p in pages]
            + [[self.scratch_page] * width] * pad)
        put(b["seq_lens"][:bucket], [pos + 1 for pos in positions] + [1] * pad)
        put(b["temperature"][:bucket], temperature + [0.0] * pad)
        put(b["top_k"][:bucket], top_k + [1] * pad)
        put(b["top_p"][:bucket], top_p + [1.0] * pad)
        put(b["seed"][:bucket], seed + [0] * pad)

    def _capture(self, greedy: bool, args: tuple[Tensor, ...]) -> tuple[Any, Tensor]:
        """Warm up on a side stream (the real rows: decode is idempotent for them, it rewrites the same k and v),
        then capture."""
        step = (self.model, self.kv, self.vocab_bias, greedy)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            decode_step(*step, *args)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's generation on the same GPU does not break the capture.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = decode_step(*step, *args)
        return graph, out


def put(buffer: Tensor, values: list) -> None:
    """Copy a host list into a slice of a static device buffer, from pinned memory, without a device sync."""
    host = torch.tensor(values, dtype=buffer.dtype)
    if buffer.is_cuda:
        buffer.copy_(host.pin_memory(), non_blocking=True)
    else:
        buffer.copy_(host)
