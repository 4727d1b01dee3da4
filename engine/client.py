"""The engine's front end: requests in as token ids, outputs back as text through the one output processor.

EngineClient checks each request against the core's limits, keeps each running request's RequestText
(streaming.py: detokenization, stop strings), and talks to a core through a link: LocalLink runs the core in this
process (LLM.generate_batch, benchmarks, tests), engine/process.py's CoreProcess runs it in a process of its own
(serve.py). A stop string is matched here; the request is then aborted in the core, and its last output (with the
core's stats) ends it.

    engine = Engine(llm)                       # this process
    handle = engine.add_request("Hello", GenerationOptions(max_new_tokens=16))
    print(handle.result().text)
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from redline.engine.core import EngineCore, EngineSettings
from redline.grammar import GrammarCompiler
from redline.engine.images import image_inputs
from redline.engine.messages import CoreOutput, CoreRequest, ImageInput
from redline.engine.requests import (EngineFull, EngineStats, Limits, RequestHandle, RequestOutput, Waiter,
                                     check_request, wake)
from redline.options import GenerationOptions, GenerationResult, GenerationStats, prompt_token_ids, resolve_options
from redline.streaming import RequestText


class Link(Protocol):
    """How the client reaches a core."""

    def add(self, request: CoreRequest) -> None: ...

    def abort(self, request_id: str, reason: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def shutdown(self, timeout: float | None) -> None: ...


@dataclass
class Live:
    """A request that has not ended yet, as the client sees it."""

    handle: RequestHandle
    text: RequestText
    options: GenerationOptions
    stopped: bool = False  # a stop string ended its text; the core's last output is awaited
    got_first: bool = False


class EngineClient:
    """The front end of one engine core (see the module docstring). `encode` turns a prompt (text or ids) into
    ids; by default prompts must be token ids."""

    def __init__(self, link: Link, limits: Limits, tokenizer: Any = None,
                 encode: Callable[[Any], list[int]] | None = None, max_queue: int | None = None,
                 vision: Any = None) -> None:
        """vision: the model's vision.VisionArgs, for prompts with images (None: images are refused)."""
        self.link, self.limits, self.tokenizer, self.max_queue = link, limits, tokenizer, max_queue
        self.vision = vision
        self.encode = encode if encode is not None else prompt_token_ids
        self._live: dict[str, Live] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._closed = False

    @property
    def block_size(self) -> int:
        return self.limits.block_size

    @property
    def closed(self) -> bool:
        """True once shutdown was called (or the core died): the engine takes no new requests."""
        with self._lock:
            return self._closed

    def queue_room(self) -> int | None:
        """How many more requests add_request takes before EngineFull; None without max_queue."""
        if self.max_queue is None:
            return None
        with self._lock:
            return self.max_queue - sum(not r.got_first for r in self._live.values())

    def check_request(self, prompt: str | Sequence[int], options: GenerationOptions | None,
                      images: Sequence[Any] | None = None) -> tuple[list[int], GenerationOptions, list[ImageInput]]:
        """The prompt's token ids (each image placeholder expanded into its image's tokens), the options and the
        images as they travel to the core, validated; ValueError in one line otherwise. images: one per image
        placeholder of the prompt, each a PIL image or the bytes of a PNG, JPEG, WebP or GIF file."""
        ids, inputs = image_inputs(self.vision, self.encode(prompt), images)
        return ids, check_request(ids, options, self.limits), inputs

    def add_request(self, prompt: str | Sequence[int], options: GenerationOptions | None = None,
                    images: Sequence[Any] | None = None) -> RequestHandle:
        ids, options, inputs = self.check_request(prompt, options, images)
        eos = [] if options.ignore_eos or self.tokenizer is None else list(self.tokenizer.eos_ids)
        s = options.sampling
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is shut down; make a new one")
            if self.max_queue is not None and sum(not r.got_first for r in self._live.values()) >= self.max_queue:
                raise EngineFull(f"{self.max_queue} requests already wait; retry later or raise max_queue")
            request_id = f"req-{next(self._ids)}"
            handle = RequestHandle(request_id, ids, self.abort)
            text = RequestText(self.tokenizer, list(options.stop), options.min_tokens,
                               options.include_stop_str_in_output, options.skip_special_tokens)
            self._live[request_id] = Live(handle, text, options)
        self.link.add(CoreRequest(request_id, ids, min(options.max_new_tokens, self.limits.block_size - len(ids)),
                                  float(s.temperature), s.top_k, s.top_p, options.seed, eos, bool(options.logprobs),
                                  int(options.top_logprobs), bool(options.prompt_logprobs),
                                  options.grammar.text if options.grammar is not None else None, images=inputs,
                                  presence_penalty=float(s.presence_penalty),
                                  frequency_penalty=float(s.frequency_penalty),
                                  repetition_penalty=float(s.repetition_penalty), min_p=float(s.min_p),
                                  logit_bias=[tuple(p) for p in s.logit_bias], min_tokens=int(options.min_tokens),
                                  stop_token_ids=list(options.stop_token_ids),
                                  keep_stop_token=bool(options.include_stop_str_in_output)))
        return handle

    def abort(self, handle: RequestHandle) -> None:
        self.link.abort(handle.request_id, "abort")

    def stats(self) -> EngineStats:
        return self.link.stats()

    def shutdown(self, timeout: float | None = None) -> None:
        """Refuse new requests, let running ones finish (those left after `timeout` seconds are aborted), stop."""
        with self._lock:
            self._closed = True
        self.link.shutdown(timeout)

    def fail_all(self, error: str) -> None:
        """End every running request with an error (the core is gone)."""
        with self._lock:
            live, self._live = list(self._live.values()), {}
            self._closed = True
        for r in live:
            r.handle.push(RequestOutput([], r.text.piece(True), [] if r.options.logprobs else None,
                                        [] if r.options.top_logprobs else None, "error", error))

    def receive(self, outputs: list[CoreOutput]) -> None:
        """The core's outputs, in order (called by the link's thread): text, stop strings, then each handle; the
        asyncio readers of all of them are woken together."""
        waiters: list[Waiter] = []
        for out in outputs:
            with self._lock:
                live = self._live.get(out.request_id)
                if live is not None:
                    live.got_first = True
                    if out.finish_reason is not None:
                        del self._live[out.request_id]
            if live is not None:
                waiters += self._deliver(live, out)
        wake(waiters)

    def _deliver(self, live: Live, out: CoreOutput) -> list[Waiter]:
        ended = out.finish_reason is not None
        stats = GenerationStats(**out.stats) if out.stats is not None else None
        if live.stopped:  # text already ended at a stop string: only the core's last output matters
            if not ended:
                return []
            return live.handle.add(RequestOutput([], "", [] if live.options.logprobs else None,
                                                 [] if live.options.top_logprobs else None, "stop"), stats)
        keep, stopped = live.text.push(out.token_ids, ended)
        reason = out.finish_reason
        if stopped:
            reason = "stop"
            if not ended:
                live.stopped = True
                self.link.abort(out.request_id, "stop")
                reason = None
        finished = reason is not None
        piece = live.text.piece(finished or live.stopped)
        cut = (lambda xs: xs[:keep] if xs is not None else None)
        return live.handle.add(RequestOutput(out.token_ids[:keep], piece, cut(out.logprobs), cut(out.top_logprobs),
                                             reason, out.error, out.prompt_tokens, out.cached_tokens,
                                             out.prompt_logprobs, out.prompt_top_logprobs),
                               stats if finished else None)


class LocalLink:
    """A core in this process: calls go straight to it, and its thread hands outputs to the client."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core

    def add(self, request: CoreRequest) -> None:
        self.core.add(request)

    def abort(self, request_id: str, reason: str) -> None:
        self.core.abort(request_id, reason)

    def stats(self) -> EngineStats:
        return self.core.stats()

    def shutdown(self, timeout: float | None) -> None:
        self.core.shutdown(timeout)


class Engine(EngineClient):
    """The batching engine of an LLM in this process: an EngineCore over llm.runner and its front end.

        Engine(llm, max_running=256, ...)   # EngineSettings' fields as keywords
    """

    def __init__(self, llm: Any, settings: EngineSettings | None = None, **fields: Any) -> None:
        settings = settings if settings is not None else EngineSettings(**fields)
        grammars = GrammarCompiler(llm.tokenizer, llm.runner.model.args.vocab_size) if llm.tokenizer else None
        vision = getattr(llm, "vision", None)
        self.core = EngineCore(llm.runner, settings, self._receive_later, grammars, vision)
        super().__init__(LocalLink(self.core), self.core.limits, llm.tokenizer, llm.encode_prompt, settings.max_queue,
                         vision.args if vision is not None else None)

    @classmethod
    def of_runner(cls, runner: Any, settings: EngineSettings, vision: Any = None) -> Engine:
        """The engine of a bare runner: prompts are token ids, outputs have no text (benchmarks); vision: its
        vision tower, if any."""
        return cls(_Bare(runner, vision=vision), settings)

    def _receive_later(self, outputs: list[CoreOutput]) -> None:
        self.receive(outputs)

    # The core's parts, read by benchmarks and tests.
    pool = property(lambda self: self.core.pool)
    scheduler = property(lambda self: self.core.scheduler)
    paged = property(lambda self: self.core.paged)
    graphs = property(lambda self: self.core.paged.graphs)
    steps_followed = property(lambda self: self.core.steps_followed)

    def capture_graphs(self, max_tokens: int | None = None,
                       progress: Callable[[int, int], None] | None = None) -> int:
        return self.core.capture_graphs(max_tokens, progress)

    def warm_up(self, longest: int | None = None) -> None:
        self.core.warm_up(longest)

    def follow(self) -> None:
        """A tensor-parallel rank other than 0 (under torchrun every rank makes the engine): run rank 0's steps on
        this rank's heads until rank 0's engine shuts down; rank 0 alone adds requests."""
        self.core.follow()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Requests added inside start together, in one step."""
        with self.core.paused():
            yield


@dataclass
class _Bare:
    """A runner with no tokenizer, in the shape Engine reads an LLM."""

    runner: Any
    tokenizer: Any = None
    encode_prompt: Callable[[Any], list[int]] = prompt_token_ids
    vision: Any = None


def generate_all(engine: EngineClient, prompts: Sequence[str | Sequence[int]],
                 options: GenerationOptions | Sequence[GenerationOptions] | None,
                 settings: dict[str, Any], images: Sequence[Sequence[Any] | None] | None = None
                 ) -> list[GenerationResult]:
    """LLM.generate_batch: every request checked before any starts, then all run together; results in input order.
    images: one list (or None) per prompt."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError("prompts must be a list of strings or token-id lists; for one prompt use LLM.generate")
    if images is None:
        images = [None] * len(prompts)
    elif not isinstance(images, Sequence) or len(images) != len(prompts):
        raise ValueError(f"images must hold one list (or None) per prompt, {len(prompts)} in all")
    if isinstance(options, Sequence):
        if len(options) != len(prompts):
            raise ValueError(f"{len(options)} options for {len(prompts)} prompts; pass one per prompt, or one")
        per_prompt = [resolve_options(o, settings) for o in options]
    else:
        per_prompt = [resolve_options(options, settings)] * len(prompts)
    for i, (prompt, opts, pictures) in enumerate(zip(prompts, per_prompt, images)):
        try:
            engine.check_request(prompt, opts, pictures)
        except ValueError as exc:
            raise ValueError(f"prompt {i}: {exc}") from None
    handles = [engine.add_request(prompt, opts, pictures)
               for prompt, opts, pictures in zip(prompts, per_prompt, images)]
    return [handle.result() for handle in handles]
