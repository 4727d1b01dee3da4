"""Tool calls in a model's own output format, parsed as the text streams in, and the grammar that makes a model
write them when a request requires a call.

Three formats are parsed (the parser is chosen from the checkpoint's chat template, or named with --tool-parser):
- "hermes": `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, repeated for parallel calls (Qwen2.5,
  Qwen3, Hermes and many fine-tunes);
- "llama3_json": the whole reply is `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, calls
  separated by `;` (Llama 3.1, 3.2, 3.3);
- "mistral": `[TOOL_CALLS]` then a JSON list of {"name", "arguments"} objects, or `name[ARGS]{...}` per call (the
  newer tokenizers).
A call is sent once its JSON is complete and parses with a name and an object of arguments; anything else, a
malformed call included, comes back as content, so nothing is lost and nothing crashes.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

PARSERS = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str

    @classmethod
    def new(cls, name: str, arguments: Any) -> ToolCall:
        return cls(name, json.dumps(arguments, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")


def parser_for_template(template: str | None) -> str | None:
    """The tool-call format a chat template asks the model to write, or None when it mentions no tools."""
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("<|eom_id|>" in template or "parameters" in template) and "ipython" in template:
        return "llama3_json"
    return None


def _call(obj: Any, arguments_key: str) -> ToolCall | None:
    """A ToolCall from one parsed JSON object, or None when it is not shaped as a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some fine-tunes write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall.new(obj["name"], args)


def _json_calls(text: str, arguments_key: str) -> list[ToolCall] | None:
    """Calls from text holding one JSON object or a list of them, or None."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_call(v, arguments_key) for v in items]
    return calls if calls and all(c is not None for c in calls) else None  # type: ignore[return-value]


class ToolParser:
    """Incremental parser: feed() text pieces as they come, finish() at the end; each returns (content text,
    completed calls). Content that may be the start of a call is held back until it is known not to be."""

    def __init__(self, fmt: str) -> None:
        if fmt not in PARSERS:
            raise ValueError(f"unknown tool parser {fmt!r}; use one of {', '.join(PARSERS)}")
        self.fmt = fmt
        self.buffer = ""  # text not yet sent as content or parsed into calls
        self.in_call = False
        self.seen_text = False  # llama3_json: a call must be the whole reply
        self.called = False  # a call was parsed (whitespace between calls is then not content)
        self.space = ""  # the whitespace held back before the call being read

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buffer += text
        return getattr(self, f"_{self.fmt}")(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        return getattr(self, f"_{self.fmt}")(final=True)

    # -- hermes --------------------------------------------------------------------------------------------------------

    def _hermes(self, final: bool) -> tuple[str, list[ToolCall]]:
        content, calls = "", []
        while True:
            if not self.in_call:
                start = self.buffer.find("<tool_call>")
                if start < 0:
                    # Held back: what may begin a call, and trailing whitespace (between calls it is dropped).
                    rest = len(self.buffer) - len(self.buffer.rstrip())
                    keep = 0 if final else max(_partial_suffix(self.buffer, "<tool_call>"), rest)
                    if final and self.called and not self.buffer.strip():
                        keep, self.buffer = 0, ""
                    content += self.buffer[:len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return content, calls
                before = self.buffer[:start]
                # Whitespace before a call is no content, unless the call turns out malformed.
                self.space = before if not before.strip() else ""
                content += before if before.strip() else ""
                self.buffer = self.buffer[start:]
                self.in_call = True
            end = self.buffer.find("</tool_call>")
            if end < 0:
                if not final:
                    return content, calls
                body = self.buffer[len("<tool_call>"):]
                parsed = _json_calls(body.strip(), "arguments")  # a call cut off before its closing tag
                if parsed is None:
                    content += self.space + self.buffer
                else:
                    calls += parsed
                    self.called = True
                self.buffer, self.in_call = "", False
                return content, calls
            block = self.buffer[:end + len("</tool_call>")]
            parsed = _json_calls(block[len("<tool_call>"):-len("</tool_call>")].strip(), "arguments")
            if parsed is None:
                content += self.space + block
            else:
                calls += parsed
                self.called = True
            self.buffer, self.in_call = self.buffer[len(block):], False

    # -- llama3_json ---------------------------------------------------------------------------------------------------

    def _llama3_json(self, final: bool) -> tuple[str, list[ToolCall]]:
        if not self.in_call and not self.seen_text:
            head = self.buffer.lstrip()
            if not head:
                return "", []
            if head.startswith("<|python_tag|>") or head.startswith("{"):
                self.in_call = True
            elif "<|python_tag|>".startswith(head):
                if not final:
                    return "", []
            else:
                self.seen_text = True
        if not self.in_call:
            content, self.buffer = self.buffer, ""
            return content, []
        if not final:
            return "", []
        text, self.buffer, self.in_call = self.buffer, "", False
        body = text.strip().removeprefix("<|python_tag|>")
        calls: list[ToolCall] = []
        for part in _split_top_level(body, ";"):
            parsed = _json_calls(part.strip(), "parameters") if part.strip() else None
            if parsed is None:
                return text, []
            calls += parsed
        return ("", calls) if calls else (text, [])

    # -- mistral -------------------------------------------------------------------------------------------------------

    def _mistral(self, final: bool) -> tuple[str, list[ToolCall]]:
        if not self.in_call:
            start = self.buffer.find("[TOOL_CALLS]")
            if start < 0:
                keep = 0 if final else _partial_suffix(self.buffer, "[TOOL_CALLS]")
                content = self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return content, []
            content = self.buffer[:start]
            self.buffer, self.in_call = self.buffer[start:], True
        else:
            content = ""
        if not final:
            return content, []
        text, self.buffer, self.in_call = self.buffer, "", False
        calls: list[ToolCall] = []
        for part in text.split("[TOOL_CALLS]")[1:]:
            part = part.strip()
            if "[ARGS]" in part and not part.startswith("["):
                name, _, args = part.partition("[ARGS]")
                parsed = _json_calls(json.dumps({"name": name.strip()})[:-1] + ', "arguments": ' + args + "}",
                                     "arguments") if name.strip() else None
            else:
                parsed = _json_calls(part, "arguments")
            if parsed is None:
                return content + text, []
            calls += parsed
        return content, calls


def _partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of text may begin `marker` (held back until the next piece decides)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _split_top_level(text: str, sep: str) -> list[str]:
    """text split at `sep` outside JSON strings and brackets."""
    parts, depth, start, in_string, escaped = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            escaped = ch == "\\" and not escaped
            if ch == '"' and not escaped:
                in_string = False
            continue
        if ch == '"':
            in_string, escaped = True, False
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


# ---------------------------------------------------------------------------------------------------------------------
# The grammar of a required call.


def call_schema(tool: dict[str, Any], arguments_key: str) -> dict[str, Any]:
    """The JSON schema of one call of an OpenAI-style function tool, in the format's key order."""
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, arguments_key: params},
            "required": ["name", arguments_key], "additionalProperties": False}


def calls_grammar_body(fmt: str, tools: list[dict[str, Any]], parallel: bool, special_id: int | None) -> str:
    """A lark rule body (grammar.reply_grammar's `body`) that matches one call, or several with `parallel`, of
    `tools` in the format `fmt`; special_id: the id of the format's special marker token, if the tokenizer has one."""
    from redline.grammar import json_schema_lark, lark_literal

    key = "parameters" if fmt == "llama3_json" else "arguments"
    schemas = [call_schema(t, key) for t in tools]
    one = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if fmt == "mistral":
        marker = f"<[{special_id}]>" if special_id is not None else lark_literal("[TOOL_CALLS]")
        listed = {"type": "array", "items": one, "minItems": 1}
        if not parallel:
            listed["maxItems"] = 1
        return f"{marker} {json_schema_lark(listed, 'the tools')}"
    call = json_schema_lark(one, "the tools")
    if fmt == "hermes":
        call = f'"<tool_call>\\n" {call} "\\n</tool_call>"'
        return f'{call} ("\\n" {call})*' if parallel else call
    return f'{call} ("; " {call})*' if parallel else call
