"""Tokenizers for Llama-family checkpoints, behind one small interface.

`load_tokenizer(path)` looks in the checkpoint's directory and returns one of:

- `SentencePieceTokenizer` for a SentencePiece `tokenizer.model` (Llama 2, Mistral, TinyLlama, CodeLlama);
  chat format "llama2".
- `TiktokenTokenizer` for a tiktoken-format `tokenizer.model` (Llama 3, 3.1, 3.2); chat format "llama3".
- `HFTokenizer` for a Hugging Face `tokenizer.json`; chat format "llama3" when the vocabulary has the
  Llama 3 header tokens, otherwise "plain".

Every tokenizer encodes user text as plain text: text that looks like a special token (`<|eot_id|>`,
`<s>`) never turns into a special id. Special ids come only from `bos=True`, `eos=True` and `encode_chat`.

Chat formats, as `encode_chat` lays them out (`content` is stripped of surrounding whitespace, as the
Llama reference code and chat templates do):

- "llama2":  `<s>[INST] <<SYS>>\\n{system}\\n<</SYS>>\\n\\n{user} [/INST] {assistant} </s><s>[INST] {user} [/INST]`
  (an optional leading system message, then user/assistant turns ending with a user turn).
- "llama3":  `<|begin_of_text|>` then `<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>`
  for each message, then `<|start_header_id|>assistant<|end_header_id|>\\n\\n`.
- "plain":   BOS (when the tokenizer has one), then one `{role}: {content}\\n` line per message, then
  `assistant: `. For base models without a chat template.
"""
from __future__ import annotations

import base64
import binascii
import json
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json")  # searched in this order
ROLES = ("system", "user", "assistant")

# Llama 3: the pre-tokenizer regex and the 256 special tokens that follow the base vocabulary.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_NUM_SPECIAL_TOKENS = 256
LLAMA3_NAMED_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
)
LLAMA3_SPECIAL_TOKENS = LLAMA3_NAMED_SPECIAL_TOKENS + tuple(
    f"<|reserved_special_token_{3 + i}|>"
    for i in range(LLAMA3_NUM_SPECIAL_TOKENS - len(LLAMA3_NAMED_SPECIAL_TOKENS))
)

# tiktoken can crash or take very long on huge inputs, above all on long runs of whitespace or of
# non-whitespace, so long text is encoded in pieces of at most this many characters, and a single
# run of (non-)whitespace is cut into slices of at most MAX_TIKTOKEN_RUN_CHARS.
MAX_TIKTOKEN_CHUNK_CHARS = 400_000
MAX_TIKTOKEN_RUN_CHARS = 25_000
_WHITESPACE_OR_NOT_RUN = re.compile(r"\s+|\S+")
_TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+=*\s+\d+")


class Tokenizer:
    """The interface every tokenizer offers. Subclasses set the four attributes and implement
    `encode_text`, `decode` and `special_token_id`; BOS/EOS handling and chat layouts live here."""

    bos_id: int | None  # None when the tokenizer has no BOS token
    eos_ids: tuple[int, ...]  # every id that ends generation; eos_ids[0] is the one `encode(eos=True)` appends
    vocab_size: int
    chat_format: str  # "llama2" | "llama3" | "plain"

    def encode_text(self, text: str) -> list[int]:
        """Ids for `text` as plain text: no BOS/EOS, and special-token text is not special."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        """Text for `ids`. Complete sequences round-trip; a sequence that ends inside a multi-byte
        character may end in U+FFFD."""
        raise NotImplementedError

    def special_token_id(self, token: str) -> int:
        """The id of a special token such as "<|eot_id|>"; KeyError when the vocabulary lacks it."""
        raise NotImplementedError

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Ids for `text`, with BOS prepended and the primary EOS appended when asked for
        (and when the tokenizer has them)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, not {type(text).__name__}.")
        ids = self.encode_text(text)
        if bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if eos and self.eos_ids:
            ids.append(self.eos_ids[0])
        return ids

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Prompt ids for a conversation, BOS first, ending where the assistant's reply starts.
        The layouts are described in this module's docstring."""
        _check_messages(messages)
        if self.chat_format == "llama2":
            return self._encode_llama2_chat(messages)
        if self.chat_format == "llama3":
            return self._encode_llama3_chat(messages)
        return self._encode_plain_chat(messages)

    def _bos(self) -> list[int]:
        return [] if self.bos_id is None else [self.bos_id]

    def _encode_llama2_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if len(messages) > 1 and messages[0]["role"] == "system" and messages[1]["role"] == "user":
            system, first = messages[0]["content"].strip(), messages[1]["content"].strip()
            merged = {"role": "user", "content": f"<<SYS>>\n{system}\n<</SYS>>\n\n{first}"}
            messages = [merged, *messages[2:]]
        roles = [m["role"] for m in messages]
        if roles[-1] != "user" or any(r != ("user" if i % 2 == 0 else "assistant") for i, r in enumerate(roles)):
            raise ValueError(
                "The llama2 chat format needs an optional system message followed by alternating "
                f"user/assistant messages that ends with a user message; got roles {roles}."
            )
        eos = list(self.eos_ids[:1])
        ids: list[int] = []
        for user, assistant in zip(messages[:-1:2], messages[1::2]):
            turn = f"[INST] {user['content'].strip()} [/INST] {assistant['content'].strip()} "
            ids += self._bos() + self.encode_text(turn) + eos
        ids += self._bos() + self.encode_text(f"[INST] {messages[-1]['content'].strip()} [/INST]")
        return ids

    def _encode_llama3_chat(self, messages: list[dict[str, str]]) -> list[int]:
        start, end = self.special_token_id("<|start_header_id|>"), self.special_token_id("<|end_header_id|>")
        eot = self.special_token_id("<|eot_id|>")

        def header(role: str) -> list[int]:
            return [start, *self.encode_text(role), end, *self.encode_text("\n\n")]

        ids = self._bos()
        for m in messages:
            ids += header(m["role"]) + self.encode_text(m["content"].strip()) + [eot]
        return ids + header("assistant")

    def _encode_plain_chat(self, messages: list[dict[str, str]]) -> list[int]:
        lines = "".join(f"{m['role']}: {m['content'].strip()}\n" for m in messages)
        return self._bos() + self.encode_text(lines + "assistant: ")


def _check_messages(messages: list[dict[str, str]]) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("encode_chat() needs a non-empty list of {'role': ..., 'content': ...} messages.")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(
                f"Message {i} must be a dict with 'role' in {ROLES} and a str 'content'; got {m!r}."
            )


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model (Llama 2 family). BOS/EOS come from the model; -1 there means none."""

    chat_format = "llama2"

    def __init__(self, model_proto: bytes, source: Path):
        import sentencepiece

        try:
            self.processor = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
        except Exception as exc:  # sentencepiece raises RuntimeError/OSError with a C++ message
            raise ValueError(f"{source} is not a readable SentencePiece model ({exc}).") from exc
        if self.processor.vocab_size() == 0:  # e.g. an empty file parses as an empty protobuf
            raise ValueError(f"{source} is not a readable SentencePiece model (it holds no pieces).")
        bos, eos = self.processor.bos_id(), self.processor.eos_id()
        self.bos_id = bos if bos >= 0 else None
        self.eos_ids = (eos,) if eos >= 0 else ()
        self.vocab_size = self.processor.vocab_size()

    def encode_text(self, text: str) -> list[int]:
        return self.processor.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.processor.decode(list(ids))

    def special_token_id(self, token: str) -> int:
        token_id = self.processor.piece_to_id(token)
        if token_id == self.processor.unk_id() and token != self.processor.id_to_piece(token_id):
            raise KeyError(token)
        return token_id


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE file (`<base64 token> <rank>` per line) with the Llama 3 regex and special tokens."""

    chat_format = "llama3"

    def __init__(self, mergeable_ranks: dict[bytes, int], source: Path):
        import tiktoken

        num_base = len(mergeable_ranks)
        self.special_tokens = {token: num_base + i for i, token in enumerate(LLAMA3_SPECIAL_TOKENS)}
        self.encoding = tiktoken.Encoding(
            name=source.name,
            pat_str=LLAMA3_PATTERN,
            mergeable_ranks=mergeable_ranks,
            special_tokens=self.special_tokens,
        )
        self.bos_id = self.special_tokens["<|begin_of_text|>"]
        self.eos_ids = (self.special_tokens["<|end_of_text|>"], self.special_tokens["<|eot_id|>"])
        self.vocab_size = num_base + len(self.special_tokens)

    def encode_text(self, text: str) -> list[int]:
        if len(text) <= MAX_TIKTOKEN_RUN_CHARS:  # the common case: nothing to split
            return self.encoding.encode_ordinary(text)
        ids: list[int] = []
        for piece in _tiktoken_safe_pieces(text):
            ids += self.encoding.encode_ordinary(piece)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode(list(ids))  # errors="replace": a cut-off character becomes U+FFFD

    def special_token_id(self, token: str) -> int:
        return self.special_tokens[token]


def _tiktoken_safe_pieces(text: str) -> Iterator[str]:
    """Consecutive pieces of `text`, each at most MAX_TIKTOKEN_CHUNK_CHARS long and with no run of
    whitespace or non-whitespace longer than MAX_TIKTOKEN_RUN_CHARS. Pieces are cut between runs
    where possible, so that only pathological inputs tokenize differently from one tiktoken call."""
    start = 0  # where the piece being built starts
    for run in _WHITESPACE_OR_NOT_RUN.finditer(text):
        run_start, run_end = run.span()
        if run_end - start > MAX_TIKTOKEN_CHUNK_CHARS and run_start > start:
            yield text[start:run_start]
            start = run_start
        while run_end - start > MAX_TIKTOKEN_RUN_CHARS and run_end - run_start > MAX_TIKTOKEN_RUN_CHARS:
            cut = max(start, run_start) + MAX_TIKTOKEN_RUN_CHARS
            yield text[start:cut]
            start = run_start = cut
    if start < len(text):
        yield text[start:]


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer.json, with BOS/EOS from the config files beside it."""

    def __init__(self, path: Path):
        import tokenizers

        try:
            self.tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception with a serde message
            raise ValueError(f"{path} is not a readable Hugging Face tokenizer.json ({exc}).") from exc
        self.tokenizer.encode_special_tokens = True  # special-token text in user input stays plain text
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.eos_ids = self._bos_and_eos(path.parent)
        has_llama3_headers = self.tokenizer.token_to_id("<|start_header_id|>") is not None
        self.chat_format = "llama3" if has_llama3_headers else "plain"

    def _bos_and_eos(self, directory: Path) -> tuple[int | None, tuple[int, ...]]:
        """tokenizer_config.json's bos_token/eos_token, else config.json's bos_token_id/eos_token_id."""
        tokenizer_config = _read_json(directory / "tokenizer_config.json")
        bos = self._token_config_id(tokenizer_config.get("bos_token"))
        eos = self._token_config_id(tokenizer_config.get("eos_token"))
        config_path = directory / "config.json"
        config = _read_json(config_path)
        if bos is None:
            bos = next(iter(_id_list(config.get("bos_token_id"), config_path)), None)
        eos_ids = (eos,) if eos is not None else _id_list(config.get("eos_token_id"), config_path)
        return bos, eos_ids

    def _token_config_id(self, token: str | dict[str, Any] | None) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        return self.tokenizer.token_to_id(token) if isinstance(token, str) else None

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def special_token_id(self, token: str) -> int:
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise KeyError(token)
        return token_id


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer in the directory `path` names, or in the directory of the file it names.

    Looks for `tokenizer.model` (SentencePiece or tiktoken, told apart by content), then
    `tokenizer.json`. A path naming one of those files directly loads that file. Ids listed in a
    `generation_config.json` beside it are added to `eos_ids`."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; pass a checkpoint file or its directory.")
    directory = path if path.is_dir() else path.parent
    candidates = [path] if path.name in TOKENIZER_FILES else [directory / name for name in TOKENIZER_FILES]
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        raise FileNotFoundError(
            f"No tokenizer in {directory}: expected {' or '.join(TOKENIZER_FILES)} there; "
            "download the tokenizer files next to the checkpoint."
        )
    tokenizer = _load_tokenizer_file(found)
    generation_config_path = directory / "generation_config.json"
    extra_eos = _id_list(_read_json(generation_config_path).get("eos_token_id"), generation_config_path)
    tokenizer.eos_ids = tuple(dict.fromkeys(tokenizer.eos_ids + extra_eos))  # dedupe, keep order
    bad = [i for i in (tokenizer.bos_id, *tokenizer.eos_ids) if i is not None and not 0 <= i < tokenizer.vocab_size]
    if bad:
        raise ValueError(
            f"Special token ids {bad} from the files in {directory} are outside the tokenizer's "
            f"vocabulary of {tokenizer.vocab_size}; check that the config files match {found.name}."
        )
    return tokenizer


def _load_tokenizer_file(path: Path) -> Tokenizer:
    if path.name == "tokenizer.json":
        return HFTokenizer(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"Cannot read the tokenizer file {path} ({exc}).") from exc
    ranks = _parse_tiktoken_ranks(data, path)
    if ranks is not None:
        return TiktokenTokenizer(ranks, path)
    return SentencePieceTokenizer(data, path)


def _parse_tiktoken_ranks(data: bytes, path: Path) -> dict[bytes, int] | None:
    """The mergeable ranks of a tiktoken-format file, or None when `data` does not look like one
    (then it may be a SentencePiece protobuf). Raises ValueError for a damaged tiktoken file."""
    lines = data.splitlines()
    first = next((line.strip() for line in lines if line.strip()), b"")
    if not _TIKTOKEN_LINE.fullmatch(first):
        return None
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if not _TIKTOKEN_LINE.fullmatch(line.strip()):
            raise ValueError(f"{path} line {number} is not `<base64 token> <rank>`; the tiktoken file is damaged.")
        token, rank = line.split()
        try:
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except binascii.Error as exc:
            raise ValueError(f"{path} line {number} has invalid base64 ({exc}); the tiktoken file is damaged.") from exc
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path} must hold unique tokens with ranks 0..{len(ranks) - 1}, each once.")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{path} lacks {len(missing)} of the 256 single-byte tokens; the tiktoken file is damaged.")
    return ranks


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} when there is no such file."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); fix or remove it.") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object.")
    return value


def _id_list(value: Any, source: Path) -> tuple[int, ...]:
    """A token id field that may be absent, one int, or a list of ints."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{source}: token ids must be an int or a list of ints, got {value!r}.")
    return tuple(values)
