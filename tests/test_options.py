"""Tests for options.py's CPU thread setting (EngineConfig.threads, physical_cores) and its plumbing through
LLM.load, the stats and generate.py's --threads."""
from __future__ import annotations

import os
import re

import pytest
import torch

from redline.options import EngineConfig, GenerationStats, physical_cores


@pytest.fixture
def restore_threads():
    from redline.kernels.cpu_linear import cpu_ops

    cpu_ops()
    before = torch.get_num_threads(), torch.ops.redline_cpu.threads()
    yield
    torch.set_num_threads(before[0])
    torch.ops.redline_cpu.set_threads(before[1])


def test_physical_cores_counts_usable_cores():
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert 1 <= physical_cores() <= usable


@pytest.mark.parametrize("threads", [0, -2, 1.5, "2", True])
def test_bad_threads_are_one_line_errors(threads):
    with pytest.raises(ValueError, match="threads must be a positive integer"):
        EngineConfig(threads=threads)


def test_cpu_threads_defaults_to_the_physical_cores_on_the_cpu_only():
    assert EngineConfig().cpu_threads(torch.device("cpu")) == physical_cores()
    assert EngineConfig().cpu_threads(torch.device("cuda")) is None  # a GPU engine leaves torch's setting alone
    assert EngineConfig(threads=3).cpu_threads(torch.device("cuda")) == 3


def test_summary_names_the_threads():
    stats = GenerationStats(prompt_tokens=3, new_tokens=4, ttft_s=0.1, prefill_tok_s=30.0, decode_tok_s=20.0,
                            model_bytes_per_token=10**6, bandwidth_gb_s=0.02, peak_memory_gb=None, threads=2)
    assert stats.summary().endswith(", 2 threads")
    assert "threads" not in GenerationStats(3, 4, 0.1, 30.0, 20.0, 10**6, 0.02, None).summary()


def test_llm_load_sets_and_reports_the_threads(tiny_llm_checkpoint, restore_threads):
    from redline.generate import LLM

    llm = LLM.load(tiny_llm_checkpoint[0], device="cpu", threads=3)
    assert torch.ops.redline_cpu.threads() == 3 and torch.get_num_threads() == 1  # the kernels' pool; torch's ops 1
    result = llm.generate("abc", max_new_tokens=3, temperature=0, ignore_eos=True)
    assert result.stats.threads == 3 and ", 3 threads" in result.stats.summary()
    LLM.load(tiny_llm_checkpoint[0], device="cpu")  # the default: the physical cores
    assert torch.ops.redline_cpu.threads() == physical_cores()


def test_cli_threads_flag(tiny_llm_checkpoint, restore_threads, capsys):
    from redline.generate import main, parse_args

    assert parse_args(["--checkpoint_path", "m", "--prompt", "p", "--threads", "2"]).engine.threads == 2
    assert main(["--checkpoint_path", str(tiny_llm_checkpoint[0]), "--prompt", "abc", "--max_new_tokens", "3",
                 "--device", "cpu", "--threads", "1"]) == 0
    assert re.search(r", 1 thread\b(?!s)", capsys.readouterr().err)
    assert main(["--checkpoint_path", str(tiny_llm_checkpoint[0]), "--prompt", "abc", "--threads", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "threads must be a positive integer" in err


def test_a_model_converted_into_a_dtype_folder_is_named_by_the_folder_above(tiny_llm_checkpoint, tmp_path):
    import shutil

    from redline.generate import LLM
    from redline.serve import ServeSettings

    target = tmp_path / "smollm2" / "float32"
    shutil.copytree(tiny_llm_checkpoint[0].parent, target)
    path = target / tiny_llm_checkpoint[0].name
    assert LLM.load(path, device="cpu").model_name == "smollm2"
    assert ServeSettings(checkpoint_path=path).model_name == "smollm2"
    assert ServeSettings(checkpoint_path=target).model_name == "smollm2"
