"""GGUF metadata and tensor layout, type- and range-checked before anything is built from them.

A GGUF file is untrusted input: a value of the wrong type (an array where a number belongs), out of range (zero heads,
a billion layers, a token id past the vocabulary) or a tensor whose data lies outside the file is a one-line
ValueError here, never a traceback or a loop later.
"""
from __future__ import annotations

import math
import os
from typing import Any

# The largest model dimension, head count, context and vocabulary a GGUF file may declare.
MAX_DIMENSION = 1 << 24
# Expected type of each metadata key Redline reads (keys under an architecture are matched by their suffix).
INT_SUFFIXES = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
                "attention.head_count_kv", "attention.key_length", "rope.dimension_count", "context_length",
                "vocab_size", "expert_count", "expert_used_count", "expert_feed_forward_length", "expert_gating_func")
FLOAT_SUFFIXES = ("rope.freq_base", "attention.layer_norm_rms_epsilon")
STR_KEYS = ("general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template")
STR_SUFFIXES = ("rope.scaling.type",)
BOOL_KEYS = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix")
BOOL_SUFFIXES = ("expert_weights_norm",)
LIST_KEYS = {"tokenizer.ggml.tokens": str, "tokenizer.ggml.merges": str, "tokenizer.ggml.scores": float,
             "tokenizer.ggml.token_type": int}
TOKEN_ID_SUFFIX = "_token_id"


def checked_value(key: str, value: Any) -> Any:
    """`value` of metadata `key`, refused with one line when its type or range is not what the key needs."""
    if key in LIST_KEYS:
        return _checked_list(key, value, LIST_KEYS[key])
    if key in STR_KEYS or key.endswith(STR_SUFFIXES):
        if not isinstance(value, str):
            raise ValueError(_wrong(key, value, "a string"))
        return value
    if key in BOOL_KEYS or key.endswith(BOOL_SUFFIXES):
        if not (isinstance(value, bool) or value in (0, 1)) or isinstance(value, (list, float)):
            raise ValueError(_wrong(key, value, "true or false"))
        return bool(value)
    if key.startswith("tokenizer.ggml.") and key.endswith(TOKEN_ID_SUFFIX):
        return _checked_int(key, value, 0, 1 << 31)
    if key.endswith(INT_SUFFIXES):
        low = 0 if key.endswith(("attention.key_length", "rope.dimension_count", "vocab_size", "expert_count",
                                 "expert_used_count", "expert_gating_func")) else 1
        return _checked_int(key, value, low, MAX_DIMENSION)
    if key.endswith(FLOAT_SUFFIXES):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(_wrong(key, value, "a finite number above 0"))
        return float(value)
    return value


def _checked_int(key: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(_wrong(key, value, "an integer"))
    if not low <= value <= high:
        raise ValueError(f"the GGUF metadata's {key} is {value}, outside {low}..{high}; the file is damaged or "
                         f"crafted")
    return value


def _checked_list(key: str, value: Any, kind: type) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(_wrong(key, value, f"an array of {kind.__name__}"))
    allowed = (int, float) if kind is float else (kind,)
    if not all(isinstance(v, allowed) and not isinstance(v, bool) for v in value):
        raise ValueError(_wrong(key, value, f"an array of {kind.__name__}"))
    return value


def _wrong(key: str, value: Any, expected: str) -> str:
    shown = f"an array of {len(value)}" if isinstance(value, list) else repr(value)[:60]
    return f"the GGUF metadata's {key} must be {expected}, got {shown}; the file is damaged or crafted"


def field(reader: Any, key: str, default: Any = None) -> Any:
    """Metadata `key` of a GGUFReader, type- and range-checked, or `default` when absent."""
    found = reader.fields.get(key)
    if found is None:
        return default
    try:
        value = found.contents()
    except (IndexError, ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"the GGUF metadata's {key} cannot be read ({type(exc).__name__}); the file is damaged") from None
    return checked_value(key, value)


def check_tensor_layout(reader: Any, path: str | os.PathLike) -> None:
    """Every tensor's data must lie inside the file's data section: offsets are recomputed with Python integers (the
    reader adds them as 64-bit numbers, so a huge offset wraps around onto the header)."""
    size = os.path.getsize(path)
    start = int(reader.data_offset)
    for t in reader.tensors:
        offset = int(t.field.parts[-1][0])
        elements = math.prod(int(d) for d in t.shape.tolist())
        first = start + offset
        if first != int(t.data_offset) or not start <= first or first + int(t.n_bytes) > size:
            raise ValueError(f"tensor {t.name}'s data (offset {offset}, {int(t.n_bytes)} bytes) lies outside the "
                             f"file's data section; the file is truncated or damaged")
        if elements != int(t.n_elements) or elements > 1 << 40:
            raise ValueError(f"tensor {t.name} declares an impossible shape {t.shape.tolist()}; the file is damaged")
