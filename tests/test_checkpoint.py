"""checkpoint.py: atomic writes and their temp files, output checks, and metadata that is checked, not trusted."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from redline.checkpoint import TEMP_FILE, check_output_path, read_checkpoint_info, remove_stale_temp_files, write_atomically


def temp_files(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if TEMP_FILE.fullmatch(p.name)]


def test_temp_file_is_named_for_its_target_and_process(tmp_path):
    seen = []

    def write(tmp: Path) -> None:
        seen.append(tmp)
        tmp.write_text("data")

    write_atomically(tmp_path / "out.json", write)
    match = TEMP_FILE.fullmatch(seen[0].name)
    assert seen[0].parent == tmp_path and match and match["name"] == "out.json" and int(match["pid"]) == os.getpid()
    assert (tmp_path / "out.json").read_text() == "data" and temp_files(tmp_path) == []


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_written_files_respect_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        write_atomically(tmp_path / "m.safetensors", lambda tmp: save_file({"a": torch.zeros(2)}, str(tmp)))
    finally:
        os.umask(old)
    assert (tmp_path / "m.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


def test_interrupt_leaves_neither_output_nor_temp(tmp_path):
    def write(tmp: Path) -> None:
        tmp.write_text("partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(tmp_path / "out.bin", write)
    assert list(tmp_path.iterdir()) == []


def test_a_killed_write_leaves_a_temp_that_the_next_write_removes(tmp_path):
    script = (
        "import sys, time\nfrom pathlib import Path\nfrom redline.checkpoint import write_atomically\n"
        "def write(tmp):\n    tmp.write_bytes(b'x' * 1000)\n    time.sleep(60)\n"
        "write_atomically(Path(sys.argv[1]), write)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "big.safetensors")],
                            env=os.environ.copy())
    deadline = time.monotonic() + 30
    while not [p for p in temp_files(tmp_path) if p.stat().st_size] and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    (stale,) = temp_files(tmp_path)
    assert int(TEMP_FILE.fullmatch(stale.name)["pid"]) == proc.pid
    live = tmp_path / f".other.tmp-{os.getppid()}-abcd"  # a write of a live process is left alone
    live.write_text("in progress")
    write_atomically(tmp_path / "small.json", lambda tmp: tmp.write_text("{}"))
    assert not stale.exists() and live.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "small.json"])


def test_stale_cleanup_ignores_names_that_only_look_alike(tmp_path):
    keep = [tmp_path / "model.tmp-1-ab", tmp_path / ".model.tmp-x-ab", tmp_path / ".model.tmp"]
    for path in keep:
        path.write_text("user data")
    assert remove_stale_temp_files(tmp_path) == []
    assert all(p.exists() for p in keep)


def test_output_that_is_an_input_is_refused_through_links(tmp_path):
    source = tmp_path / "in.safetensors"
    source.write_text("weights")
    (tmp_path / "sym.safetensors").symlink_to(source)
    os.link(source, tmp_path / "hard.safetensors")
    for out in ("in.safetensors", "sym.safetensors", "hard.safetensors", "./x/../in.safetensors"):
        with pytest.raises(ValueError, match="overwrite the input"):
            check_output_path(tmp_path / out, inputs=[source])
    check_output_path(tmp_path / "new.safetensors", inputs=[source])


def test_output_under_a_file_or_onto_a_folder_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        write_atomically(tmp_path / "file" / "sub" / "out.json", lambda tmp: tmp.write_text("{}"))
    with pytest.raises(ValueError, match="is a folder"):
        check_output_path(tmp_path)


@pytest.fixture(scope="module")
def redline_file(tiny_checkpoint, tmp_path_factory):
    """(tensors, metadata) of a valid converted checkpoint, to tamper with."""
    from safetensors import safe_open

    with safe_open(str(tiny_checkpoint[0]), "pt") as f:
        meta = f.metadata()
    return load_file(tiny_checkpoint[0]), meta


def write_tampered(path: Path, redline_file, tensors=None, **meta_changes) -> Path:
    tensors_in, meta = redline_file
    meta = {**meta, **meta_changes}
    save_file(tensors if tensors is not None else tensors_in, str(path), metadata=meta)
    return path


def with_config(redline_file, **changes) -> str:
    return json.dumps({**json.loads(redline_file[1]["config"]), **changes})


@pytest.mark.parametrize("quantization", ['"int8"', "null", '["int8"]', "{}", '{"scheme": 8}', "7"])
def test_tampered_quantization_metadata_is_one_clear_error(tmp_path, redline_file, quantization):
    path = write_tampered(tmp_path / "t.safetensors", redline_file, quantization=quantization)
    with pytest.raises(ValueError, match="malformed Redline metadata .*quantization"):
        read_checkpoint_info(path)


@pytest.mark.parametrize("scaling", ['"yarn"', "[8]", '{"factor": "8"}', '{"rope_type": "yarn"}'])
def test_tampered_rope_scaling_is_one_clear_error(tmp_path, redline_file, scaling):
    config = json.loads(redline_file[1]["config"])
    config["rope_scaling"] = json.loads(scaling)
    path = write_tampered(tmp_path / "t.safetensors", redline_file, config=json.dumps(config))
    with pytest.raises(ValueError, match="malformed Redline metadata"):
        read_checkpoint_info(path)


@pytest.mark.parametrize("changes", [dict(rope_base=float("nan")), dict(norm_eps="1e-5"), dict(tie_word_embeddings=1),
                                     dict(dim=64.0), dict(n_head=None)])
def test_tampered_config_values_are_one_clear_error(tmp_path, redline_file, changes):
    path = write_tampered(tmp_path / "t.safetensors", redline_file, config=with_config(redline_file, **changes))
    with pytest.raises(ValueError, match="malformed Redline metadata"):
        read_checkpoint_info(path)


@pytest.mark.parametrize("meta", [dict(redline_format="one"), dict(config="[1, 2]"), dict(dtype="int8")])
def test_tampered_format_fields_are_one_clear_error(tmp_path, redline_file, meta):
    path = write_tampered(tmp_path / "t.safetensors", redline_file, **meta)
    with pytest.raises(ValueError, match="malformed Redline metadata"):
        read_checkpoint_info(path)


def test_an_int8_tensor_under_scheme_none_is_refused(tmp_path, redline_file):
    tensors = dict(redline_file[0])
    name = "layers.0.attention.wo.weight"
    tensors[name] = tensors[name].to(torch.int8)
    path = write_tampered(tmp_path / "t.safetensors", redline_file, tensors=tensors)
    with pytest.raises(ValueError, match=f"{name} is I8, which quantization scheme 'none' does not allow"):
        read_checkpoint_info(path)


def test_an_integer_scale_free_tensor_under_int8_is_refused(tmp_path, redline_file):
    tensors = dict(redline_file[0])
    tensors["norm.weight"] = tensors["norm.weight"].to(torch.int8)
    path = write_tampered(tmp_path / "t.safetensors", redline_file, tensors=tensors, quantization='{"scheme": "int8"}')
    with pytest.raises(ValueError, match="norm.weight is I8"):
        read_checkpoint_info(path)


def test_unreadable_checkpoint_path_is_one_clear_error():
    target = Path("/proc/1/root/model.safetensors")
    try:
        target.exists()
    except PermissionError:
        with pytest.raises(ValueError, match="cannot read checkpoint"):
            read_checkpoint_info(target)
    else:
        pytest.skip("this process may read /proc/1/root")


def test_special_files_are_not_checkpoints():
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        read_checkpoint_info("/proc/self/environ")


# Metadata values for the property test: valid pieces, wrong types and JSON that parses to the wrong shape.
_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 10**6) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
_CONFIG_KEYS = ["dim", "n_layer", "n_head", "n_kv_heads", "head_dim", "intermediate_size", "vocab_size", "block_size",
                "rope_base", "rope_scaling", "norm_eps", "tie_word_embeddings", "other"]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    format_version=st.sampled_from(["1", "0", "2", "x", "", "1.0"]),
    config_changes=st.dictionaries(st.sampled_from(_CONFIG_KEYS), _JSON_VALUES, max_size=3),
    quantization=st.one_of(_JSON_VALUES.map(json.dumps), st.sampled_from(['{"scheme": "none"}', '{"scheme": "int8"}'])),
    dtype=st.sampled_from(["bfloat16", "float32", "fp16", "int8", "", "float64"]),
    drop=st.sampled_from([None, "config", "dtype", "quantization"]),
)
def test_random_metadata_gives_a_result_or_one_clear_error(tmp_path, redline_file, format_version, config_changes,
                                                           quantization, dtype, drop):
    meta = {**redline_file[1], "redline_format": format_version, "dtype": dtype, "quantization": quantization,
            "config": with_config(redline_file, **config_changes)}
    meta.pop(drop, None)
    path = tmp_path / "random.safetensors"
    save_file(redline_file[0], str(path), metadata=meta)
    try:
        info = read_checkpoint_info(path)
    except (ValueError, FileNotFoundError) as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    # Accepted: everything it reports is well-formed.
    assert info.format_version <= 1 and info.dtype in (torch.bfloat16, torch.float16, torch.float32)
    assert isinstance(info.quantization, dict) and isinstance(info.scheme, str)
    assert info.args.q_size > 0
    assert info.args.rope_scaling is None or hasattr(info.args.rope_scaling, "factor")


def test_meta_model_has_the_models_tensors_and_leaves_no_trace():
    """meta_model builds the same tensors as Transformer on the meta device, without importing the compiler stack
    (checked in a fresh interpreter), and leaves nn.Embedding's own initialization in place."""
    from redline.checkpoint import meta_model
    from redline.model import ModelArgs, Transformer

    args = ModelArgs.from_name("debug-tiny")
    with torch.device("meta"):
        want = {n: t.shape for n, t in Transformer(args).state_dict().items()}
    assert {n: t.shape for n, t in meta_model(args).state_dict().items()} == want
    assert torch.nn.Embedding(4, 2).weight.std() > 0  # initialized as usual outside it
    code = ("import sys; from redline.checkpoint import meta_model; from redline.model import ModelArgs; "
            "meta_model(ModelArgs.from_name('debug-tiny')); print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
