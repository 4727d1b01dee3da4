"""The OpenAI-compatible API's request bodies (pydantic models that refuse what Redline does not implement), its
errors in OpenAI's JSON shape, and the mapping of a request onto GenerationOptions. serve.py serves them."""
from __future__ import annotations

import dataclasses
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from redline.options import MAX_STOP_TOKEN_IDS, GenerationOptions
from redline.sampling import LOGIT_BIAS_LIMIT, MAX_LOGIT_BIAS, PENALTY_LIMIT, SEED_LIMIT

MAX_N = 16  # choices per request
MAX_STOP_STRINGS = 16
MAX_COMPLETION_LOGPROBS = 20  # alternatives per token in /v1/completions (OpenAI: 5; vLLM and lm-eval ask up to 20)
MAX_CHAT_TOP_LOGPROBS = 20
MAX_PROMPTS = 2048  # prompts in one /v1/completions request, as OpenAI allows; counted before any is tokenized
MAX_TOP_K = (1 << 31) - 1  # any top_k at or past the vocabulary keeps every token; larger numbers are refused
DEFAULT_COMPLETION_TOKENS = 16  # /v1/completions' max_tokens when absent or null, as OpenAI documents
# Fields clients and SDK wrappers attach that mean nothing to a local server: accepted, ignored, and named in the
# response's Warning header. Anything else Redline does not implement is a 400 naming it.
IGNORED_PARAMETERS = ("store", "metadata", "service_tier", "user", "safety_identifier", "prompt_cache_key",
                      "reasoning_effort")
# The engine's finish reasons as the API reports them.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort", "error": "error"}


class APIError(Exception):
    """An error the API reports as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


class Strict(BaseModel):
    # Unknown fields are refused; "5" is not an int and true is not a number.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ImageURL(Strict):
    url: str = Field(max_length=64 * 1024 * 1024)
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the towers see every image at their own size


class ImagePart(Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class Echoed(BaseModel):
    # Calls sent back from an earlier reply carry what the client library added (index, parsed_arguments).
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionCall(Echoed):
    name: str
    arguments: str  # JSON text


class ToolCallItem(Echoed):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[Union[TextPart, ImagePart]], None] = None
    name: str | None = Field(None, min_length=1, max_length=64)  # a participant's name, passed to the template
    tool_calls: list[ToolCallItem] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message answers this call
    reasoning_content: str | None = None  # an assistant's earlier reasoning; not shown to the model again

    @model_validator(mode="after")
    def _check_message(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise invalid("a message needs content (only an assistant message with tool_calls may omit it)",
                          "messages.content")
        if self.role == "tool" and not self.tool_call_id:
            raise invalid("a tool message needs the tool_call_id of the call it answers", "messages.tool_call_id")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    def image_urls(self) -> list[str]:
        return [] if isinstance(self.content, (str, type(None))) else [
            p.image_url.url for p in self.content if isinstance(p, ImagePart)]

    def template_content(self) -> str | list[dict[str, str]]:
        """The content as the chat template gets it: text, or with images the parts in order, each image as
        {"type": "image"} (which multimodal templates render as the model's image placeholder)."""
        if not self.image_urls():
            return self.text()
        return [{"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text}
                for p in self.content]

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template gets it: `developer` is OpenAI's newer name for `system` (templates
        know only the older one); `name` is passed on for the templates that use it."""
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.template_content()}
        if self.name is not None:
            out["name"] = self.name
        return out


class FunctionDef(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_format(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise invalid("response_format json_schema needs (only with that type) a json_schema object",
                          "response_format")
        return self

    def spec(self) -> tuple[str, Any] | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return ("json_object", None)
        return ("json_schema", self.json_schema.schema_ if self.json_schema.schema_ is not None else {})


class SamplingRequest(Strict):
    """The fields both endpoints share."""
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)  # OpenAI's default is 1
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)  # extra; -1 or 0: off
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extra, for benchmarks
    frequency_penalty: float | None = Field(None, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    presence_penalty: float | None = Field(None, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    logit_bias: dict[str, float] | None = None  # token id (a decimal string) -> bias in [-100, 100]
    # vLLM's extras, as top-level body fields (the openai client's extra_body)
    repetition_penalty: float | None = Field(None, gt=0)
    min_p: float | None = Field(None, ge=0, le=1)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool | None = None  # None: true, except where a tool or reasoning parser reads the reply
    # Accepted and ignored (IGNORED_PARAMETERS): any JSON value, as clients send them.
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    user: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    reasoning_effort: Any = None

    @model_validator(mode="after")
    def _check_common(self) -> SamplingRequest:
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS:
            raise invalid(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS}", "logit_bias")
        for key, value in bias.items():
            if not key.isdigit():
                raise invalid(f"logit_bias keys must be token ids (decimal strings), got {key!r}", "logit_bias")
            if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                raise invalid(f"logit_bias values must lie in [-100, 100], got {value} for token {key}", "logit_bias")
        if any(t < 0 for t in self.stop_token_ids or ()):
            raise invalid("stop_token_ids must be token ids (non-negative integers)", "stop_token_ids")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP_STRINGS or not all(stops):
            raise invalid(f"stop must be up to {MAX_STOP_STRINGS} non-empty strings", "stop")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options needs stream=true", "stream_options")
        if self.seed is not None and self.seed + self.n - 1 >= SEED_LIMIT:
            raise invalid("seed + n - 1 must stay below 2**63 (choice i uses seed + i)", "seed")
        return self

    @property
    def ignored(self) -> list[str]:
        """The accepted-and-ignored parameters this request set."""
        return [name for name in IGNORED_PARAMETERS if name in self.model_fields_set]

    def options(self, max_new_tokens: int, vocab_size: int | None = None, parsed: bool = False,
                **extra: Any) -> GenerationOptions:
        """GenerationOptions for one choice; a top_k at or past the vocabulary (the same distribution as none) is
        none. parsed: a tool or reasoning parser reads the reply, so special tokens stay in its text unless
        skip_special_tokens says otherwise (their markers may be special tokens)."""
        temperature = 1.0 if self.temperature is None else self.temperature
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        top_k = self.top_k if self.top_k is not None and self.top_k > 0 else None
        if top_k is not None and vocab_size is not None and top_k >= vocab_size:
            top_k = None
        top_p = self.top_p if self.top_p is not None and self.top_p < 1 else None
        skip = self.skip_special_tokens if self.skip_special_tokens is not None else not parsed
        penalties = {name: getattr(self, name) for name in ("presence_penalty", "frequency_penalty",
                                                            "repetition_penalty", "min_p")
                     if getattr(self, name) is not None}
        try:
            options = GenerationOptions(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                        top_p=top_p, stop=stops, seed=self.seed, ignore_eos=self.ignore_eos,
                                        logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
                                        min_tokens=self.min_tokens, stop_token_ids=tuple(self.stop_token_ids or ()),
                                        include_stop_str_in_output=self.include_stop_str_in_output,
                                        skip_special_tokens=skip, **penalties, **extra)
            if vocab_size is not None:
                options.check_vocabulary(vocab_size)  # "logit_bias names token id ...": the param is its first word
            return options
        except ValueError as exc:
            message = str(exc)
            name = message.split()[0]
            raise invalid(message, name if name in type(self).model_fields else None) from None

    def seeded(self, options: GenerationOptions) -> list[GenerationOptions]:
        """One options per choice: choice i uses seed + i when a seed is given."""
        if options.seed is None:
            return [options] * self.n
        return [dataclasses.replace(options, seed=options.seed + i) for i in range(self.n)]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatRequest:
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise invalid("tool_choice needs tools", "tool_choice")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise invalid("give max_tokens or max_completion_tokens, not both", "max_tokens")
        if self.top_logprobs and not self.logprobs:
            raise invalid("top_logprobs needs logprobs=true", "top_logprobs")
        return self

    @property
    def max_new(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]

    def image_urls(self) -> list[str]:
        """The URLs of the messages' image parts, in order."""
        return [url for m in self.messages for url in m.image_urls()]

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as chat templates read them: tool calls with their arguments parsed, tool results with
        the name of the function that made them."""
        from redline.replies import history_arguments

        names: dict[str, str] = {}
        out: list[dict[str, Any]] = []
        for i, m in enumerate(self.messages):
            message: dict[str, Any] = dict(m.template_dict())  # developer as system; a participant's name
            if m.tool_calls:
                message["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {
                        "name": c.function.name,
                        "arguments": history_arguments(c.function.arguments,
                                                       f"messages[{i}].tool_calls[{j}].function.arguments")}}
                    for j, c in enumerate(m.tool_calls)]
                names.update((c.id, c.function.name) for c in m.tool_calls)
            if m.role == "tool":
                message["tool_call_id"] = m.tool_call_id
                if m.tool_call_id in names or m.name:
                    message["name"] = m.name or names[m.tool_call_id]
            out.append(message)
        return out

    def reply_spec(self) -> Any:
        from redline.replies import ReplySpec

        choice: Any = self.tool_choice or "auto"
        if isinstance(choice, NamedToolChoice):
            choice = {"name": choice.function.name}
        return ReplySpec(self.template_messages(), [t.model_dump(exclude_none=True) for t in self.tools or []] or None,
                         choice, self.parallel_tool_calls,
                         self.response_format.spec() if self.response_format is not None else None,
                         dict(self.chat_template_kwargs or {}))


Prompt = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    max_tokens: int = Field(DEFAULT_COMPLETION_TOKENS, ge=0)  # null too means the default; 0 only with echo
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    response_format: ResponseFormat | None = None  # extra: the completion matches a JSON schema

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _null_is_the_default(cls, value: Any) -> Any:
        return DEFAULT_COMPLETION_TOKENS if value is None else value

    @field_validator("prompt", mode="before")
    @classmethod
    def _count_before_reading(cls, value: Any) -> Any:
        """At most MAX_PROMPTS prompts, counted before pydantic walks (or anything tokenizes) them."""
        if isinstance(value, list) and value and not isinstance(value[0], int) and len(value) > MAX_PROMPTS:
            raise invalid(f"prompt holds {len(value)} prompts; at most {MAX_PROMPTS} per request", "prompt")
        return value

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise invalid("max_tokens=0 only makes sense with echo=true (scoring the prompt)", "max_tokens")
        if self.max_tokens == 0 and self.stream:
            raise invalid("max_tokens=0 cannot stream; drop stream", "max_tokens")
        if not self.prompts():
            raise invalid("prompt is empty", "prompt")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise invalid("give exactly one of prompt and messages", "prompt")
        return self


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


def parse_request(model: type[BaseModel], body: bytes) -> Any:
    """A request model from a JSON body; APIError 400 naming the first bad or unknown parameter."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> APIError:
    err = exc.errors(include_url=False)[0]
    param = ".".join(str(p) for p in err["loc"]) or None
    if err["type"] == "json_invalid" and "recursion limit" in err["msg"]:
        return invalid("the request body nests deeper than this server parses; flatten it")
    if err["type"] == "json_invalid":
        return invalid(f"the request body is not valid JSON: {err['msg']}")
    if err["type"] == "model_type" and param is None:
        return invalid("the request body must be a JSON object")
    if err["type"] == "extra_forbidden":
        return invalid(f"unsupported parameter {param!r}: Redline does not implement it; drop it", param,
                       "unsupported_parameter")
    if err["type"] == "missing":
        return invalid(f"missing required parameter {param!r}", param, "missing_required_parameter")
    return invalid(f"invalid value for {param!r}: {err['msg']}", param, "invalid_value")


def context_room(llm: Any, ids: list[int], asked: int | None, param: str) -> int:
    """Tokens the reply may have: what was asked (None: the rest of the context). Asking more than the context leaves
    after the prompt is a 400, as OpenAI answers it, not a silently shorter reply."""
    context = llm.block_size
    if len(ids) >= context:
        raise invalid(f"the prompt has {len(ids)} tokens, but the model's context is {context}; shorten it", param,
                      "context_length_exceeded")
    room = context - len(ids)
    if asked is not None and asked > room:
        raise invalid(f"max_tokens is {asked}, but the model's context of {context} tokens leaves {room} after the "
                      f"prompt's {len(ids)}; ask for at most {room}", "max_tokens", "context_length_exceeded")
    return room if asked is None else asked
