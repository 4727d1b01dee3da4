"""scripts/convert_hf_checkpoint.py: format, metadata, atomic writes and clear errors."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from redline.checkpoint import FORMAT_VERSION, TEMP_FILE, read_checkpoint_info, resolve_checkpoint_path
from conftest import save_tiny_hf_checkpoint
from redline.scripts.convert_hf_checkpoint import convert_hf_checkpoint, main


@pytest.fixture
def hf_dir(tmp_path):
    return save_tiny_hf_checkpoint(tmp_path / "hf", "gqa")[0]


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_writes_one_file_with_metadata(hf_dir, capsys):
    code, out, err = run_cli(capsys, "--checkpoint_dir", str(hf_dir), "--dtype", "bfloat16")
    assert code == 0, err
    path = resolve_checkpoint_path(out.strip())
    assert path.parent == hf_dir and path.suffix == ".safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}
    assert meta["redline_format"] == str(FORMAT_VERSION)
    assert meta["dtype"] == "bfloat16" and dtypes == {torch.bfloat16}
    assert json.loads(meta["quantization"]) == {"scheme": "none"}
    assert json.loads(meta["config"])["n_kv_heads"] == 2
    info = read_checkpoint_info(hf_dir)  # the folder resolves to the one Redline file in it
    assert info.path == path and info.args.n_layer == 2
    assert not [p for p in hf_dir.iterdir() if p.name.endswith(".tmp")]


def test_reconverting_ignores_the_earlier_output_and_replaces_it_only_with_overwrite(hf_dir, capsys):
    assert run_cli(capsys, "--checkpoint_dir", str(hf_dir))[0] == 0
    code, _, err = run_cli(capsys, "--checkpoint_dir", str(hf_dir), "--dtype", "float32")
    assert code == 2 and "--overwrite" in err and len(err.strip().splitlines()) == 1
    code, out, err = run_cli(capsys, "--checkpoint_dir", str(hf_dir), "--dtype", "float32", "--overwrite")
    assert code == 0, err
    assert read_checkpoint_info(out.strip()).dtype == torch.float32


def test_cli_out_and_dtype(hf_dir, tmp_path, capsys):
    out_file = tmp_path / "sub" / "m.safetensors"
    code, out, _ = run_cli(capsys, "--checkpoint_dir", str(hf_dir), "--out", str(out_file), "--dtype", "float16")
    assert code == 0 and out.strip() == str(out_file)
    assert read_checkpoint_info(out_file).dtype == torch.float16


def test_interrupted_write_leaves_no_file(hf_dir, tmp_path, monkeypatch):
    from redline import checkpoint

    def explode(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "write_safetensors", explode)
    out_file = tmp_path / "never.safetensors"
    with pytest.raises(KeyboardInterrupt):
        convert_hf_checkpoint(hf_dir, out_file)
    assert list(tmp_path.glob("*never*")) == []


@pytest.mark.parametrize(
    "break_it, message",
    [
        ("missing_dir", "does not exist"),
        ("no_weights", "no weights"),
        ("truncated", "truncated"),
        ("gpt2", "unsupported architecture 'GPT2LMHeadModel'"),
        ("missing_tensor", "model.layers.1.mlp.down_proj.weight"),
        ("extra_tensor", "model.layers.0.mlp.extra.weight"),
        ("wrong_shape", "model.layers.0.self_attn.o_proj.weight has shape (64, 63)"),
        ("no_config", "config.json not found"),
    ],
)
def test_bad_input_is_one_clear_line(hf_dir, tmp_path, capsys, break_it, message):
    from safetensors.torch import load_file, save_file

    weights = hf_dir / "model.safetensors"
    target = hf_dir
    if break_it == "missing_dir":
        target = tmp_path / "nope"
    elif break_it == "no_weights":
        weights.unlink()
    elif break_it == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif break_it == "gpt2":
        (hf_dir / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    elif break_it == "no_config":
        (hf_dir / "config.json").unlink()
    else:
        tensors = load_file(weights)
        if break_it == "missing_tensor":
            del tensors["model.layers.1.mlp.down_proj.weight"]
        elif break_it == "extra_tensor":
            tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
        else:
            tensors["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 63)
        save_file(tensors, weights, metadata={"format": "pt"})
    code, out, err = run_cli(capsys, "--checkpoint_dir", str(target))
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert message in err


def test_redline_file_is_required_for_loading(tmp_path):
    with pytest.raises(FileNotFoundError, match="convert_hf_checkpoint"):
        read_checkpoint_info(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_checkpoint_info(tmp_path / "missing.safetensors")


def one_line_error(code: int, out: str, err: str, message: str) -> None:
    assert code == 2 and out == "", (code, out, err)
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert message in err, err


def test_out_onto_the_hf_weights_is_refused_and_they_survive(hf_dir, capsys):
    weights = hf_dir / "model.safetensors"
    before = weights.read_bytes()
    one_line_error(*run_cli(capsys, "--checkpoint_dir", str(hf_dir), "--out", str(weights)), "overwrite the input")
    assert weights.read_bytes() == before


def test_out_onto_a_shard_or_a_link_to_it_is_refused(tmp_path, capsys):
    hf_dir = save_tiny_hf_checkpoint(tmp_path / "sharded", "sharded")[0]
    shards = sorted(hf_dir.glob("model-*.safetensors"))
    assert len(shards) > 2
    (tmp_path / "link.safetensors").symlink_to(shards[1])
    import os

    os.link(shards[2], tmp_path / "hard.safetensors")
    before = {p: p.read_bytes() for p in shards}
    capsys.readouterr()  # drop the HF writer's own progress output
    for out in (shards[1], tmp_path / "link.safetensors", tmp_path / "hard.safetensors"):
        one_line_error(*run_cli(capsys, "--checkpoint_dir", str(hf_dir), "--out", str(out)), "overwrite the input")
    assert {p: p.read_bytes() for p in shards} == before


def test_out_onto_a_file_that_is_not_redline_is_refused(hf_dir, tmp_path, capsys):
    other = tmp_path / "adapter.safetensors"
    save_file_with({"x": torch.zeros(2)}, other)
    one_line_error(*run_cli(capsys, "--checkpoint_dir", str(hf_dir), "--out", str(other)), "not a Redline checkpoint")


def save_file_with(tensors, path):
    from safetensors.torch import save_file

    save_file(tensors, str(path))


def rewrite_weights(hf_dir, change) -> None:
    from safetensors.torch import load_file, save_file

    weights = hf_dir / "model.safetensors"
    tensors = load_file(weights)
    change(tensors)
    save_file(tensors, weights, metadata={"format": "pt"})


def resplit(tensors, first: str, second: str, at: int) -> None:
    both = torch.cat([tensors[first], tensors[second]])
    tensors[first], tensors[second] = both[:at].clone(), both[at:].clone()


@pytest.mark.parametrize("first, second, at, shapes", [
    ("self_attn.q_proj", "self_attn.k_proj", 80, ("(80, 64), but config.json implies (64, 64)",
                                                  "(16, 64), but config.json implies (32, 64)")),
    ("mlp.gate_proj", "mlp.up_proj", 200, ("(200, 64), but config.json implies (160, 64)",
                                           "(120, 64), but config.json implies (160, 64)")),
])
def test_mis_split_fused_tensors_are_refused(hf_dir, capsys, first, second, at, shapes):
    """The concatenation has the right size, so only a check of each HF tensor before fusing catches this."""
    rewrite_weights(hf_dir, lambda t: resplit(t, f"model.layers.0.{first}.weight", f"model.layers.0.{second}.weight", at))
    code, out, err = run_cli(capsys, "--checkpoint_dir", str(hf_dir))
    one_line_error(code, out, err, "has shape")
    assert f"{first}.weight has shape {shapes[0]}" in err or f"{second}.weight has shape {shapes[1]}" in err, err


@pytest.mark.parametrize("shape", [(64, 65), (64,), (64 * 64,)])
def test_malformed_q_proj_is_one_line(hf_dir, capsys, shape):
    rewrite_weights(hf_dir, lambda t: t.update({"model.layers.1.self_attn.q_proj.weight": torch.zeros(shape)}))
    one_line_error(*run_cli(capsys, "--checkpoint_dir", str(hf_dir)), f"q_proj.weight has shape {shape}")


def test_integer_hf_tensor_is_refused(hf_dir, capsys):
    rewrite_weights(hf_dir, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)}))
    one_line_error(*run_cli(capsys, "--checkpoint_dir", str(hf_dir)), "model.norm.weight is torch.int32")


def edit_config(hf_dir, change) -> None:
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps(change(config)))


@pytest.mark.parametrize("change, message", [
    (lambda c: [c], "must hold a JSON object, got a list"),
    (lambda c: {k: v for k, v in c.items() if k != "num_attention_heads"}, "no 'num_attention_heads'"),
    (lambda c: {**c, "num_attention_heads": "4"}, "num_attention_heads must be a positive integer, got '4'"),
    (lambda c: {**c, "hidden_size": 64.0}, "hidden_size must be a positive integer"),
    (lambda c: {**c, "rms_norm_eps": -1}, "rms_norm_eps must be a positive number"),
    (lambda c: {**c, "tie_word_embeddings": "no"}, "tie_word_embeddings must be true or false"),
    (lambda c: {**c, "rope_parameters": {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
     "rope parameters has no 'factor'"),
    (lambda c: {**c, "rope_parameters": "linear"}, "rope_parameters must be an object or null"),
    (lambda c: {**c, "rope_scaling": {"type": "dynamic", "factor": 4.0}}, "rope type 'dynamic'"),
])
def test_bad_config_is_one_line(hf_dir, capsys, change, message):
    edit_config(hf_dir, change)
    one_line_error(*run_cli(capsys, "--checkpoint_dir", str(hf_dir)), message)


def test_out_under_a_file_is_one_line(hf_dir, capsys):
    target = hf_dir / "config.json" / "model.safetensors"
    one_line_error(*run_cli(capsys, "--checkpoint_dir", str(hf_dir), "--out", str(target)), "is a file, not a folder")


@pytest.mark.parametrize("path, message", [("/proc/self", "config.json not found"),
                                           ("/proc/self/environ", "is not a folder")])
def test_checkpoint_dir_in_proc_is_one_line(capsys, path, message):
    one_line_error(*run_cli(capsys, "--checkpoint_dir", path), message)


def test_output_respects_the_umask(hf_dir, tmp_path, capsys):
    import os

    old = os.umask(0o027)
    try:
        assert run_cli(capsys, "--checkpoint_dir", str(hf_dir), "--out", str(tmp_path / "m.safetensors"))[0] == 0
    finally:
        os.umask(old)
    assert (tmp_path / "m.safetensors").stat().st_mode & 0o777 == 0o640


def test_legacy_bin_is_read_without_mmap(tmp_path, capsys):
    hf_dir, hf_model = save_tiny_hf_checkpoint(tmp_path / "legacy", "bin")
    torch.save(hf_model.state_dict(), hf_dir / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    code, out, err = run_cli(capsys, "--checkpoint_dir", str(hf_dir), "--dtype", "float32")
    assert code == 0, err
    from safetensors.torch import load_file

    converted = load_file(out.strip())
    assert torch.equal(converted["layers.1.feed_forward.w2.weight"], hf_model.state_dict()["model.layers.1.mlp.down_proj.weight"])


def test_bin_with_pickled_objects_is_refused_as_unsafe(tmp_path, capsys):
    hf_dir, hf_model = save_tiny_hf_checkpoint(tmp_path / "pickled", "bin")
    torch.save({**hf_model.state_dict(), "extra": Path("x")}, hf_dir / "pytorch_model.bin")
    capsys.readouterr()
    one_line_error(*run_cli(capsys, "--checkpoint_dir", str(hf_dir)), "holds more than plain tensors")


def test_ctrl_c_is_one_line_and_status_130(hf_dir, tmp_path, capsys, monkeypatch):
    from redline import checkpoint

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "write_safetensors", interrupted)
    code, out, err = run_cli(capsys, "--checkpoint_dir", str(hf_dir), "--out", str(tmp_path / "m.safetensors"))
    assert code == 130 and out == "" and err.count("\n") == 1 and "interrupted" in err
    assert list(tmp_path.glob("*m.safetensors*")) == []


def test_progress_bar_only_on_a_terminal(hf_dir, tmp_path, capsys, monkeypatch):
    assert run_cli(capsys, "--checkpoint_dir", str(hf_dir), "--out", str(tmp_path / "a.safetensors"))[2] == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    code, _, err = run_cli(capsys, "--checkpoint_dir", str(hf_dir), "--out", str(tmp_path / "b.safetensors"))
    assert code == 0 and "converting" in err and "tensor" in err


@pytest.fixture(scope="module")
def hf_dir_shared(tmp_path_factory):
    return save_tiny_hf_checkpoint(tmp_path_factory.mktemp("hf-prop"), "tied")[0]


def _not_help(arg: str) -> bool:
    return not (arg.startswith("-") and len(arg) >= 2 and ("--help".startswith(arg) or arg.startswith("-h")))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_arguments_give_a_result_or_one_line(hf_dir_shared, tmp_path, capsys, data):
    values = [str(hf_dir_shared), str(hf_dir_shared / "model.safetensors"), str(hf_dir_shared / "config.json"),
              str(tmp_path / "out.safetensors"), str(tmp_path / "out.txt"), str(tmp_path / "missing"),
              str(hf_dir_shared / "config.json" / "x.safetensors"), "/proc/self", "", "float32", "int8", "bf16"]
    words = st.sampled_from(["--checkpoint_dir", "--out", "--dtype", "--out=", "--bogus"] + values)
    argv = data.draw(st.lists(words | st.text("-abcdefghijklmnopqrstuvwxyz_=./", max_size=10).filter(_not_help),
                              max_size=6))
    weights = (hf_dir_shared / "model.safetensors").read_bytes()
    code, out, err = run_cli(capsys, *argv)
    assert "Traceback" not in err
    if code == 0:
        assert read_checkpoint_info(out.strip()).args.tie_word_embeddings
    else:
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (argv, err)
    assert (hf_dir_shared / "model.safetensors").read_bytes() == weights
    for folder in (hf_dir_shared, tmp_path):
        assert not [p for p in folder.iterdir() if TEMP_FILE.fullmatch(p.name)]


def test_a_file_that_leads_out_of_the_folder_is_never_read_or_copied(tmp_path, capsys):
    import shutil

    hf_dir = save_tiny_hf_checkpoint(tmp_path / "hf", "gqa")[0]
    capsys.readouterr()  # drop the HF writer's own progress output
    secret = tmp_path / "secret.json"
    secret.write_text('{"private": "data"}')
    (hf_dir / "tokenizer_config.json").unlink(missing_ok=True)
    (hf_dir / "tokenizer_config.json").symlink_to(secret)
    out = tmp_path / "out" / "m.safetensors"
    code, _, err = run_cli(capsys, "--checkpoint_dir", str(hf_dir), "--out", str(out))
    assert code == 2 and "outside the checkpoint folder" in err and err.count("\n") == 1
    assert not out.parent.exists() or not any(out.parent.iterdir())
    (hf_dir / "tokenizer_config.json").unlink()
    shutil.move(hf_dir / "config.json", tmp_path / "config.json")
    (hf_dir / "config.json").symlink_to(tmp_path / "config.json")
    code, _, err = run_cli(capsys, "--checkpoint_dir", str(hf_dir), "--out", str(out))
    assert code == 2 and "outside the checkpoint folder" in err


def test_a_small_config_that_declares_a_billion_layers_is_refused_at_once(hf_dir, tmp_path, capsys):
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10 ** 9}))
    start = time.monotonic()
    code, _, err = run_cli(capsys, "--checkpoint_dir", str(hf_dir), "--out", str(tmp_path / "m.safetensors"))
    assert code == 2 and "declares 1000000000 layers" in err and err.count("\n") == 1
    assert time.monotonic() - start < 30


def test_a_context_no_loader_accepts_is_refused_before_writing(hf_dir, capsys):
    edit_config(hf_dir, lambda c: {**c, "max_position_embeddings": 10 ** 18})
    one_line_error(*run_cli(capsys, "--checkpoint_dir", str(hf_dir)), "declares a context of 1000000000000000000")
    assert not (hf_dir / "model.redline.safetensors").exists()


def test_deeply_nested_config_is_one_line(hf_dir, capsys):
    depth = 100_000
    (hf_dir / "config.json").write_text('{"a": ' * depth + "1" + "}" * depth)
    one_line_error(*run_cli(capsys, "--checkpoint_dir", str(hf_dir)), "nests its JSON too deeply")
