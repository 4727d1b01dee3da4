"""A reasoning model's thinking split from its answer as the text streams in: what is inside `<think>...</think>`
(Qwen3, DeepSeek-R1 distills, QwQ) is reasoning, the rest is content.

The reply starts inside the block when the prompt opened it (a template whose generation prompt ends in `<think>`);
otherwise a reply that begins with `<think>` (after whitespace) opens it. Text after `</think>` is content, with the
whitespace that separates the two dropped. A tag split across pieces is held back until the next piece decides.
"""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def template_thinks(template: str | None) -> bool:
    """Whether a chat template is a reasoning model's (it writes or expects <think> blocks)."""
    return bool(template) and CLOSE in template


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open think block (the reply starts as reasoning)."""
    tail = prompt.rstrip()
    return tail.endswith(OPEN)


def prompt_skips_thinking(prompt: str) -> bool:
    """Whether a rendered prompt ends with a closed think block (thinking switched off, as Qwen3's template does
    with enable_thinking=false): the reply is all answer."""
    return prompt.rstrip().endswith(CLOSE)


class ReasoningSplitter:
    """feed() text pieces, finish() at the end; each returns (reasoning text, content text)."""

    def __init__(self, starts_open: bool) -> None:
        self.state = "thinking" if starts_open else "start"  # start -> thinking -> answer, or start -> answer
        self.buffer = ""
        self.strip_next = False  # drop whitespace right after </think>

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        return self._split(final=False)

    def finish(self) -> tuple[str, str]:
        return self._split(final=True)

    def _split(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        while True:
            if self.state == "start":
                head = self.buffer.lstrip()
                if head.startswith(OPEN):
                    self.buffer, self.state = head[len(OPEN):], "thinking"
                    continue
                if not final and (not head or OPEN.startswith(head)):
                    return reasoning, content
                self.state = "answer"
            if self.state == "thinking":
                end = self.buffer.find(CLOSE)
                if end < 0:
                    keep = 0 if final else _partial_suffix(self.buffer, CLOSE)
                    reasoning += self.buffer[:len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return reasoning, content
                reasoning += self.buffer[:end]
                self.buffer, self.state, self.strip_next = self.buffer[end + len(CLOSE):], "answer", True
            if self.strip_next:
                self.buffer = self.buffer.lstrip()
                if not self.buffer and not final:
                    return reasoning, content
                self.strip_next = False
            content += self.buffer
            self.buffer = ""
            return reasoning, content


def _partial_suffix(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
