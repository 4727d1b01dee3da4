"""A request as its caller sees it: a handle whose outputs arrive as the engine makes them, each output, the
engine's counters, and the checks a request passes before it is queued."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from redline.engine.messages import Stats
from redline.options import GenerationOptions, GenerationResult, GenerationStats

FINISH_REASONS = ("eos", "stop", "length", "abort", "error")


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
    # with prompt_logprobs and top_logprobs = N > 0: N most likely ids -> logprob per prompt token (None for the first)
    prompt_top_logprobs: list[dict[int, float] | None] | None = None


EngineStats = Stats  # the engine's counters: the same struct in this process and across the core's boundary


@dataclass(frozen=True)
class Limits:
    """What a request is checked against before it is queued: the core's, as it reported them when ready."""

    block_size: int  # the model's context
    vocab_size: int  # the model's embedding rows
    capacity_tokens: int  # tokens the page pool holds


def check_request(ids: list[int], options: GenerationOptions | None, limits: Limits) -> GenerationOptions:
    """The options, validated against the prompt's ids and the limits; ValueError in one line otherwise."""
    options = GenerationOptions() if options is None else options
    if not isinstance(options, GenerationOptions):
        raise ValueError(f"options must be a GenerationOptions, got {type(options).__name__}")
    if options.draft is not None:
        raise ValueError("the batching engine does not speculate; drop draft= (LLM.generate speculates)")
    if options.profile is not None:
        raise ValueError("the batching engine does not profile one request; drop profile= (LLM.generate does)")
    if not ids:
        raise ValueError("the prompt is empty; pass some text or token ids")
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the model's vocabulary (0..{limits.vocab_size - 1})")
    options.check_vocabulary(limits.vocab_size)
    if len(ids) >= limits.block_size:
        raise ValueError(f"the prompt has {len(ids)} tokens, but the model's context is {limits.block_size}; "
                         "shorten it")
    # The last new token's keys are never computed: a request holds at most prompt + max_new - 1 of them.
    need = len(ids) + min(options.max_new_tokens, limits.block_size - len(ids)) - 1
    if need > limits.capacity_tokens:
        raise ValueError(f"the prompt ({len(ids)} tokens) and max_new_tokens need up to {need} tokens of KV cache, "
                         f"more than the pool's {limits.capacity_tokens}; raise max_kv_tokens or lower "
                         "max_new_tokens")
    return options


Waiter = tuple[asyncio.AbstractEventLoop, asyncio.Event]


def wake(waiters: list[Waiter]) -> None:
    """Set the waiters' events, with one call into each event loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}
    for loop, event in waiters:
        by_loop.setdefault(loop, []).append(event)
    for loop, events in by_loop.items():
        try:
            loop.call_soon_threadsafe(set_all, events)
        except RuntimeError:  # that loop is closed: nobody waits there any more
            pass


def set_all(events: list[asyncio.Event]) -> None:
    for event in events:
        event.set()


def merged(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one (their tokens, text and logprobs joined; the last one's end)."""
    if len(outputs) == 1:
        return outputs[0]
    first, last = outputs[0], outputs[-1]

    def joined(name: str) -> list | None:
        parts = [getattr(o, name) for o in outputs]
        return None if all(p is None for p in parts) else [x for p in parts if p for x in p]

    return RequestOutput([t for o in outputs for t in o.token_ids], "".join(o.text for o in outputs),
                         joined("logprobs"), joined("top_logprobs"), last.finish_reason, last.error,
                         last.prompt_tokens, max(o.cached_tokens for o in outputs), first.prompt_logprobs,
                         first.prompt_top_logprobs)


class RequestHandle:
    """One request's outputs as the engine makes them; iterate it (or `async for`), or wait for result()."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], abort: Callable[[RequestHandle], None]) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._abort = abort
        self._outputs: list[RequestOutput] = []
        self._cond = threading.Condition()
        self._waiters: list[Waiter] = []
        self._stats: GenerationStats | None = None

    @property
    def finished(self) -> bool:
        with self._cond:
            return bool(self._outputs) and self._outputs[-1].finish_reason is not None

    def abort(self) -> None:
        """Ask the engine to end this request (its last output then says "abort")."""
        self._abort(self)

    def push(self, output: RequestOutput, stats: GenerationStats | None = None) -> None:
        """Called by whoever makes the outputs; wakes the handle's readers."""
        wake(self.add(output, stats))

    def add(self, output: RequestOutput, stats: GenerationStats | None = None) -> list[Waiter]:
        """Append output and wake threads that wait; returns the asyncio readers to wake (wake() them, many
        handles' at once: one call into each event loop per engine step instead of one per request)."""
        with self._cond:
            self._outputs.append(output)
            if stats is not None:
                self._stats = stats
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        return waiters

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
        async for batch in self.batches():
            for output in batch:
                yield output

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._aiter()

    async def batches(self) -> AsyncIterator[list[RequestOutput]]:
        """The outputs in order, each time all that arrived since the last batch (a reader slower than the engine
        gets several outputs at once instead of falling behind one at a time)."""
        loop = asyncio.get_running_loop()
        index = 0
        while True:
            with self._cond:
                batch = self._outputs[index:]
                if not batch:
                    event = asyncio.Event()
                    self._waiters.append((loop, event))
            if not batch:
                await event.wait()
                continue
            index += len(batch)
            yield batch
            if batch[-1].finish_reason is not None:
                return

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
