"""The tokenizer files a GGUF file describes, written beside its converted checkpoint.

- GPT-2 style byte-level BPE (`tokenizer.ggml.model == "gpt2"`): tokenizer.json built with the `tokenizers` library.
- Llama SentencePiece (`"llama"`): tokenizer.model, a SentencePiece ModelProto built from the vocabulary,
  scores and token types.
Both get a tokenizer_config.json (special tokens, add_bos_token/add_eos_token, the chat template) and a
generation_config.json (BOS and every EOS id).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from redline.checkpoint import write_atomically
from redline.outputs import side_files_to_write
from redline.scripts import gguf_metadata
from redline.tokenizer import LLAMA3_PATTERN, TOKENIZER_SIDE_FILES

# GGUF token types (llama.cpp's llama_token_type); SentencePiece numbers its piece types the same way.
TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_BYTE = 3, 4, 6
# The pre-tokenizer regexes of the `tokenizer.ggml.pre` names Redline knows; None is GPT-2's own regex.
PRE_TOKENIZER_REGEX = {
    "default": None, "gpt2": None, "gpt-2": None, "smollm": None,
    "llama3": LLAMA3_PATTERN, "llama-v3": LLAMA3_PATTERN, "llama-bpe": LLAMA3_PATTERN, "smaug-bpe": LLAMA3_PATTERN,
    "dbrx": LLAMA3_PATTERN,
}
# GGUF keys naming special tokens, and the tokenizer_config.json names they become.
SPECIAL_ID_KEYS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                   "pad_token": "padding_token_id"}
# Ids that end a turn besides EOS (end of turn, end of message), as llama.cpp names them.
EXTRA_EOS_KEYS = ("eot_token_id", "eom_token_id")


def _field(reader: Any, key: str, default: Any = None) -> Any:
    return gguf_metadata.field(reader, key, default)


def check_vocabulary(reader: Any, tokens: list[str], types: list[int]) -> None:
    """Refuse token ids past the vocabulary, per-token arrays of another length, and merges that are not pairs."""
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id", *EXTRA_EOS_KEYS):
        token_id = _field(reader, f"tokenizer.ggml.{key}")
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise ValueError(f"the GGUF metadata's tokenizer.ggml.{key} is {token_id}, outside the vocabulary of "
                             f"{len(tokens)} tokens; the file is damaged")
    for key, values in (("token_type", types), ("scores", _field(reader, "tokenizer.ggml.scores"))):
        if values is not None and len(values) != len(tokens):
            raise ValueError(f"the GGUF metadata's tokenizer.ggml.{key} has {len(values)} entries for {len(tokens)} "
                             f"tokens; the file is damaged")
    bad = next((m for m in _field(reader, "tokenizer.ggml.merges") or [] if " " not in m.strip(" ")), None)
    if bad is not None:
        raise ValueError(f"the GGUF metadata's tokenizer.ggml.merges holds {bad[:40]!r}, not two tokens separated by "
                         f"a space; the file is damaged")


def tokenizer_files(reader: Any) -> dict[str, bytes]:
    """The tokenizer, tokenizer_config.json and generation_config.json for `reader`, by file name; empty when the
    GGUF file carries no tokenizer. Raises ValueError for a tokenizer kind Redline cannot rebuild."""
    kind = _field(reader, "tokenizer.ggml.model")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if kind is None or not tokens:
        return {}
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    check_vocabulary(reader, tokens, types)
    if kind == "gpt2":
        try:
            files = {"tokenizer.json": byte_level_tokenizer_json(reader, tokens, types).encode("utf-8")}
        except ValueError:
            raise
        except Exception as exc:  # the tokenizers library raises a bare Exception for an inconsistent vocabulary
            raise ValueError(f"the GGUF file's BPE vocabulary and merges do not form a tokenizer "
                             f"({' '.join(str(exc).split())[:120]}); the file is damaged") from None
        default_add_bos = False
    elif kind == "llama":
        files = {"tokenizer.model": sentencepiece_model(reader, tokens, types)}
        default_add_bos = True
    else:
        raise ValueError(f"unsupported GGUF tokenizer {kind!r}; Redline converts 'gpt2' (BPE) and 'llama' (SentencePiece)")
    files["tokenizer_config.json"] = _json(tokenizer_config(reader, tokens, default_add_bos))
    files["generation_config.json"] = _json(generation_config(reader))
    return files


def write_tokenizer_files(files: dict[str, bytes], out_dir: Path, overwrite: bool = False) -> list[Path]:
    """Write `files` into `out_dir`, each atomically. Another model's side files there (a tokenizer of the other
    kind, which would be loaded first or mixed with these) are refused, and with `overwrite` replaced or removed."""
    todo = side_files_to_write(files, out_dir, (), overwrite, exclusive=TOKENIZER_SIDE_FILES if files else ())
    written = [_write(out_dir / name, data) for name, data in todo.items()]
    for other in TOKENIZER_SIDE_FILES:
        if files and overwrite and other not in files and (out_dir / other).is_file():
            (out_dir / other).unlink()
    return written


def tokenizer_config(reader: Any, tokens: list[str], default_add_bos: bool) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for name, key in SPECIAL_ID_KEYS.items():
        token_id = _field(reader, f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= token_id < len(tokens):
            config[name] = tokens[token_id]
    config["add_bos_token"] = bool(_field(reader, "tokenizer.ggml.add_bos_token", default_add_bos))
    config["add_eos_token"] = bool(_field(reader, "tokenizer.ggml.add_eos_token", False))
    template = _field(reader, "tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return config


def generation_config(reader: Any) -> dict[str, Any]:
    eos = [_field(reader, f"tokenizer.ggml.{key}") for key in ("eos_token_id", *EXTRA_EOS_KEYS)]
    config: dict[str, Any] = {"eos_token_id": list(dict.fromkeys(i for i in eos if i is not None))}
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if bos is not None:
        config["bos_token_id"] = bos
    return config


def byte_level_tokenizer_json(reader: Any, tokens: list[str], types: list[int]) -> str:
    """tokenizer.json for a byte-level BPE vocabulary: the merges, the pre-tokenizer regex its `pre` names,
    control tokens as special added tokens and user-defined tokens as plain added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_REGEX:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; Redline knows {', '.join(sorted(PRE_TOKENIZER_REGEX))}")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_spelling = _bytes_to_unicode()
    vocab = {_byte_spelled(t, alphabet, byte_spelling): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in (_field(reader, "tokenizer.ggml.merges") or [])]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    regex = PRE_TOKENIZER_REGEX[pre]
    if regex is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    spelled_only = set(alphabet)
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types)
               if k == TOKEN_CONTROL and set(t) <= spelled_only]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == TOKEN_USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    bos, eos = _field(reader, "tokenizer.ggml.bos_token_id"), _field(reader, "tokenizer.ggml.eos_token_id")
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:  # the post-processor is what decides, for transformers and for Redline alike
        ends = [(tokens[bos], bos)] * add_bos + [(tokens[eos], eos)] * add_eos
        single = " ".join([f"{tokens[bos]}:0"] * add_bos + ["$A:0"] + [f"{tokens[eos]}:0"] * add_eos)
        pair = single + " " + " ".join([f"{tokens[bos]}:1"] * add_bos + ["$B:1"] + [f"{tokens[eos]}:1"] * add_eos)
        tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=ends)
    return tok.to_str()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte: printable Latin-1 bytes as themselves, the rest from U+0100 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def _byte_spelled(token: str, alphabet: list[str], spelling: dict[int, str]) -> str:
    """A token in the byte-level alphabet (as GGUF stores normal tokens), else its UTF-8 bytes spelled so."""
    if set(token) <= set(alphabet):
        return token
    return "".join(spelling[b] for b in token.encode("utf-8"))


def sentencepiece_model(reader: Any, tokens: list[str], types: list[int]) -> bytes:
    """A serialized SentencePiece ModelProto (BPE) for a GGUF "llama" vocabulary."""
    scores = _field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
    pieces = b"".join(_message(1, _string(1, t) + _float(2, s) + _varint_field(3, k))
                      for t, s, k in zip(tokens, scores, types))
    ids = {key: _field(reader, f"tokenizer.ggml.{key}") for key in ("unknown_token_id", "bos_token_id", "eos_token_id",
                                                                    "padding_token_id")}
    trainer = (_varint_field(3, 2) + _varint_field(4, len(tokens)) + _varint_field(35, int(TOKEN_BYTE in types))
               + b"".join(_varint_field(number, -1 if ids[key] is None else ids[key])
                          for number, key in zip((40, 41, 42, 43), ids)))
    dummy_prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", True))
    normalizer = _string(1, "identity") + _varint_field(3, int(dummy_prefix)) + _varint_field(4, 0) + _varint_field(5, 1)
    return pieces + _message(2, trainer) + _message(3, normalizer)


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int32 values are written as 10-byte two's complement, as protobuf does
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _varint_field(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _float(number: int, value: float) -> bytes:
    return _varint(number << 3 | 5) + struct.pack("<f", value)


def _string(number: int, value: str) -> bytes:
    return _message(number, value.encode("utf-8"))


def _message(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _json(value: dict[str, Any]) -> bytes:
    return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _write(path: Path, data: bytes) -> Path:
    write_atomically(path, lambda tmp: tmp.write_bytes(data))  # the umask decides its mode, as for any new file
    return path
