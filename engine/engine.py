"""The continuous-batching engine: many distinct requests decoded together over a paged KV cache.

One background thread owns the model and loops: schedule -> step -> sample -> postprocess (detokenize, stop
strings, EOS, max tokens) -> each request's handle. add_request and abort are safe from any thread; a handle's
outputs are read with a blocking iterator, an async iterator or result().
"""
from __future__ import annotations

import asyncio
import gc
import importlib
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from redline.engine.graphs import DecodeGraphs, TokenReader
from redline.engine.kv_pages import PagePool, pool_pages
from redline.engine.prefill_graphs import PrefillGraphs
from redline.engine.scheduler import DEFAULT_PREFILL_CHUNK, Chunk, Scheduler
from redline.engine.scheduler import Sequence as Seq
from redline.engine.steps import (RowSettings, chosen_logprobs, prefill_logits, sample_tokens, step_batch,
                                  step_logits, vocab_bias)
from redline.kernels import FusedDecode
from redline.model import PagedKVCache
from redline.options import GenerationOptions, GenerationResult, GenerationStats, resolve_options
from redline.sampling import SEED_LIMIT, TOP_P_DISABLED
from redline.streaming import TextStream, first_stop

if TYPE_CHECKING:
    from redline.generate import LLM

FINISH_REASONS = ("eos", "stop", "length", "abort", "error")
PREFILL_GRAPHS_HELP = ("replay steps that prefill one chunk of under 512 tokens and nothing else (a chat's next turn) "
                       "as CUDA graphs; needs the compiled prefill steps (default: off)")
COMPILE_PREFILL_HELP = ("compile the steps with prompt chunks, once with dynamic sizes at start-up (default: where the "
                        "decode steps compile, on a GPU with the kernels, and the model has no soft-caps)")


class EngineFull(RuntimeError):
    """max_queue requests already wait; try again later."""


@dataclass(frozen=True)
class RequestOutput:
    token_ids: list[int]  # tokens new in this piece
    text: str  # new text (a possible stop string or an incomplete UTF-8 character held back until resolved)
    logprobs: list[float] | None  # when options.logprobs: log_softmax(float32 logits)[chosen] per new token
    top_logprobs: list[dict[int, float]] | None  # when options.top_logprobs = N > 0: N most likely ids -> logprob
    finish_reason: str | None  # None while running; then "eos" | "stop" | "length" | "abort" | "error"
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[float | None] | None = None  # in the first piece only, when options.prompt_logprobs


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_pages_used: int
    kv_pages_total: int
    page_size: int
    prefix_cache_queries: int  # in tokens
    prefix_cache_hits: int  # in tokens
    prompt_tokens_total: int
    generation_tokens_total: int
    preemptions: int
    requests_finished: int


@dataclass
class Flight:
    """A decode graph step on the device whose tokens the host has not read yet."""

    chunks: list[Chunk]
    tokens: Tensor  # (B,) on the device: the graph's output, the next step's input
    host: Tensor  # (B,) their pinned host copy, valid once `ready` has passed
    ready: Any  # a CUDA event (None on the CPU)
    started: float  # perf_counter when the host began to launch it
    committed: bool = False  # the scheduler already counts its keys as computed


class RequestHandle:
    """One request's outputs as the engine makes them; iterate it (or `async for`), or wait for result()."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], engine: Engine) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._engine = engine
        self._outputs: list[RequestOutput] = []
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._stats: GenerationStats | None = None

    @property
    def finished(self) -> bool:
        with self._cond:
            return bool(self._outputs) and self._outputs[-1].finish_reason is not None

    def _push(self, output: RequestOutput, stats: GenerationStats | None = None) -> None:
        """Called by the engine's thread."""
        with self._cond:
            self._outputs.append(output)
            if stats is not None:
                self._stats = stats
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that loop is closed: nobody waits there any more
                pass

    def _wait(self, index: int, timeout: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self._outputs) > index, timeout)

    def __iter__(self) -> Iterator[RequestOutput]:
        index = 0
        while True:
            self._wait(index, None)
            output = self._outputs[index]
            index += 1
            yield output
            if output.finish_reason is not None:
                return

    async def _aiter(self) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        index = 0
        while True:
            with self._cond:
                ready = len(self._outputs) > index
                if not ready:
                    event = asyncio.Event()
                    self._waiters.append((loop, event))
            if not ready:
                await event.wait()
                continue
            output = self._outputs[index]
            index += 1
            yield output
            if output.finish_reason is not None:
                return

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._aiter()

    def result(self, timeout: float | None = None) -> GenerationResult:
        """The whole generation once it ended; TimeoutError after timeout seconds, RuntimeError if it failed."""
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._outputs) and self._outputs[-1].finish_reason is not None,
                                       timeout):
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
            outputs, stats = list(self._outputs), self._stats
        last = outputs[-1]
        if last.finish_reason == "error":
            raise RuntimeError(f"request {self.request_id} failed: {last.error}")
        return GenerationResult(text="".join(o.text for o in outputs),
                                token_ids=[t for o in outputs for t in o.token_ids],
                                stats=stats, finish_reason=last.finish_reason)


class RequestState:
    """The engine thread's bookkeeping of one request: detokenizer, stop strings, timings."""

    def __init__(self, handle: RequestHandle, options: GenerationOptions, max_new_tokens: int, eos: set[int],
                 seed: int, tokenizer: Any, top_k: int) -> None:
        self.handle, self.options, self.max_new_tokens, self.eos = handle, options, max_new_tokens, eos
        s = options.sampling
        self.settings = (float(s.temperature), top_k if s.top_k is None else s.top_k,
                         TOP_P_DISABLED if s.top_p is None else float(s.top_p), seed)
        self.text_stream = TextStream(tokenizer) if tokenizer is not None else None
        self.stops = list(options.stop)
        self.holdback = max((len(x) - 1 for x in self.stops), default=0)
        self.text, self.emitted = "", 0
        self.new_ids: list[int] = []
        self.arrived = time.perf_counter()
        self.token_times: list[float] = []
        self.sent_first = False
        self.prompt_logprobs: list[float | None] | None = [None] if options.prompt_logprobs else None

    def take(self, token: int) -> str | None:
        """Account one sampled token; returns the finish reason when the request ends with it."""
        self.token_times.append(time.perf_counter())
        if token in self.eos:
            return "eos"
        self.new_ids.append(token)
        if self.text_stream is not None:
            self.text += self.text_stream.push(token)
            cut = first_stop(self.text, self.stops)
            if cut is not None:
                self.text = self.text[:cut]
                return "stop"
        if len(self.new_ids) >= self.max_new_tokens:
            if self.text_stream is not None:
                self.text += self.text_stream.flush()
                cut = first_stop(self.text, self.stops)
                if cut is not None:
                    self.text = self.text[:cut]
                    return "stop"
            return "length"
        return None

    def piece(self, finished: bool) -> str:
        """New text to send: all of it at the end, else what cannot grow into a stop string any more."""
        end = len(self.text) if finished else len(self.text) - self.holdback
        if end <= self.emitted:
            return ""
        out, self.emitted = self.text[self.emitted:end], end
        return out


class Engine:
    """Continuous batching over `llm`'s model; see the module docstring."""

    def __init__(self, llm: LLM, *, max_kv_tokens: int | None = None, max_running: int = 256,
                 max_queue: int | None = None, page_size: int = 16,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, compile_prefill: bool | None = None,
                 prefill_graphs: bool = False) -> None:
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        if max_queue is not None and (not isinstance(max_queue, int) or isinstance(max_queue, bool) or max_queue < 1):
            raise ValueError(f"max_queue must be a positive integer or None, got {max_queue!r}")
        self.llm = llm
        self.model, self.device, self.tokenizer = llm.model, llm.device, llm.tokenizer
        args = self.model.args
        self.block_size, self.vocab_size = args.block_size, args.vocab_size
        dtype = self.model.cache_dtype
        num_pages = pool_pages(args, page_size, dtype, self.device, max_kv_tokens)
        self.pool = PagePool(num_pages, page_size)
        self.scheduler = Scheduler(self.pool, max_running, prefill_chunk)
        if compile_prefill and args.attn_softcap:
            raise ValueError("compile_prefill runs the paged attention kernels, which have no soft-capping yet; drop "
                             "compile_prefill=True (--compile-prefill) for this model")
        kernel_ops = paged_attention_ops(llm)
        if compile_prefill is None:  # on where it pays: a compiling LLM on a GPU, with the kernels, no soft-caps
            compile_prefill = bool(llm.compile and self.device.type == "cuda" and kernel_ops and not args.attn_softcap)
        ops = kernel_ops or (registered_paged_ops() if compile_prefill else None)
        self.kv = PagedKVCache(args, num_pages, page_size, dtype, self.device, ops)
        # Steps with prompt chunks, compiled once with dynamic sizes (their attention is the ops: the references'
        # host lists would specialize every step).
        self.prefill_step = compiled_prefill(self.device) if compile_prefill else None
        self.vocab_bias = vocab_bias(self.vocab_size, self.tokenizer, self.device)
        # Decode steps as CUDA graphs (compiled on the CPU) when the LLM compiles; padding rows write a scratch page.
        scratch = self.pool.reserve() if llm.compile or compile_prefill else None
        # A one-row step runs the fused batch-1 decode's blocks where the LLM fuses its own (its own sums buffer:
        # the LLM's static path may run beside the engine).
        fused = FusedDecode(self.model) if llm.fuse else None
        self.graphs = DecodeGraphs(self.model, self.kv, self.vocab_bias, self.device, scratch,
                                   fused) if llm.compile else None
        self.pad_page = scratch if compile_prefill else None  # the compiled prefill step's padding sequence
        if prefill_graphs and not compile_prefill:
            raise ValueError("prefill_graphs replays the compiled prefill step; add compile_prefill=True "
                             "(--compile-prefill), or drop prefill_graphs")
        pool = self.graphs.pool if self.graphs is not None else None
        self.prefill_graphs = PrefillGraphs(self.prefill_step, self.model, self.kv, self.vocab_bias, self.device,
                                            scratch, pool) if prefill_graphs else None
        self._reader = TokenReader(self.device)
        self._flight: Flight | None = None  # the decode step on the device, not read yet
        self.steps_followed = 0  # decode steps launched before the step before them was read
        # Called as each step's tokens reach the host, with its chunks and its seconds (from the later of its
        # launch and the step before it landing); with a listener, steps that sample nothing wait for the device.
        self.step_listener: Callable[[list[Chunk], float], None] | None = None
        self._landed = 0.0
        self.max_queue = max_queue
        self._ids = itertools.count()
        self._lock = threading.Condition()  # guards the inbox, aborts and the flags below
        self._inbox: list[Seq] = []
        self._aborts: list[RequestHandle] = []
        self._closing = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self._seqs: dict[str, Seq] = {}  # request id -> its sequence, for the engine thread
        # Outputs of the last step, sent once the next step is on the GPU (the host work overlaps the device's)
        self._pending: list[tuple[Any, ...]] = []
        self.prompt_tokens_total = self.generation_tokens_total = self.requests_finished = 0

    # -- the API -------------------------------------------------------------------------------------------------------

    def capture_graphs(self, max_tokens: int | None = None) -> int:
        """Capture the decode graphs of every batch bucket for sequences of up to max_tokens tokens (default: the
        model's context) now, before the first request, instead of in the first step that needs each; returns how
        many were captured (0 without graphs)."""
        if self.graphs is None:
            return 0
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("capture_graphs runs before the first request")
            with torch.inference_mode():  # as the engine's thread runs its steps
                return self.graphs.capture(self.block_size if max_tokens is None else min(max_tokens, self.block_size))

    def warm_up(self) -> None:
        """Run short requests through the engine (one alone, one longer than a prefill chunk alone, then four
        together; greedy and sampled), so that what the first real steps would compile on first use (Triton kernels
        specialize on sizes of 1; the compiled prefill step) is ready before serving; then set the counters back to
        zero (their pages stay in the prefix cache, the least recently used). Last, the objects alive now (compiled
        code, graphs, the model) are moved out of the garbage collector's reach: full collections over them took
        0.7-1.6 s each in the middle of serving an 8B model."""
        vocab = min(self.vocab_size, self.tokenizer.vocab_size if self.tokenizer is not None else self.vocab_size)
        longest = max(1, min(self.scheduler.prefill_chunk + 37, self.block_size - 4, self.pool.capacity_tokens // 8))
        for group in ((128,), (longest,), (7, 48, 301, longest)):
            handles = []
            for i, length in enumerate(min(n, longest) for n in group):
                ids = [(j * 7919 + 131 * i + length) % vocab for j in range(length)]  # distinct: no cache hits
                sampled = {"temperature": 0.8, "top_p": 0.9, "seed": i} if i % 2 else {}
                handles.append(self.add_request(ids, GenerationOptions(max_new_tokens=3, ignore_eos=True, **sampled)))
            for handle in handles:
                handle.result()
        with self._lock:
            self.prompt_tokens_total = self.generation_tokens_total = self.requests_finished = 0
            self.pool.queries = self.pool.hits = self.scheduler.preemptions = 0
        gc.collect()
        gc.freeze()

    def check_request(self, prompt: str | Sequence[int], options: GenerationOptions | None) -> tuple[list[int],
                                                                                                   GenerationOptions]:
        """The prompt's token ids and the options, validated; ValueError in one line otherwise."""
        options = GenerationOptions() if options is None else options
        if not isinstance(options, GenerationOptions):
            raise ValueError(f"options must be a GenerationOptions, got {type(options).__name__}")
        if options.draft is not None:
            raise ValueError("the batching engine does not speculate; drop draft= (LLM.generate speculates)")
        if options.profile is not None:
            raise ValueError("the batching engine does not profile one request; drop profile= (LLM.generate does)")
        ids = self.llm.encode_prompt(prompt)
        if len(ids) >= self.block_size:
            raise ValueError(f"the prompt has {len(ids)} tokens, but the model's context is {self.block_size}; "
                             "shorten it")
        # The last new token's keys are never computed: a request holds at most prompt + max_new - 1 of them.
        need = len(ids) + min(options.max_new_tokens, self.block_size - len(ids)) - 1
        if need > self.pool.capacity_tokens:
            raise ValueError(f"the prompt ({len(ids)} tokens) and max_new_tokens need up to {need} tokens of KV cache, "
                             f"more than the pool's {self.pool.capacity_tokens}; raise max_kv_tokens or lower "
                             "max_new_tokens")
        return ids, options

    def add_request(self, prompt: str | Sequence[int], options: GenerationOptions | None = None) -> RequestHandle:
        ids, options = self.check_request(prompt, options)
        max_new = min(options.max_new_tokens, self.block_size - len(ids))
        seed = options.seed if options.seed is not None else int(torch.randint(0, SEED_LIMIT - 1, ()).item())
        eos = set() if options.ignore_eos or self.tokenizer is None else set(self.tokenizer.eos_ids)
        with self._lock:
            if self._closing:
                raise RuntimeError("the engine is shut down; make a new one")
            if self.max_queue is not None and len(self._inbox) + len(self.scheduler.waiting) >= self.max_queue:
                raise EngineFull(f"{self.max_queue} requests already wait; retry later or raise max_queue")
            request_id = f"req-{next(self._ids)}"
            handle = RequestHandle(request_id, ids, self)
            state = RequestState(handle, options, max_new, eos, seed, self.tokenizer, self.vocab_size)
            seq = Seq(request_id, list(ids), len(ids), max_new, use_prefix_cache=not options.prompt_logprobs,
                      state=state)
            self._inbox.append(seq)
            self._start()
            self._lock.notify_all()
        return handle

    def abort(self, handle: RequestHandle) -> None:
        with self._lock:
            self._aborts.append(handle)
            self._lock.notify_all()

    def stats(self) -> EngineStats:
        with self._lock:
            waiting = len(self._inbox) + len(self.scheduler.waiting)
            return EngineStats(
                running=len(self.scheduler.running), waiting=waiting, kv_pages_used=self.pool.num_used,
                kv_pages_total=self.pool.num_pages, page_size=self.pool.page_size,
                prefix_cache_queries=self.pool.queries, prefix_cache_hits=self.pool.hits,
                prompt_tokens_total=self.prompt_tokens_total, generation_tokens_total=self.generation_tokens_total,
                preemptions=self.scheduler.preemptions, requests_finished=self.requests_finished)

    def shutdown(self, timeout: float | None = None) -> None:
        """Refuse new requests, let running ones finish (those left after `timeout` seconds are aborted), stop."""
        with self._lock:
            self._closing = True
            thread = self._thread
            self._lock.notify_all()
        if thread is None:
            return
        thread.join(timeout)
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        thread.join()

    # -- the engine thread ---------------------------------------------------------------------------------------------

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="redline-engine", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        with torch.inference_mode():
            while self._next_round():
                try:
                    self._step()
                except Exception as exc:  # a bug outside the model call: end every request, keep serving
                    self._flight = None
                    message = f"{type(exc).__name__}: {exc}".splitlines()[0]
                    for seq in list(self._seqs.values()):
                        self._end(seq, "error", message)

    def _next_round(self) -> bool:
        """Take new requests and aborts in; wait while idle. False when the thread should end."""
        with self._lock:
            while True:
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
                for seq in inbox:
                    self._seqs[seq.request_id] = seq
                    self.scheduler.add(seq)
                    self.prompt_tokens_total += seq.prompt_len
                stop = self._stop
                if not stop:
                    for handle in aborts:
                        self._end_by_id(handle.request_id, "abort")
                if stop:
                    self._flight = None
                    for seq in list(self._seqs.values()):
                        self._end(seq, "abort")
                    self._deliver()
                    return False
                if self.scheduler.has_work() or self._flight is not None:
                    return True
                self._deliver()  # idle: no step will follow soon, so send what the last one made now
                if self._closing:
                    return False
                self._lock.wait()

    def _step(self) -> None:
        flight, self._flight = self._flight, None
        if flight is not None:  # launch the step after it first when it can be known now, then read it
            try:
                self._flight = self._follow(flight)
            except Exception as exc:
                self._fail_step(flight.chunks, exc)
                return
            self._land(flight)
            if self._flight is not None:
                self._deliver()  # while the device runs the next step
            return
        chunks = self.scheduler.schedule()
        for seq in self.scheduler.failed:
            self._end(seq, "error", seq.error, already_released=True)
        if not chunks:
            self._deliver()
            return
        started = time.perf_counter()
        try:
            if self._graph_step(chunks):
                self._flight = self._launch(chunks, None, started)
                self._deliver()  # while the device runs the step
                return
            tokens, extras = self._run(chunks)
        except Exception as exc:  # a failed step ends its requests, never the engine
            self._fail_step(chunks, exc)
            return
        self.scheduler.commit(chunks)
        self._listen(chunks, started, read=bool(tokens))
        for chunk, token, extra in zip([c for c in chunks if c.samples], tokens, extras):
            self._emit(chunk.seq, token, extra)

    def _fail_step(self, chunks: list[Chunk], exc: Exception) -> None:
        message = f"{type(exc).__name__}: {exc}".splitlines()[0]
        for chunk in chunks:
            if chunk.seq.finish_reason is None:
                self._end(chunk.seq, "error", message)

    def _launch(self, chunks: list[Chunk], tokens: Tensor | None, started: float) -> Flight:
        """Replay the decode graph of chunks (their input tokens: tokens (B,) on the device, else each sequence's
        own) and start copying its tokens to the host."""
        inputs = tokens if tokens is not None else [c.seq.tokens[c.start] for c in chunks]
        out = self.graphs.run(inputs, [c.start for c in chunks], [c.seq.pages for c in chunks],
                              [c.seq.state.settings for c in chunks])
        host, ready = self._reader.start(out)
        return Flight(chunks, out, host, ready, started)

    def _follow(self, flight: Flight) -> Flight | None:
        """The decode step after flight, launched before flight's tokens are read (the host's work for both then
        runs while the device computes), when that step is known now: the same rows, one position on. None when
        it may differ: a request arrived, was aborted or could be admitted, another sequence is prefilling, a
        row may end by length, or a row's next page is not free. A row that ends by EOS or a stop string is then
        computed once more, and dropped."""
        sched, pool = self.scheduler, self.pool
        chunks = flight.chunks
        if self._inbox or self._aborts or len(chunks) != len(sched.running):
            return None
        if sched.waiting and len(sched.running) < sched.max_running:
            return None
        if any(c.seq.finish_reason is not None or c.seq.num_new + 1 >= c.seq.max_new_tokens for c in chunks):
            return None
        new_page = [(c.start + 1) % pool.page_size == 0 for c in chunks]  # its next key starts a page
        if sum(new_page) > pool.num_free:
            return None
        sched.commit(chunks)
        flight.committed = True
        for chunk, needs in zip(chunks, new_page):
            if needs:
                chunk.seq.pages += pool.allocate(1)
        self.steps_followed += 1
        return self._launch([Chunk(c.seq, c.start + 1, 1) for c in chunks], flight.tokens, time.perf_counter())

    def _land(self, flight: Flight) -> None:
        """Read flight's tokens and hand them to its rows that still run (a row ended since is dropped)."""
        if flight.ready is not None:
            flight.ready.synchronize()
        tokens = flight.host.tolist()
        live = [(c, t) for c, t in zip(flight.chunks, tokens)
                if c.seq.finish_reason is None and c.seq.num_tokens == c.start + 1]
        if not flight.committed:
            self.scheduler.commit([c for c, _ in live])
        self._listen(flight.chunks, flight.started, read=True)
        for chunk, token in live:
            self._emit(chunk.seq, token, {})

    def _listen(self, chunks: list[Chunk], started: float, read: bool) -> None:
        """Tell the step listener, if any, that a step landed."""
        if self.step_listener is None:
            return
        if not read and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.step_listener(chunks, now - max(started, self._landed))
        self._landed = now

    def _run(self, chunks: list[Chunk]) -> tuple[list[int], list[dict[str, Any]]]:
        """Run the model on chunks eagerly; the sampled token of each sampling chunk and its logprob extras."""
        wants_prompt = {i for i, c in enumerate(chunks)
                        if c.seq.state.prompt_logprobs is not None and c.start < c.seq.prompt_len}
        bucket = self.prefill_graphs.bucket(chunks) if self.prefill_graphs and not wants_prompt else None
        if bucket is not None:  # one short chunk: a replayed graph; its logits row 0 is the chunk's last token
            logits, prompt_rows, sample_rows = self.prefill_graphs.logits(chunks[0], bucket), {}, slice(0, 1)
        else:
            batch = step_batch(chunks, self.kv, self.device, wants_prompt, self.pad_page)
            logits = step_logits(self.model, batch, self.vocab_bias, self.prefill_step)  # (L, V)
            prompt_rows, sample_rows = batch.prompt_rows, batch.sample_rows
        self._deliver()  # while the device runs the step
        for i, (begin, end) in prompt_rows.items():
            self._prompt_logprobs(chunks[i], logits[begin:end])
        sampling = [c for c in chunks if c.samples]
        if not sampling:
            return [], []
        rows = logits[sample_rows]  # (B, V)
        settings = RowSettings.of([(*c.seq.state.settings, c.seq.num_tokens) for c in sampling], self.device)
        tokens = sample_tokens(rows, settings, all(c.seq.state.settings[0] == 0 for c in sampling))  # (B,)
        extras: list[dict[str, Any]] = [{} for _ in sampling]
        top = max(c.seq.state.options.top_logprobs for c in sampling)
        if any(c.seq.state.options.logprobs or c.seq.state.options.top_logprobs for c in sampling):
            chosen, values, ids = chosen_logprobs(rows, tokens, top)
            chosen_list = chosen.tolist()
            for r, c in enumerate(sampling):
                n = c.seq.state.options.top_logprobs
                extras[r]["logprob"] = chosen_list[r]
                if n:
                    extras[r]["top"] = dict(zip(ids[r, :n].tolist(), values[r, :n].tolist()))
        return tokens.tolist(), extras

    def _graph_step(self, chunks: list[Chunk]) -> bool:
        """Whether this step runs as a captured decode graph: decode rows only, no logprobs asked for."""
        if self.graphs is None or not self.graphs.fits(len(chunks)):
            return False
        return all(c.length == 1 and c.samples and not (c.seq.state.options.logprobs
                                                        or c.seq.state.options.top_logprobs) for c in chunks)

    def _prompt_logprobs(self, chunk: Chunk, logits: torch.Tensor) -> None:
        """Logits (chunk.length, V) at the chunk's tokens give the logprob of each next prompt token; positions
        already scored (before a preemption's recompute) are skipped."""
        seq, state = chunk.seq, chunk.seq.state
        first = max(chunk.start, len(state.prompt_logprobs) - 1)  # logits at position p score token p + 1
        last = min(chunk.start + chunk.length, seq.prompt_len - 1)
        if last <= first:
            return
        logprobs = torch.log_softmax(logits[first - chunk.start:last - chunk.start].float(), dim=-1)
        targets = torch.tensor(seq.tokens[first + 1:last + 1], device=logits.device).view(-1, 1)
        state.prompt_logprobs += logprobs.gather(-1, targets).squeeze(1).tolist()

    def _emit(self, seq: Seq, token: int, extra: dict[str, Any]) -> None:
        state: RequestState = seq.state
        seq.tokens.append(token)
        self.generation_tokens_total += 1
        reason = state.take(token)
        counted = token not in state.eos
        opts = state.options
        logprobs = [extra["logprob"]] if opts.logprobs and counted else ([] if opts.logprobs else None)
        top = [extra["top"]] if opts.top_logprobs and counted else ([] if opts.top_logprobs else None)
        self._pending.append((seq, [token] if counted else [], state.piece(reason is not None), logprobs, top, reason))
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self._seqs.pop(seq.request_id, None)
            self.requests_finished += 1

    def _deliver(self) -> None:
        """Send the outputs the last step made (each request's in order)."""
        pending, self._pending = self._pending, []
        for output in pending:
            self._send(*output)

    def _send(self, seq: Seq, token_ids: list[int], text: str, logprobs: list[float] | None,
              top: list[dict[int, float]] | None, reason: str | None, error: str | None = None) -> None:
        state: RequestState = seq.state
        first = not state.sent_first
        state.sent_first = True
        output = RequestOutput(token_ids=token_ids, text=text, logprobs=logprobs, top_logprobs=top,
                               finish_reason=reason, error=error, prompt_tokens=seq.prompt_len,
                               cached_tokens=seq.cached_tokens,
                               prompt_logprobs=state.prompt_logprobs if first else None)
        state.handle._push(output, self._result_stats(seq) if reason is not None else None)

    def _end(self, seq: Seq, reason: str, error: str | None = None, already_released: bool = False) -> None:
        """End seq now (abort or error): release its pages and send what text it held back."""
        self._deliver()  # its earlier outputs first
        if not already_released:
            self.scheduler.finish(seq, reason, error)
        self._seqs.pop(seq.request_id, None)
        self.requests_finished += 1
        state: RequestState = seq.state
        opts = state.options
        self._send(seq, [], state.piece(True), [] if opts.logprobs else None, [] if opts.top_logprobs else None,
                   reason, error)

    def _end_by_id(self, request_id: str, reason: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is not None:
            self._end(seq, reason)

    def _result_stats(self, seq: Seq) -> GenerationStats:
        state: RequestState = seq.state
        times = state.token_times
        ttft = (times[0] - state.arrived) if times else 0.0
        decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
        decode = (len(times) - 1) / decode_s if decode_s > 0 else 0.0
        peak = torch.cuda.max_memory_allocated(self.device) / 1e9 if self.device.type == "cuda" else None
        return GenerationStats(
            prompt_tokens=seq.prompt_len, new_tokens=len(state.new_ids), ttft_s=ttft,
            prefill_tok_s=seq.prompt_len / ttft if ttft > 0 else 0.0, decode_tok_s=decode,
            model_bytes_per_token=self.llm.bytes_per_token,
            bandwidth_gb_s=decode * self.llm.bytes_per_token / 1e9,  # each of its steps read the weights once
            peak_memory_gb=peak)


def paged_attention_ops(llm: LLM) -> tuple[Any, Any] | None:
    """The GPU's paged attention kernels (torch.ops.redline.paged_prefill_attention, paged_decode_attention) when
    the LLM runs Redline's kernels and they are registered; None: model.py's references."""
    if not llm.kernels:
        return None
    namespace = torch.ops.redline
    names = ("paged_prefill_attention", "paged_decode_attention")
    if not all(hasattr(namespace, name) for name in names):
        return None
    return tuple(getattr(namespace, name) for name in names)


def compiled_prefill(device: torch.device) -> Any:
    """prefill_logits under torch.compile, dynamic in the sizes mark_step_dynamic names, no CUDA graphs."""
    from redline.runner import CompiledStep

    return CompiledStep(prefill_logits, device, graphs=False, dynamic=None)


def registered_paged_ops() -> tuple[Any, Any]:
    """torch.ops.redline's paged attention ops (importing their module registers them); on the CPU, or where no
    kernel config fits, they run the references."""
    importlib.import_module("redline.kernels.paged_attention")
    return torch.ops.redline.paged_prefill_attention, torch.ops.redline.paged_decode_attention


def generate_all(engine: Engine, prompts: Sequence[str | Sequence[int]],
                 options: GenerationOptions | Sequence[GenerationOptions] | None,
                 settings: dict[str, Any]) -> list[GenerationResult]:
    """LLM.generate_batch: every request checked before any starts, then all run together; results in input order."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError("prompts must be a list of strings or token-id lists; for one prompt use LLM.generate")
    if isinstance(options, Sequence):
        if len(options) != len(prompts):
            raise ValueError(f"{len(options)} options for {len(prompts)} prompts; pass one per prompt, or one")
        per_prompt = [resolve_options(o, settings) for o in options]
    else:
        per_prompt = [resolve_options(options, settings)] * len(prompts)
    for prompt, opts in zip(prompts, per_prompt):
        engine.check_request(prompt, opts)
    handles = [engine.add_request(prompt, opts) for prompt, opts in zip(prompts, per_prompt)]
    return [handle.result() for handle in handles]
