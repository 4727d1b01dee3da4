"""The <think> reasoning split, fed whole and in random splits."""
from __future__ import annotations

import random

import pytest

from redline.reasoning import ReasoningSplitter, prompt_opens_thinking, template_thinks


def split(text: str, starts_open: bool, pieces: list[str]) -> tuple[str, str]:
    splitter = ReasoningSplitter(starts_open)
    reasoning = content = ""
    for piece in pieces:
        r, c = splitter.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("text, starts_open, reasoning, content", [
    ("<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", False, "\nThe user wants 2+2.\n", "It is 4."),  # Qwen3
    ("Okay, 2+2 is 4.\n</think>\n\n4", True, "Okay, 2+2 is 4.\n", "4"),  # R1 distills: the prompt opened it
    ("  <think>a<b</think>c", False, "a<b", "c"),
    ("No thinking here <think>x</think>", False, "", "No thinking here <think>x</think>"),
    ("<think>cut off while thinking", False, "cut off while thinking", ""),
    ("<thin", False, "", "<thin"),
    ("", True, "", ""),
])
def test_reasoning_is_split_whole_and_in_random_splits(text, starts_open, reasoning, content):
    rng = random.Random(0)
    pieces = [[text], list(text)]
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(max(len(text) - 1, 0), rng.randint(1, 8)))) if text else []
        pieces.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    for p in pieces:
        assert split(text, starts_open, p) == (reasoning, content)


def test_the_answer_streams_as_it_comes():
    splitter = ReasoningSplitter(False)
    assert splitter.feed("<think>hm") == ("hm", "")
    assert splitter.feed("m</th") == ("m", "")
    assert splitter.feed("ink>\n\nThe") == ("", "The")
    assert splitter.feed(" end") == ("", " end")


def test_templates_and_prompts():
    assert template_thinks("{% if x %}<think>\n\n</think>{% endif %}") and not template_thinks("{{ messages }}")
    assert prompt_opens_thinking("<|Assistant|><think>\n") and not prompt_opens_thinking("<|assistant|>\n")
