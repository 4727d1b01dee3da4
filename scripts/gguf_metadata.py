"""GGUF metadata and tensor layout, type- and range-checked before anything is built from them.

A GGUF file is untrusted input: a value of the wrong type (an array where a number belongs), out of range (zero heads,
a billion layers, a token id past the vocabulary) or a tensor whose data lies outside the file is a one-line
ValueError here, never a traceback or a loop later.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
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
# Bytes of one metadata value of each fixed-size GGUF type (8 is a string, 9 an array: both sized by a count).
FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
MAX_TENSOR_DIMS = 8  # GGML_MAX_DIMS is 4; anything past 8 is a damaged file


def check_header(path: str | os.PathLike) -> None:
    """Walk the GGUF header (metadata and tensor table) once, checking every declared count against the bytes left in
    the file before anything loops over it: a 1 KB file declaring an array of 2^40 items is refused here, at once,
    where the gguf package's reader would walk the count past the file's end. Fixed-size arrays are skipped by
    arithmetic; the work is bounded by the file's size."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise ValueError(f"{os.fspath(path)} is {size} bytes, too short for a GGUF header; re-download it")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            _HeaderWalk(data, size).walk()


class _HeaderWalk:
    """A cursor over a GGUF header whose every read is bounds-checked (see check_header)."""

    def __init__(self, data: Any, size: int) -> None:
        self.data, self.size, self.offset = data, size, 0
        self.order = "<"

    def walk(self) -> None:
        if bytes(self.data[:4]) != b"GGUF":
            raise ValueError("the file does not start with the GGUF magic; it is not a GGUF file")
        self.offset = 4
        if self.read("I") & 0xFFFF == 0:  # written on a big-endian machine (the gguf reader's own test)
            self.order = ">"
        tensors, keys = self.read("Q"), self.read("Q")
        self.check_count(keys, 8 + 8 + 4, "metadata keys")
        for _ in range(keys):
            self.string("a metadata key")
            self.value(self.read("I"), depth=0)
        self.check_count(tensors, 8 + 4 + 4 + 8, "tensors")
        for _ in range(tensors):
            self.string("a tensor name")
            dims = self.read("I")
            if dims > MAX_TENSOR_DIMS:
                raise ValueError(f"a tensor declares {dims} dimensions (at most {MAX_TENSOR_DIMS}); the file is damaged")
            self.skip(8 * dims + 4 + 8, "a tensor's shape, type and offset")

    def read(self, fmt: str) -> int:
        width = struct.calcsize(fmt)
        if self.offset + width > self.size:
            raise ValueError(f"the GGUF header runs past the file's end at byte {self.offset}; the file is truncated")
        (value,) = struct.unpack_from(self.order + fmt, self.data, self.offset)
        self.offset += width
        return value

    def skip(self, n: int, what: str) -> None:
        if self.offset + n > self.size:
            raise ValueError(f"{what} at byte {self.offset} declares {n} bytes, past the file's end ({self.size} "
                             f"bytes); the file is damaged or crafted")
        self.offset += n

    def check_count(self, count: int, smallest: int, what: str) -> None:
        if count * smallest > self.size - self.offset:
            raise ValueError(f"the GGUF header declares {count} {what} at byte {self.offset}, more than the "
                             f"{self.size - self.offset} bytes left in the file hold; the file is damaged or crafted")

    def string(self, what: str) -> None:
        self.skip(self.read("Q"), what)

    def value(self, kind: int, depth: int) -> None:
        if kind in FIXED_SIZES:
            self.skip(FIXED_SIZES[kind], "a metadata value")
        elif kind == STRING:
            self.string("a metadata string")
        elif kind == ARRAY:
            if depth >= 4:
                raise ValueError("a GGUF metadata array nests more than 4 deep; the file is damaged or crafted")
            item, count = self.read("I"), self.read("Q")
            if item in FIXED_SIZES:
                self.skip(count * FIXED_SIZES[item], f"a metadata array of {count} items")
                return
            self.check_count(count, 8 if item == STRING else 12, "array items")
            for _ in range(count):
                self.value(item, depth + 1)
        else:
            raise ValueError(f"a GGUF metadata value has unknown type {kind}; the file is damaged or crafted")


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
