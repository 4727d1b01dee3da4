"""Test-only scaffolding: the batching engine's interface (redline.engine) served one request at a time.

A worker thread runs `llm.stream(...)` for each request in arrival order and feeds the request's handle; logprobs
come from one float32 forward of the model over the prompt and the generated tokens once a request ends. It has no
pages: a running request is counted as holding the pages its whole context would take (`page_size` tokens each),
so /metrics shows them return. The server's tests run against it until the real engine is merged.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

import torch

from redline.options import GenerationOptions, GenerationResult


class EngineFull(RuntimeError):
    """max_queue requests already wait."""


@dataclass(frozen=True)
class RequestOutput:
    token_ids: list[int]
    text: str
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: list[float | None] | None = None


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_pages_used: int
    kv_pages_total: int
    page_size: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens_total: int
    generation_tokens_total: int
    preemptions: int
    requests_finished: int


class RequestHandle:
    def __init__(self, request_id: str, prompt_token_ids: list[int], options: GenerationOptions) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.options = options
        self.aborted = False
        self.result_value: GenerationResult | None = None
        self._outputs: list[RequestOutput] = []
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def push(self, output: RequestOutput) -> None:
        with self._cond:
            self._outputs.append(output)
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the loop is closed
                pass

    @property
    def finish_reason(self) -> str | None:
        with self._cond:
            return self._outputs[-1].finish_reason if self._outputs else None

    def __iter__(self) -> Iterator[RequestOutput]:
        index = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: len(self._outputs) > index)
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
        with self._cond:
            if not self._cond.wait_for(lambda: self._outputs and self._outputs[-1].finish_reason, timeout):
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        if self.result_value is None:
            raise RuntimeError(f"request {self.request_id} ended with {self.finish_reason}")
        return self.result_value


class SequentialEngine:
    """The batching engine's interface, one request at a time (see the module docstring)."""

    def __init__(self, llm, *, max_kv_tokens: int | None = None, max_running: int = 256,
                 max_queue: int | None = None, page_size: int = 16, prefill_chunk: int = 512) -> None:
        self.llm = llm
        self.block_size = llm.model.args.block_size
        self.page_size = page_size
        self.max_queue = max_queue
        self.pages_total = -(-(max_kv_tokens or self.block_size) // page_size)
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._queue: collections.deque[RequestHandle] = collections.deque()
        self._running: RequestHandle | None = None
        self._pages_used = 0
        self._closing = False
        self._thread: threading.Thread | None = None
        self.finished: list[RequestHandle] = []  # every ended request, for tests to inspect
        self.piece_delay_s = 0.0  # tests slow generation down to act while a request runs
        self.prompt_tokens_total = self.generation_tokens_total = 0

    def add_request(self, prompt: str | Sequence[int], options: GenerationOptions | None = None) -> RequestHandle:
        options = GenerationOptions() if options is None else options
        if not isinstance(options, GenerationOptions):
            raise ValueError(f"options must be a GenerationOptions, got {type(options).__name__}")
        ids = self.llm.encode_prompt(prompt)
        if len(ids) >= self.block_size:
            raise ValueError(f"the prompt has {len(ids)} tokens, but the model's context is {self.block_size}; "
                             "shorten it")
        with self._cond:
            if self._closing:
                raise RuntimeError("the engine is shut down; make a new one")
            if self.max_queue is not None and len(self._queue) >= self.max_queue:
                raise EngineFull(f"{self.max_queue} requests already wait; retry later or raise max_queue")
            handle = RequestHandle(f"seq-{next(self._ids)}", ids, options)
            self._queue.append(handle)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="sequential-engine", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return handle

    def abort(self, handle: RequestHandle) -> None:
        with self._cond:
            handle.aborted = True
            if handle in self._queue:
                self._queue.remove(handle)
                self._end(handle, "abort")

    def stats(self) -> EngineStats:
        with self._cond:
            return EngineStats(running=int(self._running is not None), waiting=len(self._queue),
                               kv_pages_used=self._pages_used, kv_pages_total=self.pages_total,
                               page_size=self.page_size, prefix_cache_queries=0, prefix_cache_hits=0,
                               prompt_tokens_total=self.prompt_tokens_total,
                               generation_tokens_total=self.generation_tokens_total, preemptions=0,
                               requests_finished=len(self.finished))

    def shutdown(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is None:
            return
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        with self._cond:  # what is left after the timeout is aborted
            for handle in list(self._queue) + ([self._running] if self._running is not None else []):
                handle.aborted = True
            self._cond.notify_all()
        thread.join()

    def _end(self, handle: RequestHandle, reason: str, error: str | None = None) -> None:
        self.finished.append(handle)
        handle.push(RequestOutput([], "", None, None, reason, error, len(handle.prompt_token_ids)))

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                handle = self._running = self._queue.popleft()
                self._pages_used = -(-(len(handle.prompt_token_ids) + handle.options.max_new_tokens)
                                     // self.page_size)
            try:
                self._run(handle)
            except Exception as exc:  # one request's failure ends it, not the loop
                with self._cond:
                    self._end(handle, "error", str(exc))
            finally:
                with self._cond:
                    self._running, self._pages_used = None, 0

    def _run(self, handle: RequestHandle) -> None:
        ids, options = handle.prompt_token_ids, handle.options
        stream = self.llm.stream(ids, options)
        for piece in stream:
            if handle.aborted:
                stream.close()
                with self._cond:
                    self._end(handle, "abort")
                return
            handle.push(RequestOutput([], piece, None, None, None, prompt_tokens=len(ids)))
            if self.piece_delay_s:
                time.sleep(self.piece_delay_s)
        result = stream.result
        logprobs, top, prompt_lp = self._logprobs(ids, result.token_ids, options)
        with self._cond:
            self.prompt_tokens_total += len(ids)
            self.generation_tokens_total += len(result.token_ids)
            handle.result_value = result
            self.finished.append(handle)
        handle.push(RequestOutput(list(result.token_ids), "", logprobs, top, result.finish_reason,
                                  prompt_tokens=len(ids), prompt_logprobs=prompt_lp))

    def _logprobs(self, ids: list[int], new: list[int], options: GenerationOptions):
        if not (options.logprobs or options.top_logprobs or options.prompt_logprobs):
            return None, None, None
        full = ids + new
        model = self.llm.model
        with torch.inference_mode():
            if model.max_seq_length < len(full):
                model.setup_caches(max(1, model.max_batch_size), len(full))
            logits = model(torch.tensor([full], device=self.llm.device),
                           torch.arange(len(full), device=self.llm.device), from_start=True)[0].float()  # (T, V)
        vocab = self.llm.tokenizer.vocab_size if self.llm.tokenizer is not None else logits.shape[-1]
        logp = torch.log_softmax(logits[:, :vocab], dim=-1)  # (T, V): row t predicts token t + 1
        rows = logp[len(ids) - 1:len(full) - 1]  # (N, V)
        chosen = [rows[i, t].item() for i, t in enumerate(new)] if options.logprobs else None
        top = None
        if options.top_logprobs:
            values, indices = rows.topk(options.top_logprobs, dim=-1)
            top = [dict(zip(i.tolist(), v.tolist())) for i, v in zip(indices, values)]
        prompt_lp = None
        if options.prompt_logprobs:
            prompt_lp = [None] + [logp[i - 1, t].item() for i, t in enumerate(ids) if i > 0]
        return chosen, top, prompt_lp
