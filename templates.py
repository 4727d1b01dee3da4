"""Chat templates rendered as transformers renders them, in Jinja's sandbox, under limits.

A chat template is code that comes with a checkpoint. It runs in Jinja's ImmutableSandboxedEnvironment (no
attribute access to internals, no mutation of the conversation) and, on top of that, under limits: a render longer
than RENDER_SECONDS or a string, list or output larger than MAX_TEMPLATE_CHARS stops with a ValueError, as does any
error inside the template (a missing include, a division by zero, runaway recursion) or a template that renders to
nothing. Every failure is one line naming the problem.
"""
from __future__ import annotations

import functools
import json
import operator
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import jinja2
from jinja2.compiler import CodeGenerator, Frame
from jinja2.ext import loopcontrols
from jinja2.nodes import Concat
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The longest string (characters), list, or rendered prompt a template may build, and the longest render.
MAX_TEMPLATE_CHARS = 1 << 24
RENDER_SECONDS = 10.0
# The largest exponent `**` may take (a huge power is unbounded work on one line).
MAX_EXPONENT = 256
RANGE_CAP = 100_000  # as Jinja's sandbox caps one range()


class TemplateLimitError(jinja2.TemplateError):
    """A chat template went past a limit (size or time)."""


def _size(value: Any) -> int:
    """How many characters or items `value` holds, nested lists and dicts counted through (without building it)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)):
        return len(value) + sum(_size(v) for v in value)
    if isinstance(value, dict):
        return len(value) + sum(_size(k) + _size(v) for k, v in value.items())
    return 0


class _LimitedCodeGenerator(CodeGenerator):
    """Compiles `a ~ b` to the environment's size-checked join instead of a bare str join."""

    def visit_Concat(self, node: Concat, frame: Frame) -> None:
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class LimitedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with every operator, call, filter and loop checked against a size budget and a deadline."""

    code_generator_class = _LimitedCodeGenerator
    intercepted_binops = frozenset(["*", "+", "**", "//", "%", "/"])

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(optimized=False, **kwargs)  # constant folding would run filters unchecked, at compile time
        self.deadline = float("inf")

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"rendering took longer than {RENDER_SECONDS:g} s")

    def check_size(self, size: int, what: str) -> None:
        if size > MAX_TEMPLATE_CHARS:
            raise TemplateLimitError(f"{what} would hold {size} characters or items, above the limit of "
                                     f"{MAX_TEMPLATE_CHARS}")

    def checked_concat(self, parts: tuple[Any, ...]) -> str:
        self.check_time()
        texts = [str(p) for p in parts]
        self.check_size(sum(len(t) for t in texts), "a `~` concatenation")
        return "".join(texts)

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        self.check_time()
        if op == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                    self.check_size(_size(seq) * max(times, 0), "a repetition")
        if op == "+":
            self.check_size(_size(left) + _size(right), "a sum")
        if op == "**" and isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
            raise TemplateLimitError(f"an exponent of {right} is above the limit of {MAX_EXPONENT}")
        return {"*": operator.mul, "+": operator.add, "**": operator.pow, "//": operator.floordiv,
                "%": operator.mod, "/": operator.truediv}[op](left, right)

    def _check_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any], what: str) -> None:
        self.check_time()
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool):
                self.check_size(abs(value), f"{what}'s number argument")
            else:
                self.check_size(_size(value), f"{what}'s argument")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's names)
        __self._check_arguments(args, kwargs, "a call")
        result = super().call(__context, __obj, *args, **kwargs)
        __self.check_size(_size(result), "a call's result")
        return result

    def checked_filter(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        """`function` (a filter, which compiled templates call directly) with its arguments and result checked."""
        @functools.wraps(function)  # keeps Jinja's pass_context/pass_eval_ctx marks
        def checked(*args: Any, **kwargs: Any) -> Any:
            self._check_arguments(args, kwargs, f"filter {name}")
            result = function(*args, **kwargs)
            self.check_size(_size(result), f"filter {name}'s result")
            return result

        return checked

    def timed_range(self, *args: int) -> Iterator[int]:
        """range(), at most RANGE_CAP items (as the sandbox allows), checking the deadline at every step."""
        numbers = range(*args)
        if len(numbers) > RANGE_CAP:
            raise TemplateLimitError(f"a range of {len(numbers)} items is above the limit of {RANGE_CAP}")
        for i in numbers:
            self.check_time()
            yield i


def compile_chat_template(source: str) -> jinja2.Template:
    """A template compiled the way transformers compiles chat templates (a sandbox, trim_blocks and lstrip_blocks,
    loop controls, a `tojson` that keeps non-ASCII text, `raise_exception`, `strftime_now`), with the limits above."""

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = LimitedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = {name: env.checked_filter(name, f) for name, f in env.filters.items()}
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, range=env.timed_range)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template is not valid Jinja ({exc}); fix or remove it") from None
    except (RecursionError, MemoryError):
        raise ValueError("the chat template is too deeply nested to compile; fix or remove it") from None


def render_chat_template(source: str, **context: Any) -> str:
    """The rendered prompt, or a one-line ValueError: the template failed, went past a limit, or rendered nothing."""
    template = compile_chat_template(source)
    env: LimitedEnvironment = template.environment  # type: ignore[assignment]
    env.deadline = time.monotonic() + RENDER_SECONDS
    pieces: list[str] = []
    total = 0
    try:
        for piece in template.generate(**context):
            total += len(piece)
            env.check_size(total, "the rendered prompt")
            env.check_time()
            pieces.append(piece)
    except TemplateLimitError as exc:
        raise ValueError(f"the chat template went past a limit: {exc}; fix or remove the template") from None
    except jinja2.TemplateError as exc:
        raise ValueError(f"the chat template rejected the conversation: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise ValueError("the chat template recursed too deeply; fix or remove it") from None
    except MemoryError:
        raise ValueError("the chat template ran out of memory; fix or remove it") from None
    except Exception as exc:  # any error raised inside the template's own code (1 / 0, a missing include, ...)
        raise ValueError(f"the chat template failed ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); "
                         f"fix or remove it") from None
    text = "".join(pieces)
    if not text:
        raise ValueError("the chat template rendered nothing for this conversation; fix or remove it")
    return text
