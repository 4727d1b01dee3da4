"""What a tokenizer.json may ask of the tokenizers library before Redline loads it.

The library runs a file's regexes and normalizers in native code that cannot be interrupted, so two kinds of file
are refused up front, with one line:
- a regex with a quantified group that itself repeats or alternates (`(a+)+`, `(a|ab)*`): catastrophic
  backtracking, minutes or hours on a short input;
- normalizers or decoders that grow their input: a chain of replacements whose growth factors multiply past
  MAX_NORMALIZER_GROWTH (each `a -> aa` doubles the text), or steps that add more than MAX_ADDED_CHARACTERS to
  every text (a Prepend of a megabyte, a regex replacement matching the empty string).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

# How many times longer a normalizer or decoder chain may make its input, and how many characters it may add.
MAX_NORMALIZER_GROWTH = 64
MAX_ADDED_CHARACTERS = 1024
QUANTIFIERS = "+*?{"


def risky_group(pattern: str) -> str | None:
    """The first quantified group of `pattern` whose body repeats or alternates, or None."""
    stack: list[tuple[int, bool]] = []  # (start index, whether the body repeats or alternates so far)
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            braces = pattern[i + 1:i + 3] in ("p{", "P{")  # \p{L} is a character class, not a repetition
            i = pattern.find("}", i) + 1 if braces and "}" in pattern[i:] else i + 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == "(":
            stack.append((i, False))
        elif c == ")" and stack:
            start, repeats = stack.pop()
            after = pattern[i + 1:i + 2]
            quantified = after in ("+", "*") or (after == "{" and not pattern[i + 2:].startswith(("0}", "1}")))
            if repeats and quantified:
                return pattern[start:i + 2]
            if stack and (repeats or quantified):
                stack[-1] = (stack[-1][0], True)
        elif c in "+*|" or (c == "{" and not pattern[i + 1:].startswith(("0}", "1}"))):
            if stack and not (c == "+" and pattern[i - 1:i] in QUANTIFIERS):  # a possessive `++` is no new repeat
                stack[-1] = (stack[-1][0], True)
        i += 1
    return None


def regexes(node: Any) -> list[str]:
    """Every regex pattern in a tokenizer.json (normalizers, pre-tokenizers, decoders)."""
    if isinstance(node, list):
        return [r for item in node for r in regexes(item)]
    if not isinstance(node, dict):
        return []
    found = []
    pattern = node.get("pattern")
    if isinstance(pattern, dict) and isinstance(pattern.get("Regex"), str):
        found.append(pattern["Regex"])
    return found + [r for key, value in node.items() if key != "pattern" for r in regexes(value)]


def text_growth(node: Any, sequence_key: str = "normalizers") -> tuple[float, float]:
    """A bound on how much a normalizer or decoder (or a Sequence of them) can grow its input: (factor, added) with
    output length <= factor * input length + added. Replacements multiply, a Prepend adds, a Sequence composes them
    in order; every other step keeps the text's length or shortens it."""
    if not isinstance(node, dict):
        return 1.0, 0.0
    kind = node.get("type")
    if kind == "Sequence":
        factor, added = 1.0, 0.0
        for step in node.get(sequence_key) or []:
            f, a = text_growth(step, sequence_key)
            factor, added = factor * f, added * f + a
        return factor, added
    if kind == "Replace":
        content = node.get("content") if isinstance(node.get("content"), str) else ""
        pattern = node.get("pattern") or {}
        literal = pattern.get("String") if isinstance(pattern, dict) else None
        if isinstance(literal, str) and literal:
            return max(1.0, len(content) / len(literal)), 0.0
        # a regex may match the empty string: content between every two characters and at both ends
        return float(len(content) + 1), float(len(content))
    if kind == "Prepend":
        prepend = node.get("prepend")
        return 1.0, float(len(prepend) if isinstance(prepend, str) else 0)
    return 1.0, 0.0


def normalizer_growth(node: Any) -> float:
    """How many times longer a normalizer (or a Sequence of them) can make its input, at most."""
    return text_growth(node)[0]


def check_tokenizer_json(spec: Any, path: Path) -> None:
    """Refuse a tokenizer.json whose regexes backtrack catastrophically or whose normalizers multiply the text."""
    if not isinstance(spec, dict):
        return  # the tokenizers library reports a malformed file itself
    try:
        patterns = regexes(spec)
    except RecursionError:
        raise ValueError(f"{path} nests its JSON too deeply to be a tokenizer; fix or re-download it") from None
    for pattern in patterns:
        group = risky_group(pattern)
        if group is not None:
            raise ValueError(f"{path}: the regex {pattern[:80]!r} repeats the group {group[:40]!r}, which can take "
                             f"exponential time on short text; Redline refuses it, fix the tokenizer.json")
    for part, key in (("normalizer", "normalizers"), ("decoder", "decoders")):
        growth, added = text_growth(spec.get(part), key)
        if growth > MAX_NORMALIZER_GROWTH:
            raise ValueError(f"{path}: its {part}s can make the text {growth:.0f} times longer (limit "
                             f"{MAX_NORMALIZER_GROWTH}); Redline refuses it, fix the tokenizer.json")
        if added > MAX_ADDED_CHARACTERS:
            raise ValueError(f"{path}: its {part}s can add {added:.0f} characters to every text (limit "
                             f"{MAX_ADDED_CHARACTERS}); Redline refuses it, fix the tokenizer.json")
