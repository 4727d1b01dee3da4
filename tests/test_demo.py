"""The demo (`make demo`: SmolLM2-135M-Instruct, fetched as GGUF and converted) and the README's first command."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from redline.scripts.demo_model import DEFAULT_DIR, checkpoint_path, demo_checkpoint, gguf_path

REPO = Path(__file__).resolve().parents[1]
QUESTION = "What is the capital of France?"


def test_readme_opens_with_the_two_commands():
    lines = (REPO / "README.md").read_text().splitlines()
    block = lines[lines.index("```bash") + 1:lines.index("```bash") + 3]
    assert block[0].startswith("make demo") and block[1].startswith("make test")


@pytest.mark.real_model
def test_demo_model_is_cached_and_not_converted_twice(smollm2_checkpoint):
    assert smollm2_checkpoint == REPO / checkpoint_path(DEFAULT_DIR)
    before = smollm2_checkpoint.stat().st_mtime_ns
    assert demo_checkpoint(REPO / DEFAULT_DIR) == smollm2_checkpoint
    assert smollm2_checkpoint.stat().st_mtime_ns == before


@pytest.mark.real_model
def test_demo_answers_the_question_through_the_chat_template(smollm2_checkpoint):
    from redline.generate import LLM

    llm = LLM.load(smollm2_checkpoint, device="cpu", dtype="float32")
    result = llm.generate(llm.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}]),
                          max_new_tokens=64, temperature=0)
    assert "Paris" in result.text and result.finish_reason == "eos"


@pytest.mark.real_model
def test_make_demo_works_on_a_fresh_clone(smollm2_checkpoint, tmp_path):
    if shutil.which("git") is None or shutil.which("make") is None or not (REPO / ".git").exists():
        pytest.skip("needs git, make and a git checkout")
    if "--chat" not in (REPO / "generate.py").read_text():
        pytest.skip("generate.py has no --chat option, which `make demo` uses")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{REPO}", str(clone)], check=True)
    # The download is what the smollm2_checkpoint fixture already did: seed the clone's cache with the GGUF, so the
    # clone converts it itself but does not download it again.
    cache = clone / DEFAULT_DIR
    cache.mkdir(parents=True)
    try:
        os.link(gguf_path(REPO / DEFAULT_DIR), gguf_path(cache))
    except OSError:  # another filesystem
        shutil.copy2(gguf_path(REPO / DEFAULT_DIR), gguf_path(cache))
    # The install step is what `make test` already ran; skip it so the clone does not re-point the editable install.
    run = subprocess.run(["make", "-s", "demo", f"PYTHON={sys.executable}", "SKIP_SETUP=1"], cwd=clone,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Paris" in run.stdout
    assert "decode" in run.stderr and "tok/s" in run.stderr
