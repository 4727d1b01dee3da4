"""tokenizer_checks.py: tokenizer.json files that would hang or blow up the tokenizers library are refused."""
from __future__ import annotations

import json
import shutil
import time

import pytest

from redline.tokenizer import LLAMA3_PATTERN, load_tokenizer
from redline.tokenizer_checks import normalizer_growth, risky_group, text_growth

GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                 r"|\s+(?!\S)|\s+")


@pytest.mark.parametrize("pattern", [LLAMA3_PATTERN, GPT2_PATTERN, QWEN2_PATTERN, r"(\p{L})+", r"[(a+)+]", r"(ab){2}"])
def test_the_patterns_of_real_tokenizers_pass(pattern):
    assert risky_group(pattern) is None


@pytest.mark.parametrize("pattern", [r"(a+)+$", r"(a*)*b", r"(a|aa)+$", r"((ab)+)+", r"(\w+\s?)+$", r"(a+){2,}"])
def test_catastrophic_patterns_are_found(pattern):
    assert risky_group(pattern) is not None


def test_growth_of_replacement_chains():
    double = {"type": "Replace", "pattern": {"String": "a"}, "content": "aa"}
    assert normalizer_growth({"type": "Sequence", "normalizers": [double] * 3}) == 8
    assert normalizer_growth({"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}) == 1
    assert normalizer_growth({"type": "NFKC"}) == 1


def with_spec(hf_tokenizer_dir, tmp_path, change) -> tuple:
    folder = tmp_path / "tok"
    shutil.copytree(hf_tokenizer_dir, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    change(spec)
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


def test_a_catastrophic_pre_tokenizer_regex_is_refused_in_one_line(hf_tokenizer_dir, tmp_path):
    def change(spec):
        spec["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": r"(a+)+$"}, "behavior": "Isolated",
                                 "invert": False}

    folder = with_spec(hf_tokenizer_dir, tmp_path, change)
    start = time.monotonic()
    with pytest.raises(ValueError, match="exponential time") as info:
        load_tokenizer(folder).encode("a" * 40 + "!")
    assert "\n" not in str(info.value) and time.monotonic() - start < 10


def test_a_normalizer_that_multiplies_its_input_is_refused(hf_tokenizer_dir, tmp_path):
    def change(spec):
        double = {"type": "Replace", "pattern": {"String": "a"}, "content": "aa"}
        spec["normalizer"] = {"type": "Sequence", "normalizers": [double] * 30}

    with pytest.raises(ValueError, match="1073741824 times longer"):
        load_tokenizer(with_spec(hf_tokenizer_dir, tmp_path, change)).encode("a" * 100)


def test_growth_bounds_compose_in_order():
    prepend = {"type": "Prepend", "prepend": "xyz"}
    double = {"type": "Replace", "pattern": {"String": "a"}, "content": "aa"}
    # prepend then double: 2 * (n + 3); double then prepend: 2n + 3
    assert text_growth({"type": "Sequence", "normalizers": [prepend, double]}) == (2, 6)
    assert text_growth({"type": "Sequence", "normalizers": [double, prepend]}) == (2, 3)
    assert text_growth({"type": "Sequence", "decoders": [double, double]}, "decoders") == (4, 0)
    # a regex replacement may match between every two characters
    assert text_growth({"type": "Replace", "pattern": {"Regex": "x*"}, "content": "ab"}) == (3, 2)


@pytest.mark.parametrize("part, spec, message", [
    # a normalizer that adds a megabyte to every text
    ("normalizer", {"type": "Prepend", "prepend": "p" * 1_000_000}, "add 1000000 characters"),
    # additive growth multiplied by a later step
    ("normalizer", {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "p" * 100},
        *[{"type": "Replace", "pattern": {"String": "p"}, "content": "pppp"}] * 3]}, "add 6400 characters"),
    # decoders: a replacement that turns each space into a long string, and a chain of small ones
    ("decoder", {"type": "Replace", "pattern": {"String": " "}, "content": "z" * 5000}, "5000 times longer"),
    ("decoder", {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "a"}, "content": "aaaa"}] * 4}, "256 times longer"),
])
def test_text_growing_normalizers_and_decoders_are_refused(hf_tokenizer_dir, tmp_path, part, spec, message):
    def change(s):
        s[part] = spec

    start = time.monotonic()
    with pytest.raises(ValueError, match=message) as info:
        load_tokenizer(with_spec(hf_tokenizer_dir, tmp_path, change)).decode([5, 6, 7])
    assert "\n" not in str(info.value) and f"its {part}s" in str(info.value) and time.monotonic() - start < 10


def test_a_deeply_nested_tokenizer_json_is_one_line(hf_tokenizer_dir, tmp_path):
    folder = with_spec(hf_tokenizer_dir, tmp_path, lambda s: None)
    (folder / "tokenizer.json").write_text('{"a": [' * 50_000 + "]}" * 50_000)
    with pytest.raises(ValueError, match="too deeply") as info:
        load_tokenizer(folder)
    assert "\n" not in str(info.value)
