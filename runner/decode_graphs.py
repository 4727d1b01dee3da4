"""Decode steps, torch.compile'd and (on a GPU) replayed as CUDA graphs, at batch-size buckets.

A step where every sequence decodes one token is padded to the next bucket (1, 2, 4, 8, every 8 up to 256, then
every 16 up to 512; only the buckets up to the engine's largest step are made)
and to a power-of-two number of pages per row (at least 2); each (bucket, pages, greedy) shape is captured once,
the first time it runs. The graph reads static staging buffers, which each step fills in place; pages live in
the pool, outside every graph. Padding rows decode token 0 at position 0 into a scratch page that no sequence
holds, with temperature 0, and their tokens are dropped.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from redline.grammar import apply_masks, mask_words
from redline.model import PagedContext, PagedKVCache, Transformer
from redline.sampling import argmax_rows, sample_rows

BATCH_BUCKETS = (1, 2, 4, 8) + tuple(range(16, 257, 8)) + tuple(range(272, 513, 16))
MAX_GRAPH_ROWS = BATCH_BUCKETS[-1]


def batch_bucket(rows: int, largest: int = MAX_GRAPH_ROWS) -> int | None:
    """The smallest bucket that holds rows, or None above the largest (at most `largest` rows)."""
    return next((b for b in BATCH_BUCKETS if rows <= b and b <= largest), None)


def pages_bucket(pages: int, limit: int) -> int:
    """The power of two, at least 2 (so that one page is never a shape of its own), that holds pages."""
    bucket = 2
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
                seed: Tensor, masks: Tensor | None = None, penalties: tuple[Any, Tensor] | None = None) -> Tensor:
    """tokens (B,) from logits (B, V) with per-row settings (B,); the new token's position is positions + 1. With
    masks (B, ceil(V / 32)) int32, a row samples only the tokens whose bits are set. With penalties (a
    runner.penalties.PenaltySlots, the rows' slots (B,) int64), each row's bias, bans, penalties and min_p apply
    and its token is counted in its slot."""
    if masks is not None:
        logits = apply_masks(logits, masks)
    return chosen_tokens(logits, greedy, temperature, top_k, top_p, seed, positions + 1, penalties)


def chosen_tokens(logits: Tensor, greedy: bool, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor,
                  position: Tensor, penalties: tuple[Any, Tensor] | None = None) -> Tensor:
    """tokens (B,) from logits (B, V): the argmax when greedy, else sample_rows with the rows' settings (B,) at the
    new tokens' positions (B,). penalties (runner.penalties.PenaltySlots, the rows' slots (B,) int64): each row's
    bias, bans, penalties and min_p apply first, and its token is counted in its slot."""
    min_p = None
    if penalties is not None:
        logits, min_p = penalties[0].apply(logits, penalties[1])
    tokens = argmax_rows(logits) if greedy else sample_rows(logits, temperature, top_k, top_p, seed, position, min_p)
    if penalties is not None:
        penalties[0].count(penalties[1], tokens)
    return tokens


class DecodeGraphs:
    """Static buffers and the captured (CUDA) or compiled (CPU) decode steps of one engine.

    The model's part of the step is compiled once with dynamic sizes, the rows and the table width (inductor fuses
    the norms, rope and residual adds of every bucket; a single row gets its own specialization); on a GPU each
    (bucket, pages, greedy) shape of the compiled step and the sampler is then captured as a CUDA graph, on the CPU
    the compiled step runs as it is (one compile for every batch size a server meets). A step's inputs travel in
    three host copies, one per dtype, laid out so that each bucket's slice of the staging buffers is contiguous."""

    def __init__(self, model: Transformer, kv: PagedKVCache, vocab_bias: Tensor | None, device: torch.device,
                 scratch_page: int, step_model: Any = None, max_rows: int = MAX_GRAPH_ROWS,
                 min_tokens: int | None = None) -> None:
        """step_model: what a step calls, model by default; a kernels.FusedDecode of model runs a one-row step's
        blocks in its fused kernels (the other buckets go on to model). max_rows: the most rows a step holds (the
        engine's max_running); buckets above the one that holds it are never made. min_tokens: every step's block
        tables are at least as wide as sequences of this many tokens need (one graph per bucket serves them all;
        None: the narrowest power of two, a graph per width)."""
        from redline.runner.runner import CompiledStep

        self.model, self.kv, self.vocab_bias, self.device = model, kv, vocab_bias, device
        self.step_model = model if step_model is None else step_model
        self.max_pages = -(-model.args.block_size // kv.page_size)
        self.min_width = pages_bucket(-(-min_tokens // kv.page_size), self.max_pages) if min_tokens else 2
        self.scratch_page = scratch_page
        self.largest = batch_bucket(min(max_rows, MAX_GRAPH_ROWS))
        n = self.largest
        # ids, positions, slots, top_k, seed, penalty slots
        self.longs = torch.zeros(6 * n, dtype=torch.long, device=device)
        self.ints = torch.zeros(n * (1 + self.max_pages), dtype=torch.int32, device=device)  # seq_lens, tables
        self.floats = torch.zeros(2 * n, dtype=torch.float32, device=device)  # temperature, top_p
        # Grammar rows' token bitmasks, read by the graphs of steps that have such rows (all ones elsewhere).
        self.masks = torch.full((n, mask_words(model.args.vocab_size)), -1, dtype=torch.int32, device=device)
        # Rows with penalties, a logit bias, min_p or min_tokens: their slots' state (runner.penalties.PenaltySlots),
        # set by the owner when the first such request comes; the steps with such rows are graphs of their own.
        self.penalties: Any = None
        self.graphs: dict[tuple[int, int, bool, bool, bool], tuple[Any, Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        # The sampler runs eagerly (on the CPU inductor's code for it crashed or drew other tokens under torch 2.13;
        # on a GPU the graph holds it anyway).
        # dynamic=None: dynamic in the sizes mark_sizes_dynamic names, and only those.
        self.compiled = CompiledStep(decode_logits, device, graphs=False, dynamic=None)

    def fits(self, rows: int) -> bool:
        return rows <= self.largest

    def run(self, tokens: list[int] | Tensor, positions: list[int], pages: list[list[int]],
            settings: list[tuple[float, int, float, int]], masks: Callable[[], Tensor] | None = None,
            penalty_slots: list[int] | None = None) -> Tensor:
        """The next token (B,) of each decoding row (its last token, its position, its pages and sampling
        settings), on the device: the step is launched, not awaited. tokens may be a device tensor (B,), the
        previous step's output, which the step then reads without the host ever seeing it. masks: for a step with
        grammar rows, what returns the rows' allowed tokens (B, W) int32 on the device (grammar.fill_masks); it is
        called once the step's forward is launched, so the host computes the masks while the device computes the
        logits, and a second graph then masks and samples. penalty_slots: for a step with rows that use penalties,
        each row's slot in self.penalties (its scratch slot for the others); such steps run graphs of their own,
        so a step without them does none of that work."""
        rows = len(positions)
        bucket = batch_bucket(rows, self.largest)
        width = max(self.min_width, pages_bucket(max(len(p) for p in pages), self.max_pages))
        greedy = all(s[0] == 0 for s in settings)
        on_device = isinstance(tokens, Tensor)
        penalized = penalty_slots is not None
        scratch = self.penalties.scratch if penalized else 0
        self._fill(bucket, width, [0] * rows if on_device else tokens, positions, pages, settings,
                   penalty_slots or [], scratch)
        if on_device:
            self.longs[:rows].copy_(tokens)  # after the fill's copy on the same stream: it overwrites the zeros
        args = self._inputs(bucket, width)
        penalties = (self.penalties, args[-1]) if penalized else None
        args = args[:-1]
        if masks is None:
            if self.device.type != "cuda":
                return self._step(greedy, args, penalties)[:rows]
            key = (bucket, width, greedy, False, penalized)
            if key not in self.graphs:
                self.graphs[key] = self._capture(greedy, args, penalties)
            graph, out = self.graphs[key]
            graph.replay()
            return out[:rows]
        if self.device.type != "cuda":
            logits = self._logits(args)
            self._put_masks(masks(), rows, bucket)
            return pick_tokens(logits, greedy, args[1], *args[5:], self.masks[:bucket], penalties)[:rows]
        key = (bucket, width, greedy, True, penalized)
        if key not in self.graphs:
            self.graphs[key] = self._capture_masked(greedy, args, penalties)
        (forward, _), (sampler, out) = self.graphs[key]
        forward.replay()
        self._put_masks(masks(), rows, bucket)
        sampler.replay()
        return out[:rows]

    def _put_masks(self, masks: Tensor, rows: int, bucket: int) -> None:
        self.masks[:rows].copy_(masks)
        self.masks[rows:bucket].fill_(-1)  # padding rows: anything

    def capture(self, max_tokens: int, progress: Any = None) -> int:
        """Capture the greedy step of every bucket at every page width that sequences of up to max_tokens tokens
        reach, before serving (a shape met later is captured then, in a step of its own; the two graphs of a step
        with grammar rows are captured when one first runs). Returns the graphs made;
        progress(done, total), if given, is called after each."""
        if self.device.type != "cuda":
            return 0
        top = max(self.min_width, pages_bucket(-(-max_tokens // self.kv.page_size), self.max_pages))
        widths = [2 ** i for i in range(1, top.bit_length()) if self.min_width <= 2 ** i <= top]
        widths += [top] if top not in widths else []  # the context's page count need not be a power of two
        todo = [(bucket, width) for width in widths for bucket in BATCH_BUCKETS
                if bucket <= self.largest and (bucket, width, True, False, False) not in self.graphs]
        for done, (bucket, width) in enumerate(todo, 1):
            self._fill(bucket, width, [], [], [], [])  # padding rows only: they write the scratch page
            self.graphs[(bucket, width, True, False, False)] = self._capture(True, self._inputs(bucket, width)[:-1])
            if progress is not None:
                progress(done, len(todo))
        return len(todo)

    def _inputs(self, bucket: int, width: int) -> tuple[Tensor, ...]:
        """ids (1, B), positions, slots, tables (B, W), seq_lens, temperature, top_k, top_p, seed, penalty slots: views
        of the staging buffers for one (bucket, width)."""
        ids, positions, slots, top_k, seed, penalty_slots = self.longs[:6 * bucket].view(6, bucket)
        seq_lens = self.ints[:bucket]
        tables = self.ints[bucket:bucket * (1 + width)].view(bucket, width)
        temperature, top_p = self.floats[:2 * bucket].view(2, bucket)
        return ids.view(1, bucket), positions, slots, tables, seq_lens, temperature, top_k, top_p, seed, penalty_slots

    def _fill(self, bucket: int, width: int, tokens: list[int], positions: list[int], pages: list[list[int]],
              settings: list[tuple[float, int, float, int]], penalty_slots: list[int] = (),
              scratch_slot: int = 0) -> None:
        """Write the rows, then padding rows, into the staging buffers: one host-to-device copy per dtype."""
        pad = bucket - len(tokens)
        size, scratch = self.kv.page_size, self.scratch_page
        slots = [p[pos // size] * size + pos % size for p, pos in zip(pages, positions)]
        temperature, top_k, top_p, seed = (list(col) for col in zip(*settings)) if settings else ([], [], [], [])
        zeros = [0] * pad
        put(self.longs, tokens + zeros + positions + zeros + slots + [scratch * size] * pad + top_k + [1] * pad
            + seed + zeros + list(penalty_slots) + [scratch_slot] * (bucket - len(penalty_slots)))
        ints = [pos + 1 for pos in positions] + [1] * pad
        for p in pages:
            ints += p
            ints += [scratch] * (width - len(p))
        ints += [scratch] * (width * pad)
        put(self.ints, ints)
        put(self.floats, temperature + [0.0] * pad + top_p + [1.0] * pad)

    def _logits(self, args: tuple[Tensor, ...]) -> Tensor:
        mark_sizes_dynamic(*args[:5])
        return self.compiled(self.step_model, self.kv, self.vocab_bias, *args[:5])  # (B, V)

    def _step(self, greedy: bool, args: tuple[Tensor, ...], penalties: tuple[Any, Tensor] | None = None) -> Tensor:
        return pick_tokens(self._logits(args), greedy, args[1], *args[5:], penalties=penalties)

    def _capture_masked(self, greedy: bool, args: tuple[Tensor, ...],
                        penalties: tuple[Any, Tensor] | None = None) -> tuple[tuple[Any, Tensor], ...]:
        """A grammar step as two graphs: the forward (its logits stay in the pool), then masking and sampling."""
        forward = captured(lambda: self._logits(args), self.device, self.pool)
        masks = self.masks[:args[0].shape[1]]
        sampler = captured(lambda: pick_tokens(forward[1], greedy, args[1], *args[5:], masks, penalties),
                           self.device, self.pool, penalties)
        return forward, sampler

    def _capture(self, greedy: bool, args: tuple[Tensor, ...],
                 penalties: tuple[Any, Tensor] | None = None) -> tuple[Any, Tensor]:
        """The step captured (its real rows warm up first: decode is idempotent for them, it rewrites the same k
        and v; the first call of a shape compiles)."""
        return captured(lambda: self._step(greedy, args, penalties), self.device, self.pool, penalties)


def captured(step: Any, device: torch.device, pool: Any,
             penalties: tuple[Any, Tensor] | None = None) -> tuple[Any, Tensor]:
    """(CUDA graph, its output) of step(): run once on a side stream (the first call of a shape compiles), then
    captured into pool. penalties: the step counts its tokens in these slots; the warm-up run's and the capture's
    counts are taken back (the capture's are not computed, only recorded: a count it records happens at each
    replay)."""
    saved = snapshot(penalties)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream(device).wait_stream(side)
    restore(penalties, saved)
    graph = torch.cuda.CUDAGraph()
    # thread_local: another thread's generation on the same GPU does not break the capture.
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = step()
    return graph, out


def snapshot(penalties: tuple[Any, Tensor] | None) -> tuple[Tensor, Tensor] | None:
    """Copies of the token counts of penalties' slots (B,), which a warm-up run of a step would change."""
    if penalties is None:
        return None
    state, slots = penalties
    return state.counts[slots].clone(), state.generated[slots].clone()


def restore(penalties: tuple[Any, Tensor] | None, saved: tuple[Tensor, Tensor] | None) -> None:
    if penalties is None:
        return
    state, slots = penalties
    state.counts[slots] = saved[0]
    state.generated[slots] = saved[1]


def mark_sizes_dynamic(ids: Tensor, positions: Tensor, slots: Tensor, tables: Tensor, seq_lens: Tensor) -> None:
    """The rows and the page width are the sizes one compiled step serves in every bucket (a size of 1 still
    specializes); every other size of the step is fixed."""
    mark_dynamic((ids, (1,)), (positions, (0,)), (slots, (0,)), (tables, (0, 1)), (seq_lens, (0,)))


def mark_dynamic(*dims_of: tuple[Tensor, tuple[int, ...]]) -> None:
    """Mark each (tensor, dims) pair's dims dynamic for the next compiled call that meets them."""
    for t, dims in dims_of:
        for d in dims:
            torch._dynamo.maybe_mark_dynamic(t, d)


def put(buffer: Tensor, values: list) -> None:
    """Copy a flat host list into the start of a device buffer, from pinned memory, without a device sync."""
    host = torch.tensor(values, dtype=buffer.dtype)
    if buffer.is_cuda:
        buffer[:len(values)].copy_(host.pin_memory(), non_blocking=True)
    else:
        buffer[:len(values)].copy_(host)


class TokenReader:
    """Sampled tokens (B,) copied from the device into pinned host memory without a sync, read when needed. Two
    buffers take turns: a step's copy is issued while the host may still read the step before it."""

    def __init__(self, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.buffers = [torch.zeros(MAX_GRAPH_ROWS, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self.turn = 0
        self.cuda = cuda

    def start(self, tokens: Tensor) -> tuple[Tensor, Any]:
        """Issue the copy of tokens (B,); returns (host view, event to wait on, None on the CPU)."""
        host = self.buffers[self.turn][:tokens.shape[0]]
        self.turn ^= 1
        host.copy_(tokens, non_blocking=self.cuda)
        if not self.cuda:
            return host, None
        event = torch.cuda.Event()
        event.record()
        return host, event
