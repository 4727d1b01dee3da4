"""generate.py's CLI on hostile input: outputs checked before the model loads, closed streams, one line each."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from redline.generate import main


def one_line(capsys, argv, status=2) -> str:
    assert main(argv) == status
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def folder(tiny_llm_checkpoint, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(tiny_llm_checkpoint[0].parent, target)
    return target


@pytest.mark.parametrize("name", ["model.redline.safetensors", "tokenizer.model", "generation_config.json"])
def test_profile_never_names_a_file_the_run_reads(folder, capsys, monkeypatch, name):
    from redline import generate

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr(generate.LLM, "from_config", no_load)
    target = folder / name
    before = target.read_bytes()
    link = folder.parent / "trace.json"
    link.symlink_to(target)
    for out in (target, link):
        err = one_line(capsys, ["--checkpoint_path", str(folder), "--prompt", "hi", "--profile", str(out)])
        assert "--profile" in err or "trace path must end with" in err
    assert target.read_bytes() == before


def test_profile_in_a_read_only_folder_fails_before_generating(folder, tmp_path, capsys, monkeypatch):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    assert "not writable" in one_line(capsys, ["--checkpoint_path", str(folder), "--prompt", "hi",
                                              "--profile", str(locked / "t.json.gz")])


def test_a_read_only_trace_folder_fails_before_the_model_loads(folder, tmp_path, capsys, monkeypatch):
    """As root every folder is writable, so the folder's permission is simulated."""
    from redline import generate, outputs

    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(outputs.os, "access", lambda path, mode: Path(path) != locked and real_access(path, mode))

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the trace path was checked")

    monkeypatch.setattr(generate.LLM, "from_config", no_load)
    err = one_line(capsys, ["--checkpoint_path", str(folder), "--prompt", "hi", "--profile", str(locked / "t.json.gz")])
    assert "not writable" in err
    with pytest.raises(ValueError, match="not writable"):  # the Python API checks it through the same function
        generate.GenerationOptions(profile=locked / "t.json.gz")


def test_profile_replaces_an_earlier_trace_only_with_overwrite(folder, tmp_path, capsys):
    trace = tmp_path / "t.json.gz"
    argv = ["--checkpoint_path", str(folder), "--prompt", "hi", "--device", "cpu", "--max_new_tokens", "3",
            "--profile", str(trace)]
    assert main(argv) == 0
    capsys.readouterr()
    assert "pass --overwrite" in one_line(capsys, argv)
    assert main([*argv, "--overwrite"]) == 0
    capsys.readouterr()
    notes = tmp_path / "notes.json"
    notes.write_text("my notes")
    assert "not a file this command writes" in one_line(capsys, [*argv[:-1], str(notes), "--overwrite"])
    assert notes.read_text() == "my notes"


def test_a_text_prompt_past_the_embedding_table_is_one_line(folder, capsys):
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = folder / "model.redline.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    config = json.loads(meta["config"])
    small = 40  # the tokenizer's ids go past it
    tensors = load_file(str(path))
    tensors = {n: (t[:small] if n in ("tok_embeddings.weight", "output.weight") else t) for n, t in tensors.items()}
    save_file(tensors, str(path), metadata={**meta, "config": json.dumps({**config, "vocab_size": small})})
    err = one_line(capsys, ["--checkpoint_path", str(folder), "--prompt", "def fibonacci(n): return n",
                            "--device", "cpu"])
    assert "outside the model's vocabulary" in err


def run_cli(argv, **kwargs) -> subprocess.CompletedProcess:
    code = "import sys; from redline.generate import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300,
                          env=os.environ.copy(), **kwargs)


def test_interactive_with_stdin_closed_is_one_line(folder):
    proc = run_cli(["--checkpoint_path", str(folder), "--interactive", "--device", "cpu"],
                   stdin=subprocess.DEVNULL, preexec_fn=lambda: os.close(0))
    assert proc.returncode == 2 and proc.stderr.startswith("error: stdin is closed"), proc.stderr
    assert proc.stderr.count("\n") == 1


def test_stdout_closed_is_one_line(folder):
    proc = run_cli(["--checkpoint_path", str(folder), "--prompt", "hi", "--device", "cpu"],
                   preexec_fn=lambda: os.close(1))
    assert proc.returncode == 2 and proc.stderr.startswith("error: stdout is closed"), proc.stderr
    assert proc.stderr.count("\n") == 1


def test_output_piped_into_a_reader_that_goes_away_is_one_line(folder):
    code = "import sys; from redline.generate import main; sys.exit(main(sys.argv[1:]))"
    argv = ["--checkpoint_path", str(folder), "--prompt", "hello " * 20, "--device", "cpu", "--max_new_tokens", "64",
            "--temperature", "0"]
    reader, writer = os.pipe()
    os.close(reader)  # as `| head` exits: every write now fails with EPIPE
    proc = subprocess.run([sys.executable, "-c", code, *argv], stdout=writer, stderr=subprocess.PIPE, text=True,
                          timeout=300, env=os.environ.copy())
    os.close(writer)
    assert proc.returncode == 141, proc.stderr
    assert proc.stderr.startswith("error: the output was closed") and proc.stderr.count("\n") == 1, proc.stderr


NESTED_JSON = '{"a": ' * 100_000 + "1" + "}" * 100_000


@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json", "special_tokens_map.json"])
def test_deeply_nested_side_file_is_one_line(folder, name):
    (folder / name).write_text(NESTED_JSON)
    proc = run_cli(["--checkpoint_path", str(folder), "--prompt", "hi", "--device", "cpu", "--max_new_tokens", "2"])
    assert proc.returncode == 2 and proc.stderr.startswith("error: "), proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "too deeply" in proc.stderr and name in proc.stderr


def test_deeply_nested_checkpoint_metadata_is_one_line(folder):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = folder / "model.redline.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    save_file(load_file(str(path)), str(path), metadata={**meta, "config": '{"a": ' * 5000 + "1" + "}" * 5000})
    proc = run_cli(["--checkpoint_path", str(folder), "--prompt", "hi", "--device", "cpu", "--max_new_tokens", "2"])
    assert proc.returncode == 2 and proc.stderr.startswith("error: "), proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "nested too deeply" in proc.stderr
