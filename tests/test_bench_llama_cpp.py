"""Tests for benchmarks/bench_llama_cpp.py: its arguments, its table (ratios to llama.cpp, load averages, the busy
share) and its one-line error without llama-cpp-python."""
from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

from redline.benchmarks import bench_llama_cpp as bench


def run_of(decode: float, prefill: float, loads: list[float]) -> dict:
    return {"decode_tok_s": decode, "prefill_tok_s": prefill, "load_avg": loads, "all": []}


def test_table_gives_ratios_to_llama_cpp_load_averages_and_the_busy_share():
    result = {"gguf": "/x/model.Q4_1.gguf", "cpu": "Some CPU", "instruction_sets": ["avx2", "fma", "f16c"],
              "redline_simd": "avx2", "llama_cpp_features": ["AVX2", "FMA"], "threads": 2, "new_tokens": 128, "rounds": 3,
              "idle": {"llama.cpp": run_of(100.0, 200.0, [0.5, 0.6, 0.7]),
                       "redline q4_1": run_of(90.0, 120.0, [0.7, 0.8, 0.9])},
              "busy": {"llama.cpp": run_of(50.0, 100.0, [1.5]), "redline q4_1": run_of(60.0, 90.0, [1.6])}}
    text = bench.table(result)
    assert "model.Q4_1.gguf on Some CPU (avx2, fma, f16c), 2 threads" in text
    assert "Redline's kernels on avx2, llama.cpp built with AVX2, FMA" in text
    assert "| redline q4_1 | 90.0 | 0.90x | 120.0 | 0.60x | 0.7, 0.8, 0.9 | 60.0 (67%) |" in text
    assert "| llama.cpp | 100.0 | 1.00x | 200.0 | 1.00x | 0.5, 0.6, 0.7 | 50.0 (50%) |" in text


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--tokens", "1"], ["--busy", "-1"], ["--threads", "0"],
                                  ["--gguf", "/no/such/file.gguf"], ["--simd", "sse9"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as info:
        bench.parse_args(argv)
    assert info.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1].startswith("usage") is False


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is not None, reason="llama-cpp-python is installed")
def test_without_llama_cpp_python_the_error_says_how_to_install_it(tmp_path):
    with pytest.raises(RuntimeError, match=r"llama-cpp-python is not installed; pip install 'redline\[llamacpp\]'"):
        bench.llama_cpp_runner(tmp_path / "m.gguf", 2, 4)


def test_cpu_instruction_sets_are_named_from_the_cpus_flags():
    sets = bench.cpu_instruction_sets()
    assert all(s in bench.ISA_FLAGS for s in sets)


def test_extra_redline_checkpoints_are_named_files(tmp_path):
    ckpt = tmp_path / "model.int8.safetensors"
    ckpt.write_bytes(b"")
    assert bench.parse_args(["--redline", f"int8={ckpt}"]).redline == {"int8": ckpt}
    for bad in ("int8", f"={ckpt}", f"int8={tmp_path / 'missing.safetensors'}"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--redline", bad])


def test_a_conversion_newer_than_its_gguf_is_reused_not_rewritten(tmp_path, monkeypatch):
    import os

    from redline.scripts import convert_gguf

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    made = []
    monkeypatch.setattr(convert_gguf, "convert_gguf", lambda path, out, dtype: made.append(out) or out)
    assert bench.float32_conversion(gguf) == tmp_path / "m.redline.safetensors" and len(made) == 1
    made[0].write_bytes(b"converted")
    assert bench.float32_conversion(gguf) == made[0] and len(made) == 1  # reused
    os.utime(gguf, (made[0].stat().st_mtime + 10,) * 2)  # the GGUF changed since: convert again
    bench.float32_conversion(gguf)
    assert len(made) == 2


def test_a_conversion_is_named_for_what_it_holds(tiny_llm_checkpoint, tmp_path):
    from redline.checkpoint import load_tensors, read_checkpoint_info, save_checkpoint
    from redline.quantize import quantize_checkpoint

    float_path = tiny_llm_checkpoint[0]
    int4_path = quantize_checkpoint(float_path, "int4", tmp_path / "model.int4.safetensors")
    assert bench.conversion_name(float_path) == "converted (float32)"
    assert bench.conversion_name(int4_path) == "converted (int4 projections, float32 rest)"
    # A conversion written in bf16 (convert_gguf.py's default) is not called float32.
    info = read_checkpoint_info(float_path)
    tensors = {k: v.to(torch.bfloat16) for k, v in load_tensors(info).items()}
    bf16_path = save_checkpoint(tmp_path / "model.bf16.safetensors", tensors, replace(info, dtype=torch.bfloat16))
    assert bench.conversion_name(bf16_path) == "converted (bfloat16)"


@pytest.mark.real_model
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_llama_cpp_decodes_as_many_tokens_as_redline_past_the_end_of_text(smollm2_checkpoint):
    """The demo stops at its end of text after about 30 tokens of the benchmark's prompt; both engines must decode
    the asked count, so their rates cover the same positions."""
    from redline.scripts.demo_model import gguf_path

    once = bench.llama_cpp_runner(gguf_path(smollm2_checkpoint.parents[1]), 2, 48)
    run = once()
    assert run["new_tokens"] == 48 and run["decode_tok_s"] > 0 and run["prefill_tok_s"] > 0


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_llama_cpp_features_are_the_ones_its_build_enabled():
    import llama_cpp

    features = bench.llama_cpp_features()
    info = llama_cpp.llama_print_system_info().decode()
    assert features and all(f"{name} = 1" in info and ":" not in name for name in features)
    assert all(f"{name} = 0" not in info for name in features)


def test_redline_runs_on_the_asked_instruction_set(monkeypatch):
    """--simd: the rounds run with the kernels forced to that set, which the result records."""
    seen = []

    def measured(*args):
        from redline.kernels.cpu_linear import simd

        seen.append(simd())
        return {"redline_simd": simd()}

    monkeypatch.setattr(bench, "measured", measured)
    assert bench.run(None, {}, 1, 2, 1, 0, simd="portable") == {"redline_simd": "portable"}
    assert seen == ["portable"]
