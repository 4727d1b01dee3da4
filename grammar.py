"""Constrained decoding with llguidance: grammars compiled per schema off the engine's thread, with limits, and the
per-row token bitmask the engine applies just before sampling.

A Grammar is compiled once per grammar text (cached) in a small thread pool, so a large schema never stalls the
engine's steps; each request then takes a cheap copy of its compiled matcher. A matcher gives, before each step, the
row's allowed tokens as a bitmask (one bit per token id, int32 words, ceil(V / 32) of them a row) and consumes the
token the row sampled. Rows without a grammar keep an all-ones row, so one step serves any mix.

Hostile input is refused in bounded time: a schema larger than MAX_SCHEMA_BYTES or nested deeper than
MAX_SCHEMA_DEPTH is refused before llguidance sees it, llguidance's own fuel limits (GRAMMAR_LIMITS) bound its lexer
and parser, and a compile that takes longer than COMPILE_SECONDS is given up (GrammarError, a 400 in the server).
"""
from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

MAX_SCHEMA_BYTES = 256 * 1024  # a schema's JSON text
MAX_SCHEMA_DEPTH = 64  # nested objects and lists inside one schema
COMPILE_SECONDS = 10.0
CACHED_GRAMMARS = 256
COMPILE_THREADS = 2
# Compact JSON: the model cannot spend its tokens on whitespace, and outputs stay short.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SPECIAL_PREFIX = b"\xff"  # llguidance's mark for a special token's bytes


class GrammarError(ValueError):
    """A grammar or schema that cannot be used: too large, too deep, refused by llguidance, or too slow to compile."""


def grammar_limits() -> Any:
    import llguidance

    # llguidance's defaults, with errors that do not echo the grammar back (it may be large).
    return llguidance.LLParserLimits(verbose_errors=False)


def json_depth(value: Any, limit: int = MAX_SCHEMA_DEPTH) -> int:
    """How deeply lists and dicts nest in value (iteratively; stops counting past limit + 1)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, (dict, list)):
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return deepest


def schema_text(schema: Any, what: str) -> str:
    """The schema as compact JSON, within the size and depth limits; GrammarError naming `what` otherwise."""
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"{what} must be a JSON object (a JSON Schema)")
    if json_depth(schema) > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"{what} nests deeper than {MAX_SCHEMA_DEPTH} levels; flatten it")
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise GrammarError(f"{what} is larger than {MAX_SCHEMA_BYTES} bytes; shorten it")
    return text


def json_schema_lark(schema: Any, what: str = "the schema") -> str:
    """A lark rule body that matches JSON valid under `schema` (compact separators)."""
    text = schema_text(schema, what)
    options = json.dumps({"x-guidance": JSON_OPTIONS}, separators=(",", ":"))[1:-1]
    if isinstance(schema, bool) or text == "{}":
        text = "{" + options + "}" if schema is not False else text
    else:
        text = "{" + options + "," + text[1:]
    return f"%json {text}"


def lark_literal(text: str) -> str:
    return json.dumps(text)


def reply_grammar(body: str, reasoning: str | None) -> str:
    """A lark grammar: optional reasoning first (reasoning "open": the prompt opened a think block; "tags": the
    reply may open one), then the rule body `body`."""
    gap = 'gap: /[ \\n]+/\n'  # the whitespace between the reasoning and the answer
    if reasoning == "open":
        return f'start: think gap? body\nthink[lazy]: /(.|\\n)*/ "</think>"\n{gap}body: {body}\n'
    if reasoning == "tags":
        return f'start: (think gap?)? body\nthink[lazy]: "<think>" /(.|\\n)*/ "</think>"\n{gap}body: {body}\n'
    return f"start: {body}\n"


@dataclass
class Grammar:
    """A compiled grammar: each request takes a fresh matcher from it."""
    text: str
    pristine: Any  # an llguidance.LLMatcher in its start state; copied, never advanced
    vocab_size: int

    def matcher(self) -> Any:
        return self.pristine.deep_copy()


def grammar_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """An llguidance.LLTokenizer of a Redline tokenizer, `vocab_size` wide (the model's logits may be wider)."""
    import llguidance

    eos = list(tokenizer.eos_ids)
    if hasattr(tokenizer, "tokenizer") and hasattr(tokenizer.tokenizer, "to_str"):  # HFTokenizer: tokenizer.json
        return llguidance.LLTokenizer(tokenizer.tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenTable(tokenizer)), n_vocab=vocab_size,
                                  eos_token=eos)


class _TokenTable:
    """What llguidance.TokenizerWrapper reads: each token id's bytes, special ids marked, and an encoder.

    The encoder is a greedy longest match over the token table, not the tokenizer's own: a SentencePiece model
    adds a space before the text (its dummy prefix), which llguidance would take for the text's own first byte."""

    def __init__(self, tokenizer: Any) -> None:
        self.eos_token_id = tokenizer.eos_ids[0] if tokenizer.eos_ids else 0
        self.bos_token_id = tokenizer.bos_id
        self.tokens, specials = token_bytes(tokenizer)
        self.special_token_ids = specials
        skip = set(specials)
        self.ids = {t: i for i, t in enumerate(self.tokens) if t and i not in skip}
        self.longest = max((len(t) for t in self.ids), default=1)

    def __call__(self, text: str | bytes) -> list[int]:
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        ids, i = [], 0
        while i < len(data):
            for n in range(min(self.longest, len(data) - i), 0, -1):
                token = self.ids.get(data[i:i + n])
                if token is not None:
                    ids.append(token)
                    i += n
                    break
            else:
                i += 1  # a byte no token spells (a tokenizer without byte fallback): skipped
        return ids


def token_bytes(tokenizer: Any) -> tuple[list[bytes], list[int]]:
    """Each token id's bytes (special tokens as SPECIAL_PREFIX + their text) and the special ids, for the
    SentencePiece and tiktoken tokenizers."""
    if hasattr(tokenizer, "processor"):  # SentencePiece
        sp = tokenizer.processor
        tokens, specials = [], []
        for i in range(sp.get_piece_size()):
            piece = sp.id_to_piece(i)
            if sp.is_control(i) or sp.is_unknown(i):
                tokens.append(SPECIAL_PREFIX + piece.encode())
                specials.append(i)
            elif sp.is_byte(i):
                tokens.append(bytes([int(piece[3:5], 16)]))
            else:
                tokens.append(piece.replace("\u2581", " ").encode())
        return tokens, specials
    if hasattr(tokenizer, "encoding"):  # tiktoken
        special = {i: t for t, i in tokenizer.special_token_ids.items()}
        tokens = [SPECIAL_PREFIX + special[i].encode() if i in special else
                  tokenizer.encoding.decode_single_token_bytes(i) for i in range(tokenizer.vocab_size)]
        return tokens, sorted(special)
    raise GrammarError(f"structured output does not support the {type(tokenizer).__name__} tokenizer")


class GrammarCompiler:
    """Compiles grammars in a thread pool (cached by their text) for one tokenizer."""

    def __init__(self, tokenizer: Any, vocab_size: int, threads: int = COMPILE_THREADS,
                 load: Callable[[], Any] | None = None) -> None:
        """tokenizer: the model's; or None with load, a function that loads it on first use (by warm(), in the
        pool), so that an engine core's start does not wait for it."""
        if (tokenizer is None) == (load is None):
            raise ValueError("GrammarCompiler takes a tokenizer or a function that loads one, not both or neither")
        self._tokenizer, self._load, self.vocab_size = tokenizer, load, vocab_size
        self._load_lock = threading.Lock()
        self._lltokenizer: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="redline-grammar")

    @property
    def tokenizer(self) -> Any:
        with self._load_lock:
            if self._tokenizer is None:
                self._tokenizer = self._load()
            return self._tokenizer

    def warm(self) -> None:
        """Build the llguidance tokenizer in the pool now (a second for a large vocabulary), not on first use."""
        self._pool.submit(self.lltokenizer)

    def lltokenizer(self) -> Any:
        with self._lock:
            if self._lltokenizer is None:
                self._lltokenizer = grammar_tokenizer(self.tokenizer, self.vocab_size)
            return self._lltokenizer

    def special_token_id(self, text: str) -> int | None:
        """The id of the special token spelled `text`, if the tokenizer has one."""
        try:
            return self.tokenizer.special_token_id(text)
        except (KeyError, AttributeError):
            return None

    def compile_now(self, text: str) -> Grammar:
        """The grammar for lark `text`, compiled on this thread (cached)."""
        with self._lock:
            if text in self._cache:
                self._cache.move_to_end(text)
                return self._cache[text]
        import llguidance

        tokenizer = self.lltokenizer()
        grammar = llguidance.LLMatcher.grammar_from_lark(text)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=grammar_limits())
        if matcher.is_error():
            raise GrammarError(f"the grammar does not compile: {one_line(matcher.get_error())}")
        compiled = Grammar(text, matcher, self.vocab_size)
        with self._lock:
            self._cache[text] = compiled
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    async def compile(self, text: str, timeout: float = COMPILE_SECONDS) -> Grammar:
        """compile_now in the pool; GrammarError when it takes longer than `timeout` seconds."""
        future = self._pool.submit(self.compile_now, text)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except asyncio.TimeoutError:
            raise GrammarError(f"the grammar took longer than {timeout:g} s to compile; simplify the schema") from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def one_line(message: str, limit: int = 300) -> str:
    text = " ".join(message.split())
    return text if len(text) <= limit else text[:limit] + "..."


# ---------------------------------------------------------------------------------------------------------------------
# Masks: one int32 row of ceil(V / 32) words per batch row, bit t of word t // 32 set when token t is allowed.


def mask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def fill_masks(matchers: Sequence[Any], out: Tensor) -> bool:
    """Fill out (B, W) int32 on the host: row i from matchers[i], all ones where it is None. False when no row has a
    matcher (out is left as it was)."""
    if all(m is None for m in matchers):
        return False
    out.fill_(-1)
    for i, matcher in enumerate(matchers):
        if matcher is not None:
            row = out[i]
            matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
    return True


def apply_masks(logits: Tensor, masks: Tensor) -> Tensor:
    """logits (B, V) with -inf where the row's mask (B, W) int32 clears the token's bit (out of place; no host sync,
    so it can run inside a captured graph)."""
    vocab = logits.shape[-1]
    bits = torch.arange(32, device=masks.device, dtype=torch.int32)  # (32,)
    allowed = ((masks.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]  # (B, W * 32) -> (B, V)
    return logits.masked_fill(~allowed, float("-inf"))
