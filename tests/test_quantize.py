"""quantize.py: int8 weight-only round trip, error bounds, file size, loading, CLI errors."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from redline.checkpoint import load_tensors, read_checkpoint_info
from redline.generate import LLM
from redline.quantize import Int8Linear, load_model, main, quantize_, quantize_checkpoint, quantize_int8

# The bounds this scheme promises (README: "int8 weight-only").
MAX_LAYER_REL_ERROR = 0.01
MIN_TOP1_AGREEMENT = 0.95
MAX_SIZE_RATIO = 0.55


@pytest.fixture(scope="module")
def bf16_checkpoint(tiny_llm_checkpoint, tmp_path_factory):
    from redline.scripts.convert_hf_checkpoint import convert_hf_checkpoint

    src = tiny_llm_checkpoint[0].parent
    return convert_hf_checkpoint(src, tmp_path_factory.mktemp("bf16") / "model.safetensors", dtype="bfloat16")


@pytest.fixture(scope="module")
def int8_checkpoint(bf16_checkpoint, tmp_path_factory):
    return quantize_checkpoint(bf16_checkpoint, "int8", tmp_path_factory.mktemp("int8") / "model.int8.safetensors")


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def test_quantize_int8_is_symmetric_per_channel():
    w = torch.randn(64, 300) * torch.linspace(0.1, 3, 64).unsqueeze(1)
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (64,)
    assert q.abs().max().item() == 127 and (q.abs().amax(dim=1) == 127).all()
    assert (q.float() * scales.unsqueeze(1) - w).abs().max() <= scales.max() / 2 + 1e-6


def test_round_trip_restores_identical_tensors(bf16_checkpoint, int8_checkpoint):
    original = load_tensors(read_checkpoint_info(bf16_checkpoint))
    info = read_checkpoint_info(int8_checkpoint)
    saved = load_tensors(info)
    assert info.scheme == "int8" and info.quantization["not_quantized"] == ["tok_embeddings"]
    for name in ("layers.0.attention.wqkv", "layers.1.feed_forward.w2", "output"):
        q, scales = quantize_int8(original[f"{name}.weight"])
        assert torch.equal(saved[f"{name}.weight"], q)
        assert torch.equal(saved[f"{name}.scales"], scales)
    assert saved["tok_embeddings.weight"].dtype == torch.bfloat16
    model = load_model(info, "cpu")
    layer = model.layers[0].attention.wqkv
    assert isinstance(layer, Int8Linear)
    assert torch.equal(layer.weight, saved["layers.0.attention.wqkv.weight"])
    assert torch.equal(layer.scales, saved["layers.0.attention.wqkv.scales"])


def test_per_layer_relative_error_is_within_one_percent(bf16_checkpoint, int8_checkpoint):
    ref_model = load_model(read_checkpoint_info(bf16_checkpoint), "cpu", torch.float32)
    q_model = load_model(read_checkpoint_info(int8_checkpoint), "cpu", torch.float32)
    torch.manual_seed(0)
    checked = 0
    for (name, ref), (_, q) in zip(ref_model.named_modules(), q_model.named_modules()):
        if isinstance(q, Int8Linear):
            x = torch.randn(16, q.in_features)
            err = rel_error(q(x), F.linear(x, ref.weight))
            assert err <= MAX_LAYER_REL_ERROR, (name, err)
            checked += 1
    assert checked == 2 * 4 + 1


def test_teacher_forced_top1_agreement(bf16_checkpoint, int8_checkpoint):
    bf16 = load_model(read_checkpoint_info(bf16_checkpoint), "cpu")
    int8 = load_model(read_checkpoint_info(int8_checkpoint), "cpu")
    torch.manual_seed(3)
    ids = torch.randint(3, bf16.args.vocab_size, (2, 96))  # 192 teacher-forced positions
    with torch.no_grad():
        agree = []
        for m in (bf16, int8):
            m.setup_caches(2, 96)
            agree.append(m(ids, torch.arange(96)).argmax(-1))
    agreement = (agree[0] == agree[1]).float().mean().item()
    assert agreement >= MIN_TOP1_AGREEMENT, agreement


def test_file_is_at_most_55_percent_of_bf16(bf16_checkpoint, int8_checkpoint):
    info = read_checkpoint_info(bf16_checkpoint)
    emb_bytes = info.args.vocab_size * info.args.dim * 2  # the embedding stays bf16 in both files
    ratio = (int8_checkpoint.stat().st_size - emb_bytes) / (bf16_checkpoint.stat().st_size - emb_bytes)
    assert ratio <= MAX_SIZE_RATIO, ratio


def test_llm_loads_int8_without_flags_and_quantizes_on_load(bf16_checkpoint, int8_checkpoint, tiny_llm_checkpoint,
                                                          tmp_path):
    import gzip
    import shutil

    for path in (bf16_checkpoint, int8_checkpoint):  # the tokenizer sits beside the checkpoint
        shutil.copy(tiny_llm_checkpoint[0].parent / "tokenizer.model", path.parent / "tokenizer.model")
    from_file = LLM.load(int8_checkpoint, device="cpu")
    on_load = LLM.load(bf16_checkpoint, device="cpu", quantize="int8")
    assert isinstance(from_file.model.layers[0].feed_forward.w13, Int8Linear)
    a = from_file.generate("def f(x):", max_new_tokens=16, ignore_eos=True)
    b = on_load.generate("def f(x):", max_new_tokens=16, ignore_eos=True)
    assert a.token_ids == b.token_ids
    assert a.stats.model_bytes_per_token < 0.6 * LLM.load(bf16_checkpoint, device="cpu").bytes_per_token
    # A model quantized on load is int8 in its trace too, though its checkpoint says "none".
    trace = tmp_path / "int8.json.gz"
    on_load.generate("def f(x):", max_new_tokens=8, ignore_eos=True, profile=trace)
    assert json.loads(gzip.decompress(trace.read_bytes()))["redline"]["stats"]["quantization"] == "int8"
    with pytest.raises(ValueError, match="already quantized"):
        LLM.load(int8_checkpoint, device="cpu", quantize="int8")


def test_quantize_in_memory_rejects_bad_mode_and_double_quantization(bf16_checkpoint):
    model = load_model(read_checkpoint_info(bf16_checkpoint), "cpu")
    with pytest.raises(ValueError, match="int4"):
        quantize_(model, "int3")
    quantize_(model, "int8")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_(model, "int8")


def test_cli_writes_atomically_and_reports_sizes(bf16_checkpoint, tmp_path, capsys):
    out = tmp_path / "q.safetensors"
    assert main(["--checkpoint_path", str(bf16_checkpoint), "--mode", "int8", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert str(out) in stdout and "MB ->" in stdout
    with safe_open(str(out), "pt") as f:
        assert json.loads(f.metadata()["quantization"])["scheme"] == "int8"
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left beside the output


@pytest.mark.parametrize(
    "argv_for, message",
    [
        (lambda ck, q: ["--checkpoint_path", str(ck), "--mode", "int3"], "unknown --mode 'int3'"),
        (lambda ck, q: ["--checkpoint_path", str(q), "--mode", "int8"], "already quantized"),
        (lambda ck, q: ["--checkpoint_path", str(ck.parent / "missing.safetensors"), "--mode", "int8"], "does not exist"),
        (lambda ck, q: ["--checkpoint_path", str(ck), "--mode", "int8", "--out", str(ck)], "overwrite"),
    ],
)
def test_cli_errors_are_one_line(bf16_checkpoint, int8_checkpoint, capsys, argv_for, message):
    code = main(argv_for(bf16_checkpoint, int8_checkpoint))
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and message in err


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_cli_refuses_an_out_that_is_the_input_through_a_link(bf16_checkpoint, tmp_path, capsys, link):
    import os

    out = tmp_path / "alias.safetensors"
    (out.symlink_to if link == "symlink" else lambda target: os.link(target, out))(bf16_checkpoint)
    before = bf16_checkpoint.read_bytes()
    assert main(["--checkpoint_path", str(bf16_checkpoint), "--mode", "int8", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "overwrite the input" in err and err.count("\n") == 1
    assert bf16_checkpoint.read_bytes() == before


def test_cli_ctrl_c_is_one_line_and_status_130(bf16_checkpoint, tmp_path, capsys, monkeypatch):
    from redline import quantize

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(quantize, "quantize_int8", interrupted)
    assert main(["--checkpoint_path", str(bf16_checkpoint), "--mode", "int8", "--out", str(tmp_path / "q.safetensors")]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "interrupted" in err and list(tmp_path.iterdir()) == []


def test_cli_progress_bar_only_on_a_terminal(bf16_checkpoint, tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert main(["--checkpoint_path", str(bf16_checkpoint), "--mode", "int8", "--out", str(tmp_path / "q.safetensors")]) == 0
    assert "quantizing" in capsys.readouterr().err


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_cli_random_arguments_give_a_result_or_one_line(bf16_checkpoint, int8_checkpoint, tmp_path, capsys, data):
    from redline.checkpoint import TEMP_FILE

    values = [str(bf16_checkpoint), str(bf16_checkpoint.parent), str(int8_checkpoint), str(tmp_path / "q.safetensors"),
              str(tmp_path / "q.bin"), str(tmp_path / "missing.safetensors"), str(bf16_checkpoint / "x.safetensors"),
              "/proc/self/environ", "", "int8", "int4", "none"]
    words = st.sampled_from(["--checkpoint_path", "--mode", "--out", "--mode=", "--x"] + values)
    text = st.text("-abcdefgijklmnopqrstuvwxyz_=./", max_size=10).filter(lambda a: not a.startswith("-h"))
    argv = data.draw(st.lists(words | text, max_size=6))
    before = bf16_checkpoint.read_bytes()
    code = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    if code == 0:
        assert read_checkpoint_info(out.splitlines()[0]).scheme == "int8"
    else:
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (argv, err)
    assert bf16_checkpoint.read_bytes() == before
    for folder in (bf16_checkpoint.parent, tmp_path):
        assert not [p for p in folder.iterdir() if TEMP_FILE.fullmatch(p.name)]


def test_quantizing_a_folder_keeps_the_folder_usable(bf16_checkpoint, sp_tokenizer_dir, tmp_path, capsys):
    import shutil

    from redline.checkpoint import resolve_checkpoint_path

    folder = tmp_path / "model"
    shutil.copytree(bf16_checkpoint.parent, folder)
    shutil.copyfile(sp_tokenizer_dir / "tokenizer.model", folder / "tokenizer.model")
    assert main(["--checkpoint_path", str(folder), "--mode", "int8"]) == 0
    capsys.readouterr()
    assert resolve_checkpoint_path(folder) == folder / "model.safetensors"  # the unquantized one, said on stderr
    assert "using the unquantized model.safetensors" in capsys.readouterr().err
    assert main(["--checkpoint_path", str(folder), "--mode", "int4"]) == 0  # a later command on the folder works
    assert LLM.load(folder, device="cpu", compile=False).info.scheme == "none"
    code = main(["--checkpoint_path", str(folder), "--mode", "int8"])
    assert code == 2 and "--overwrite" in capsys.readouterr().err
    assert main(["--checkpoint_path", str(folder), "--mode", "int8", "--overwrite"]) == 0


def test_default_names_of_two_checkpoints_sharing_a_prefix_differ(bf16_checkpoint, tmp_path):
    import shutil

    a, b = tmp_path / "llama.v1.safetensors", tmp_path / "llama.v2.safetensors"
    shutil.copyfile(bf16_checkpoint, a)
    shutil.copyfile(bf16_checkpoint, b)
    out_a, out_b = quantize_checkpoint(a, "int8"), quantize_checkpoint(b, "int8")
    assert out_a != out_b and out_a.name == "llama.v1.int8.safetensors"
    assert read_checkpoint_info(out_a).scheme == read_checkpoint_info(out_b).scheme == "int8"


def test_quantize_out_into_another_models_folder_keeps_its_tokenizer(bf16_checkpoint, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text('{"another": "model"}')
    code = main(["--checkpoint_path", str(bf16_checkpoint), "--mode", "int8", "--out", str(other / "q.safetensors")])
    err = capsys.readouterr().err
    assert code == 2 and "tokenizer.json of another model" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in other.iterdir()) == ["tokenizer.json"]


def test_copied_tokenizer_files_follow_the_umask(tiny_llm_checkpoint, tmp_path):
    import os

    old = os.umask(0o022)
    try:
        assert main(["--checkpoint_path", str(tiny_llm_checkpoint[0]), "--mode", "int8",
                     "--out", str(tmp_path / "q" / "m.safetensors")]) == 0
    finally:
        os.umask(old)
    copied = [p for p in (tmp_path / "q").iterdir() if p.name != "m.safetensors"]
    assert copied and all(p.stat().st_mode & 0o777 == 0o644 for p in copied)
