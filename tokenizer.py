"""Tokenizers for Llama-family checkpoints, behind one small interface.

`load_tokenizer(path)` looks in the checkpoint's directory and returns one of:

- `SentencePieceTokenizer` for a SentencePiece `tokenizer.model` (Llama 2, Mistral, TinyLlama, CodeLlama).
- `TiktokenTokenizer` for a tiktoken-format `tokenizer.model` (Llama 3, 3.1, 3.2).
- `HFTokenizer` for a Hugging Face `tokenizer.json` (SmolLM, Qwen, most Hub models, and GGUF conversions).

`encode(text)` gives the ids Hugging Face's `AutoTokenizer.from_pretrained(dir)(text)["input_ids"]` gives:
special-token text in the input (`<|im_start|>`) becomes its special id, and BOS/EOS are added by each
tokenizer's own rule. A tokenizer.json follows its post-processor alone (transformers 5 ignores
tokenizer_config.json's `add_bos_token`/`add_eos_token` when a tokenizer.json is present, and a file without a
post-processor adds nothing). SentencePiece and tiktoken tokenizers add BOS unless tokenizer_config.json's
`add_bos_token` says otherwise, as HF's Llama tokenizers do. `encode(text, add_special_tokens=False)` adds no
BOS/EOS; `encode_text(text)` treats special-token text as plain text as well.

`apply_chat_template(messages)` renders the checkpoint's own Jinja chat template (tokenizer_config.json's
"chat_template", or chat_template.jinja beside it) as transformers renders it, then encodes the text without
adding BOS/EOS again. Checkpoints without a template fall back to the hand-written layouts of their family:

- "llama2":  `<s>[INST] <<SYS>>\\n{system}\\n<</SYS>>\\n\\n{user} [/INST] {assistant} </s><s>[INST] {user} [/INST]`
  (SentencePiece tokenizers).
- "llama3":  `<|begin_of_text|>` then `<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>`
  for each message, then `<|start_header_id|>assistant<|end_header_id|>\\n\\n` (tiktoken tokenizers, and
  tokenizer.json vocabularies with the Llama 3 header tokens).
Any other tokenizer without a template is an error when asked for a chat prompt.
"""
from __future__ import annotations

import base64
import binascii
import functools
import json
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json")  # searched in this order
# Every file a tokenizer loader reads beside a checkpoint, copied along when a checkpoint is written elsewhere.
TOKENIZER_SIDE_FILES = TOKENIZER_FILES + (
    "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
    "generation_config.json", "config.json",
)
ROLES = ("system", "user", "assistant", "tool")
# The special-token names transformers puts into a chat template's context.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")

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
    """The interface every tokenizer offers. Subclasses set the attributes and implement `encode_text`,
    `_encode_with_specials`, `decode` and `special_token_id`; BOS/EOS rules and chat prompts live here."""

    bos_id: int | None  # None when the tokenizer has no BOS token
    eos_ids: tuple[int, ...]  # every id that ends generation; eos_ids[0] is the primary EOS
    vocab_size: int  # how many ids decode, added tokens included
    add_bos: bool = False  # whether encode(text) prepends BOS
    add_eos: bool = False  # whether encode(text) appends eos_ids[0]
    chat_template: str | None = None  # the checkpoint's Jinja chat template
    special_tokens: dict[str, str] = {}  # bos_token/eos_token/... as strings, for the template's context
    fallback_chat_format: str | None = None  # "llama2" | "llama3" | None: the layout used without a template

    def encode_text(self, text: str) -> list[int]:
        """Ids for `text` as plain text: no BOS/EOS, and special-token text is not special."""
        raise NotImplementedError

    def _encode_with_specials(self, text: str) -> list[int]:
        """Ids for `text` with special-token text turned into special ids, no BOS/EOS added."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        """Text for `ids`. Complete sequences round-trip; a sequence that ends inside a multi-byte
        character may end in U+FFFD."""
        raise NotImplementedError

    def special_token_id(self, token: str) -> int:
        """The id of a special token such as "<|eot_id|>"; KeyError when the vocabulary lacks it."""
        raise NotImplementedError

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids of the special tokens (control tokens; added tokens marked special), which decoding with
        skip_special_tokens leaves out of the text."""
        return frozenset()

    @property
    def chat_format(self) -> str:
        """"template" when the checkpoint has a chat template, else the fallback layout's name, else "none"."""
        return "template" if self.chat_template is not None else (self.fallback_chat_format or "none")

    def encode(self, text: str, add_special_tokens: bool = True, *, bos: bool | None = None,
               eos: bool | None = None) -> list[int]:
        """Ids for `text` as Hugging Face's tokenizer call gives them (see the module docstring).

        `add_special_tokens=False` adds no BOS/EOS. `bos`/`eos`, when given, choose BOS and the primary EOS
        explicitly and encode `text` as plain text (the older interface)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, not {type(text).__name__}.")
        if bos is not None or eos is not None:
            return self._with_bos_eos(self.encode_text(text), bool(bos), bool(eos))
        if not add_special_tokens:
            return self._encode_with_specials(text)
        return self._encode_with_post_processor(text)

    def _encode_with_post_processor(self, text: str) -> list[int]:
        return self._with_bos_eos(self._encode_with_specials(text), self.add_bos, self.add_eos)

    def _with_bos_eos(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        if bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if eos and self.eos_ids:
            ids.append(self.eos_ids[0])
        return ids

    def render_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                             tools: list[dict[str, Any]] | None = None,
                             template_kwargs: dict[str, Any] | None = None) -> str:
        """The checkpoint's chat template rendered for `messages`, as transformers renders it: a message's content
        may be a list of parts ({"type": "text", "text": ...}, {"type": "image"}), which multimodal templates take;
        `tools` (OpenAI-style function tools) go in as `tools=`, and `template_kwargs` (such as enable_thinking) as
        extra variables."""
        _check_messages(messages, parts=True)
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; add chat_template.jinja beside the checkpoint")
        from redline.templates import render_chat_template

        return render_chat_template(self.chat_template, **{
            **(template_kwargs or {}), **self.special_tokens, "messages": messages, "tools": tools,
            "documents": None, "add_generation_prompt": add_generation_prompt})

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Prompt ids for a conversation: the checkpoint's chat template rendered and encoded without adding
        BOS/EOS again (the template writes them), or the family's hand-written layout when there is no
        template. With `add_generation_prompt` the prompt ends where the assistant's reply starts. Tools and
        template_kwargs need a template."""
        if self.chat_template is not None:
            return self.encode_rendered(self.render_chat_template(messages, add_generation_prompt, tools,
                                                                  template_kwargs))
        if tools or template_kwargs:
            raise ValueError("this checkpoint has no chat template, so tools and chat_template_kwargs cannot be "
                             "rendered; add chat_template.jinja beside the checkpoint")
        _check_messages(messages)
        if self.fallback_chat_format == "llama2":
            return self._encode_llama2_chat(messages)
        if self.fallback_chat_format == "llama3":
            return self._encode_llama3_chat(messages, add_generation_prompt)
        raise ValueError(
            "this checkpoint has no chat template (tokenizer_config.json 'chat_template' or chat_template.jinja) "
            "and its tokenizer has no known chat layout; add a template or send a plain prompt"
        )

    def encode_rendered(self, text: str) -> list[int]:
        """Ids of a rendered chat prompt: special-token text is special, no BOS/EOS added (the template wrote them)."""
        return self._encode_with_specials(text)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """The older name of `apply_chat_template(messages)`."""
        return self.apply_chat_template(messages)

    def _bos(self) -> list[int]:
        return [] if self.bos_id is None else [self.bos_id]

    def _encode_llama2_chat(self, messages: list[dict[str, Any]]) -> list[int]:
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

    def _encode_llama3_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        start, end = self.special_token_id("<|start_header_id|>"), self.special_token_id("<|end_header_id|>")
        eot = self.special_token_id("<|eot_id|>")

        def header(role: str) -> list[int]:
            return [start, *self.encode_text(role), end, *self.encode_text("\n\n")]

        ids = self._bos()
        for m in messages:
            ids += header(m["role"]) + self.encode_text(m["content"].strip()) + [eot]
        return ids + header("assistant") if add_generation_prompt else ids


def _check_messages(messages: list[dict[str, Any]], parts: bool = False) -> None:
    """Each message a dict with a known role and str content (or, with `parts`, a list of typed part dicts)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("a chat prompt needs a non-empty list of {'role': ..., 'content': ...} messages.")
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        typed = parts and isinstance(content, list) and all(isinstance(p, dict) and "type" in p for p in content)
        calls = isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls")
        if not isinstance(m, dict) or m.get("role") not in ROLES or not (
                isinstance(content, str) or typed or calls and content is None):
            raise ValueError(
                f"Message {i} must be a dict with 'role' in {ROLES} and a str 'content'; got {m!r}."
            )


def _split_on_specials(text: str, specials: Sequence[str]) -> list[tuple[str, bool]]:
    """`text` cut into (piece, is_special) pairs, longest special strings matched first."""
    if not specials or not text:
        return [(text, False)] if text else []
    pattern = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
    pieces: list[tuple[str, bool]] = []
    start = 0
    for match in pattern.finditer(text):
        if match.start() > start:
            pieces.append((text[start:match.start()], False))
        pieces.append((match.group(), True))
        start = match.end()
    if start < len(text):
        pieces.append((text[start:], False))
    return pieces


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model (Llama 2 family). BOS/EOS come from the model; -1 there means none.
    Control pieces (`<s>`, `</s>`) and `<unk>` in the text are special, as in HF's Llama tokenizers."""

    fallback_chat_format = "llama2"
    add_bos = True

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
        ids = range(self.vocab_size)
        self.specials = {self.processor.id_to_piece(i): i for i in ids
                         if self.processor.is_control(i) or self.processor.is_unknown(i)}
        self.specials.pop("", None)
        names = {"bos_token": self.bos_id, "eos_token": eos if eos >= 0 else None, "unk_token": self.processor.unk_id()}
        self.special_tokens = {k: self.processor.id_to_piece(i) for k, i in names.items() if i is not None and i >= 0}

    def encode_text(self, text: str) -> list[int]:
        return self.processor.encode(text)

    def _encode_with_specials(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece, special in _split_on_specials(text, list(self.specials)):
            ids += [self.specials[piece]] if special else self.processor.encode(piece)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.processor.decode(list(ids))

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(self.specials.values())

    def special_token_id(self, token: str) -> int:
        token_id = self.processor.piece_to_id(token)
        if token_id == self.processor.unk_id() and token != self.processor.id_to_piece(token_id):
            raise KeyError(token)
        return token_id


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE file (`<base64 token> <rank>` per line) with the Llama 3 regex and special tokens."""

    fallback_chat_format = "llama3"
    add_bos = True

    def __init__(self, mergeable_ranks: dict[bytes, int], source: Path):
        import tiktoken

        num_base = len(mergeable_ranks)
        self.special_token_ids = {token: num_base + i for i, token in enumerate(LLAMA3_SPECIAL_TOKENS)}
        self.encoding = tiktoken.Encoding(
            name=source.name,
            pat_str=LLAMA3_PATTERN,
            mergeable_ranks=mergeable_ranks,
            special_tokens=self.special_token_ids,
        )
        self.bos_id = self.special_token_ids["<|begin_of_text|>"]
        self.eos_ids = (self.special_token_ids["<|end_of_text|>"], self.special_token_ids["<|eot_id|>"])
        self.vocab_size = num_base + len(self.special_token_ids)
        self.special_tokens = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}

    def encode_text(self, text: str) -> list[int]:
        if len(text) <= MAX_TIKTOKEN_RUN_CHARS:  # the common case: nothing to split
            return self.encoding.encode_ordinary(text)
        ids: list[int] = []
        for piece in _tiktoken_safe_pieces(text):
            ids += self.encoding.encode_ordinary(piece)
        return ids

    def _encode_with_specials(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece, special in _split_on_specials(text, list(self.special_token_ids)):
            ids += [self.special_token_ids[piece]] if special else self.encode_text(piece)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode(list(ids))  # errors="replace": a cut-off character becomes U+FFFD

    def special_token_id(self, token: str) -> int:
        return self.special_token_ids[token]

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(self.special_token_ids.values())


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
    """A Hugging Face `tokenizers` tokenizer.json, with BOS/EOS rules from the config files beside it."""

    def __init__(self, path: Path):
        import tokenizers

        from redline.tokenizer_checks import check_tokenizer_json

        try:
            check_tokenizer_json(json.loads(path.read_text(encoding="utf-8")), path)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            pass  # the library's own error below names the problem
        except RecursionError:
            raise ValueError(f"{path} nests its JSON too deeply to be a tokenizer; fix or re-download it") from None
        try:
            self.tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception with a serde message
            raise ValueError(f"{path} is not a readable Hugging Face tokenizer.json ({exc}).") from exc
        config = _read_json(path.parent / "tokenizer_config.json")
        self.split_special_tokens = bool(config.get("split_special_tokens", False))
        self.tokenizer.encode_special_tokens = self.split_special_tokens  # False: special text in input is special
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_tokens = _special_token_strings(path.parent, config)
        self.bos_id, self.eos_ids = self._bos_and_eos(path.parent)
        added = self.tokenizer.encode("", add_special_tokens=True).ids  # what the post-processor adds
        self.add_bos = bool(added) and added[0] == self.bos_id
        self.add_eos = bool(added) and added[-1] in self.eos_ids
        has_llama3_headers = self.tokenizer.token_to_id("<|start_header_id|>") is not None
        self.fallback_chat_format = "llama3" if has_llama3_headers else None

    def _bos_and_eos(self, directory: Path) -> tuple[int | None, tuple[int, ...]]:
        """tokenizer_config.json's bos_token/eos_token, else config.json's bos_token_id/eos_token_id."""
        bos = self._token_config_id(self.special_tokens.get("bos_token"))
        eos = self._token_config_id(self.special_tokens.get("eos_token"))
        config_path = directory / "config.json"
        config = _read_json(config_path)
        if bos is None:
            bos = next(iter(_id_list(config.get("bos_token_id"), config_path)), None)
        eos_ids = (eos,) if eos is not None else _id_list(config.get("eos_token_id"), config_path)
        return bos, eos_ids

    def _token_config_id(self, token: str | None) -> int | None:
        return self.tokenizer.token_to_id(token) if isinstance(token, str) else None

    def encode_text(self, text: str) -> list[int]:
        self.tokenizer.encode_special_tokens = True
        try:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        finally:
            self.tokenizer.encode_special_tokens = self.split_special_tokens

    def _encode_with_specials(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _encode_with_post_processor(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(i for i, token in self.tokenizer.get_added_tokens_decoder().items() if token.special)

    def special_token_id(self, token: str) -> int:
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise KeyError(token)
        return token_id


def _special_token_strings(directory: Path, config: dict[str, Any]) -> dict[str, str]:
    """bos_token/eos_token/... as strings, from tokenizer_config.json, else special_tokens_map.json."""
    fallback = _read_json(directory / "special_tokens_map.json")
    out: dict[str, str] = {}
    for name in SPECIAL_TOKEN_NAMES:
        token = config.get(name, fallback.get(name))
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str):
            out[name] = token
    return out


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer in the directory `path` names, or in the directory of the file it names.

    Looks for `tokenizer.model` (SentencePiece or tiktoken, told apart by content), then
    `tokenizer.json`. A path naming one of those files directly loads that file. Ids listed in a
    `generation_config.json` beside it are added to `eos_ids`; the chat template comes from
    chat_template.jinja, else tokenizer_config.json's "chat_template"."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; pass a checkpoint file or its directory.")
    directory = path if path.is_dir() else path.parent
    from redline.outputs import check_inside

    for name in TOKENIZER_SIDE_FILES:  # every file read from the folder must lie inside it (no symlink out)
        if (directory / name).exists():
            check_inside(directory / name, directory)
    candidates = [path] if path.name in TOKENIZER_FILES else [directory / name for name in TOKENIZER_FILES]
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        raise FileNotFoundError(
            f"No tokenizer in {directory}: expected {' or '.join(TOKENIZER_FILES)} there; "
            "download the tokenizer files next to the checkpoint."
        )
    tokenizer = _load_tokenizer_file(found)
    config = _read_json(directory / "tokenizer_config.json")
    if not isinstance(tokenizer, HFTokenizer):
        _apply_config_to_model_tokenizer(tokenizer, config, directory)
    tokenizer.chat_template = _chat_template(directory, config)
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


def _apply_config_to_model_tokenizer(tokenizer: Tokenizer, config: dict[str, Any], directory: Path) -> None:
    """tokenizer_config.json's add_bos_token/add_eos_token and token names, for a tokenizer.model."""
    tokenizer.add_bos = bool(config.get("add_bos_token", True))
    tokenizer.add_eos = bool(config.get("add_eos_token", False))
    named = _special_token_strings(directory, config)
    tokenizer.special_tokens = {**tokenizer.special_tokens, **named}
    eos = named.get("eos_token")
    if eos is not None:
        try:
            eos_id = tokenizer.special_token_id(eos)
        except KeyError:
            return
        tokenizer.eos_ids = tuple(dict.fromkeys((eos_id, *tokenizer.eos_ids)))


def _chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's "chat_template" (a string, or a list of named
    templates of which "default" is taken), else chat_template.json's, else None."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read {jinja} ({exc}); fix or remove it") from exc
    template = config.get("chat_template", _read_json(directory / "chat_template.json").get("chat_template"))
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(f"{directory / 'tokenizer_config.json'}: chat_template is a list of named templates "
                             f"({', '.join(map(str, named))}) without a 'default' one; name one 'default'")
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{directory / 'tokenizer_config.json'}: chat_template must be a string; fix or remove it")
    return template


def copy_tokenizer_files(src_dir: str | os.PathLike, dst_dir: str | os.PathLike, overwrite: bool = False,
                         inputs: Sequence[str | os.PathLike] = ()) -> list[Path]:
    """Copy every tokenizer, chat-template and generation-config file in `src_dir` to `dst_dir`, each written
    atomically; returns the files written. Nothing is copied when both name the same folder. Checked first (see
    tokenizer_files_to_copy); with `overwrite`, side files of another model left in `dst_dir` are removed."""
    from redline.checkpoint import write_atomically

    src, dst = Path(src_dir), Path(dst_dir)
    todo = tokenizer_files_to_copy(src, dst, overwrite, inputs)
    written = []
    for name, source in todo.items():
        write_atomically(dst / name, lambda tmp, source=source: shutil.copyfile(source, tmp))
        written.append(dst / name)
    for name in TOKENIZER_SIDE_FILES:
        if overwrite and not (src / name).is_file() and (dst / name).is_file():
            (dst / name).unlink()
    return written


def tokenizer_files_to_copy(src: Path, dst: Path, overwrite: bool = False,
                            inputs: Sequence[str | os.PathLike] = ()) -> dict[str, Path]:
    """The side files copy_tokenizer_files will write (name: source), checked before any work: sources must lie
    inside `src` (no symlink out of it), and a different file already in `dst` (another model's) is replaced only
    with `overwrite`."""
    from redline.outputs import check_inside, side_files_to_write

    if not src.is_dir():
        raise FileNotFoundError(f"{src} is not a folder; pass the checkpoint's folder")
    if dst.exists() and dst.resolve() == src.resolve():
        return {}
    sources = {name: check_inside(src / name, src) for name in TOKENIZER_SIDE_FILES if (src / name).is_file()}
    return side_files_to_write(sources, dst, [*inputs, *sources.values()], overwrite, exclusive=TOKENIZER_SIDE_FILES)


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
        raise ValueError(f"{path} is not valid JSON ({exc}); fix or remove it.") from None
    except RecursionError:
        raise ValueError(f"{path} nests its JSON too deeply; fix or remove it.") from None
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
