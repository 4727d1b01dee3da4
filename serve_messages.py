"""POST /v1/messages: Anthropic's Messages API (text, tool_use and tool_result blocks, tools, streaming), translated
onto one chat reply (replies.py) and back; errors in Anthropic's JSON shape, the key in `x-api-key` (or a Bearer
header)."""
from __future__ import annotations

import hmac
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from redline.replies import ReplyEvent, ReplyReader, ReplySpec
from redline.serve import SSE_HEADERS, Run, ServerState, read_body, submit
from redline.serve_protocol import (MAX_STOP_STRINGS, APIError, Strict, context_room, invalid, parse_request)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}


class Block(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control, citations: accepted, without effect here


class TextBlock(Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: Any


class ToolResultBlock(Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[TextBlock], None] = None
    is_error: bool = False

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ThinkingBlock(Block):
    type: Literal["thinking", "redacted_thinking"]


ContentBlock = Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock]


class Message(Strict):
    role: Literal["user", "assistant"]
    content: Union[str, list[ContentBlock]]


class Tool(Strict):
    model_config = ConfigDict(extra="ignore", strict=True)  # cache_control, type: "custom"
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _check(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise invalid("tool_choice of type tool needs (only then) a name", "tool_choice")
        return self


class Thinking(Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)


class MessagesRequest(Strict):
    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None
    thinking: Thinking | None = None  # switches a reasoning model's thinking on or off (its template's
    # enable_thinking); budget_tokens is not enforced

    @model_validator(mode="after")
    def _check(self) -> MessagesRequest:
        if self.tool_choice is not None and self.tool_choice.type in ("any", "tool") and not self.tools:
            raise invalid("tool_choice needs tools", "tool_choice")
        if self.stop_sequences and not all(self.stop_sequences):
            raise invalid("stop_sequences must be non-empty strings", "stop_sequences")
        return self

    def spec(self) -> ReplySpec:
        messages: list[dict[str, Any]] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            messages.append({"role": "system", "content": system})
        names: dict[str, str] = {}
        for i, m in enumerate(self.messages):
            if isinstance(m.content, str):
                messages.append({"role": m.role, "content": m.content})
                continue
            text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
            calls = [b for b in m.content if isinstance(b, ToolUseBlock)]
            results = [b for b in m.content if isinstance(b, ToolResultBlock)]
            for b in calls:
                if not isinstance(b.input, dict):
                    raise invalid(f"messages[{i}]: a tool_use block's input must be a JSON object", "messages")
                names[b.id] = b.name
            for b in results:  # a user turn's tool results come first, as tool messages
                message = {"role": "tool", "content": b.text(), "tool_call_id": b.tool_use_id}
                if b.tool_use_id in names:
                    message["name"] = names[b.tool_use_id]
                messages.append(message)
            if calls:
                messages.append({"role": "assistant", "content": text, "tool_calls": [
                    {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                    for b in calls]})
            elif text or not results:
                messages.append({"role": m.role, "content": text})
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                   "parameters": t.input_schema}} for t in self.tools or []] or None
        choice: Any = "auto"
        parallel = True
        if self.tool_choice is not None:
            parallel = not self.tool_choice.disable_parallel_tool_use
            choice = {"auto": "auto", "any": "required", "none": "none"}.get(self.tool_choice.type) or \
                {"name": self.tool_choice.name}
        kwargs = {} if self.thinking is None else {"enable_thinking": self.thinking.type != "disabled"}
        return ReplySpec(messages, tools, choice, parallel, None, kwargs, "tools", "tools")


def anthropic_error(exc: APIError) -> JSONResponse:
    kind = ERROR_TYPES.get(exc.status, "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": exc.message}}, status_code=exc.status,
                        headers=exc.headers)


def authorize(state: ServerState, request: Request) -> None:
    key = state.settings.api_key
    if key is None:
        return
    given = request.headers.get("x-api-key")
    if given is None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else ""
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise APIError(401, "missing or wrong API key; send the header `x-api-key: <key>`", "authentication_error")


def route(state: ServerState) -> Callable[[Request], Any]:
    """The endpoint with Anthropic's authentication and error shape."""
    async def call(request: Request) -> Response:
        try:
            authorize(state, request)
            response = await messages(state, request)
        except APIError as exc:
            response = anthropic_error(exc)
        state.metrics.count_request("messages", response.status_code)
        return response
    return call


async def messages(state: ServerState, request: Request) -> Response:
    llm, engine = state.ready()
    req = parse_request(MessagesRequest, await read_body(request, state.settings.max_body_bytes))
    state.check_model(req.model)
    prepared = await state.agent().prepare(req.spec())
    from redline.options import GenerationOptions
    from redline.replies import parsed

    try:
        options = GenerationOptions(
            max_new_tokens=context_room(llm, prepared.ids, req.max_tokens, "messages"),
            temperature=1.0 if req.temperature is None else req.temperature, top_k=req.top_k,
            top_p=req.top_p if req.top_p is not None and req.top_p < 1 else None,
            stop=tuple(req.stop_sequences or ()), grammar=prepared.grammar, skip_special_tokens=not parsed(prepared))
    except ValueError as exc:
        raise invalid(str(exc)) from None
    run = Run(state, request, submit(engine, [(prepared.ids, options)]))
    message_id, model = f"msg_{uuid.uuid4().hex[:24]}", state.settings.model_name
    if req.stream:
        return StreamingResponse(message_events(run, req, ReplyReader(prepared), message_id, model),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    choice = (await run.gather())[0]
    reader = ReplyReader(prepared)
    reader.feed("".join(choice.text))
    reader.finish()
    content: list[dict[str, Any]] = []
    if reader.reasoning_content:
        content.append({"type": "thinking", "thinking": reader.reasoning_content, "signature": ""})
    if reader.content:
        content.append({"type": "text", "text": reader.content})
    content += [tool_use(c) for c in reader.calls]
    return JSONResponse({"id": message_id, "type": "message", "role": "assistant", "model": model,
                         "content": content, "stop_reason": stop_reason(run, req, reader), "stop_sequence": None,
                         "usage": usage(run)})


def tool_use(call: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": f"toolu_{call.id.removeprefix('call_')}", "name": call.name,
            "input": json.loads(call.arguments)}


def stop_reason(run: Run, req: MessagesRequest, reader: ReplyReader) -> str:
    if reader.calls:
        return "tool_use"
    raw = run.choices[0].finish_reason
    if raw == "length":
        return "max_tokens"
    return "stop_sequence" if raw == "stop" and req.stop_sequences else "end_turn"


def usage(run: Run) -> dict[str, Any]:
    u = run.usage()
    cached = u["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": u["prompt_tokens"] - cached, "output_tokens": u["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


async def message_events(run: Run, req: MessagesRequest, reader: ReplyReader, message_id: str,
                         model: str) -> AsyncIterator[str]:
    def frame(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"

    start_usage = {"input_tokens": len(run.handles[0].prompt_token_ids), "output_tokens": 0}
    yield frame("message_start", message={"id": message_id, "type": "message", "role": "assistant", "model": model,
                                          "content": [], "stop_reason": None, "stop_sequence": None,
                                          "usage": start_usage})
    blocks = Blocks()
    async for _, out in run.stream():
        if out.finish_reason == "error":
            yield frame("error", error={"type": "api_error", "message": f"generation failed: {run.choices[0].error}"})
            return
        events = reader.feed(out.text) if out.text else []
        if out.finish_reason is not None:
            events += reader.finish()
        for event in events:
            for kind, fields in blocks.add(event):
                yield frame(kind, **fields)
    for kind, fields in blocks.close():
        yield frame(kind, **fields)
    yield frame("message_delta", delta={"stop_reason": stop_reason(run, req, reader), "stop_sequence": None},
                usage={"output_tokens": len(run.choices[0].token_ids)})
    yield frame("message_stop")


class Blocks:
    """Content blocks from reply events, as the stream's block events."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking" | "text" while a block takes deltas

    def close(self) -> list[tuple[str, dict[str, Any]]]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"index": self.index})]

    def add(self, event: ReplyEvent) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        if event.kind == "tool_call":
            out += self.close()
            self.index += 1
            block = tool_use(event.call)
            out.append(("content_block_start", {"index": self.index, "content_block": {**block, "input": {}}}))
            out.append(("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": event.call.arguments}}))
            out.append(("content_block_stop", {"index": self.index}))
            return out
        kind = "thinking" if event.kind == "reasoning" else "text"
        if self.open != kind:
            out += self.close()
            self.index += 1
            self.open = kind
            start = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            out.append(("content_block_start", {"index": self.index, "content_block": start}))
        delta = {"type": "thinking_delta", "thinking": event.text} if kind == "thinking" else \
            {"type": "text_delta", "text": event.text}
        out.append(("content_block_delta", {"index": self.index, "delta": delta}))
        return out
