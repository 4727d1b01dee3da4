"""Tools, structured output and the Responses and Anthropic Messages APIs against a live server on a tiny random
model whose chat template writes Hermes-style tool calls, through the real `openai` and `anthropic` clients and
LangChain. The model is random: what these tests check is what the grammar guarantees (every output parses and
validates), the protocol shapes the clients read, and the errors."""
from __future__ import annotations

import json
import time
from typing import Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from redline.engine import Engine
from redline.generate import LLM
from redline.serve import ServeSettings, create_app
from live_server import ServerThread

KEY = "sk-agent-key"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                  "required": ["city", "days"], "additionalProperties": False}
TIME_PARAMS = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"],
               "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": TIME_PARAMS}}]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}


class Forecast(BaseModel):
    city: str = Field(max_length=8)
    days: int = Field(ge=1, le=9)
    sunny: bool


@pytest.fixture(scope="module")
def served(tools_chat_checkpoint):
    llm = LLM.load(tools_chat_checkpoint[0], device="cpu")
    engine = Engine(llm, max_queue=64)
    yield llm, engine
    engine.shutdown()


def serve_app(checkpoint, served, **settings):
    llm, engine = served
    return ServerThread(create_app(engine, llm, ServeSettings(checkpoint_path=checkpoint, served_model_name="tiny",
                                                              api_key=KEY, **settings)))


@pytest.fixture(scope="module")
def url(tools_chat_checkpoint, served):
    """A server that does not split reasoning: a random model that opens a think block would never close it."""
    with serve_app(tools_chat_checkpoint[0], served, reasoning_parser="none") as base:
        yield base


@pytest.fixture(scope="module")
def thinking_url(tools_chat_checkpoint, served):
    """The same model with the reasoning split its chat template asks for (the default)."""
    with serve_app(tools_chat_checkpoint[0], served) as base:
        yield base


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


def check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_parse_with_a_pydantic_model(client):
    for seed in range(3):
        reply = client.chat.completions.parse(model="tiny", messages=USER, response_format=Forecast,
                                              temperature=1.0, max_tokens=120, seed=seed)
        message = reply.choices[0].message
        assert isinstance(message.parsed, Forecast) and reply.choices[0].finish_reason == "stop"
        assert Forecast.model_validate_json(message.content) == message.parsed


def test_schema_with_thinking_switched_off(thinking_url):
    """With thinking switched off (the template closes the think block in the prompt) the grammar starts at once."""
    client = openai.OpenAI(base_url=f"{thinking_url}/v1", api_key=KEY, max_retries=0, timeout=60)
    schema = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": WEATHER_PARAMS, "strict": True}}
    reply = client.chat.completions.create(model="tiny", messages=USER, response_format=schema,
                                           temperature=1.0, max_tokens=190, seed=1, extra_body={
                                               "chat_template_kwargs": {"enable_thinking": False}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), WEATHER_PARAMS)
    assert reply.choices[0].message.model_extra.get("reasoning_content") is None


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice, names", [("required", {"get_weather", "get_time"}),
                                           ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})])
def test_tool_round_trip(client, stream, choice, names):
    kwargs = dict(model="tiny", messages=USER, tools=TOOLS, tool_choice=choice, temperature=1.0, max_tokens=150,
                  seed=3, parallel_tool_calls=False)
    if stream:
        with client.chat.completions.stream(**kwargs, stream_options={"include_usage": True}) as events:
            deltas = [e for e in events if e.type == "chunk"]
            reply = events.get_final_completion()
        streamed = [d.chunk.choices[0].delta.tool_calls for d in deltas if d.chunk.choices
                    and d.chunk.choices[0].delta.tool_calls]
        assert streamed[0][0].id and streamed[0][0].function.name and streamed[0][0].index == 0
    else:
        reply = client.chat.completions.create(**kwargs)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and not message.content
    check_calls(message.tool_calls, names)
    assert len(message.tool_calls) == 1  # parallel_tool_calls=False
    call = message.tool_calls[0]
    # Second step: the call and its result go back in the history, rendered by the template.
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'}]
    final = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=8, temperature=0.0)
    assert final.choices[0].message.tool_calls is None and final.usage.prompt_tokens > reply.usage.prompt_tokens


def test_responses_create_and_stream(client):
    schema = {"type": "json_schema", "name": "forecast", "schema": Forecast.model_json_schema(), "strict": True}
    response = client.responses.create(model="tiny", input="Weather?", instructions="Answer in JSON.",
                                       text={"format": schema}, max_output_tokens=120, temperature=1.0)
    assert response.status == "completed" and response.usage.output_tokens > 0
    Forecast.model_validate_json(response.output_text)
    with client.responses.stream(model="tiny", input=[{"role": "user", "content": "Weather?"}],
                                 text_format=Forecast, max_output_tokens=120, temperature=1.0) as events:
        kinds = [e.type for e in events]
        final = events.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and isinstance(final.output_parsed, Forecast)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_function_calls(client, stream):
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    kwargs = dict(model="tiny", input="What time is it?", tools=tools, tool_choice="required", max_output_tokens=150,
                  temperature=1.0, parallel_tool_calls=False)
    if stream:
        with client.responses.stream(**kwargs) as events:
            kinds = [e.type for e in events]
            response = events.get_final_response()
        assert "response.function_call_arguments.delta" in kinds
    else:
        response = client.responses.create(**kwargs)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])
    follow = client.responses.create(model="tiny", tools=tools, max_output_tokens=4, temperature=0.0, input=[
        {"role": "user", "content": "What time is it?"}, calls[0].model_dump(),
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "12:00"}])
    assert follow.status in ("completed", "incomplete")


def test_responses_refuses_stored_state(client):
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_123")
    with pytest.raises(openai.BadRequestError, match="store"):
        client.responses.create(model="tiny", input="hi", store=True)


ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather forecast", "input_schema": WEATHER_PARAMS},
                   {"name": "get_time", "description": "The time", "input_schema": TIME_PARAMS}]


@pytest.fixture
def claude(url):
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=60)


def test_anthropic_messages_with_a_tool(claude):
    message = claude.messages.create(model="tiny", max_tokens=150, tools=ANTHROPIC_TOOLS,
                                     tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                     system="You call tools.", messages=[{"role": "user", "content": "Weather?"}])
    assert message.stop_reason == "tool_use" and message.role == "assistant"
    uses = [b for b in message.content if b.type == "tool_use"]
    assert len(uses) == 1
    jsonschema.validate(uses[0].input, SCHEMAS[uses[0].name])
    reply = claude.messages.create(model="tiny", max_tokens=6, tools=ANTHROPIC_TOOLS, messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [b.model_dump() for b in message.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny"}]}],
        extra_body={"temperature": 0.0})
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use") and reply.usage.input_tokens > 0


def test_anthropic_stream_with_a_named_tool(claude):
    with claude.messages.stream(model="tiny", max_tokens=150, tools=ANTHROPIC_TOOLS,
                                tool_choice={"type": "tool", "name": "get_time"},
                                messages=[{"role": "user", "content": "Time?"}]) as stream:
        kinds = [e.type for e in stream]
        message = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses and all(u.name == "get_time" for u in uses) and message.stop_reason == "tool_use"
    for u in uses:
        jsonschema.validate(u.input, TIME_PARAMS)


def test_anthropic_text_stream(claude):
    with claude.messages.stream(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "Hi"}],
                                thinking={"type": "disabled"}, extra_body={"temperature": 0.0}) as stream:
        text = "".join(stream.text_stream)
        message = stream.get_final_message()
    assert message.content[0].text == text and message.stop_reason in ("max_tokens", "end_turn")
    assert message.usage.output_tokens > 0


def test_anthropic_errors_have_anthropic_shape(url, claude):
    bad = anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "Hi"}])
    r = httpx.post(f"{url}/v1/messages", headers={"x-api-key": KEY}, json={"model": "tiny", "messages": []})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in r.json()["error"]["message"]


def test_langchain_drives_a_two_step_tool_loop(url):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_time(zone: Literal["UTC", "CET", "PST"]) -> str:
        """The time in a zone."""
        return f"12:00 in {zone}"
    llm = ChatOpenAI(base_url=f"{url}/v1", api_key=KEY, model="tiny", temperature=1.0, max_tokens=120,
                     max_retries=0)
    tool_llm = llm.bind_tools([get_time], tool_choice="get_time")
    messages = [HumanMessage("What time is it in Oslo?")]
    first = tool_llm.invoke(messages)
    assert first.tool_calls and first.tool_calls[0]["name"] == "get_time"
    messages += [first] + [ToolMessage(get_time.invoke(c["args"]), tool_call_id=c["id"]) for c in first.tool_calls]
    second = llm.bind(max_tokens=6).invoke(messages)
    assert isinstance(second.content, str) and not second.tool_calls


def nested(levels: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


HOSTILE = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": {}}}}, "nests deeper"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": nested(40)}}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
                for i in range(1000)]}, "tools"),
    ({"messages": USER + [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_time", "arguments": "zone=UTC"}}]}, {"role": "tool", "tool_call_id": "c1", "content": "12"}],
      "tools": TOOLS}, "arguments"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}}}}}, "response_format"),
]


@pytest.mark.parametrize("extra, named", HOSTILE)
def test_hostile_input_is_refused_quickly(url, client, extra, named):
    body = {"model": "tiny", "messages": USER, "max_tokens": 5, **extra}
    text = json.dumps(body)
    if named == "nests deeper":  # 10^5 nested levels, as JSON text (no Python object could hold it for json.dumps)
        levels = 100_000
        text = text.replace('"schema": {}', '"schema": ' + '{"type": "object", "properties": {"x": ' * levels
                            + "{}" + "}}" * levels)
    start = time.monotonic()
    r = httpx.post(f"{url}/v1/chat/completions", content=text, timeout=60,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert time.monotonic() - start < 10
    error = r.json()["error"]
    assert named in (error["param"] or "") + error["message"]
    ok = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2)  # still serving
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_regex_bomb_is_answered_in_bounded_time(client):
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": "(a|aa)*(b|c){1000}(d{100}){100}"}},
              "required": ["s"]}
    start = time.monotonic()
    try:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=20, temperature=1.0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "bomb", "schema": schema}})
    except openai.BadRequestError as exc:
        assert "response_format" in str(exc)
    assert time.monotonic() - start < 20


def test_completions_take_a_response_format(client):
    reply = client.completions.create(model="tiny", prompt="Forecast:", max_tokens=100, temperature=1.0, seed=2,
                                      extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                          "name": "w", "schema": WEATHER_PARAMS}}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].text), WEATHER_PARAMS)


def test_template_kwargs_are_allowlisted(client):
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"tools_in_user_message": True}})
