"""Streaming a generation: incremental detokenisation (TextStream), the Stream a caller iterates, and the lock that
serializes the generations of one engine (GenerationLock)."""
from __future__ import annotations

import threading
from collections.abc import Generator
from typing import Any, Callable

from redline.options import GenerationResult
from redline.tokenizer import Tokenizer


class TextStream:
    """Turns token ids into text pieces, holding back bytes of a character that is not complete yet."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        """skip_special_tokens: the tokenizer's special tokens (tokenizer.special_ids) add no text."""
        self.tokenizer = tokenizer
        self.skip = getattr(tokenizer, "special_ids", frozenset()) if skip_special_tokens else frozenset()
        self.ids: list[int] = []
        self.prefix_start = 0  # ids before this are final
        self.read_start = 0  # ids before this have been emitted

    def push(self, token: int) -> str:
        if token in self.skip:
            return ""
        self.ids.append(token)
        prefix = self.tokenizer.decode(self.ids[self.prefix_start:self.read_start])
        text = self.tokenizer.decode(self.ids[self.prefix_start:])
        if text.endswith("\ufffd") or len(text) <= len(prefix):
            return ""  # an incomplete multi-byte character, or nothing new yet
        self.prefix_start, self.read_start = self.read_start, len(self.ids)
        return text[len(prefix):]

    def flush(self) -> str:
        prefix = self.tokenizer.decode(self.ids[self.prefix_start:self.read_start])
        text = self.tokenizer.decode(self.ids[self.prefix_start:])
        self.prefix_start = self.read_start = len(self.ids)
        return text[len(prefix):]


class GenerationLock:
    """Serializes one engine's generations across threads. A thread whose own earlier stream is suspended takes the
    engine over instead of waiting for itself (which would deadlock); that stream's number is then stale."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread holding _lock
        self.number = 0  # bumped when a generation starts; a stream holding an older number is invalid

    def acquire(self) -> int:
        """Hold the engine for one generation; returns its number."""
        if self._owner != threading.get_ident():
            self._lock.acquire()
            self._owner = threading.get_ident()
        self.number += 1
        return self.number

    def release(self, number: int) -> None:
        """Let others in, unless a later generation of this thread has taken over."""
        if number == self.number and self._owner is not None:
            self._owner = None
            self._lock.release()


class Stream:
    """The text pieces of one generation as they are decoded; `.result` (a GenerationResult) once exhausted.

    The engine is held from the first next() until the stream is exhausted or closed (`with llm.stream(...) as s:`
    closes it). Another thread's call waits meanwhile; a call from this thread takes the engine over, and this
    stream then raises RuntimeError when resumed instead of returning tokens from a cache the other call rewrote.
    """

    def __init__(self, lock: GenerationLock, run: Callable[[], Generator[str, None, GenerationResult]]) -> None:
        self._lock, self._run = lock, run
        self._pieces: Generator[str, None, GenerationResult] | None = None
        self._number = 0  # the lock's generation number while this stream holds it
        self._result: GenerationResult | None = None
        self._closed = False

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> str:
        if self._closed:
            raise StopIteration
        if self._pieces is None:
            self._number = self._lock.acquire()
            self._pieces = self._run()
        elif self._number != self._lock.number:
            self.close()
            raise RuntimeError("this stream was invalidated: another generation on the same LLM ran since its last "
                               "piece; exhaust or close a stream before starting another one in the same thread")
        try:
            return next(self._pieces)
        except StopIteration as done:
            self._result = done.value
            self.close()
            raise StopIteration from None
        except BaseException:
            self.close()
            raise

    @property
    def result(self) -> GenerationResult:
        if self._result is None:
            raise RuntimeError("the result is ready once the stream is exhausted; iterate it to the end first")
        return self._result

    def close(self) -> None:
        """Stop generating and let other calls use the engine (an unfinished stream has no result)."""
        if self._closed:
            return
        self._closed = True
        if self._pieces is not None:
            self._pieces.close()
            self._lock.release(self._number)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def print_stream(stream: Stream, out: Any) -> GenerationResult:
    """Write a stream's pieces to `out` as they come (the CLI's output), then a newline; returns its result."""
    for piece in stream:
        out.write(piece)
        out.flush()
    out.write("\n")
    return stream.result


def first_stop(text: str, stops: list[str]) -> int | None:
    """Where the first of the stop strings starts in text, or None."""
    hit = stop_match(text, stops)
    return hit[0] if hit is not None else None


def stop_match(text: str, stops: list[str]) -> tuple[int, int] | None:
    """(where, end) of the first stop string in text (at one place, the longest), or None."""
    hits = [(i, -len(s)) for s, i in ((s, text.find(s)) for s in stops) if i >= 0]
    if not hits:
        return None
    where, minus = min(hits)
    return where, where - minus


def step_seconds(times: list[float], counts: list[int] | None = None) -> list[float]:
    """Seconds per token of each step after the first (a step of several tokens: its time over their number)."""
    counts = counts or [1] * len(times)
    return [(b - a) / max(c, 1) for a, b, c in zip(times, times[1:], counts[1:])]


class RequestText:
    """The output processor's state for one request: its tokens' text as they arrive (incremental detokenization),
    cut at the first stop string, with the tail that could still grow into a stop string held back. The same for
    LLM.generate_batch, the engine's front end and the server. tokenizer None: no text (token ids only).
    min_tokens: a stop string ends nothing before this many tokens arrived (text before that is not searched);
    keep_stop: the text ends after the stop string instead of before it; skip_special_tokens: as TextStream's."""

    def __init__(self, tokenizer: Tokenizer | None, stops: list[str], min_tokens: int = 0, keep_stop: bool = False,
                 skip_special_tokens: bool = True) -> None:
        self.stream = TextStream(tokenizer, skip_special_tokens) if tokenizer is not None else None
        self.stops = [s for s in stops if s]
        self.holdback = max((len(s) - 1 for s in self.stops), default=0)
        self.text, self.emitted, self.searched = "", 0, 0
        self.min_tokens, self.keep_stop, self.tokens = min_tokens, keep_stop, 0

    def push(self, token_ids: list[int], last: bool) -> tuple[int, bool]:
        """Take new tokens (last: the request ends with them); returns how many of them the output keeps and
        whether a stop string ended the text (then the tokens after the one that completed it are dropped)."""
        if self.stream is None:
            return len(token_ids), False
        for i, token in enumerate(token_ids):
            self.text += self.stream.push(token)
            self.tokens += 1
            if self._cut():
                return i + 1, True
        if last:
            self.text += self.stream.flush()
            if self._cut():
                return len(token_ids), True
        return len(token_ids), False

    def _cut(self) -> bool:
        """Cut the text at a stop string that ends in its new part; True if one did."""
        start = max(0, self.searched - self.holdback)  # a stop string may straddle the old and the new text
        self.searched = len(self.text)
        if self.tokens < self.min_tokens:
            return False
        hit = stop_match(self.text[start:], self.stops)
        if hit is None:
            return False
        self.text = self.text[:start + hit[1 if self.keep_stop else 0]]
        return True

    def piece(self, finished: bool) -> str:
        """New text to send: all of it at the end, else what cannot grow into a stop string any more."""
        end = len(self.text) if finished else len(self.text) - self.holdback
        if end <= self.emitted:
            return ""
        out, self.emitted = self.text[self.emitted:end], end
        return out
