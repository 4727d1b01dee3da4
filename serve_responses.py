"""POST /v1/responses: OpenAI's Responses API, stateless (nothing is stored: previous_response_id and store=true are
refused), translated onto one chat reply (replies.py) and back into the Responses output items and stream events."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from redline.replies import ReplyEvent, ReplyReader, ReplySpec, history_arguments
from redline.serve import (SSE_HEADERS, Run, ServerState, finish_reason, read_body, request_images, sse,
                           submit_images)
from redline.serve_protocol import Strict, context_room, invalid, parse_request


class Lenient(BaseModel):
    # Items sent back from an earlier response carry fields (id, status, annotations) that change nothing here.
    model_config = ConfigDict(extra="ignore")


class ContentPart(Lenient):
    type: Literal["input_text", "output_text", "text"]
    text: str


class ImageInputPart(Lenient):
    type: Literal["input_image"]
    image_url: str | None = None  # a data: URL, or an http(s) URL on the server's --allowed-media-domains
    file_id: str | None = None  # refused: this server stores no files

    @model_validator(mode="after")
    def _check_image(self) -> ImageInputPart:
        if self.image_url is None:
            raise invalid("an input_image part needs image_url (a data: URL); this server stores no files",
                          "input")
        return self


class MessageItem(Lenient):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[Union[ContentPart, ImageInputPart]]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, ContentPart))

    def image_urls(self) -> list[str]:
        return [] if isinstance(self.content, str) else [
            p.image_url for p in self.content if isinstance(p, ImageInputPart)]

    def template_content(self) -> str | list[dict[str, str]]:
        """Text, or with images the parts in order, each image as {"type": "image"} (the template's placeholder)."""
        if not self.image_urls():
            return self.text()
        return [{"type": "image"} if isinstance(p, ImageInputPart) else {"type": "text", "text": p.text}
                for p in self.content]


class FunctionCallItem(Lenient):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionOutputItem(Lenient):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[ContentPart]]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(Lenient):
    type: Literal["reasoning"]


InputItem = Union[FunctionCallItem, FunctionOutputItem, ReasoningItem, MessageItem]


class FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(Strict):
    format: TextFormat | None = None


class ResponsesRequest(Strict):
    model: str | None = None
    input: Union[str, list[InputItem]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedChoice, None] = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        if self.previous_response_id is not None:
            raise invalid("previous_response_id needs stored responses, which this server does not keep; send the "
                          "whole conversation as input", "previous_response_id")
        if self.store:
            raise invalid("this server stores no responses; drop store or set it to false", "store")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise invalid("tool_choice needs tools", "tool_choice")
        return self

    def image_urls(self) -> list[str]:
        """The URLs of the input messages' images, in order."""
        if isinstance(self.input, str):
            return []
        return [url for item in self.input if isinstance(item, MessageItem) for url in item.image_urls()]

    def spec(self) -> ReplySpec:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        names: dict[str, str] = {}
        for i, item in enumerate(items):
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.template_content()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function", "function": {
                    "name": item.name, "arguments": history_arguments(item.arguments, f"input[{i}].arguments")}}
                names[item.call_id] = item.name
                if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                    messages[-1]["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif isinstance(item, FunctionOutputItem):
                message = {"role": "tool", "content": item.text(), "tool_call_id": item.call_id}
                if item.call_id in names:
                    message["name"] = names[item.call_id]
                messages.append(message)
        if not messages:
            raise invalid("input is empty", "input")
        tools = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type", "strict"})}
                 for t in self.tools or []] or None
        choice: Any = self.tool_choice or "auto"
        if isinstance(choice, NamedChoice):
            choice = {"name": choice.name}
        fmt = self.text.format if self.text is not None else None
        response = None
        if fmt is not None and fmt.type == "json_object":
            response = ("json_object", None)
        elif fmt is not None and fmt.type == "json_schema":
            response = ("json_schema", fmt.schema_ if fmt.schema_ is not None else {})
        return ReplySpec(messages, tools, choice, self.parallel_tool_calls, response, {}, "tools", "text.format")


async def responses(state: ServerState, request: Request) -> Response:
    llm, engine = state.ready()
    req = parse_request(ResponsesRequest, await read_body(request, state.settings.max_body_bytes))
    state.check_model(req.model)
    images = await request_images(state, req.image_urls(), "input")
    prepared = await state.agent().prepare(req.spec())
    sampling = {"temperature": 1.0 if req.temperature is None else req.temperature,
                "top_p": req.top_p if req.top_p is not None and req.top_p < 1 else None}
    from redline.options import GenerationOptions
    from redline.replies import parsed

    try:
        options = GenerationOptions(max_new_tokens=context_room(llm, prepared.ids, req.max_output_tokens, "input"),
                                    grammar=prepared.grammar, skip_special_tokens=not parsed(prepared), **sampling)
    except ValueError as exc:
        raise invalid(str(exc)) from None
    run = Run(state, request, await submit_images(engine, [(prepared.ids, options)], images))
    shell = Shell(req, state.settings.model_name)
    if req.stream:
        return StreamingResponse(response_events(run, shell, ReplyReader(prepared)), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    choice = (await run.gather())[0]
    reader = ReplyReader(prepared)
    reader.feed("".join(choice.text))
    reader.finish()
    items = Items()
    for event in reader_events(reader):
        items.add(event)
    return JSONResponse(shell.body("completed" if finish_reason(choice) != "length" else "incomplete",
                                   items.done_items(), usage(run)))


def reader_events(reader: ReplyReader) -> list[ReplyEvent]:
    """A finished reader's reply as whole events: reasoning, content, then each call."""
    events = []
    if reader.reasoning_content:
        events.append(ReplyEvent("reasoning", reader.reasoning_content))
    if reader.content:
        events.append(ReplyEvent("content", reader.content))
    return events + [ReplyEvent("tool_call", call=c) for c in reader.calls]


class Shell:
    """The response object around the output items."""

    def __init__(self, req: ResponsesRequest, model: str) -> None:
        self.req, self.model = req, model
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else \
            {"type": "text"}
        choice = req.tool_choice or "auto"
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature,
                "top_p": req.top_p, "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
                "tools": [t.model_dump(exclude_none=True) for t in req.tools or []], "text": {"format": fmt},
                "metadata": req.metadata or {}, "store": False, "usage": usage}


def usage(run: Run) -> dict[str, Any]:
    u = run.usage()
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens_details": {"reasoning_tokens": 0}}


class Items:
    """Output items built from reply events; `add` returns the stream events each step makes."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: int | None = None  # the index of the reasoning or message item text is going into
        self.seq = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def add(self, reply: ReplyEvent) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if reply.kind == "tool_call":
            out += self.close()
            call = reply.call
            item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": call.id,
                    "name": call.name, "arguments": "", "status": "in_progress"}
            index = len(self.items)
            self.items.append(item)
            out.append(self.event("response.output_item.added", output_index=index, item=dict(item)))
            out.append(self.event("response.function_call_arguments.delta", output_index=index, item_id=item["id"],
                                  delta=call.arguments))
            item.update(arguments=call.arguments, status="completed")
            out.append(self.event("response.function_call_arguments.done", output_index=index, item_id=item["id"],
                                  arguments=call.arguments))
            out.append(self.event("response.output_item.done", output_index=index, item=dict(item)))
            return out
        kind = "reasoning" if reply.kind == "reasoning" else "message"
        if self.open is not None and self.items[self.open]["type"] != kind:
            out += self.close()
        if self.open is None:
            index = len(self.items)
            if kind == "reasoning":
                item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex[:24]}", "summary": [],
                        "content": [], "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "role": "assistant",
                        "content": [], "status": "in_progress"}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.items.append(item)
            self.open = index
            out.append(self.event("response.output_item.added", output_index=index,
                                  item={**item, "content": []}))
            item["content"].append(part)
            out.append(self.event("response.content_part.added", output_index=index, item_id=item["id"],
                                  content_index=0, part=dict(part)))
        item = self.items[self.open]
        item["content"][0]["text"] += reply.text
        delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        out.append(self.event(delta, output_index=self.open, item_id=item["id"], content_index=0, delta=reply.text,
                              **({} if kind == "reasoning" else {"logprobs": []})))
        return out

    def close(self) -> list[dict[str, Any]]:
        """Finish the open reasoning or message item."""
        if self.open is None:
            return []
        index, item = self.open, self.items[self.open]
        self.open = None
        part = item["content"][0]
        item["status"] = "completed"
        done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
        return [self.event(done, output_index=index, item_id=item["id"], content_index=0, text=part["text"],
                           **({} if item["type"] == "reasoning" else {"logprobs": []})),
                self.event("response.content_part.done", output_index=index, item_id=item["id"], content_index=0,
                           part=dict(part)),
                self.event("response.output_item.done", output_index=index, item=item)]

    def done_items(self) -> list[dict[str, Any]]:
        self.close()
        return self.items


async def response_events(run: Run, shell: Shell, reader: ReplyReader) -> AsyncIterator[str]:
    items = Items()

    def frame(event: dict[str, Any]) -> str:
        return f"event: {event['type']}\n{sse(event)}"

    start = shell.body("in_progress", [], None)
    yield frame(items.event("response.created", response=start))
    yield frame(items.event("response.in_progress", response=start))
    async for _, out in run.stream():
        if out.finish_reason == "error":
            failed = shell.body("failed", items.items, None)
            failed["error"] = {"code": "server_error", "message": f"generation failed: {run.choices[0].error}"}
            yield frame(items.event("response.failed", response=failed))
            return
        events = reader.feed(out.text) if out.text else []
        if out.finish_reason is not None:
            events += reader.finish()
        for reply in events:
            for event in items.add(reply):
                yield frame(event)
    for event in items.close():
        yield frame(event)
    status = "incomplete" if finish_reason(run.choices[0]) == "length" else "completed"
    kind = "response.completed" if status == "completed" else "response.incomplete"
    yield frame(items.event(kind, response=shell.body(status, items.items, usage(run))))
