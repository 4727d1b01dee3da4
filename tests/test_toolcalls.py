"""Tool-call parsers on each family's documented output format, fed whole and in random splits; malformed calls come
back as content. The grammar of a required call accepts exactly the format the parser reads."""
from __future__ import annotations

import json
import random

import pytest

from redline.toolcalls import ToolParser, calls_grammar_body, parser_for_template

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}

# (format, model output, expected content, expected calls as (name, arguments))
CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
     "", [("get_weather", {"city": "Paris", "unit": "c"})]),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]),
    ("hermes", "No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool is not a tag.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Lima"}}', "",
     [("get_weather", {"city": "Lima"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
                    '{"name": "get_time", "parameters": {"zone": "a;b"}}', "",
     [("get_weather", {"city": "Rome"}), ("get_time", {"zone": "a;b"})]),
    ("llama3_json", "The weather is {unknown} today.", "The weather is {unknown} today.", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Bern"}}]', "",
     [("get_weather", {"city": "Bern"})]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Bern"}}, '
                '{"name": "get_time", "arguments": {"zone": "UTC"}}]', "Sure. ",
     [("get_weather", {"city": "Bern"}), ("get_time", {"zone": "UTC"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Graz"}', "", [("get_weather", {"city": "Graz"})]),
]
MALFORMED = [
    ("hermes", 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call> bye'),
    ("hermes", '<tool_call>\n{"arguments": {"city": "x"}}\n</tool_call>'),  # no name
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": '),  # cut off
    ("llama3_json", '{"name": "get_weather", "parameters": [1, 2]}'),  # arguments not an object
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "x"}'),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "x"}'),
    ("mistral", "[TOOL_CALLS] not json at all"),
]


def parse(fmt: str, text: str, pieces: list[str]) -> tuple[str, list]:
    parser = ToolParser(fmt)
    content, calls = "", []
    for piece in pieces:
        c, k = parser.feed(piece)
        content += c
        calls += k
    c, k = parser.finish()
    return content + c, calls + k


def random_splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("fmt, text, content, expected", CASES)
def test_each_format_parses_whole_and_in_random_splits(fmt, text, content, expected):
    rng = random.Random(0)
    for pieces in [[text], list(text)] + [random_splits(text, rng) for _ in range(30)]:
        got_content, calls = parse(fmt, text, pieces)
        assert got_content.strip() == content.strip()
        assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
        assert len({c.id for c in calls}) == len(calls) and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("fmt, text", MALFORMED)
def test_malformed_calls_come_back_as_content(fmt, text):
    rng = random.Random(1)
    for pieces in [[text], list(text)] + [random_splits(text, rng) for _ in range(20)]:
        content, calls = parse(fmt, text, pieces)
        assert calls == [] and content == text


def test_content_is_streamed_before_the_reply_ends():
    parser = ToolParser("hermes")
    assert parser.feed("Hello the")[0] == "Hello the"
    assert parser.feed(" weather <tool")[0] == " weather "  # "<tool" may begin a call: held back
    assert parser.feed("box>")[0] == "<toolbox>"
    assert parser.feed(" \n")[0] == ""  # trailing whitespace waits: it is dropped before a call
    assert parser.finish() == (" \n", [])


@pytest.mark.parametrize("template, fmt", [
    ("{% if tools %}{{ tools | tojson }}{% endif %}<tool_call>", "hermes"),
    ("{% for t in tools %}{% endfor %}[TOOL_CALLS]", "mistral"),
    ("{% if tools %}<|start_header_id|>ipython<|end_header_id|>{% endif %}<|python_tag|>", "llama3_json"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
    (None, None),
])
def test_parser_comes_from_the_chat_template(template, fmt):
    assert parser_for_template(template) == fmt


@pytest.mark.parametrize("fmt, parallel", [("hermes", False), ("hermes", True), ("llama3_json", True),
                                           ("mistral", False)])
def test_required_call_grammar_accepts_what_the_parser_reads(fmt, parallel, tools_grammar_compiler):
    """The grammar of a required call of either tool accepts each format's own calls (the parser then reads them
    back) and refuses text that is not a call."""
    body = calls_grammar_body(fmt, [WEATHER, TIME], parallel, None)
    compiled = tools_grammar_compiler.compile_now(f"start: {body}\n")
    key = "parameters" if fmt == "llama3_json" else "arguments"
    one = json.dumps({"name": "get_weather", key: {"city": "Paris", "unit": "c"}})
    two = json.dumps({"name": "get_time", key: {"zone": "CET"}})
    sep = {"hermes": "\n", "llama3_json": "; ", "mistral": ", "}[fmt]
    wrap = {"hermes": lambda c: f"<tool_call>\n{c}\n</tool_call>", "llama3_json": lambda c: c,
            "mistral": lambda c: c}[fmt]
    calls = [wrap(one)] + ([wrap(two)] if parallel else [])
    text = sep.join(calls)
    if fmt == "mistral":
        text = "[TOOL_CALLS][" + text + "]"
    assert accepts(tools_grammar_compiler, compiled, text)
    assert [c.name for c in parse(fmt, text, [text])[1]] == ["get_weather"] + (["get_time"] if parallel else [])
    assert not accepts(tools_grammar_compiler, compiled, "I will not call a tool.")
    bad = one.replace('"Paris"', "3")  # city must be a string
    assert not accepts(tools_grammar_compiler, compiled, wrap(bad) if fmt != "mistral" else f"[TOOL_CALLS][{bad}]")


def accepts(compiler, compiled, text: str) -> bool:
    matcher = compiled.matcher()
    ids = compiler.lltokenizer().tokenize_str(text)
    return matcher.consume_tokens(ids) and matcher.is_accepting()
