"""Steps that prefill one short prompt chunk and nothing else, replayed as CUDA graphs (opt-in: Engine(...,
prefill_graphs=True)).

A request that reaches an idle engine (a chat's next turn, most of it in the prefix cache) is prefilled by a step of
one chunk. Launched kernel by kernel, the compiled prefill step of an 8B model keeps the host busy for about 20 ms
(some 500 kernels) where the GPU needs about 9 ms for 80 tokens over a 4,000-token context; as a graph its launch
is one replay. The chunk is padded to a token bucket by a padding sequence in the scratch page (positions 0, 1, ...,
its keys and values overwriting the page's slots), and the step computes two logit rows, the chunk's last and the
padding's, so no size of the compiled step is ever 0 or 1 (step_batch pads the same way). Each (bucket, page width)
is captured the first time it runs. On the CPU the same padded step runs compiled, without a graph.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from redline.runner.decode_graphs import captured, pages_bucket, put
from redline.runner.paged import mark_step_dynamic
from redline.model import PagedKVCache, Transformer

if TYPE_CHECKING:  # the engine's batch type; the runner reads its fields only
    from redline.engine.batch import Chunk

# Chunk sizes whose step replays a graph, padded up to the next of these (fewer tokens than 512: larger chunks keep
# the GPU busier than the host's launches anyway).
PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512)


class PrefillGraphs:
    """Static staging buffers and the captured steps of one engine's one-chunk prefills. compiled: the engine's
    compiled prefill step (steps.prefill_logits); scratch_page: a page no sequence holds."""

    def __init__(self, compiled: Any, model: Transformer, kv: PagedKVCache, vocab_bias: Tensor | None,
                 device: torch.device, scratch_page: int, pool: Any = None) -> None:
        self.compiled, self.model, self.kv, self.vocab_bias, self.device = compiled, model, kv, vocab_bias, device
        self.scratch, self.pool = scratch_page, pool
        block_size = model.args.block_size
        self.max_pages = -(-block_size // kv.page_size)
        self.buckets = tuple(b for b in PREFILL_GRAPH_TOKENS if b <= block_size)  # padding positions stay in range
        n = PREFILL_GRAPH_TOKENS[-1]
        # Inference tensors, as the engine thread's own step inputs are: a normal tensor's extra dispatch key
        # (ADInplaceOrView) fails the compiled step's guards and compiles it a second time.
        with torch.inference_mode():
            # The host's values land in two packed buffers (two copies a step)...
            self.longs = torch.zeros(3 * n + 2, dtype=torch.long, device=device)  # ids, positions, slots, logits_at
            self.ints = torch.zeros(5 + 2 * self.max_pages, dtype=torch.int32, device=device)  # lens, cu, tables
            # ...which the step copies into inputs of their own, each at storage offset 0 like the engine's other
            # step inputs: an offset of 2 or more would fail the compiled step's guards as well.
            self.step_longs = [torch.zeros(size, dtype=torch.long, device=device) for size in (n, n, n, 2)]
            self.step_ints = [torch.zeros(size, dtype=torch.int32, device=device)
                              for size in (2, 3, 2 * self.max_pages)]
        self.graphs: dict[tuple[int, int], tuple[Any, Tensor]] = {}

    def bucket(self, chunks: list[Chunk]) -> int | None:
        """The token bucket of a step that is one chunk with fewer tokens than the largest bucket; else None."""
        if len(chunks) != 1:
            return None
        return next((b for b in self.buckets if b > chunks[0].length), None)

    def logits(self, chunk: Chunk, bucket: int) -> Tensor:
        """Logits (2, V) fp32 of the padded step: row 0 at the chunk's last token, row 1 the padding's. The chunk's
        keys and values are written to its pages."""
        seq, size = chunk.seq, self.kv.page_size
        n, pad = chunk.length, bucket - chunk.length
        width = pages_bucket(max(len(seq.pages), -(-pad // size)), self.max_pages)
        span = range(chunk.start, chunk.start + n)
        slots = [seq.pages[p // size] * size + p % size for p in span]
        put(self.longs, seq.tokens[chunk.start:chunk.start + n] + [0] * pad + list(span) + list(range(pad)) + slots
            + [self.scratch * size + p % size for p in range(pad)] + [n - 1, bucket - 1])
        put(self.ints, [chunk.start + n, pad, 0, n, bucket] + seq.pages + [0] * (width - len(seq.pages))
            + [self.scratch] * width)
        args = self._inputs(bucket, width)
        if self.device.type != "cuda":
            return self._step(args)
        key = (bucket, width)
        if key not in self.graphs:
            self.graphs[key] = self._capture(args)
        graph, out = self.graphs[key]
        graph.replay()
        return out

    def _inputs(self, bucket: int, width: int) -> tuple[list[tuple[Tensor, Tensor]], tuple[Tensor, ...]]:
        """(packed view, step input) pairs, and the step's inputs: ids (1, T), positions, slots (T,), tables (2, W),
        seq_lens (2,), cu_seqlens (3,), logits_at (2,), for one (bucket, width)."""
        ids, positions, slots = (buffer[:bucket] for buffer in self.step_longs[:3])
        logits_at, (seq_lens, cu_seqlens, tables) = self.step_longs[3], self.step_ints
        tables = tables[:2 * width]
        longs, ints = self.longs, self.ints
        packed = [*longs[:3 * bucket].view(3, bucket), longs[3 * bucket:3 * bucket + 2], ints[:2], ints[2:5],
                  ints[5:5 + 2 * width]]
        own = [ids, positions, slots, logits_at, seq_lens, cu_seqlens, tables]
        return list(zip(packed, own)), (ids.view(1, bucket), positions, slots, tables.view(2, width), seq_lens,
                                        cu_seqlens, logits_at)

    def _step(self, inputs: tuple[list[tuple[Tensor, Tensor]], tuple[Tensor, ...]]) -> Tensor:
        pairs, args = inputs
        for packed, own in pairs:
            own.copy_(packed)
        mark_step_dynamic(*args)
        return self.compiled(self.model, self.kv, self.vocab_bias, *args)  # (2, V)

    def _capture(self, inputs: tuple[list[tuple[Tensor, Tensor]], tuple[Tensor, ...]]) -> tuple[Any, Tensor]:
        """The step captured, its copies from the packed buffers included (its warm-up run rewrites the same keys and
        values)."""
        return captured(lambda: self._step(inputs), self.device, self.pool)
