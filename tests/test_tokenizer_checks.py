"""tokenizer_checks.py: tokenizer.json files that would hang or blow up the tokenizers library are refused."""
from __future__ import annotations

import json
import shutil
import time

import pytest

from redline.tokenizer import LLAMA3_PATTERN, load_tokenizer
from redline.tokenizer_checks import normalizer_growth, risky_group

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
