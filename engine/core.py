"""The engine core: continuous batching of token-id requests over the runner's paged model.

One thread owns the device and loops: take requests and aborts in -> the scheduler picks the step's rows -> the
runner computes them and samples -> EOS and length end requests -> each request's new token ids (with logprobs) go
to the sink. The core knows no tokenizer and no text: detokenization and stop strings are the front end's
(engine/client.py), which aborts a request here when its text meets a stop string. `add` and `abort` are safe from
any thread.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from redline import tensor_parallel
from redline.engine.batch import Chunk
from redline.engine.batch import Sequence as Seq
from redline.engine.images import encode_images, seq_images
from redline.engine.images import refusal as image_refusal
from redline.engine.kv_pages import PagePool, kv_dtype, pool_pages
from redline.engine.messages import CoreOutput, CoreRequest
from redline.engine.requests import EngineStats, Limits
from redline.engine.scheduler import DEFAULT_PREFILL_CHUNK, Scheduler
from redline.model import check_kv_cache_dtype
from redline.options import GenerationStats
from redline.runner.paged import (GrammarMasks, PagedModel, RowSettings, chosen_logprobs, compile_prefill_default,
                                  on_device, sample_tokens)
from redline.runner.penalties import MAX_BANNED_IDS, RowPenalties
from redline.sampling import SEED_LIMIT, TOP_P_DISABLED

PREFILL_GRAPHS_HELP = ("replay steps that prefill one chunk of under 512 tokens and nothing else (a chat's next turn) "
                       "as CUDA graphs; needs the compiled prefill steps")
KV_CACHE_DTYPE_HELP = ("the paged KV cache's element type: auto (the model's dtype) or fp8 (e4m3 with a fixed scale "
                       "per layer and KV head, calibrated at start-up: twice the tokens in the same memory)")
COMPILE_PREFILL_HELP = ("compile the steps with prompt chunks, once with dynamic sizes at start-up (default: where the "
                        "decode steps compile, on a GPU with the kernels, and the model has no soft-caps)")


@dataclass(frozen=True)
class EngineSettings:
    """How the engine batches: the one place each of these defaults is written (serve.py's flags read them)."""

    max_kv_tokens: int | None = None  # the page pool in tokens; None: sized from free memory
    max_running: int = 256  # requests decoded together at most (decode graphs are made up to this many rows)
    max_queue: int | None = None  # requests waiting at most; more are refused (EngineFull)
    page_size: int = 16  # tokens a KV page holds
    kv_cache_dtype: str = "auto"  # the pages' element type: "auto" (the model's dtype) or "fp8" (e4m3 and scales)
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # prompt tokens one step computes at most
    compile_prefill: bool | None = None  # steps with prompt chunks compiled; None: where it pays
    prefill_graphs: bool = False  # steps that prefill one short chunk replayed as CUDA graphs
    min_step_s: float = 0.0  # each step waits at least this long (paces a demo or a test that must catch a stream)
    capture_tokens: int | None = None  # decode graphs captured before serving cover sequences up to this many
    # tokens, one graph per batch bucket whose block tables are that wide (None: a graph per bucket and power-of-two
    # width up to the whole context); a longer sequence's first step captures its own width

    def __post_init__(self) -> None:
        for name in ("max_running", "page_size", "prefill_chunk", "max_kv_tokens", "max_queue", "capture_tokens"):
            value = getattr(self, name)
            if value is None and name in ("max_kv_tokens", "max_queue", "capture_tokens"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if not self.min_step_s >= 0:
            raise ValueError(f"min_step_s must be >= 0 seconds, got {self.min_step_s!r}")

    @classmethod
    def default(cls, name: str) -> Any:
        """The default of one field (the flags' defaults come from here)."""
        return next(f.default for f in fields(cls) if f.name == name)


@dataclass
class Flight:
    """A decode graph step on the device whose tokens the host has not read yet."""

    chunks: list[Chunk]
    tokens: Tensor  # (B,) on the device: the graph's output, the next step's input
    host: Tensor  # (B,) their pinned host copy, valid once `ready` has passed
    ready: Any  # a CUDA event (None on the CPU)
    started: float  # perf_counter when the host began to launch it
    committed: bool = False  # the scheduler already counts its keys as computed
    landed: bool = False  # its tokens were read and handed on (_land)


class RequestState:
    """The core's bookkeeping of one request: its sampling settings, EOS ids, timings."""

    def __init__(self, request: CoreRequest, max_new_tokens: int, seed: int, top_k: int, matcher: Any = None) -> None:
        self.request, self.max_new_tokens, self.eos = request, max_new_tokens, set(request.eos)
        self.settings = (float(request.temperature), top_k if request.top_k is None else request.top_k,
                         TOP_P_DISABLED if request.top_p is None else float(request.top_p), seed)
        self.new_tokens = 0
        self.arrived = time.perf_counter()
        self.token_times: list[float] = []
        self.sent_first = False
        self.prompt_logprobs: list[float | None] | None = [None] if request.prompt_logprobs else None
        self.prompt_top: list[dict[int, float] | None] | None = (
            [None] if request.prompt_logprobs and request.top_logprobs else None)
        self.matcher = matcher  # the request's grammar state: which tokens its next step may sample (None: any)
        self.stop_ids = set(request.stop_token_ids)
        self.penalties = row_penalties(request)  # None: the request uses no penalty, bias, min_p or min_tokens

    def take(self, token: int) -> str | None:
        """Account one sampled token; returns the finish reason when the request ends with it."""
        self.token_times.append(time.perf_counter())
        if self.matcher is not None:
            self.matcher.consume_token(token)
        if token in self.eos:
            return "eos"
        self.new_tokens += 1
        if token in self.stop_ids:
            return "stop"
        if self.matcher is not None and self.matcher.is_stopped():  # the grammar is complete: nothing may follow
            return "stop"
        return "length" if self.new_tokens >= self.max_new_tokens else None


class EngineCore:
    """Continuous batching over `runner`'s model; see the module docstring. Outputs go to `sink(list of
    CoreOutput)`, called from the engine's thread (keep it short: hand them on)."""

    def __init__(self, runner: Any, settings: EngineSettings, sink: Callable[[list[CoreOutput]], None],
                 grammars: Any = None, vision: Any = None) -> None:
        """grammars: a grammar.GrammarCompiler over the model's tokenizer, for requests with a grammar (None: they
        are refused). vision: the model's vision tower (vision.py), for requests with images (None: refused)."""
        self.runner, self.settings, self.sink = runner, settings, sink
        self.grammars = grammars
        self.vision = vision
        if grammars is not None:
            grammars.warm()  # its llguidance tokenizer, built off this thread before the first grammar request
        self.min_step_s = settings.min_step_s  # may be changed while it runs (a test catching a stream)
        model = runner.model
        args = model.args
        self.block_size, self.vocab_size, self.device = args.block_size, args.vocab_size, runner.device
        self.kv_dtype = kv_dtype(settings.kv_cache_dtype, model.cache_dtype, self.device)  # the pages' elements
        num_pages = pool_pages(args, settings.page_size, self.kv_dtype, self.device, settings.max_kv_tokens,
                               settings.max_running)
        # Tensor parallel: every rank makes this core over its model; rank 0's runs the requests and sends each model
        # call to the others, which run it on their heads (follow). Each rank's pages hold its share of the KV heads,
        # and every pool has the same page ids.
        ranks = tensor_parallel.engine_channel(model)
        if ranks is not None:
            num_pages = tensor_parallel.agreed_pages(ranks, num_pages)
        self.pool = PagePool(num_pages, settings.page_size)
        self.scheduler = Scheduler(self.pool, settings.max_running, settings.prefill_chunk)
        compile_prefill = compile_prefill_default(runner, settings.compile_prefill)
        scratch = self.pool.reserve() if runner.compile or compile_prefill else None
        self.paged = PagedModel(runner, num_pages, settings.page_size, scratch, compile_prefill,
                                settings.prefill_graphs, settings.max_running, settings.capture_tokens, ranks,
                                self.kv_dtype)
        self._flight: Flight | None = None  # the decode step on the device, not read yet
        self.steps_followed = 0  # decode steps launched before the step before them was read
        # Called as each step's tokens reach the host, with its chunks and its seconds (from the later of its
        # launch and the step before it landing); with a listener, steps that sample nothing wait for the device.
        self.step_listener: Callable[[list[Chunk], float], None] | None = None
        self._landed = 0.0
        self._lock = threading.Condition()  # guards the inbox, aborts and the flags below
        self._inbox: list[Seq] = []
        self._aborts: list[tuple[str, str]] = []  # (request id, reason)
        self._closing = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self._seqs: dict[str, Seq] = {}  # request id -> its sequence, for the engine thread
        # Outputs of the last step, sent once the next step is on the GPU (the host work overlaps the device's)
        self._pending: list[CoreOutput] = []
        self.masks = GrammarMasks(self.vocab_size, self.device)  # grammar rows' token bitmasks, filled each step
        self.prompt_tokens_total = self.generation_tokens_total = self.requests_finished = 0

    # -- the API -------------------------------------------------------------------------------------------------------

    @property
    def limits(self) -> Limits:
        return Limits(self.block_size, self.vocab_size, self.pool.capacity_tokens)

    @property
    def graphs(self) -> Any:
        return self.paged.graphs

    def capture_graphs(self, max_tokens: int | None = None,
                       progress: Callable[[int, int], None] | None = None) -> int:
        """Capture the decode graphs of every batch bucket for sequences of up to max_tokens tokens (default: the
        model's context) now, before the first request, instead of in the first step that needs each; returns how
        many were captured (0 without graphs). progress(done, total) is called after each."""
        if self.paged.graphs is None:
            return 0
        max_tokens = self.settings.capture_tokens if max_tokens is None else max_tokens
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("capture_graphs runs before the first request")
            with torch.inference_mode():  # as the engine's thread runs its steps
                limit = self.block_size if max_tokens is None else min(max_tokens, self.block_size)
                return self.paged.capture(limit, progress)

    def warm_up(self, longest: int | None = None) -> None:
        """Run short requests through the engine (one alone, one longer than a prefill chunk alone, then four
        together; greedy and sampled), so that what the first real steps would compile on first use (Triton kernels
        specialize on sizes of 1; the compiled prefill step) is ready before serving; then set the counters back to
        zero (their pages stay in the prefix cache, the least recently used). `longest` caps the prompt lengths
        (a CPU server warms up on short prompts). Last, the objects alive now (compiled code, graphs, the model) are
        moved out of the garbage collector's reach: full collections over them took 0.7-1.6 s each in the middle
        of serving an 8B model."""
        # On the CPU a short request alone and two together walk every path: an eager core compiles nothing (its
        # kernels were built at load), a compiled one compiles its decode step for one row and for any rows and
        # table width, and its prompt steps once for any length if they compile at all. The full set prefilled
        # ~4,600 tokens, tens of seconds on two cores.
        cpu = self.device.type == "cpu"
        top = self.scheduler.prefill_chunk + 37 if longest is None else longest
        longest = max(1, min(top, 16 if cpu else top, self.block_size - 4, self.pool.capacity_tokens // 8))
        groups = ((longest,), (7, longest)) if cpu else ((128,), (longest,), (7, 48, 301, longest))
        done = threading.Semaphore(0)
        sink, waiting = self.sink, set()

        def catch(outputs: list[CoreOutput]) -> None:  # the warm-up's outputs stop here
            for out in outputs:
                if out.request_id in waiting and out.finish_reason is not None:
                    waiting.discard(out.request_id)
                    done.release()

        self.sink = catch
        try:
            for g, group in enumerate(groups):
                for i, length in enumerate(min(n, longest) for n in group):
                    ids = [(j * 7919 + 131 * i + length) % self.vocab_size for j in range(length)]  # distinct
                    sampled = {"temperature": 0.8, "top_p": 0.9, "seed": i} if i % 2 else {}
                    request_id = f"warm-up-{g}-{i}"
                    waiting.add(request_id)
                    self.add(CoreRequest(request_id, ids, 3, **sampled))
                for _ in group:
                    done.acquire()
        finally:
            self.sink = sink
        with self._lock:
            self.prompt_tokens_total = self.generation_tokens_total = self.requests_finished = 0
            self.pool.queries = self.pool.hits = self.scheduler.preemptions = 0
        gc.collect()
        gc.freeze()

    def add(self, request: CoreRequest) -> None:
        """Queue a request (checked by the front end against `limits`; a request that is not right ends at once
        with an error output instead)."""
        ranks = self.paged.ranks
        if ranks is not None and ranks.rank != 0:
            raise RuntimeError(f"rank {ranks.rank} of a tensor-parallel engine runs rank 0's steps: call follow() "
                               f"there, and add requests on rank 0")
        error = self._refusal(request)
        if error is not None:
            self.sink([CoreOutput(request.request_id, [], finish_reason="error", error=error,
                                  prompt_tokens=len(request.prompt))])
            return
        max_new = min(request.max_new_tokens, self.block_size - len(request.prompt))
        seed = request.seed if request.seed is not None else int(torch.randint(0, SEED_LIMIT - 1, ()).item())
        try:
            matcher = self._matcher(request)
            images = seq_images(self.vision.args, request.prompt, request.images) if request.images else None
        except ValueError as exc:
            self.sink([CoreOutput(request.request_id, [], finish_reason="error", error=str(exc),
                                  prompt_tokens=len(request.prompt))])
            return
        state = RequestState(request, max_new, seed, self.vocab_size, matcher)
        seq = Seq(request.request_id, list(request.prompt), len(request.prompt), max_new,
                  use_prefix_cache=not request.prompt_logprobs, state=state, images=images)
        with self._lock:
            if self._closing:
                self.sink([CoreOutput(request.request_id, [], finish_reason="error",
                                      error="the engine is shutting down", prompt_tokens=len(request.prompt))])
                return
            self._inbox.append(seq)
            self._start()
            self._lock.notify_all()

    def _matcher(self, request: CoreRequest) -> Any:
        """A fresh matcher of the request's grammar, or None. The front end compiled the same grammar to check it;
        here it is compiled once more (cached by its text) in this caller's thread, not the engine's."""
        if request.grammar is None:
            return None
        if self.grammars is None:
            raise ValueError("this engine has no tokenizer, so it cannot follow a grammar")
        return self.grammars.compile_now(request.grammar).matcher()

    def _refusal(self, request: CoreRequest) -> str | None:
        """Why the core cannot run request (the front end checks first: this guards the core itself)."""
        n = len(request.prompt)
        if not 0 < n < self.block_size:
            return f"the prompt has {n} tokens; the model's context is {self.block_size}"
        if any(not 0 <= t < self.vocab_size for t in request.prompt):
            return "a prompt token id is outside the vocabulary"
        if request.max_new_tokens < 1 or n + min(request.max_new_tokens, self.block_size - n) - 1 > \
                self.pool.capacity_tokens:
            return "max_new_tokens is not positive, or the request needs more KV cache than the pool holds"
        if request.top_k is not None and not 1 <= request.top_k <= self.vocab_size:
            return f"top_k must lie in 1..{self.vocab_size}"
        if request.seed is not None and not 0 <= request.seed < SEED_LIMIT:
            return f"seed must lie in 0..{SEED_LIMIT - 1}"
        if not 0 <= request.top_logprobs <= 20:
            return "top_logprobs must lie in 0..20"
        bad = next((t for t in [t for t, _ in request.logit_bias] + request.stop_token_ids
                    if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return f"token id {bad} (logit_bias or stop_token_ids) is outside the vocabulary 0..{self.vocab_size - 1}"
        if row_penalties(request) is not None and self.paged.ranks is not None:
            return ("penalties, logit_bias, min_p and min_tokens are not available with tensor parallel yet; drop "
                    "them or run on one GPU")
        return image_refusal(self.vision.args if self.vision is not None else None, request.images,
                             self.paged.ranks is not None)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        with self._lock:
            self._aborts.append((request_id, reason))
            self._lock.notify_all()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the engine's thread off between steps: requests added meanwhile start in the same step."""
        with self._lock:
            yield

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
        if thread is not None:
            thread.join(timeout)
            with self._lock:
                self._stop = True
                self._lock.notify_all()
            thread.join()
        self.paged.release()  # tensor parallel: the other ranks' follow() returns

    def follow(self) -> None:
        """A tensor-parallel rank other than 0: run rank 0's steps on this rank's part of the model until rank 0's
        core shuts down (runner.paged.PagedModel.follow)."""
        self.paged.follow()

    # -- the engine thread ---------------------------------------------------------------------------------------------

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="redline-engine", daemon=True)
            self._thread.start()
            # At interpreter exit (a return from main, sys.exit, an uncaught Ctrl-C) end the step in flight before
            # torch's native state is torn down under the daemon thread (which aborts the process with SIGABRT).
            atexit.register(_shutdown_at_exit, weakref.ref(self))

    def _loop(self) -> None:
        with torch.inference_mode():
            while self._next_round():
                try:
                    if self.min_step_s:
                        time.sleep(self.min_step_s)
                    self._step()
                except Exception as exc:  # a bug outside the model call: end every request, keep serving
                    self._flight = None
                    message = f"{type(exc).__name__}: {exc}".splitlines()[0]
                    for seq in list(self._seqs.values()):
                        self._end(seq, "error", message)
                    self._deliver()

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
                    for request_id, reason in aborts:
                        seq = self._seqs.get(request_id)
                        if seq is not None:
                            self._end(seq, reason)
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

    def _launch(self, chunks: list[Chunk], tokens: Tensor | None, started: float,
                after: Flight | None = None) -> Flight:
        """Replay the decode graph of chunks (their input tokens: tokens (B,) on the device, else each sequence's
        own) and start copying its tokens to the host. after: the step before, launched and not yet read (a
        followed step): with grammar rows, its tokens are read and handed on while the device computes this step's
        forward, since this step's masks follow them."""
        inputs = tokens if tokens is not None else [c.seq.tokens[c.start] for c in chunks]
        grammar = any(c.seq.state.matcher is not None for c in chunks)
        masks = self._mask_filler(chunks, after) if grammar else None
        out, host, ready = self.paged.launch_decode(inputs, [c.start for c in chunks], [c.seq.pages for c in chunks],
                                                    [c.seq.state.settings for c in chunks], masks,
                                                    self._penalty_slots(chunks))
        return Flight(chunks, out, host, ready, started)

    def _mask_filler(self, chunks: list[Chunk], after: Flight | None) -> Callable[[], Tensor]:
        """What the runner calls once a grammar step's forward is launched: hands on the tokens of `after` (the step
        before, when this one follows it), then fills the rows' masks (B, W) from their matchers."""
        def fill() -> Tensor:
            if after is not None:
                self._land(after)
            # a row that ended with the step before is computed once more and dropped: any token will do
            return self.masks.fill([None if c.seq.finish_reason is not None else c.seq.state.matcher for c in chunks])
        return fill

    def _follow(self, flight: Flight) -> Flight | None:
        """The decode step after flight, launched before flight's tokens are read (the host's work for both then
        runs while the device computes), when that step is known now: the same rows, one position on. None when
        it may differ: a request arrived, was aborted or could be admitted, another sequence is prefilling, a
        row may end by length, or a row's next page is not free. A row that ends by EOS is then computed once
        more, and dropped. Only the scheduler allocates the pages it needs."""
        sched = self.scheduler
        chunks = flight.chunks
        if self._inbox or self._aborts or len(chunks) != len(sched.running):
            return None
        if sched.waiting and len(sched.running) < sched.max_running:
            return None
        if any(c.seq.finish_reason is not None or c.seq.num_new + 1 >= c.seq.max_new_tokens for c in chunks):
            return None
        if not sched.reserve_next(chunks):
            return None
        flight.committed = True
        self.steps_followed += 1
        return self._launch([Chunk(c.seq, c.start + 1, 1) for c in chunks], flight.tokens, time.perf_counter(),
                            after=flight)

    def _land(self, flight: Flight) -> None:
        """Read flight's tokens and hand them to its rows that still run (a row ended since is dropped), once."""
        if flight.landed:
            return
        flight.landed = True
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
        if self.vision is not None:  # the tower runs once per request, over every request whose prefill starts now
            encode_images(self.vision, [c.seq for c in chunks if c.start < c.seq.prompt_len])
        logits, prompt_rows, sample_rows = self.paged.step(chunks, wants_prompt)
        self._deliver()  # while the device runs the step
        for i, (begin, end) in prompt_rows.items():
            self._prompt_logprobs(chunks[i], logits[begin:end])
        sampling = [c for c in chunks if c.samples]
        if not sampling:
            return [], []
        rows = logits[sample_rows]  # (B, V)
        settings = RowSettings.of([(*c.seq.state.settings, c.seq.num_tokens) for c in sampling], self.device)
        matchers = [c.seq.state.matcher for c in sampling]
        if any(m is not None for m in matchers):
            rows = self.masks.apply(rows, self.masks.fill(matchers))  # (B, V), the grammars' banned tokens at -inf
        slots = self._penalty_slots(sampling)
        penalties = (self.paged.penalties, on_device(slots, torch.long, self.device)) if slots is not None else None
        tokens = sample_tokens(rows, settings, all(c.seq.state.settings[0] == 0 for c in sampling),
                               penalties)  # (B,)
        extras: list[dict[str, Any]] = [{} for _ in sampling]
        top = max(c.seq.state.request.top_logprobs for c in sampling)
        if any(c.seq.state.request.logprobs or c.seq.state.request.top_logprobs for c in sampling):
            chosen, values, ids = chosen_logprobs(rows, tokens, top)
            chosen_list = chosen.tolist()
            for r, c in enumerate(sampling):
                n = c.seq.state.request.top_logprobs
                extras[r]["logprob"] = chosen_list[r]
                if n:
                    extras[r]["top"] = dict(zip(ids[r, :n].tolist(), values[r, :n].tolist()))
        return tokens.tolist(), extras

    def _penalty_slots(self, chunks: list[Chunk]) -> list[int] | None:
        """Each sampling row's slot in the penalty state (the scratch slot for a row without penalties), a request
        that has none getting one now; None when no row uses penalties (the step then does none of that work)."""
        if all(c.seq.state.penalties is None for c in chunks):
            return None
        state, seqs = self.paged.penalties, [c.seq for c in chunks]
        slots = []
        for seq in seqs:
            row = seq.state.penalties
            slot = state.scratch if row is None else state.slot_of(seq)
            if slot is None:  # the prompt's presence and the counts of the tokens it has (on the host: no step runs)
                slot = state.assign(seq, row, seq.tokens[:seq.prompt_len], seq.tokens[seq.prompt_len:], seqs)
            slots.append(slot)
        return slots

    def _release_slot(self, seq: Seq) -> None:
        if seq.state.penalties is not None:
            self.paged.penalties.release(seq)

    def _graph_step(self, chunks: list[Chunk]) -> bool:
        """Whether this step runs as a captured decode graph: decode rows only, no logprobs asked for."""
        if not self.paged.fits_graph(len(chunks)):
            return False
        if any(c.prefills_images for c in chunks):
            return False
        return all(c.length == 1 and c.samples and not (c.seq.state.request.logprobs
                                                        or c.seq.state.request.top_logprobs) for c in chunks)

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
        if state.prompt_top is not None:
            values, ids = logprobs.topk(min(state.request.top_logprobs, logprobs.shape[-1]), dim=-1)
            state.prompt_top += [dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]

    def _emit(self, seq: Seq, token: int, extra: dict[str, Any]) -> None:
        state: RequestState = seq.state
        seq.tokens.append(token)
        self.generation_tokens_total += 1
        reason = state.take(token)
        req = state.request
        counted = token not in state.eos and (token not in state.stop_ids or req.keep_stop_token)
        logprobs = [extra["logprob"]] if req.logprobs and counted else ([] if req.logprobs else None)
        top = [extra["top"]] if req.top_logprobs and counted else ([] if req.top_logprobs else None)
        self._pending.append(self._output(seq, [token] if counted else [], logprobs, top, reason))
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self._release_slot(seq)
            self._seqs.pop(seq.request_id, None)
            self.requests_finished += 1

    def _deliver(self) -> None:
        """Send the outputs the last step made (each request's in order)."""
        pending, self._pending = self._pending, []
        if pending:
            self.sink(pending)

    def _output(self, seq: Seq, token_ids: list[int], logprobs: list[float] | None,
                top: list[dict[int, float]] | None, reason: str | None, error: str | None = None) -> CoreOutput:
        state: RequestState = seq.state
        first = not state.sent_first
        state.sent_first = True
        stats = self._result_stats(seq) if reason is not None else None
        return CoreOutput(seq.request_id, token_ids, logprobs, top, reason, error, seq.prompt_len, seq.cached_tokens,
                          state.prompt_logprobs if first else None, stats,
                          prompt_top_logprobs=state.prompt_top if first else None)

    def _end(self, seq: Seq, reason: str, error: str | None = None, already_released: bool = False) -> None:
        """End seq now (abort, stop or error): release its pages and say so after its earlier outputs."""
        if not already_released:
            self.scheduler.finish(seq, reason, error)
        self._release_slot(seq)
        self._seqs.pop(seq.request_id, None)
        self.requests_finished += 1
        req = seq.state.request
        self._pending.append(self._output(seq, [], [] if req.logprobs else None,
                                          [] if req.top_logprobs else None, reason, error))

    def _result_stats(self, seq: Seq) -> dict[str, float | int | None]:
        state: RequestState = seq.state
        times = state.token_times
        ttft = (times[0] - state.arrived) if times else 0.0
        decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
        decode = (len(times) - 1) / decode_s if decode_s > 0 else 0.0
        peak = torch.cuda.max_memory_allocated(self.device) / 1e9 if self.device.type == "cuda" else None
        per_token = self.runner.bytes_per_token
        return GenerationStats(
            prompt_tokens=seq.prompt_len, new_tokens=state.new_tokens, ttft_s=ttft,
            prefill_tok_s=seq.prompt_len / ttft if ttft > 0 else 0.0, decode_tok_s=decode,
            model_bytes_per_token=per_token,
            bandwidth_gb_s=decode * per_token / 1e9,  # each of its steps read the weights once
            peak_memory_gb=peak).as_dict()


def row_penalties(request: CoreRequest) -> RowPenalties | None:
    """What the request's penalty slot holds, or None when it uses no penalty, bias, min_p or min_tokens (min_tokens
    bans its EOS and stop ids until then: nothing to ban is nothing to do)."""
    banned = tuple(dict.fromkeys([*request.eos, *request.stop_token_ids]))[:MAX_BANNED_IDS]
    min_tokens = request.min_tokens if banned else 0
    row = RowPenalties(float(request.presence_penalty), float(request.frequency_penalty),
                       float(request.repetition_penalty), float(request.min_p),
                       tuple((int(t), float(b)) for t, b in request.logit_bias), int(min_tokens), banned)
    return None if row == RowPenalties(min_banned=banned) else row


def _shutdown_at_exit(ref: weakref.ref) -> None:
    core = ref()
    if core is not None:
        core.shutdown(timeout=0)
