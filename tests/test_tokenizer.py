"""Tests for tokenizer.py, on tiny tokenizers trained on the fly (fixtures in conftest.py)."""
from __future__ import annotations

import json
import shutil

import pytest
import sentencepiece as spm

from redline import tokenizer as tk
from redline.tokenizer import load_tokenizer

TOKENIZER_DIRS = ["sp_tokenizer_dir", "tiktoken_tokenizer_dir", "hf_tokenizer_dir"]

ROUND_TRIP_TEXTS = [
    "Hello, world! The quick brown fox.",
    "def f(x):\n    if x:\n\treturn x  # tab\n    return None\n\n\nprint(f(1))\n",
    "  leading and trailing spaces  ",
    "héllo wörld 日本語 🚀 🦙 👍🏽 Straße",
    "mixed: naïve→café ✓ ∑ x² ≥ 0, 中文 and English\r\nnext line",
    "",
]


def _num_base_tokens(directory) -> int:
    return len((directory / "tokenizer.model").read_text().splitlines())


def _copy(directory, tmp_path):
    return shutil.copytree(directory, tmp_path / "tokenizer")


@pytest.mark.parametrize("dir_fixture", TOKENIZER_DIRS)
@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip(dir_fixture, text, request):
    tok = load_tokenizer(request.getfixturevalue(dir_fixture))
    ids = tok.encode(text, add_special_tokens=False)
    assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode(text) == [tok.bos_id] * tok.add_bos + ids


@pytest.mark.parametrize("dir_fixture", TOKENIZER_DIRS)
def test_round_trip_sample_text(dir_fixture, request, tokenizer_sample_text):
    tok = load_tokenizer(request.getfixturevalue(dir_fixture))
    assert tok.decode(tok.encode(tokenizer_sample_text, add_special_tokens=False)) == tokenizer_sample_text


@pytest.mark.parametrize("dir_fixture", TOKENIZER_DIRS)
def test_decoding_any_prefix_is_safe(dir_fixture, request):
    tok = load_tokenizer(request.getfixturevalue(dir_fixture))
    text = "a🚀b日本語é"
    ids = tok.encode(text, add_special_tokens=False)
    for end in range(len(ids)):
        assert isinstance(tok.decode(ids[:end]), str)  # may end in U+FFFD, must not raise
    assert tok.decode(ids) == text


@pytest.mark.parametrize(
    "dir_fixture, chat_format",
    [("sp_tokenizer_dir", "llama2"), ("tiktoken_tokenizer_dir", "llama3"), ("hf_tokenizer_dir", "none")],
)
def test_kind_and_chat_format(dir_fixture, chat_format, request):
    tok = load_tokenizer(request.getfixturevalue(dir_fixture))
    assert isinstance(tok, tk.Tokenizer)
    assert tok.chat_format == chat_format


@pytest.mark.parametrize("dir_fixture", TOKENIZER_DIRS)
def test_bos_and_eos_flags(dir_fixture, request):
    tok = load_tokenizer(request.getfixturevalue(dir_fixture))
    plain = tok.encode("hello world", add_special_tokens=False)
    assert tok.encode("hello world", bos=True) == [tok.bos_id] + plain
    assert tok.encode("hello world", eos=True) == plain + [tok.eos_ids[0]]
    assert tok.encode("hello world", bos=True, eos=True) == [tok.bos_id] + plain + [tok.eos_ids[0]]


@pytest.mark.parametrize("dir_fixture", TOKENIZER_DIRS)
def test_special_ids_are_the_special_tokens_and_nothing_else(dir_fixture, request):
    """special_ids (what skip_special_tokens leaves out of the text) hold BOS and EOS, and no id of plain text."""
    from redline.streaming import TextStream

    tok = load_tokenizer(request.getfixturevalue(dir_fixture))
    plain = tok.encode("hello world", add_special_tokens=False)
    assert {tok.bos_id, tok.eos_ids[0]} <= tok.special_ids and not set(plain) & tok.special_ids
    ids = [tok.bos_id] + plain + [tok.eos_ids[0]]
    for skip, want in ((True, tok.decode(plain)), (False, tok.decode(ids))):
        stream = TextStream(tok, skip_special_tokens=skip)
        assert "".join(stream.push(t) for t in ids) + stream.flush() == want


@pytest.mark.parametrize("dir_fixture", TOKENIZER_DIRS)
def test_accepts_the_directory_or_a_file_in_it(dir_fixture, request, tmp_path):
    directory = _copy(request.getfixturevalue(dir_fixture), tmp_path)
    checkpoint = directory / "model.safetensors"
    checkpoint.touch()
    from_dir, from_file, from_str = load_tokenizer(directory), load_tokenizer(checkpoint), load_tokenizer(str(checkpoint))
    text = "same ids either way"
    assert from_dir.encode(text) == from_file.encode(text) == from_str.encode(text)
    assert from_dir.eos_ids == from_file.eos_ids


# --- SentencePiece ---


def test_sentencepiece_ids_match_the_model(sp_tokenizer_dir):
    sp = spm.SentencePieceProcessor(model_file=str(sp_tokenizer_dir / "tokenizer.model"))
    tok = load_tokenizer(sp_tokenizer_dir)
    assert isinstance(tok, tk.SentencePieceTokenizer)
    assert tok.bos_id == sp.bos_id() == 1
    assert tok.eos_ids == (sp.eos_id(),) == (2,)
    assert tok.vocab_size == sp.vocab_size()
    text = "héllo wörld 日本語 🚀"
    assert tok.encode(text) == [1] + sp.encode(text)  # BOS first, as HF's Llama tokenizers add it
    assert tok.encode(text, add_special_tokens=False) == sp.encode(text)


def test_sentencepiece_control_text_is_special_in_encode_and_text_in_encode_text(sp_tokenizer_dir):
    sp = spm.SentencePieceProcessor(model_file=str(sp_tokenizer_dir / "tokenizer.model"))
    tok = load_tokenizer(sp_tokenizer_dir)
    assert tok.encode("<s>a b</s>", add_special_tokens=False) == [1, *sp.encode("a b"), 2]
    ids = tok.encode_text("<s> and </s>")
    assert tok.bos_id not in ids and tok.eos_ids[0] not in ids
    assert tok.decode(ids) == "<s> and </s>"


def test_sentencepiece_add_bos_token_false_in_tokenizer_config(sp_tokenizer_dir, tmp_path):
    directory = _copy(sp_tokenizer_dir, tmp_path)
    (directory / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "add_eos_token": True}))
    tok = load_tokenizer(directory)
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False) + [tok.eos_ids[0]]


def test_sentencepiece_without_bos_or_eos(tmp_path, tokenizer_sample_text):
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(tokenizer_sample_text.splitlines()),
        model_prefix=str(tmp_path / "tokenizer"),
        model_type="bpe", vocab_size=512, hard_vocab_limit=False, byte_fallback=True,
        character_coverage=0.995, bos_id=-1, eos_id=-1, unk_id=0, pad_id=-1, minloglevel=2,
    )
    tok = load_tokenizer(tmp_path)
    assert tok.bos_id is None and tok.eos_ids == ()
    assert tok.encode("hi", bos=True, eos=True) == tok.encode("hi")


def test_llama2_chat_layout(sp_tokenizer_dir):
    sp = spm.SentencePieceProcessor(model_file=str(sp_tokenizer_dir / "tokenizer.model"))
    tok = load_tokenizer(sp_tokenizer_dir)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": " Hello. "},
        {"role": "user", "content": "Write fibonacci(n)"},
    ]
    first = "[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nHi there [/INST] Hello. "
    last = "[INST] Write fibonacci(n) [/INST]"
    expected = [1] + sp.encode(first) + [2] + [1] + sp.encode(last)
    ids = tok.encode_chat(messages)
    assert ids == expected
    eos_at = ids.index(2)
    assert tok.decode(ids[1:eos_at]) == first
    assert tok.decode(ids[eos_at + 2 :]) == last


def test_llama2_chat_single_user_message(sp_tokenizer_dir):
    tok = load_tokenizer(sp_tokenizer_dir)
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[0] == tok.bos_id
    assert tok.decode(ids) == "[INST] Hi [/INST]"


@pytest.mark.parametrize(
    "roles",
    [
        ["user", "user"],
        ["assistant"],
        ["system"],
        ["user", "assistant"],
        ["system", "assistant", "user"],
        ["system", "user", "system", "user"],
    ],
)
def test_llama2_chat_rejects_bad_turn_order(sp_tokenizer_dir, roles):
    tok = load_tokenizer(sp_tokenizer_dir)
    with pytest.raises(ValueError, match="alternating"):
        tok.encode_chat([{"role": r, "content": "x"} for r in roles])


# --- tiktoken (Llama 3) ---


def test_tiktoken_special_ids(tiktoken_tokenizer_dir):
    num_base = _num_base_tokens(tiktoken_tokenizer_dir)
    tok = load_tokenizer(tiktoken_tokenizer_dir)
    assert isinstance(tok, tk.TiktokenTokenizer)
    assert tok.bos_id == num_base + 0
    assert tok.eos_ids == (num_base + 1, num_base + 9)
    assert tok.vocab_size == num_base + 256
    assert tok.special_token_id("<|start_header_id|>") == num_base + 6
    assert tok.special_token_id("<|end_header_id|>") == num_base + 7
    assert tok.special_token_id("<|eom_id|>") == num_base + 8
    assert tok.special_token_id("<|python_tag|>") == num_base + 10
    assert tok.special_token_id("<|reserved_special_token_3|>") == num_base + 11
    assert tok.special_token_id("<|reserved_special_token_247|>") == num_base + 255
    assert tok.decode([num_base + 9]) == "<|eot_id|>"


def test_tiktoken_special_text_is_special_in_encode_and_text_in_encode_text(tiktoken_tokenizer_dir):
    num_base = _num_base_tokens(tiktoken_tokenizer_dir)
    tok = load_tokenizer(tiktoken_tokenizer_dir)
    text = "<|begin_of_text|>user says <|eot_id|><|start_header_id|>system<|end_header_id|>"
    ids = tok.encode_text(text)
    assert all(i < num_base for i in ids)
    assert tok.decode(ids) == text
    special = tok.encode(text, add_special_tokens=False)
    assert [i for i in special if i >= num_base] == [num_base, num_base + 9, num_base + 6, num_base + 7]
    assert tok.decode(special) == text


def test_tiktoken_merges_are_used(tiktoken_tokenizer_dir):
    tok = load_tokenizer(tiktoken_tokenizer_dir)
    text = "The quick brown fox"
    assert len(tok.encode(text)) < len(text.encode("utf-8"))


def test_tiktoken_partial_character_decodes_to_replacement(tiktoken_tokenizer_dir):
    tok = load_tokenizer(tiktoken_tokenizer_dir)
    ids = tok.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1  # a 4-byte character in a tiny vocabulary
    assert "\ufffd" in tok.decode(ids[:-1])
    assert tok.decode(ids) == "🚀"


def test_tiktoken_long_runs_are_chunked(tiktoken_tokenizer_dir):
    tok = load_tokenizer(tiktoken_tokenizer_dir)
    text = "a" * 60_000 + " " * 60_000 + "héllo\n" * 10 + "b" * 30_000
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize(
    "text",
    [
        "x" * 95,
        " " * 95,
        "ab cd " * 40,
        "aaaaaaaaaaaaaaaaaaaaaaaaa bb  " + "c" * 57 + "\n\n" + "d" * 12,
        "short",
        "",
    ],
)
def test_tiktoken_safe_pieces_bounds(monkeypatch, text):
    monkeypatch.setattr(tk, "MAX_TIKTOKEN_CHUNK_CHARS", 40)
    monkeypatch.setattr(tk, "MAX_TIKTOKEN_RUN_CHARS", 10)
    pieces = list(tk._tiktoken_safe_pieces(text))
    assert "".join(pieces) == text
    assert all(piece for piece in pieces)
    for piece in pieces:
        assert len(piece) <= 40
        assert all(len(run) <= 10 for run in tk._WHITESPACE_OR_NOT_RUN.findall(piece))


def test_llama3_chat_layout(tiktoken_tokenizer_dir):
    tok = load_tokenizer(tiktoken_tokenizer_dir)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there\n"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Write fibonacci(n)"},
    ]
    expected = (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWrite fibonacci(n)<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = tok.encode_chat(messages)
    assert tok.decode(ids) == expected
    assert ids[0] == tok.bos_id
    assert ids.count(tok.special_token_id("<|eot_id|>")) == 4
    assert ids.count(tok.special_token_id("<|start_header_id|>")) == 5


def test_chat_rejects_malformed_messages(tiktoken_tokenizer_dir):
    tok = load_tokenizer(tiktoken_tokenizer_dir)
    for bad in ([], [{"role": "robot", "content": "x"}], [{"role": "user"}], [{"role": "user", "content": 3}]):
        with pytest.raises(ValueError):
            tok.encode_chat(bad)


# --- Hugging Face tokenizer.json ---


def test_hf_bos_eos_from_tokenizer_config(hf_tokenizer_dir):
    tok = load_tokenizer(hf_tokenizer_dir)
    assert isinstance(tok, tk.HFTokenizer)
    assert tok.bos_id == tok.tokenizer.token_to_id("<s>") == 0
    assert tok.eos_ids == (tok.tokenizer.token_to_id("</s>"),) == (1,)
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)  # no add_bos_token, no post-processor
    ids = tok.encode_text("<s> not a bos </s>")
    assert 0 not in ids and 1 not in ids
    assert tok.decode(ids) == "<s> not a bos </s>"
    special = tok.encode("<s> a bos </s>")
    assert special[0] == 0 and special[-1] == 1


def test_hf_falls_back_to_config_json(hf_tokenizer_dir, tmp_path):
    directory = _copy(hf_tokenizer_dir, tmp_path)
    (directory / "tokenizer_config.json").unlink()
    (directory / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [0, 1]}))
    tok = load_tokenizer(directory)
    assert tok.bos_id == 1 and tok.eos_ids == (0, 1)
    (directory / "config.json").unlink()
    tok = load_tokenizer(directory)
    assert tok.bos_id is None and tok.eos_ids == ()
    assert tok.encode("hi", bos=True, eos=True) == tok.encode("hi")


def test_no_template_and_no_known_layout_is_an_error(hf_tokenizer_dir):
    tok = load_tokenizer(hf_tokenizer_dir)
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])


def test_hf_llama3_chat_layout(hf_tokenizer_dir, tmp_path):
    from tokenizers import Tokenizer

    directory = tmp_path / "llama3_hf"
    directory.mkdir()
    hf = Tokenizer.from_file(str(hf_tokenizer_dir / "tokenizer.json"))
    hf.add_special_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    hf.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})
    )
    tok = load_tokenizer(directory)
    assert tok.chat_format == "llama3"
    assert tok.eos_ids == (hf.token_to_id("<|eot_id|>"),)
    ids = tok.encode_chat([{"role": "user", "content": "Hi <|eot_id|>"}])
    assert tok.decode(ids) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi <|eot_id|><|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert ids.count(hf.token_to_id("<|eot_id|>")) == 1  # the one in the user's text stayed text


# --- eos from generation_config.json ---


@pytest.mark.parametrize("dir_fixture", TOKENIZER_DIRS)
def test_generation_config_adds_eos_ids(dir_fixture, request, tmp_path):
    directory = _copy(request.getfixturevalue(dir_fixture), tmp_path)
    before = load_tokenizer(directory).eos_ids
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [before[0], 5, 7]}))
    assert load_tokenizer(directory).eos_ids == before + (5, 7)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert load_tokenizer(directory).eos_ids == before + (9,)


def test_eos_outside_vocabulary_is_an_error(tiktoken_tokenizer_dir, tmp_path):
    directory = _copy(tiktoken_tokenizer_dir, tmp_path)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 10**9}))
    with pytest.raises(ValueError, match="outside the tokenizer's vocabulary"):
        load_tokenizer(directory)


# --- loading errors ---


def test_missing_tokenizer_names_the_directory(tmp_path):
    (tmp_path / "model.safetensors").touch()
    for path in (tmp_path, tmp_path / "model.safetensors"):
        with pytest.raises(FileNotFoundError) as info:
            load_tokenizer(path)
        assert str(tmp_path) in str(info.value)
        assert "tokenizer.model" in str(info.value) and "tokenizer.json" in str(info.value)


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope" / "model.safetensors")


@pytest.mark.parametrize(
    "content",
    [
        b"\x00\x01garbage\xff\xfe not a model",
        b"hello world\nthis is text\n",
        b"",
        b"aGVsbG8= 0\nd29ybGQ= 1\n",  # tiktoken-shaped, but without the 256 single bytes
        b"aGVsbG8= 0\n!!!notbase64 1\n",
    ],
)
def test_garbage_tokenizer_model_is_a_value_error(tmp_path, content):
    (tmp_path / "tokenizer.model").write_bytes(content)
    with pytest.raises(ValueError) as info:
        load_tokenizer(tmp_path)
    assert "tokenizer.model" in str(info.value)


def test_tiktoken_duplicate_ranks_are_a_value_error(tiktoken_tokenizer_dir, tmp_path):
    directory = _copy(tiktoken_tokenizer_dir, tmp_path)
    lines = (directory / "tokenizer.model").read_text().splitlines()
    lines[-1] = lines[-1].split()[0] + " 3"
    (directory / "tokenizer.model").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="ranks"):
        load_tokenizer(directory)


def test_garbage_tokenizer_json_is_a_value_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_garbage_config_json_is_a_value_error(hf_tokenizer_dir, tmp_path):
    directory = _copy(hf_tokenizer_dir, tmp_path)
    (directory / "tokenizer_config.json").write_text("{broken")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        load_tokenizer(directory)


def test_tokenizer_model_is_preferred_and_named_files_are_honoured(sp_tokenizer_dir, hf_tokenizer_dir, tmp_path):
    directory = _copy(sp_tokenizer_dir, tmp_path)
    shutil.copy(hf_tokenizer_dir / "tokenizer.json", directory / "tokenizer.json")
    assert isinstance(load_tokenizer(directory), tk.SentencePieceTokenizer)
    assert isinstance(load_tokenizer(directory / "tokenizer.json"), tk.HFTokenizer)


def test_encode_rejects_non_strings(tiktoken_tokenizer_dir):
    tok = load_tokenizer(tiktoken_tokenizer_dir)
    with pytest.raises(TypeError):
        tok.encode(b"bytes")  # type: ignore[arg-type]


# --- agreement with Hugging Face transformers ---

HF_TEXTS = ["Hello world", "", "  two spaces\n\n\ttab\r\n", "<s>special</s> text", "déjà vu 日本語 🚀",
            "x = [1, 2]  # c"]
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# A template exercising what transformers' environment offers: bos_token, raise_exception, tojson, trim/lstrip blocks.
FEATURED = """{{ bos_token }}
{% for m in messages %}
    {% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}
    [{{ m['role'] | upper }}] {{ m['content'] | trim }} {{ {'n': loop.index, 'text': 'é'} | tojson }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}[ASSISTANT]{% endif %}"""
CONVERSATION = [
    {"role": "system", "content": "Be brief, and answer in French."},
    {"role": "user", "content": "Hi there! 🚀"},
    {"role": "assistant", "content": "Bonjour."},
    {"role": "user", "content": "What is 2 + 2?\n"},
]


def _hf_dir(hf_tokenizer_dir, tmp_path, config=None, post_processor=None, template_file=None):
    from tokenizers import Tokenizer, processors

    directory = _copy(hf_tokenizer_dir, tmp_path)
    hf = Tokenizer.from_file(str(directory / "tokenizer.json"))
    hf.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    if post_processor:
        hf.post_processor = processors.TemplateProcessing(single=post_processor, special_tokens=[("<s>", 0), ("</s>", 1)])
    hf.save(str(directory / "tokenizer.json"))
    base = {"bos_token": "<s>", "eos_token": "</s>"}  # transformers reads a dict only as a serialized AddedToken
    (directory / "tokenizer_config.json").write_text(json.dumps({**base, **(config or {})}))
    if template_file is not None:
        (directory / "chat_template.jinja").write_text(template_file)
    return directory


@pytest.mark.parametrize("config, post_processor", [
    ({}, None),
    ({"add_bos_token": True}, None),
    ({"add_bos_token": True, "add_eos_token": True}, None),
    ({}, "<s> $A </s>"),
    ({"add_bos_token": False}, "<s> $A"),  # transformers replaces the post-processor when a flag is set
    ({"add_eos_token": True, "split_special_tokens": True}, "<s> $A"),
])
def test_hf_encode_matches_transformers(hf_tokenizer_dir, tmp_path, config, post_processor):
    from transformers import AutoTokenizer

    directory = _hf_dir(hf_tokenizer_dir, tmp_path, config, post_processor)
    ours, theirs = load_tokenizer(directory), AutoTokenizer.from_pretrained(directory)
    for text in HF_TEXTS:
        assert ours.encode(text) == theirs(text)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.vocab_size == len(theirs)


@pytest.mark.parametrize("template, where", [(CHATML, "config"), (FEATURED, "jinja"), (CHATML, "list")],
                         ids=["chatml-in-config", "featured-jinja-file", "named-list"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(hf_tokenizer_dir, tmp_path, template, where, add_generation_prompt):
    from transformers import AutoTokenizer

    config = {"add_bos_token": True}
    if where == "config":
        config["chat_template"] = template
    elif where == "list":
        config["chat_template"] = [{"name": "tool_use", "template": "{{ 'wrong' }}"},
                                   {"name": "default", "template": template}]
    directory = _hf_dir(hf_tokenizer_dir, tmp_path, config, template_file=template if where == "jinja" else None)
    ours, theirs = load_tokenizer(directory), AutoTokenizer.from_pretrained(directory)
    assert ours.chat_format == "template"
    for messages in (CONVERSATION, CONVERSATION[1:2], CONVERSATION[:3]):
        text = theirs.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        ids = theirs(text, add_special_tokens=False)["input_ids"]
        assert ours.render_chat_template(messages, add_generation_prompt) == text
        assert ours.apply_chat_template(messages, add_generation_prompt) == ids
        assert ids.count(0) == (template == FEATURED)  # BOS once, from the template, never added again


def test_chat_template_errors_are_value_errors(hf_tokenizer_dir, tmp_path):
    tok = load_tokenizer(_hf_dir(hf_tokenizer_dir, tmp_path, template_file=FEATURED))
    with pytest.raises(ValueError, match="no tools here"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    tok.chat_template = "{% for m in messages %}"
    with pytest.raises(ValueError, match="not valid Jinja"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_is_sandboxed(hf_tokenizer_dir, tmp_path):
    tok = load_tokenizer(_hf_dir(hf_tokenizer_dir, tmp_path, template_file="{{ messages.__class__.__mro__ }}"))
    with pytest.raises(ValueError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_sentencepiece_template_renders_bos_as_its_id(sp_tokenizer_dir, tmp_path):
    sp = spm.SentencePieceProcessor(model_file=str(sp_tokenizer_dir / "tokenizer.model"))
    directory = _copy(sp_tokenizer_dir, tmp_path)
    template = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = load_tokenizer(directory)
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == [1] + sp.encode("[INST] Hi [/INST]")


# --- copy_tokenizer_files ---


def test_copy_tokenizer_files_copies_what_the_loader_reads(hf_tokenizer_dir, tmp_path):
    src = _hf_dir(hf_tokenizer_dir, tmp_path, {"chat_template": CHATML}, template_file=FEATURED)
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 0]}))
    (src / "model.safetensors").write_bytes(b"weights")
    dst = tmp_path / "elsewhere" / "deeper"
    written = tk.copy_tokenizer_files(src, dst)
    assert sorted(p.name for p in written) == sorted(
        ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"])
    assert not (dst / "model.safetensors").exists() and not list(dst.glob(".*tmp"))
    a, b = load_tokenizer(src), load_tokenizer(dst)
    assert a.eos_ids == b.eos_ids and a.chat_template == b.chat_template == FEATURED
    assert a.apply_chat_template(CONVERSATION) == b.apply_chat_template(CONVERSATION)


def test_copy_tokenizer_files_never_onto_itself(sp_tokenizer_dir, tmp_path):
    directory = _copy(sp_tokenizer_dir, tmp_path)
    before = (directory / "tokenizer.model").read_bytes()
    assert tk.copy_tokenizer_files(directory, directory / ".." / directory.name) == []
    assert (directory / "tokenizer.model").read_bytes() == before
    with pytest.raises(FileNotFoundError):
        tk.copy_tokenizer_files(tmp_path / "missing", tmp_path / "out")


def test_converter_and_quantizer_clis_copy_the_tokenizer_beside_out(tiny_llm_checkpoint, tmp_path):
    from redline.quantize import main as quantize_main
    from redline.scripts.convert_hf_checkpoint import main as convert_main

    source = tiny_llm_checkpoint[0].parent
    converted = tmp_path / "converted" / "model.safetensors"
    assert convert_main(["--checkpoint_dir", str(source), "--out", str(converted), "--dtype", "float32"]) == 0
    quantized = tmp_path / "quantized" / "model.int8.safetensors"
    assert quantize_main(["--checkpoint_path", str(converted), "--mode", "int8", "--out", str(quantized)]) == 0
    for folder in (converted.parent, quantized.parent):
        assert (folder / "tokenizer.model").read_bytes() == (source / "tokenizer.model").read_bytes()
        assert load_tokenizer(folder).encode("hello") == load_tokenizer(source).encode("hello")


def test_a_tokenizer_file_that_leads_out_of_the_folder_is_not_read(sp_tokenizer_dir, tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.model").symlink_to(sp_tokenizer_dir / "tokenizer.model")
    with pytest.raises(ValueError, match="outside the checkpoint folder"):
        tk.load_tokenizer(folder)
