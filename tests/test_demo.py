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


def readme_cpu_commands() -> list[str]:
    """The README's commands (bash blocks, continuation lines joined, comments cut) that run a script on the demo
    model: every `python generate.py` and `python scripts/...py` naming checkpoints/smollm2. The server (which does
    not end) and the benchmark (minutes) have tests of their own."""
    import re

    text = (REPO / "README.md").read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for command in block.replace("\\\n", " ").splitlines():
            command = re.sub(r"\s+#.*$", "", command).strip()
            if re.match(r"python3? (generate\.py|scripts/\w+\.py) ", command) and "checkpoints/smollm2" in command:
                commands.append(" ".join(command.split()))
    return commands


def test_the_readme_names_its_cpu_commands():
    commands = readme_cpu_commands()
    assert any("--quantize int8" in c for c in commands) and any("convert_gguf.py" in c for c in commands)
    assert any("--chat" in c for c in commands) and len(commands) >= 4


@pytest.mark.real_model
@pytest.mark.slow
def test_every_readme_cpu_command_runs_as_written(smollm2_checkpoint, tmp_path):
    """Each command, as the README writes it, from a scratch folder laid out like the checkout (the demo model's
    files hard-linked or copied in, so the conversion writes a new file rather than meeting one from an earlier
    run; a checkpoint's files may not be symlinks out of its folder)."""
    import shlex

    demo = smollm2_checkpoint.parents[1]  # checkpoints/smollm2
    (tmp_path / "checkpoints" / "smollm2" / "float32").mkdir(parents=True)
    for path in [*demo.glob("*.gguf"), *smollm2_checkpoint.parent.iterdir()]:
        if path.is_file() and not path.name.startswith("model.int4"):
            target = tmp_path / path.relative_to(demo.parent.parent)
            try:
                os.link(path, target)
            except OSError:  # another file system
                shutil.copyfile(path, target)
    for name in ("generate.py", "scripts"):
        (tmp_path / name).symlink_to(REPO / name)
    for command in readme_cpu_commands():
        argv = shlex.split(command)
        proc = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{command}\n{proc.stderr[-2000:]}"
        if argv[1] == "generate.py":
            assert "Paris" in proc.stdout or "capital" in proc.stdout.lower(), (command, proc.stdout[-500:])
