"""Which tokens of which sequences the next step computes.

Each step runs every decoding sequence's one token first, then prefill chunks (of sequences already running, then
of newly admitted ones) up to `prefill_chunk` tokens, so a long prompt never stalls the streams already running.
A waiting sequence is admitted when the pool has pages for all its tokens. When a decoding sequence needs a new
page and none is free, the most recently admitted sequence is preempted: its pages are released and it waits again
at the head of the queue, to recompute its prompt and the tokens it made so far (the prefix cache often still has
them). Its sampled tokens do not change: the noise of a seeded draw depends only on the seed and the position.
"""
from __future__ import annotations

from collections import deque

from redline.engine.batch import Chunk, Sequence
from redline.engine.kv_pages import PagePool, page_key


# Prompt tokens one step computes at most: on an H200 (Llama-3-8B) 512 gave 7.2k output tok/s on 1,024 requests of
# 128/128 tokens and 4,096 gave 11.4k (fewer, larger prefill steps), at the cost of steps of 150-270 ms for the
# streams decoding beside long prompts.
DEFAULT_PREFILL_CHUNK = 4096


class Scheduler:
    """Waiting and running queues over a PagePool; the engine's thread alone calls it."""

    def __init__(self, pool: PagePool, max_running: int = 256,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> None:
        for name, value in (("max_running", max_running), ("prefill_chunk", prefill_chunk)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.pool = pool
        self.max_running, self.prefill_chunk = max_running, prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.preemptions = 0
        self.failed: list[Sequence] = []  # sequences the last schedule() ended with "error"

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens > self.pool.capacity_tokens:
            raise ValueError(f"a sequence of {seq.num_tokens} tokens cannot fit the KV pool of "
                             f"{self.pool.capacity_tokens} tokens")
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Chunk]:
        """The chunks of the next step, with pages reserved for them; sequences that can never get a page end
        with finish_reason "error" (see `failed`)."""
        chunks: list[Chunk] = []
        self.failed = []
        preempted = self.preemptions
        for seq in [s for s in self.running if len(s.tokens) - s.num_computed == 1]:  # decode rows, oldest first
            # (a sequence preempted or failed earlier in this loop is no longer running: checked only then)
            gone = (self.preemptions != preempted or self.failed) and seq not in self.running
            if not gone and self._reserve_decode(seq, chunks):
                chunks.append(Chunk(seq, seq.num_computed, 1))
        budget = self.prefill_chunk
        for seq in self.running:  # prefills already under way
            left = seq.num_tokens - seq.num_computed
            if left > 1 and budget > 0:
                chunks.append(self._prefill_chunk(seq, budget))
                budget -= chunks[-1].length
        while self.waiting and budget > 0 and len(self.running) < self.max_running and self._admit(self.waiting[0]):
            seq = self.waiting.popleft()
            self.running.append(seq)
            chunks.append(self._prefill_chunk(seq, budget))
            budget -= chunks[-1].length
        if not chunks and not self.running and self.waiting:  # cannot happen with a pool that holds any request
            seq = self.waiting.popleft()
            self._fail(seq, f"the KV pool of {self.pool.capacity_tokens} tokens cannot hold this request; raise "
                            "max_kv_tokens")
        return chunks

    @staticmethod
    def _prefill_chunk(seq: Sequence, budget: int) -> Chunk:
        """seq's next prefill chunk within `budget` tokens (past it only to hold a whole image, Sequence.chunk_end)."""
        start = seq.num_computed
        return Chunk(seq, start, seq.chunk_end(start, min(seq.num_tokens, start + budget)) - start)

    def _reserve_decode(self, seq: Sequence, chunks: list[Chunk]) -> bool:
        """A page for seq's next key, preempting the newest sequences until one is free; False when seq itself
        was preempted or failed."""
        while len(seq.pages) < self.pool.pages_for(seq.num_tokens):
            if self.pool.num_free > 0:
                seq.pages += self.pool.allocate(1)
                continue
            victim = self.running[-1]
            if victim is seq and len(self.running) == 1:
                self._fail(seq, f"the KV pool of {self.pool.capacity_tokens} tokens is too small for this "
                                f"sequence of {seq.num_tokens} tokens; raise max_kv_tokens")
                return False
            self.preempt(victim)
            chunks[:] = [c for c in chunks if c.seq is not victim]
            if victim is seq:
                return False
        return True

    def _admit(self, seq: Sequence) -> bool:
        """Pages for all of seq's tokens (shared cached ones first); False, holding nothing, when they do not fit."""
        pages, keys = self.pool.match_prefix(seq.tokens, seq.root_key, seq.page_extra) if seq.use_prefix_cache \
            else ([], [])
        needed = self.pool.pages_for(seq.num_tokens) - len(pages)
        if needed > self.pool.num_free:
            self.pool.release(pages)
            return False
        seq.pages, seq.keys = pages + self.pool.allocate(needed), keys
        seq.num_computed = len(pages) * self.pool.page_size
        seq.cached_tokens = min(seq.num_computed, seq.prompt_len)
        if seq.use_prefix_cache:
            self.pool.record_lookup(seq.prompt_len, seq.cached_tokens)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Release seq's pages and queue it first, to recompute everything it has."""
        self.running.remove(seq)
        self._release(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def commit(self, chunks: list[Chunk]) -> None:
        """The step ran: its tokens are computed, and its newly full pages are keyed for the prefix cache."""
        size = self.pool.page_size
        for chunk in chunks:
            seq = chunk.seq
            seq.num_computed = chunk.start + chunk.length
            while len(seq.keys) < seq.num_computed // size:
                i = len(seq.keys)
                key = page_key(seq.keys[-1] if seq.keys else seq.root_key, seq.tokens[i * size:(i + 1) * size],
                               seq.page_extra(i, size))
                self.pool.register(seq.pages[i], key)
                seq.keys.append(key)

    def reserve_next(self, chunks: list[Chunk]) -> bool:
        """Ready the decode step after `chunks` (the same rows, one position on) before its tokens are known: count
        chunks as computed and give each row whose next key starts a page that page. False, with nothing changed,
        when the pool lacks the pages."""
        size = self.pool.page_size
        new_page = [(c.start + 1) % size == 0 for c in chunks]  # its next key starts a page
        if sum(new_page) > self.pool.num_free:
            return False
        self.commit(chunks)
        for chunk, needs in zip(chunks, new_page):
            if needs:
                chunk.seq.pages += self.pool.allocate(1)
        return True

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """End seq (running or waiting) and release its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.finish_reason, seq.error = reason, error

    def _fail(self, seq: Sequence, error: str) -> None:
        self.finish(seq, "error", error)
        self.failed.append(seq)

    def _release(self, seq: Sequence) -> None:
        self.pool.release(seq.pages)
        seq.pages, seq.keys, seq.num_computed = [], [], 0
