"""An OpenAI-compatible HTTP server on Redline's batching engine, with a chat page at `/`.

    python serve.py --checkpoint_path checkpoints/smollm2/float32/model.safetensors   # http://127.0.0.1:8000

Endpoints: POST /v1/chat/completions, /v1/completions, /v1/responses (serve_responses.py), /v1/messages (Anthropic's
shape, serve_messages.py), streamed or not, /tokenize, /detokenize; GET /v1/models, /health (503 while loading),
/metrics (Prometheus); bodies in serve_protocol.py; tools, reasoning and grammars in replies.py. create_app serves any
engine like Engine.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from redline import __version__
from redline.engine import EngineClient, EngineSettings
from redline.engine.core import COMPILE_PREFILL_HELP, KV_CACHE_DTYPE_HELP, PREFILL_GRAPHS_HELP
from redline.engine.messages import Ready
from redline.engine.process import CoreProcess, ModelSource
from redline.engine.requests import Limits, merged
from redline.model import ModelArgs
from redline.options import DTYPE_FOLDERS, EngineConfig, check_text
from redline.outputs import OneLineArgumentParser
from redline.prompts import Prompts
from redline.replies import REASONING_PARSERS, Agent, AgentSettings, PreparedReply, ReplyReader, parsed
from redline.toolcalls import PARSERS
from redline.serve_images import MediaSettings, load_images
from redline.serve_metrics import Metrics
from redline.serve_protocol import (FINISH_REASONS, APIError, ChatRequest, CompletionRequest, DetokenizeRequest,
                                    TokenizeRequest, context_room, invalid, parse_request)
from redline.streaming import TextStream

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DISCONNECT_POLL_S = 0.25  # how often a running request checks that its client is still there
CHAT_PAGE = Path(__file__).resolve().parent / "static" / "chat.html"
PAGE_ICON = CHAT_PAGE.with_name("favicon.svg")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; "
                                           "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:"}


# The server's engine: EngineSettings' defaults, with a bounded queue, and one decode graph per batch bucket made
# before serving (tables wide enough for 2,048 tokens; a longer sequence's first step captures a wider one).
SERVE_ENGINE = EngineSettings(max_queue=1024, capture_tokens=2048)
DEFAULT_COMPILE_CACHE = Path.home() / ".cache" / "redline" / "compile"
# After the core dies, /health answers 503 for this long (a load balancer sees it) while running streams end with an
# error event; then the server exits with status 1, at once (a graceful stop would wait for open connections).
CORE_DEAD_LINGER_S = 1.5


@dataclass(frozen=True)
class ServeSettings:
    checkpoint_path: Path | None = None
    random_weights: str | None = None  # a registry model name (model.py) with random weights, for benchmarks
    tokenizer: Path | None = None  # with random_weights: a tokenizer to serve them with (structured-output benchmarks)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    device: str | None = None
    dtype: str | None = None
    quantize: str | None = None
    compile: bool | None = None
    threads: int | None = None  # CPU threads of the kernels; None: the physical cores (on the CPU)
    engine: EngineSettings = SERVE_ENGINE  # how the engine core batches (its flags are its fields)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    shutdown_grace_s: float = 30.0  # on SIGTERM, running requests get this long to finish
    compile_cache: Path | None = DEFAULT_COMPILE_CACHE  # torch.compile's on-disk caches; None: torch's defaults
    # Host names (besides this machine's loopback names) that requests may name in Host and Origin; "*" any.
    allowed_hosts: tuple[str, ...] = ()
    tool_parser: str | None = None  # the tool-call format replies are parsed in; None: from the chat template
    reasoning_parser: str = "auto"  # "auto": <think> blocks split off when the chat template writes them
    gateway_metrics: bool = False  # /metrics also under vLLM's names, for Kubernetes inference gateways
    tensor_parallel: int = 1  # GPUs of this host the model is split over (the engine core starts one rank on each)
    allowed_media_domains: tuple[str, ...] = ()  # hosts remote image URLs may name (serve_images.py); () none

    def __post_init__(self) -> None:
        if (self.checkpoint_path is None) == (self.random_weights is None):
            raise ValueError("give exactly one of --checkpoint_path and --random-weights")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key is empty; give a key or leave it out")
        if self.max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be positive, got {self.max_body_bytes}")
        object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts or ()))
        if not all(isinstance(h, str) and h and "/" not in h and " " not in h for h in self.allowed_hosts):
            raise ValueError(f"--allowed-host takes host names (example.com, 10.0.0.5, *), got {self.allowed_hosts}")
        if self.tensor_parallel < 1:
            raise ValueError(f"--tensor-parallel must be positive, got {self.tensor_parallel}")
        if not self.shutdown_grace_s >= 0:
            raise ValueError(f"--shutdown-grace must be >= 0 seconds, got {self.shutdown_grace_s}")
        self.engine_config  # validates device, dtype and quantize
        self.agent_settings  # validates the parsers
        object.__setattr__(self, "allowed_media_domains", tuple(self.allowed_media_domains or ()))
        self.media  # validates the media domains
        if self.random_weights is not None:
            ModelArgs.from_name(self.random_weights)  # an unknown name is refused before the server starts
        if self.tokenizer is not None and self.random_weights is None:
            raise ValueError("--tokenizer goes with --random-weights (a checkpoint brings its own tokenizer)")

    @property
    def engine_config(self) -> EngineConfig:
        return EngineConfig(device=self.device, dtype=self.dtype, compile=self.compile, quantize=self.quantize,
                            name=self.served_model_name, threads=self.threads)

    @property
    def media(self) -> MediaSettings:
        return MediaSettings(self.allowed_media_domains)

    def vision_args(self) -> Any:
        """The checkpoint's vision.VisionArgs (the front end expands image placeholders with them), or None."""
        if self.checkpoint_path is None or self.tensor_parallel > 1:  # tensor-parallel steps carry no images yet
            return None
        from redline.checkpoint import read_checkpoint_info
        from redline.vision import read_vision_args

        return read_vision_args(read_checkpoint_info(self.checkpoint_path).path)

    @property
    def agent_settings(self) -> AgentSettings:
        return AgentSettings(self.tool_parser, self.reasoning_parser)

    @property
    def model_name(self) -> str:
        if self.served_model_name or self.random_weights is not None:
            return self.served_model_name or self.random_weights
        path = Path(self.checkpoint_path)
        folder = path if path.is_dir() else path.parent
        return folder.parent.name if folder.name in DTYPE_FOLDERS and folder.parent.name else folder.name

    def model_source(self, tokenizer_vocab: int | None) -> ModelSource:
        return ModelSource(str(self.checkpoint_path) if self.checkpoint_path is not None else None,
                           self.random_weights, self.device, self.dtype, self.quantize, self.compile, tokenizer_vocab,
                           self.tokenizer_path(), self.threads, self.tensor_parallel)

    def tokenizer_path(self) -> str | None:
        """Where the engine core loads the tokenizer its grammars are compiled for."""
        if self.checkpoint_path is None:
            return str(self.tokenizer) if self.tokenizer is not None else None
        from redline.checkpoint import read_checkpoint_info

        return str(read_checkpoint_info(self.checkpoint_path).path)


@dataclass
class ServerState:
    """What the handlers read: the engine (a client of the engine core) and the model's prompts (tokenizer, chat
    template, context), both None until the model is ready; `error` once loading failed or the core died."""

    settings: ServeSettings
    engine: Any = None
    prompts: Any = None
    error: str | None = None
    core: Any = None  # the engine core's process (serve()), None in this process
    metrics: Metrics = field(default_factory=Metrics)
    created: int = field(default_factory=lambda: int(time.time()))
    _agent: Agent | None = None

    def agent(self) -> Agent:
        """Tool calls, reasoning and grammars for the loaded model (made on first use)."""
        llm, _ = self.ready()
        if self._agent is None:
            self._agent = Agent(llm, self.settings.agent_settings)
        return self._agent

    def ready(self) -> tuple[Any, Any]:
        if self.engine is None or self.error is not None:
            if self.error:
                message = f"the model is not available: {self.error}"
            else:
                message = "the model is still loading; retry"
            raise APIError(503, message, "service_unavailable", code="model_not_ready", headers={"Retry-After": "5"})
        return self.prompts, self.engine

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.settings.model_name!r}",
                           "invalid_request_error", "model", "model_not_found")


# ---------------------------------------------------------------------------------------------------------------------
# Request plumbing.


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def authorize(state: ServerState, request: Request) -> None:
    key = state.settings.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "missing or wrong API key; send the header `Authorization: Bearer <key>`",
                       "authentication_error", code="invalid_api_key")


# The names a browser uses for this machine: a loopback server answers requests naming only these (or the
# configured --allowed-host names) in Host and Origin, so a web page on another site cannot reach it through DNS
# rebinding or read its answers.
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
# Content types a web page can send cross-site without a CORS preflight are refused (415): only JSON is an API body.
JSON_CONTENT_TYPES = ("application/json",)


def host_name(authority: str) -> str:
    """The host of a Host header or an origin's authority, without its port: `[::1]:8000` -> `::1`."""
    if authority.startswith("["):
        return authority[1:].split("]", 1)[0].lower()
    return authority.rsplit(":", 1)[0].lower() if authority.count(":") == 1 else authority.lower()


class CrossSiteGuard:
    """ASGI middleware refusing what a web page on another site could make a browser send here: a Host that is not
    this server's (DNS rebinding; checked when it listens on loopback, where Host is known), an Origin of another
    site, and POST bodies that are not JSON (a form or text/plain needs no preflight)."""

    def __init__(self, app: Any, settings: ServeSettings) -> None:
        self.app, self.settings = app, settings
        self.loopback = settings.host in LOOPBACK_NAMES
        self.names = {n.lower() for n in settings.allowed_hosts} | (set(LOOPBACK_NAMES) if self.loopback else set())

    def allowed(self, name: str) -> bool:
        return "*" in self.names or name in self.names

    def problem(self, scope: dict[str, Any]) -> APIError | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        host = host_name(headers.get("host", ""))
        if self.loopback and not self.allowed(host):
            return APIError(403, f"the Host {headers.get('host', '')!r} is not this server's; a page on another "
                                 "site cannot use it (start the server with --allowed-host NAME to allow a name)",
                            "invalid_request_error", code="host_not_allowed")
        origin = headers.get("origin")
        if origin is not None:
            scheme, _, authority = origin.partition("://")
            name = host_name(authority)
            if not (scheme in ("http", "https") and (name == host or self.allowed(name))):
                return APIError(403, f"requests from the web origin {origin!r} are refused (start the server with "
                                     "--allowed-host NAME to allow a site)", "invalid_request_error",
                                code="origin_not_allowed")
        if scope.get("method") == "POST":
            kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if kind not in JSON_CONTENT_TYPES:
                return APIError(415, f"the body must be JSON, sent with `Content-Type: application/json` (got "
                                     f"{kind or 'none'!r})", "invalid_request_error", code="unsupported_media_type")
        return None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            error = self.problem(scope)
            if error is not None:
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# Bodies past this size are parsed in a worker thread (pydantic's walk of megabytes would stall the event loop).
PARSE_IN_THREAD_BYTES = 64 * 1024
# The model behind the answers: this build of Redline (OpenAI's field; it changes when the serving code does).
SYSTEM_FINGERPRINT = f"redline-{__version__}"


async def parse_body(model: type, request: Request, limit: int) -> Any:
    """The request model of a JSON body, parsed off the event loop when large."""
    body = await read_body(request, limit)
    if len(body) > PARSE_IN_THREAD_BYTES:
        return await asyncio.to_thread(parse_request, model, body)
    return parse_request(model, body)


def check_queue_room(engine: Any, count: int) -> None:
    """A 429 before any of a call's `count` engine requests is queued when they would not all fit, so a refused
    call (n choices, many prompts) leaves nothing behind to crowd out other clients."""
    room = engine.queue_room()
    if room is not None and count > room:
        raise APIError(429, f"the server's queue is full (room for {max(room, 0)} more requests, this call needs "
                            f"{count}); retry later", "rate_limit_error", code="queue_full",
                       headers={"Retry-After": "1"})


def ignored_header(req: Any) -> dict[str, str]:
    """A Warning header naming the accepted-and-ignored parameters the request set (serve_protocol.py's list)."""
    ignored = req.ignored
    if not ignored:
        return {}
    return {"Warning": f'299 redline "ignored parameters: {", ".join(ignored)} (no effect on a local server)"'}


async def read_body(request: Request, limit: int) -> bytes:
    too_large = APIError(413, f"the request body is larger than {limit} bytes", "invalid_request_error",
                         code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def request_images(state: ServerState, urls: list[str], param: str) -> list[bytes] | None:
    """The checked file bytes of a request's image URLs (serve_images.py), fetched and decoded in a worker thread;
    None without images; a 400 naming the problem otherwise."""
    if not urls:
        return None
    if getattr(state.engine, "vision", None) is None:
        raise invalid("this model has no vision tower, so it takes no images; serve a multimodal checkpoint (Gemma 3 "
                      "4B+, Qwen2.5-VL) or drop the image parts", param)
    try:
        return await asyncio.to_thread(load_images, urls, state.settings.media)
    except ValueError as exc:
        raise invalid(str(exc), param) from None


async def submit_images(engine: Any, requests: list[tuple[list[int], Any]], images: list[bytes] | None) -> list[Any]:
    """submit(); with images in a worker thread, where each request's images are decoded again and its prompt
    expanded (engine/images.py)."""
    if images is None:
        return submit(engine, requests)
    return await asyncio.to_thread(submit, engine, requests, images)


def submit(engine: Any, requests: list[tuple[list[int], Any]], images: list[bytes] | None = None) -> list[Any]:
    """One engine request per (prompt ids, options), each with `images` if given; all or none (those added are
    aborted on a failure)."""
    handles: list[Any] = []
    try:
        for ids, options in requests:
            handles.append(engine.add_request(ids, options) if images is None else
                           engine.add_request(ids, options, images))
    except Exception as exc:
        for handle in handles:
            engine.abort(handle)
        if any(cls.__name__ == "EngineFull" for cls in type(exc).__mro__):  # the engine's own class, by name
            raise APIError(429, f"the server's queue is full ({exc}); retry later", "rate_limit_error",
                           code="queue_full", headers={"Retry-After": "1"}) from None
        if isinstance(exc, ValueError):
            code = "context_length_exceeded" if "context" in str(exc) else None
            raise invalid(str(exc), code=code) from None
        if isinstance(exc, RuntimeError):
            raise APIError(503, f"the server is not taking requests: {exc}", "service_unavailable",
                           code="shutting_down") from None
        raise
    return handles


@dataclass
class Choice:
    """One request's outputs gathered so far."""
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    started: float = 0.0
    last: float | None = None  # when the last piece with text or tokens came
    strings: TextStream | None = None  # splits the choice's tokens into their shares of the text
    aborted: bool = False  # the server asked the engine to abort it (once)

    def token_strings(self, tokenizer: Any, ids: Sequence[int]) -> list[str]:
        """Each of `ids`' share of the decoded text, in the context of the choice's earlier tokens (a character
        split over tokens goes to its last token); call with the tokens in order."""
        if tokenizer is None:
            return ["" for _ in ids]
        if self.strings is None:
            self.strings = TextStream(tokenizer)
        texts = [self.strings.push(t) for t in ids]
        if texts and self.finish_reason is not None:
            texts[-1] += self.strings.flush()
        return texts

    def add(self, out: Any, metrics: Metrics) -> None:
        if out.text or out.token_ids:
            now = time.perf_counter()
            if self.last is None:
                metrics.observe_ttft(now - self.started)
            else:
                metrics.observe_itl(now - self.last)
            self.last = now
        self.text.append(out.text)
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs or []
        self.top_logprobs += out.top_logprobs or []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = list(out.prompt_logprobs)
        if out.prompt_top_logprobs is not None:
            self.prompt_top_logprobs = list(out.prompt_top_logprobs)
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        if out.finish_reason is not None:
            self.finish_reason, self.error = out.finish_reason, out.error


async def outputs(handles: list[Any]) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, RequestOutput) of every handle as they come; what arrived while the last one was being sent
    comes merged into one (a stream slower than the engine sends fewer, larger chunks instead of falling behind)."""
    if len(handles) == 1:
        async for batch in handles[0].batches():
            yield 0, merged(batch)
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, handle: Any) -> None:
        async for batch in handle.batches():
            queue.put_nowait((i, merged(batch)))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    left = len(handles)
    try:
        while left:
            i, out = await queue.get()
            left -= out.finish_reason is not None
            yield i, out
    finally:
        for task in tasks:
            task.cancel()


class Run:
    """The engine requests of one API call: gathers their outputs, and aborts what is unfinished when the call ends
    early (the client went away, or the server is stopping)."""

    def __init__(self, state: ServerState, request: Request, handles: list[Any], per_prompt: int = 1) -> None:
        self.state, self.request, self.handles = state, request, handles
        self.per_prompt = per_prompt  # choices per prompt (n): each prompt's tokens count once in the usage
        start = time.perf_counter()
        self.choices = [Choice(started=start) for _ in handles]
        self.next_check = time.monotonic() + DISCONNECT_POLL_S

    async def stream(self) -> AsyncIterator[tuple[int, Any]]:
        try:
            async for i, out in outputs(self.handles):
                self.choices[i].add(out, self.state.metrics)
                yield i, out
                if time.monotonic() >= self.next_check:
                    self.next_check = time.monotonic() + DISCONNECT_POLL_S
                    if await self.request.is_disconnected():
                        return
        finally:
            self.abort_unfinished()

    async def gather(self) -> list[Choice]:
        watch = asyncio.create_task(self._watch_disconnect())
        try:
            async for _ in self.stream():
                pass
        finally:
            watch.cancel()
        failed = [c for c in self.choices if c.finish_reason == "error"]
        if failed:
            raise APIError(500, f"generation failed: {failed[0].error}", "server_error", code="generation_failed")
        return self.choices

    async def _watch_disconnect(self) -> None:
        while not await self.request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        self.abort_unfinished()

    def abort_unfinished(self) -> None:
        unfinished = [h for h, c in zip(self.handles, self.choices) if c.finish_reason is None and not c.aborted]
        for choice in self.choices:
            choice.aborted = True
        for handle in unfinished:
            self.state.engine.abort(handle)
        if unfinished:
            self.state.metrics.count_abort()

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(h.prompt_token_ids) for h in self.handles[::self.per_prompt])
        cached = sum(c.cached_tokens for c in self.choices[::self.per_prompt])
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def stream_error(choice: Choice) -> str:
    return sse(APIError(500, f"generation failed: {choice.error}", "server_error", code="generation_failed").body())


def token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token]) if tokenizer is not None else ""


def alternatives_by_text(tokenizer: Any, top: dict[int, float]) -> dict[str, float]:
    """Token id -> logprob as the legacy API's text -> logprob; ids that decode alike keep the most likely's value."""
    out: dict[str, float] = {}
    for token, logprob in sorted(top.items(), key=lambda kv: -kv[1]):
        out.setdefault(token_text(tokenizer, token), logprob)
    return out


def finish_reason(choice: Choice) -> str | None:
    return FINISH_REASONS.get(choice.finish_reason) if choice.finish_reason is not None else None


# ---------------------------------------------------------------------------------------------------------------------
# POST /v1/chat/completions


def chat_logprobs(tokenizer: Any, choice: Choice, ids: list[int], logprobs: list[float],
                  top: list[dict[int, float]]) -> dict[str, Any]:
    content = []
    for i, text in enumerate(choice.token_strings(tokenizer, ids)):
        alternatives = [{"token": s, "logprob": lp, "bytes": list(s.encode("utf-8", "replace"))}
                        for alt, lp in (top[i] if i < len(top) else {}).items() for s in [token_text(tokenizer, alt)]]
        content.append({"token": text, "logprob": logprobs[i], "bytes": list(text.encode("utf-8", "replace")),
                        "top_logprobs": alternatives})
    return {"content": content}


async def chat_completions(state: ServerState, request: Request) -> Response:
    llm, engine = state.ready()
    req = await parse_body(ChatRequest, request, state.settings.max_body_bytes)
    state.check_model(req.model)
    check_queue_room(engine, req.n)
    images = await request_images(state, req.image_urls(), "messages")
    prepared = await state.agent().prepare(req.reply_spec())  # a long prompt or schema never stalls the loop
    options = req.options(context_room(llm, prepared.ids, req.max_new, "messages"), llm.vocab_size,
                          parsed(prepared), logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0,
                          grammar=prepared.grammar)
    handles = await submit_images(engine, [(prepared.ids, o) for o in req.seeded(options)], images)
    run = Run(state, request, handles, req.n)
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": state.settings.model_name,
            "system_fingerprint": SYSTEM_FINGERPRINT}
    if req.stream:
        return StreamingResponse(chat_events(run, req, base, llm.tokenizer, prepared), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, **ignored_header(req)})
    choices = await run.gather()
    out = []
    for i, c in enumerate(choices):
        reader = ReplyReader(prepared)
        reader.feed("".join(c.text))
        reader.finish()
        message: dict[str, Any] = {"role": "assistant", "content": reader.content or (None if reader.calls else "")}
        if reader.calls:
            message["tool_calls"] = [tool_call_json(call) for call in reader.calls]
        if reader.reasoning_content is not None:
            message["reasoning_content"] = reader.reasoning_content
        out.append({"index": i, "message": message, "logprobs": chat_logprobs(
            llm.tokenizer, c, c.token_ids, c.logprobs, c.top_logprobs) if req.logprobs else None,
            "finish_reason": "tool_calls" if reader.calls else finish_reason(c)})
    return JSONResponse({**base, "object": "chat.completion", "choices": out, "usage": run.usage()},
                        headers=ignored_header(req))


def tool_call_json(call: Any, index: int | None = None) -> dict[str, Any]:
    body = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return body if index is None else {"index": index, **body}


def reply_deltas(reader: ReplyReader, text: str, final: bool) -> list[dict[str, Any]]:
    """Chat deltas for a reply's next text: reasoning_content, content, and each complete tool call as OpenAI
    streams one (index, id and name first, then its arguments)."""
    deltas: list[dict[str, Any]] = []
    events = reader.feed(text) if text else []
    if final:
        events += reader.finish()
    for event in events:
        if event.kind == "reasoning":
            deltas.append({"reasoning_content": event.text})
        elif event.kind == "content":
            deltas.append({"content": event.text})
        else:
            index = reader.calls.index(event.call)
            head = tool_call_json(event.call, index)
            head["function"] = {"name": event.call.name, "arguments": ""}
            deltas.append({"tool_calls": [head]})
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": event.call.arguments}}]})
    return deltas


async def chat_events(run: Run, req: ChatRequest, base: dict[str, Any], tokenizer: Any,
                      prepared: PreparedReply) -> AsyncIterator[str]:
    head = {**base, "object": "chat.completion.chunk"}
    readers = [ReplyReader(prepared) for _ in run.handles]

    def chunk(i: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> str:
        return sse({**head, "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]})

    for i in range(len(run.handles)):
        yield chunk(i, {"role": "assistant", "content": ""})
    async for i, out in run.stream():
        choice = run.choices[i]
        if out.finish_reason == "error":
            yield stream_error(choice)
            continue
        logprobs = None
        if req.logprobs and out.token_ids:
            logprobs = chat_logprobs(tokenizer, choice, out.token_ids, out.logprobs or [], out.top_logprobs or [])
        deltas = reply_deltas(readers[i], out.text, out.finish_reason is not None)
        for delta in deltas[:-1]:
            yield chunk(i, delta)
        finish = None
        if out.finish_reason is not None:
            finish = "tool_calls" if readers[i].calls else finish_reason(choice)
        if deltas or logprobs is not None or finish:
            yield chunk(i, deltas[-1] if deltas else {}, finish, logprobs)
    if req.include_usage:
        yield sse({**head, "choices": [], "usage": run.usage()})
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------------------------------------
# POST /v1/completions


def completion_logprobs(tokenizer: Any, choice: Choice, ids: list[int], logprobs: list[float],
                        top: list[dict[int, float]], alternatives: int, offset: int,
                        prompt_ids: list[int] | None = None) -> dict[str, Any]:
    """OpenAI's legacy logprobs: tokens, token_logprobs, top_logprobs and text_offset; with `prompt_ids` (echo) the
    prompt's tokens come first, each with its logprob and `alternatives` most likely tokens (the first token has
    neither), as lm-evaluation-harness reads them."""
    tokens, values, tops = [], [], []
    if prompt_ids is not None:
        tokens += Choice().token_strings(tokenizer, prompt_ids)
        values += choice.prompt_logprobs or [None] * len(prompt_ids)
        prompt_tops = choice.prompt_top_logprobs or [None] * len(prompt_ids)
        tops += [alternatives_by_text(tokenizer, t) if t is not None and alternatives else None for t in prompt_tops]
    tokens += choice.token_strings(tokenizer, ids)
    values += logprobs
    tops += [alternatives_by_text(tokenizer, t) if alternatives else None for t in (top or [{}] * len(ids))]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def completion_prompts(llm: Any, req: CompletionRequest) -> list[tuple[str, list[int]]]:
    """(text, ids) of each prompt: text tokenized, token ids checked, and decoded for echo. Runs in a worker thread:
    a body of millions of tokens must not stall the event loop (every stream and /health)."""
    out = []
    for p in req.prompts():
        try:
            ids = llm.encode_prompt(p)
        except ValueError as exc:
            raise invalid(str(exc), "prompt") from None
        text = p if isinstance(p, str) else (llm.tokenizer.decode(ids) if req.echo and llm.tokenizer else "")
        out.append((text, ids))
    return out


async def completions(state: ServerState, request: Request) -> Response:
    llm, engine = state.ready()
    req = await parse_body(CompletionRequest, request, state.settings.max_body_bytes)
    state.check_model(req.model)
    want = req.logprobs is not None
    if req.echo and want and req.stream:
        raise invalid("echo with logprobs does not stream; drop stream or logprobs", "stream")
    score_only = req.max_tokens == 0  # echo the prompt's logprobs; one token is generated and dropped
    check_queue_room(engine, len(req.prompts()) * req.n)
    spec = req.response_format.spec() if req.response_format is not None else None
    if spec is not None and (req.echo or score_only):
        raise invalid("response_format does not go with echo; drop one", "response_format")
    grammar = await state.agent().completion_grammar(spec) if spec is not None else None
    prompts, work = [], []
    for text, ids in await asyncio.to_thread(completion_prompts, llm, req):
        prompts += [(text, ids)] * req.n
        options = req.options(context_room(llm, ids, 1 if score_only else req.max_tokens, "prompt"),
                              llm.vocab_size, logprobs=want, top_logprobs=req.logprobs or 0,
                              prompt_logprobs=req.echo and want, grammar=grammar)
        work += [(ids, o) for o in req.seeded(options)]
    run = Run(state, request, submit(engine, work), req.n)
    base = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": state.settings.model_name,
            "system_fingerprint": SYSTEM_FINGERPRINT}
    if req.stream:
        return StreamingResponse(completion_events(run, req, base, llm.tokenizer, prompts),
                                 media_type="text/event-stream", headers={**SSE_HEADERS, **ignored_header(req)})
    choices = await run.gather()
    out = []
    for i, (c, (prompt_text, prompt_ids)) in enumerate(zip(choices, prompts)):
        echo = prompt_text if req.echo else ""
        ids, lps, top = ([], [], []) if score_only else (c.token_ids, c.logprobs, c.top_logprobs)
        logprobs = completion_logprobs(llm.tokenizer, c, ids, lps, top, req.logprobs or 0, 0,
                                       prompt_ids if req.echo else None) if want else None
        out.append({"index": i, "text": echo + ("" if score_only else "".join(c.text)), "logprobs": logprobs,
                    "finish_reason": "length" if score_only else finish_reason(c)})
    usage = run.usage()
    if score_only:
        usage.update(completion_tokens=0, total_tokens=usage["prompt_tokens"])
    return JSONResponse({**base, "object": "text_completion", "choices": out, "usage": usage},
                        headers=ignored_header(req))


async def completion_events(run: Run, req: CompletionRequest, base: dict[str, Any], tokenizer: Any,
                            prompts: list[tuple[str, list[int]]]) -> AsyncIterator[str]:
    head = {**base, "object": "text_completion"}
    offsets = [len(text) if req.echo else 0 for text, _ in prompts]

    def chunk(i: int, text: str, finish: str | None = None, logprobs: Any = None) -> str:
        return sse({**head, "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}]})

    if req.echo:
        for i, (text, _) in enumerate(prompts):
            yield chunk(i, text)
    async for i, out in run.stream():
        choice = run.choices[i]
        if out.finish_reason == "error":
            yield stream_error(choice)
            continue
        logprobs = None
        if req.logprobs is not None and out.token_ids:
            logprobs = completion_logprobs(tokenizer, choice, out.token_ids, out.logprobs or [],
                                           out.top_logprobs or [], req.logprobs, offsets[i])
        offsets[i] += len(out.text)
        finish = finish_reason(choice) if out.finish_reason is not None else None
        if out.text or out.token_ids or finish:
            yield chunk(i, out.text, finish, logprobs)
    if req.include_usage:
        yield sse({**head, "choices": [], "usage": run.usage()})
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------------------------------------
# The small endpoints.


async def tokenize(state: ServerState, request: Request) -> Response:
    llm, _ = state.ready()
    req = await parse_body(TokenizeRequest, request, state.settings.max_body_bytes)
    state.check_model(req.model)
    if llm.tokenizer is None:
        raise invalid("this model has no tokenizer; send token ids")

    def encode() -> list[int]:  # in a worker thread: megabytes of text must not stall the event loop
        if req.messages is not None:
            return llm.chat_prompt([m.template_dict() for m in req.messages])
        check_text(req.prompt, "the prompt")
        return llm.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)

    try:
        ids = await asyncio.to_thread(encode)
    except ValueError as exc:
        raise invalid(str(exc), "messages" if req.messages is not None else "prompt") from None
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": llm.block_size})


async def detokenize(state: ServerState, request: Request) -> Response:
    llm, _ = state.ready()
    req = await parse_body(DetokenizeRequest, request, state.settings.max_body_bytes)
    state.check_model(req.model)
    if llm.tokenizer is None:
        raise invalid("this model has no tokenizer")
    vocab = llm.tokenizer.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise invalid(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", "tokens")
    return JSONResponse({"prompt": await asyncio.to_thread(llm.tokenizer.decode, req.tokens)})


async def models(state: ServerState, request: Request) -> Response:
    llm, _ = state.ready()
    return JSONResponse({"object": "list", "data": [
        {"id": state.settings.model_name, "object": "model", "created": state.created, "owned_by": "redline",
         "max_model_len": llm.block_size}]})


# ---------------------------------------------------------------------------------------------------------------------
# The app.


def create_app(engine: Any, prompts: Any, settings: ServeSettings,
               start: Callable[[ServerState], None] | None = None) -> FastAPI:
    """The server around `engine` (an EngineClient, or anything with its add_request, abort, stats, shutdown) and
    `prompts` (a Prompts, or an LLM); with both None, `start(state)` is called once the server listens and fills them
    in when the model is ready (/health answers 503 until then)."""
    state = ServerState(settings, engine, prompts)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if state.engine is None and start is not None:
            start(state)
        yield
        if state.engine is not None:  # running requests had the grace period already: abort what is left
            await asyncio.to_thread(state.engine.shutdown, 1.0)

    app = FastAPI(title="Redline", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.redline = state
    app.add_middleware(CrossSiteGuard, settings=settings)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                       "invalid_request_error", code=code))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> Response:
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", "server_error"))

    def api(endpoint: str, handler: Callable[[ServerState, Request], Any]) -> Callable[[Request], Any]:
        async def call(request: Request) -> Response:
            try:
                authorize(state, request)
                response = await handler(state, request)
            except APIError as exc:
                response = error_response(exc)
            state.metrics.count_request(endpoint, response.status_code)
            return response
        return call

    app.add_api_route("/v1/chat/completions", api("chat", chat_completions), methods=["POST"])
    app.add_api_route("/v1/completions", api("completions", completions), methods=["POST"])
    from redline import serve_messages, serve_responses  # they build on this module's plumbing

    app.add_api_route("/v1/responses", api("responses", serve_responses.responses), methods=["POST"])
    app.add_api_route("/v1/messages", serve_messages.route(state), methods=["POST"])
    app.add_api_route("/v1/models", api("models", models), methods=["GET"])
    app.add_api_route("/tokenize", api("tokenize", tokenize), methods=["POST"])
    app.add_api_route("/detokenize", api("detokenize", detokenize), methods=["POST"])

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__, "system_fingerprint": SYSTEM_FINGERPRINT})

    @app.get("/health")
    async def health() -> Response:
        if state.engine is not None and state.error is None:
            return JSONResponse({"status": "ok"})
        body = {"status": "error", "error": state.error} if state.error else {"status": "loading"}
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        live = state.engine is not None and state.error is None
        stats = await asyncio.to_thread(state.engine.stats) if live else None
        gateway_model = state.settings.model_name if state.settings.gateway_metrics else None
        return PlainTextResponse(state.metrics.render(stats, live, gateway_model),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/")
    async def page() -> Response:
        return HTMLResponse(CHAT_PAGE.read_text(encoding="utf-8"), headers=PAGE_HEADERS)

    @app.get("/favicon.svg")
    @app.get("/favicon.ico")  # browsers ask for it whatever the page links; an SVG answers both
    async def icon() -> Response:
        return Response(PAGE_ICON.read_bytes(), media_type="image/svg+xml",
                        headers={"Cache-Control": "max-age=86400"})

    return app


# ---------------------------------------------------------------------------------------------------------------------
# Loading and serving.


def front_tokenizer(settings: ServeSettings) -> Any:
    """The checkpoint's tokenizer, loaded in the server's own process (the engine core needs none unless a request
    has a grammar); for random weights, --tokenizer's, else None."""
    from redline.checkpoint import read_checkpoint_info
    from redline.tokenizer import load_tokenizer

    if settings.checkpoint_path is None:
        if settings.tokenizer is None:
            return None
        tokenizer = load_tokenizer(settings.tokenizer)
        vocab = ModelArgs.from_name(settings.random_weights).vocab_size
        if tokenizer.vocab_size > vocab:
            raise ValueError(f"--tokenizer has {tokenizer.vocab_size} tokens, more than {settings.random_weights}'s "
                             f"{vocab}; pick a smaller tokenizer")
        return tokenizer
    return load_tokenizer(read_checkpoint_info(settings.checkpoint_path).path)


def core_starter(settings: ServeSettings, tokenizer: Any, stop_server: Callable[[int], None]) -> Callable[[ServerState],
                                                                                                            None]:
    """start(state) for create_app: spawns the engine core's process; when it is ready the state gets the engine
    client and the prompts. If the core fails to start, the server stops with status 2; if it dies later, /health
    answers 503 at once, running requests end with an error, and the server stops with status 1."""

    vision = settings.vision_args()  # read before the core starts: a broken vision file stops the server at once

    def start(state: ServerState) -> None:
        started = time.perf_counter()

        def ready(message: Ready) -> None:
            limits = Limits(message.block_size, message.vocab_size, message.capacity_tokens)
            prompts = Prompts(tokenizer, message.block_size, message.vocab_size)
            state.prompts = prompts
            state.engine = EngineClient(core, limits, tokenizer, prompts.encode_prompt, settings.engine.max_queue,
                                        vision)
            phases = ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in message.startup.items())
            print(f"[redline] ready in {time.perf_counter() - started:.1f} s ({phases}) on {message.device}",
                  file=sys.stderr, flush=True)

        def outputs(outs: list[Any]) -> None:
            if state.engine is not None:
                state.engine.receive(outs)

        def exited(error: str | None) -> None:
            if core.stopping:
                return
            if state.engine is None:
                state.error = error or "the engine core stopped before it was ready"
                print(f"error: {state.error}", file=sys.stderr, flush=True)
                stop_server(2)
                return
            state.error = f"the engine core died ({error})"
            print(f"error: {state.error}; stopping", file=sys.stderr, flush=True)
            state.engine.fail_all(state.error)
            stop_server(1)

        core = CoreProcess(settings.model_source(tokenizer.vocab_size if tokenizer is not None else None),
                           settings.engine, ready, outputs, exited, compile_cache=settings.compile_cache)
        core.start()
        state.core = core
    return start


def serve(settings: ServeSettings) -> int:
    """Listen at once, start the engine core's process, serve until SIGINT/SIGTERM; 0 on a clean stop, 2 when the
    model failed to load, 1 when the engine core died."""
    import uvicorn

    if settings.host not in ("127.0.0.1", "localhost", "::1") and settings.api_key is None:
        print(f"warning: serving on {settings.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    tokenizer = front_tokenizer(settings)
    status = [0]
    servers: list[uvicorn.Server] = []

    def stop_server(code: int) -> None:
        status[0] = code
        if code == 2:  # the model never loaded: stop as usual
            servers[0].should_exit = True
            return

        def end() -> None:  # the streams had their error events; the core's folder goes, the process ends
            core = app.state.redline.core
            if core is not None:
                core.close()
            print(f"[redline] exiting with status {code}", file=sys.stderr, flush=True)
            os._exit(code)
        threading.Timer(CORE_DEAD_LINGER_S, end).start()

    app = create_app(None, None, settings, core_starter(settings, tokenizer, stop_server))
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info", access_log=False,
                            timeout_graceful_shutdown=max(1, round(settings.shutdown_grace_s)))
    servers.append(uvicorn.Server(config))
    # uvicorn stops on SIGINT/SIGTERM and then re-raises the signal to the handler it found; a no-op handler there
    # makes a graceful stop exit 0 instead of dying by the signal.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        servers[0].run()
    finally:
        core = getattr(app.state.redline, "core", None)
        if core is not None:
            core.stopping = True
            core.kill()  # a clean stop shut it down already; this ends one that hangs
            core.close()
    return status[0]


def media_domains(value: str) -> tuple[str, ...]:
    return tuple(d for d in value.split(",") if d.strip())


def cache_folder(value: str) -> Path | None:
    return None if value.lower() == "none" else Path(value).expanduser()


def parse_args(argv: Sequence[str] | None) -> ServeSettings:
    p = OneLineArgumentParser(description="Serve a Redline checkpoint over the OpenAI API, with a chat page at /.")
    p.add_argument("--checkpoint_path", "--checkpoint-path", type=Path, default=None,
                   help="a Redline checkpoint (file or folder); `make demo-model` writes the demo's")
    p.add_argument("--random-weights", default=None, metavar="MODEL",
                   help="serve a registry model (e.g. Llama-3-8B) with random weights and no tokenizer, to benchmark")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="with --random-weights: serve them with this tokenizer (a folder or file), for grammars")
    p.add_argument("--host", default="127.0.0.1", help="bind address; 127.0.0.1 is this machine only")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY`; None means $REDLINE_API_KEY when set, else no key")
    p.add_argument("--served-model-name", default=None, help="the model's name in the API; None means its folder")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N; None means cuda when available")
    p.add_argument("--dtype", default=None, help="bfloat16 | float16 | float32; None means the checkpoint's")
    p.add_argument("--quantize", default=None, help="quantize on load: int8, int4 or int4-gG; None keeps the weights")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA-graph decode steps; None means on for a GPU")
    p.add_argument("--threads", type=int, default=None, help="CPU threads; None means the physical cores")
    engine = p.add_argument_group("engine", "how the engine core batches (defaults: EngineSettings')")
    engine.add_argument("--max-kv-tokens", type=int, default=SERVE_ENGINE.max_kv_tokens,
                        help="KV cache size in tokens; None means from free GPU memory, or a few contexts on the "
                             "CPU")
    engine.add_argument("--kv-cache-dtype", default=SERVE_ENGINE.kv_cache_dtype, help=KV_CACHE_DTYPE_HELP)
    engine.add_argument("--max-running", type=int, default=SERVE_ENGINE.max_running,
                        help="requests decoded together at most; decode graphs are made up to this many rows "
                             "(512: about 40 more graphs than 256)")
    engine.add_argument("--prefill-chunk", type=int, default=SERVE_ENGINE.prefill_chunk,
                        help="prompt tokens one step computes at most")
    engine.add_argument("--compile-prefill", action=argparse.BooleanOptionalAction,
                        default=SERVE_ENGINE.compile_prefill, help=COMPILE_PREFILL_HELP)
    engine.add_argument("--prefill-graphs", action="store_true", default=SERVE_ENGINE.prefill_graphs,
                        help=PREFILL_GRAPHS_HELP)
    engine.add_argument("--max-queue", type=int, default=SERVE_ENGINE.max_queue,
                        help="requests waiting at most; more are refused (429)")
    engine.add_argument("--capture-tokens", type=int, default=SERVE_ENGINE.capture_tokens,
                        help="before serving, capture one decode graph per batch bucket for sequences up to this many "
                             "tokens; a longer sequence's first step captures a wider one")
    engine.add_argument("--min-step-s", type=float, default=SERVE_ENGINE.min_step_s,
                        help="each engine step takes at least this long (paces a demo on a fast machine)")
    p.add_argument("--compile-cache", type=cache_folder, default=DEFAULT_COMPILE_CACHE, metavar="DIR",
                   help="torch.compile's and Triton's on-disk caches, reused by the next start ('none': torch's "
                        "own defaults)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger bodies get 413")
    p.add_argument("--shutdown-grace", type=float, default=30.0, dest="shutdown_grace_s",
                   help="seconds running requests get to finish after SIGTERM")
    p.add_argument("--allowed-host", action="append", default=None, dest="allowed_hosts", metavar="NAME",
                   help="a host name requests may use besides 127.0.0.1/localhost (Host header) and a web site "
                        "whose pages may call the API (Origin); repeatable; * allows any")
    p.add_argument("--tool-parser", default=None, choices=PARSERS,
                   help="the tool-call format replies are parsed in (default: the one the chat template writes)")
    p.add_argument("--reasoning-parser", default="auto", choices=REASONING_PARSERS,
                   help="split <think> reasoning from the answer: auto (when the chat template thinks), think, none")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model over N GPUs of this host: the engine core runs as rank 0 of N ranks, "
                        "schedules, and every rank runs each step on its share of the heads")
    p.add_argument("--allowed-media-domains", type=media_domains, default=(), metavar="HOST,...",
                   help="hosts (and their subdomains) whose http(s) image URLs requests may name; the server fetches "
                        "them, from public addresses only; default: none, images come inline as data: URLs")
    p.add_argument("--gateway-metrics", action="store_true",
                   help="/metrics also under vLLM's names (vllm:num_requests_waiting, vllm:num_requests_running, "
                        "vllm:kv_cache_usage_perc), which Kubernetes inference gateways route on")
    ns = p.parse_args(argv)
    if ns.api_key is None:
        ns.api_key = os.environ.get("REDLINE_API_KEY")
    if ns.checkpoint_path is not None and not ns.checkpoint_path.exists():
        raise FileNotFoundError(f"{ns.checkpoint_path} does not exist; pass a Redline checkpoint (make demo-model "
                                "writes checkpoints/smollm2/float32/model.safetensors)")
    fields = vars(ns)
    engine_fields = {name: fields.pop(name) for name in ("max_kv_tokens", "kv_cache_dtype", "max_running",
                                                         "prefill_chunk", "compile_prefill", "prefill_graphs",
                                                         "max_queue", "min_step_s", "capture_tokens")}
    try:
        engine = EngineSettings(**engine_fields)
    except ValueError as exc:  # EngineSettings names its fields; the command line names its flags
        name = next((n for n in engine_fields if str(exc).startswith(n)), None)
        raise ValueError(str(exc).replace(name, "--" + name.replace("_", "-"), 1) if name else str(exc)) from None
    return ServeSettings(**fields, engine=engine)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return serve(parse_args(argv))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # Run the package's copy of this module, so the classes it defines are the ones every other module imports.
    from redline.serve import main as package_main

    sys.exit(package_main())
