"""One chat reply as every endpoint asks for it (chat completions, Responses, Anthropic Messages): the conversation
and tools rendered by the checkpoint's chat template, the grammar that constrains the reply (a JSON schema, a
required tool call; after the reasoning when the model thinks), and the reply read back as reasoning, content and
tool calls while it streams. The endpoints translate their own bodies into a ReplySpec and ReplyEvents back."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from redline.grammar import (Grammar, GrammarCompiler, GrammarError, json_schema_lark, one_line, reply_grammar,
                             schema_text)
from redline.reasoning import ReasoningSplitter, prompt_opens_thinking, prompt_skips_thinking, template_thinks
from redline.serve_protocol import invalid
from redline.toolcalls import PARSERS, ToolCall, ToolParser, calls_grammar_body, parser_for_template

# chat_template_kwargs a request may set (chat templates document them): thinking on or off.
TEMPLATE_KWARGS = {"enable_thinking": bool, "thinking": bool}
MAX_TOOLS = 128  # as OpenAI allows
REASONING_PARSERS = ("auto", "think", "none")


@dataclass(frozen=True)
class AgentSettings:
    """How the server reads replies: the tool-call format (None: from the chat template) and reasoning
    ("auto": from the chat template, "think": <think> blocks, "none": never split)."""
    tool_parser: str | None = None
    reasoning_parser: str = "auto"

    def __post_init__(self) -> None:
        if self.tool_parser is not None and self.tool_parser not in PARSERS:
            raise ValueError(f"--tool-parser must be one of {', '.join(PARSERS)}, got {self.tool_parser!r}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")


@dataclass(frozen=True)
class ReplySpec:
    """What an endpoint asks of one reply, in OpenAI chat terms."""
    messages: list[dict[str, Any]]  # for the chat template; assistant tool_calls carry parsed arguments
    tools: list[dict[str, Any]] | None = None  # OpenAI function tools: {"type": "function", "function": {...}}
    tool_choice: Any = "auto"  # "auto" | "none" | "required" | a function's name (str in a dict: {"name": ...})
    parallel_tool_calls: bool = True
    response_format: tuple[str, Any] | None = None  # ("json_object", None) | ("json_schema", schema)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools_param: str = "tools"  # the request's names for errors
    format_param: str = "response_format"


@dataclass
class PreparedReply:
    ids: list[int]
    grammar: Grammar | None
    tool_parser: str | None  # parse tool calls in this format (None: no tools in play)
    reasoning_open: bool | None  # None: no reasoning split; else whether the reply starts inside <think>


def parsed(prepared: PreparedReply) -> bool:
    """Whether a tool or reasoning parser reads the reply's text: its markers may be special tokens, which then stay
    in the text (skip_special_tokens=False, as vLLM's parsers set it)."""
    return prepared.tool_parser is not None or prepared.reasoning_open is not None


class Agent:
    """The server's side of replies for one model: its tool format, reasoning and grammar compiler."""

    def __init__(self, prompts: Any, settings: AgentSettings) -> None:
        """prompts: the model's prompts.Prompts (or an LLM): its tokenizer, context and vocabulary."""
        self.llm, self.settings = prompts, settings
        tokenizer = prompts.tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self.tool_parser = settings.tool_parser or parser_for_template(template)
        self.reasoning = settings.reasoning_parser == "think" or (settings.reasoning_parser == "auto"
                                                                  and template_thinks(template))
        vocab = getattr(prompts, "vocab_size", None) or prompts.prompts.vocab_size
        self.compiler = GrammarCompiler(tokenizer, vocab) if tokenizer is not None else None

    async def prepare(self, spec: ReplySpec) -> PreparedReply:
        tokenizer = self.llm.tokenizer
        if tokenizer is None:
            raise invalid("this model has no tokenizer, so it cannot chat", "messages")
        check_template_kwargs(spec.template_kwargs)
        tools = spec.tools or None
        if tools is not None and len(tools) > MAX_TOOLS:
            raise invalid(f"{len(tools)} tools is more than the {MAX_TOOLS} allowed; send fewer", spec.tools_param)
        try:
            if tokenizer.chat_template is None:  # the family's own layout (no tools, no template variables)
                if tools or spec.template_kwargs:
                    raise ValueError("this checkpoint has no chat template, so tools and chat_template_kwargs "
                                     "cannot be rendered; add chat_template.jinja beside the checkpoint")
                text = ""
                ids = await asyncio.to_thread(self.llm.chat_prompt, spec.messages)
            else:
                text = await asyncio.to_thread(tokenizer.render_chat_template, spec.messages, True, tools,
                                               spec.template_kwargs or None)
                ids = self.llm.encode_prompt(tokenizer.encode_rendered(text))
        except ValueError as exc:
            raise invalid(str(exc), "messages") from None
        thinks = self.reasoning and not prompt_skips_thinking(text)
        reasoning_open = prompt_opens_thinking(text) if thinks else None
        parse_tools = tools is not None and spec.tool_choice != "none"
        if parse_tools and self.tool_parser is None:
            raise invalid("this checkpoint's chat template names no tool-call format this server parses; start "
                          f"the server with --tool-parser ({', '.join(PARSERS)})", spec.tools_param)
        body = self.grammar_body(spec, tools if parse_tools else None)
        grammar = None
        if body is not None:
            mode = None if reasoning_open is None else ("open" if reasoning_open else "tags")
            grammar = await self.compile(reply_grammar(body, mode), spec)
        return PreparedReply(ids, grammar, self.tool_parser if parse_tools else None, reasoning_open)

    def grammar_body(self, spec: ReplySpec, tools: list[dict[str, Any]] | None) -> str | None:
        """The lark body the reply must match, or None when it is free."""
        try:
            response = None
            if spec.response_format is not None:
                kind, schema = spec.response_format
                response = json_schema_lark({"type": "object"} if kind == "json_object" else schema,
                                            f"{spec.format_param}'s schema")
            if tools is None:
                return response
            choice = spec.tool_choice
            chosen = tools
            if isinstance(choice, dict):
                chosen = [t for t in tools if t["function"]["name"] == choice["name"]]
                if not chosen:
                    raise invalid(f"tool_choice names the function {choice['name']!r}, which is not among the tools",
                                  "tool_choice")
            for t in chosen:
                schema_text(t["function"].get("parameters") or {}, f"the parameters of tool {t['function']['name']!r}")
            if choice == "auto":
                if response is None:
                    return None  # free text; calls are parsed when the model writes them
            special = self.compiler.special_token_id("[TOOL_CALLS]") if self.tool_parser == "mistral" else None
            calls = calls_grammar_body(self.tool_parser, chosen, spec.parallel_tool_calls, special)
            return f"({calls}) | ({response})" if choice == "auto" else calls
        except GrammarError as exc:
            raise invalid(str(exc), spec.tools_param if tools else spec.format_param, "invalid_schema") from None

    async def completion_grammar(self, response_format: tuple[str, Any]) -> Grammar:
        """The grammar of a plain completion's response_format (no chat template, no reasoning)."""
        if self.compiler is None:
            raise invalid("response_format needs the model's tokenizer; this server has none", "response_format")
        spec = ReplySpec([], response_format=response_format)
        return await self.compile(reply_grammar(self.grammar_body(spec, None), None), spec)

    async def compile(self, text: str, spec: ReplySpec) -> Grammar:
        param = spec.tools_param if spec.tools and spec.tool_choice != "none" else spec.format_param
        try:
            return await self.compiler.compile(text)
        except GrammarError as exc:
            raise invalid(str(exc), param, "invalid_schema") from None
        except (ValueError, RuntimeError) as exc:  # llguidance refused the grammar
            raise invalid(f"the schema cannot be compiled: {one_line(str(exc))}", param, "invalid_schema") from None

    def close(self) -> None:
        if self.compiler is not None:
            self.compiler.shutdown()


def check_template_kwargs(kwargs: dict[str, Any]) -> None:
    for name, value in kwargs.items():
        if name not in TEMPLATE_KWARGS:
            raise invalid(f"chat_template_kwargs.{name} is not allowed; allowed: {', '.join(TEMPLATE_KWARGS)}",
                          "chat_template_kwargs")
        if not isinstance(value, TEMPLATE_KWARGS[name]):
            raise invalid(f"chat_template_kwargs.{name} must be a {TEMPLATE_KWARGS[name].__name__}",
                          "chat_template_kwargs")


def history_arguments(arguments: Any, where: str) -> dict[str, Any]:
    """A tool call's arguments from the history (JSON text or an object) as the dict templates render; 400 when
    they are not a JSON object."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else None
    except (json.JSONDecodeError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise invalid(f"{where} must be a JSON object (as text), got {str(arguments)[:80]!r}", where)
    return value


# ---------------------------------------------------------------------------------------------------------------------
# Reading a reply back.


@dataclass(frozen=True)
class ReplyEvent:
    kind: str  # "reasoning" | "content" | "tool_call"
    text: str = ""
    call: ToolCall | None = None


class ReplyReader:
    """Splits one reply's text, piece by piece, into reasoning, content and tool calls."""

    def __init__(self, prepared: PreparedReply) -> None:
        self.reasoning = (ReasoningSplitter(prepared.reasoning_open) if prepared.reasoning_open is not None
                          else None)
        self.tools = ToolParser(prepared.tool_parser) if prepared.tool_parser is not None else None
        self.calls: list[ToolCall] = []
        self.reasoning_text: list[str] = []
        self.content_text: list[str] = []

    def feed(self, text: str) -> list[ReplyEvent]:
        return self._read(text, final=False)

    def finish(self) -> list[ReplyEvent]:
        return self._read("", final=True)

    def _read(self, text: str, final: bool) -> list[ReplyEvent]:
        events: list[ReplyEvent] = []
        if self.reasoning is not None:
            thought, content = self.reasoning.finish() if final and not text else self.reasoning.feed(text)
            if final and text:
                more = self.reasoning.finish()
                thought, content = thought + more[0], content + more[1]
            if thought:
                events.append(ReplyEvent("reasoning", thought))
                self.reasoning_text.append(thought)
        else:
            content = text
        if self.tools is not None:
            parts = [self.tools.feed(content)] if content else []
            if final:
                parts.append(self.tools.finish())
            for content, calls in parts:
                if content:
                    events.append(ReplyEvent("content", content))
                events += [ReplyEvent("tool_call", call=c) for c in calls]
                self.calls += calls
        elif content:
            events.append(ReplyEvent("content", content))
        self.content_text += [e.text for e in events if e.kind == "content"]
        return events

    @property
    def content(self) -> str:
        return "".join(self.content_text)

    @property
    def reasoning_content(self) -> str | None:
        return "".join(self.reasoning_text) if self.reasoning_text else None


def read_all(prepared: PreparedReply, text: str) -> ReplyReader:
    reader = ReplyReader(prepared)
    reader.feed(text)
    reader.finish()
    return reader
