"""scripts/download.py and scripts/prepare.sh, without network access."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


download = _load("redline_download", ROOT / "scripts" / "download.py")

TOKENIZER = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


class FakeHub:
    """Stands in for HfApi + snapshot_download; records calls, writes the allowed files."""

    def __init__(self, files, list_error=None, download_error=None):
        self.files = list(files)
        self.list_error = list_error
        self.download_error = download_error
        self.calls: list[dict] = []
        self.tokens: list = []

    def install(self, monkeypatch):
        hub = self

        class FakeApi:
            def model_info(self, repo_id, token=None, **kw):
                hub.tokens.append(token)
                if hub.list_error is not None:
                    raise hub.list_error
                return SimpleNamespace(siblings=[SimpleNamespace(rfilename=f) for f in hub.files])

        def fake_snapshot_download(repo_id, *, local_dir, allow_patterns, token=None, **kw):
            hub.calls.append(
                dict(repo_id=repo_id, local_dir=local_dir, allow_patterns=list(allow_patterns), token=token, **kw)
            )
            if hub.download_error is not None:
                raise hub.download_error
            import fnmatch

            for f in hub.files:
                if any(fnmatch.fnmatch(f, p) for p in allow_patterns):
                    dst = Path(local_dir) / f
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    dst.write_text(f"contents of {f}")
            return str(local_dir)

        monkeypatch.setattr(download, "HfApi", FakeApi)
        monkeypatch.setattr(download, "snapshot_download", fake_snapshot_download)
        return self


def _one_error_line(capsys) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert out == ""
    return lines[0]


def _http_error(cls, status: int, message: str = "boom"):
    # json: huggingface_hub 0.x reads the server's message from the body of the response.
    response = SimpleNamespace(status_code=status, headers={}, request=None, url="https://huggingface.co/x", json=dict)
    try:
        return cls(message, response=response)
    except TypeError:  # very old / new signature without a response keyword
        err = cls(message)
        err.response = response
        return err


# --------------------------------------------------------------------------------------
# file selection / allow_patterns
# --------------------------------------------------------------------------------------


def test_safetensors_repo_fetches_only_what_conversion_needs(tmp_path, monkeypatch, capsys):
    files = [
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "consolidated.safetensors",  # Mistral-style duplicate
        "pytorch_model.bin",  # legacy duplicate: skipped because safetensors exist
        "original/consolidated.00.pth",
        "original/params.json",
        "original/tokenizer.model",
        "tokenizer.model",
        *TOKENIZER,
        "README.md",
        "LICENSE",
    ]
    hub = FakeHub(files).install(monkeypatch)
    rc = download.main(["--repo_id", "org/model", "--checkpoint_dir", str(tmp_path), "--hf_token", "tok"])
    assert rc == 0
    out = capsys.readouterr().out.strip()
    local = tmp_path / "org" / "model"
    assert out == str(local)
    (call,) = hub.calls
    assert call["repo_id"] == "org/model"
    assert Path(call["local_dir"]) == local
    assert call["token"] == "tok" and hub.tokens == ["tok"]
    assert sorted(call["allow_patterns"]) == sorted(
        [
            "config.json",
            "generation_config.json",
            "tokenizer.model",
            *TOKENIZER,
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
        ]
    )
    assert not (local / "original").exists()
    assert not (local / "consolidated.safetensors").exists()


def test_bin_only_repo_fetches_pytorch_model_bins(tmp_path, monkeypatch):
    files = [
        "config.json",
        "pytorch_model-00001-of-00002.bin",
        "pytorch_model-00002-of-00002.bin",
        "pytorch_model.bin.index.json",
        "training_args.bin",
        "optimizer.pt",
        "tokenizer.model",
        "tokenizer_config.json",
    ]
    hub = FakeHub(files).install(monkeypatch)
    path = download.download_checkpoint("org/old-model", tmp_path, None)
    assert path == tmp_path / "org" / "old-model"
    assert sorted(hub.calls[0]["allow_patterns"]) == sorted(
        [
            "config.json",
            "tokenizer.model",
            "tokenizer_config.json",
            "pytorch_model-00001-of-00002.bin",
            "pytorch_model-00002-of-00002.bin",
            "pytorch_model.bin.index.json",
        ]
    )
    assert hub.calls[0]["token"] is None


def test_llama3_tokenizer_model_comes_from_original(tmp_path, monkeypatch):
    files = [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "original/consolidated.00.pth",
        "original/params.json",
        "original/tokenizer.model",
        *TOKENIZER,
    ]
    hub = FakeHub(files).install(monkeypatch)
    path = download.download_checkpoint("meta-llama/Llama-3.2-1B", tmp_path, None)
    patterns = hub.calls[0]["allow_patterns"]
    assert "original/tokenizer.model" in patterns
    assert "model.safetensors" in patterns
    assert not any("consolidated" in p or "params" in p for p in patterns)
    assert (path / "tokenizer.model").read_text() == "contents of original/tokenizer.model"
    assert not (path / "original" / "consolidated.00.pth").exists()


def test_patterns_are_exact_names():
    # '*', '?' and '[' in a file name must not act as wildcards
    assert download.allow_patterns_for(["a[1].safetensors", "config.json"]) == [
        "a[[]1].safetensors",
        "config.json",
    ]


@pytest.mark.parametrize(
    "files, message",
    [
        (["model.safetensors", "tokenizer.json"], "no top-level config.json"),
        (["config.json", "original/consolidated.00.pth", "consolidated.safetensors"], "no top-level"),
    ],
)
def test_repo_without_usable_files(tmp_path, monkeypatch, capsys, files, message):
    hub = FakeHub(files).install(monkeypatch)
    assert download.main(["--repo_id", "org/x", "--checkpoint_dir", str(tmp_path)]) == 2
    line = _one_error_line(capsys)
    assert message in line and "org/x" in line
    assert hub.calls == []


# --------------------------------------------------------------------------------------
# errors: one line on stderr, exit 2
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("repo_id", ["noslash", "a/b/c", "/name", "org/", "org/na me", "org/..", "-org/x"])
def test_bad_repo_id(tmp_path, monkeypatch, capsys, repo_id):
    hub = FakeHub(["config.json"]).install(monkeypatch)
    assert download.main([f"--repo_id={repo_id}", "--checkpoint_dir", str(tmp_path)]) == 2
    assert "ORG/NAME" in _one_error_line(capsys)
    assert hub.tokens == [] and hub.calls == []


def _transport_connect_errors(message: str) -> list[Exception]:
    """A connect failure from each installed HTTP library that huggingface_hub has used (0.x requests, 1.x httpx,
    2.x httpx2), as its own code raises it."""
    errs: list[Exception] = []
    if importlib.util.find_spec("httpx2") is not None:
        import httpx2

        errs.append(httpx2.ConnectError(message))
    if importlib.util.find_spec("httpx") is not None:
        import httpx

        errs.append(httpx.ConnectError(message))
    if importlib.util.find_spec("requests") is not None:
        import requests

        errs.append(requests.ConnectionError(message))
    return errs


def _offline_errors():
    return [ConnectionError("[Errno 111] Connection refused"),
            *_transport_connect_errors("[Errno -2] Name or service not known"),
            download.OfflineModeIsEnabled("offline mode is enabled")]


@pytest.mark.parametrize("error", _offline_errors(), ids=lambda e: type(e).__name__)
def test_offline_listing_error(tmp_path, monkeypatch, capsys, error):
    FakeHub([], list_error=error).install(monkeypatch)
    assert download.main(["--repo_id", "org/model", "--checkpoint_dir", str(tmp_path)]) == 2
    line = _one_error_line(capsys)
    assert line.startswith("error: cannot reach the Hugging Face Hub")
    assert "already-downloaded directory" in line


@pytest.mark.parametrize("cause", _transport_connect_errors("connection refused"), ids=lambda e: type(e).__module__)
def test_connection_failure_found_anywhere_in_the_chain(cause):
    try:
        try:
            raise cause
        except Exception as c:
            raise RuntimeError("listing failed") from c
    except RuntimeError as e:
        assert download._is_connection_error(e)
    assert not download._is_connection_error(RuntimeError("listing failed"))
    assert not download._is_connection_error(_http_error(download.HfHubHTTPError, 503))


def test_offline_download_error_wrapped_in_local_entry_not_found(tmp_path, monkeypatch, capsys):
    cause = ConnectionResetError("connection reset")
    try:
        try:
            raise cause
        except ConnectionResetError as c:
            raise download.LocalEntryNotFoundError("cannot find the requested files in the local cache") from c
    except download.LocalEntryNotFoundError as e:
        err = e
    FakeHub(["config.json", "model.safetensors"], download_error=err).install(monkeypatch)
    assert download.main(["--repo_id", "org/model", "--checkpoint_dir", str(tmp_path)]) == 2
    assert "cannot reach the Hugging Face Hub" in _one_error_line(capsys)


def test_offline_with_complete_local_copy_succeeds(tmp_path, monkeypatch, capsys):
    local = tmp_path / "org" / "model"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    (local / "model.safetensors").write_bytes(b"x")
    FakeHub([], list_error=ConnectionError("down")).install(monkeypatch)
    assert download.main(["--repo_id", "org/model", "--checkpoint_dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(local)
    assert "using the existing download" in err


def test_offline_with_incomplete_sharded_copy_fails(tmp_path, monkeypatch, capsys):
    local = tmp_path / "org" / "model"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    (local / "model-00001-of-00002.safetensors").write_bytes(b"x")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (local / "model.safetensors.index.json").write_text(json.dumps(index))
    FakeHub([], list_error=ConnectionError("down")).install(monkeypatch)
    assert download.main(["--repo_id", "org/model", "--checkpoint_dir", str(tmp_path)]) == 2
    assert "cannot reach the Hugging Face Hub" in _one_error_line(capsys)  # no fallback to a partial copy


@pytest.mark.parametrize("where", ["list", "download"])
def test_gated_repo(tmp_path, monkeypatch, capsys, where):
    err = _http_error(download.GatedRepoError, 403, "Access to model meta-llama/Llama-3.1-8B is restricted.")
    files = ["config.json", "model.safetensors"]
    if where == "list":
        FakeHub(files, list_error=err).install(monkeypatch)
    else:
        FakeHub(files, download_error=err).install(monkeypatch)
    assert download.main(["--repo_id", "meta-llama/Llama-3.1-8B", "--checkpoint_dir", str(tmp_path)]) == 2
    line = _one_error_line(capsys)
    assert "accept the license at https://huggingface.co/meta-llama/Llama-3.1-8B" in line
    assert "--hf_token" in line and ("`huggingface-cli login`" in line or "`hf auth login`" in line)


@pytest.mark.parametrize("status", [401, 403])
def test_plain_http_auth_error_is_reported_as_gated(tmp_path, monkeypatch, capsys, status):
    FakeHub([], list_error=_http_error(download.HfHubHTTPError, status, "unauthorized")).install(monkeypatch)
    assert download.main(["--repo_id", "org/private", "--checkpoint_dir", str(tmp_path)]) == 2
    line = _one_error_line(capsys)
    assert "accept the license at https://huggingface.co/org/private" in line


def test_repo_not_found(tmp_path, monkeypatch, capsys):
    err = _http_error(download.RepositoryNotFoundError, 404, "Repository Not Found for url: ...\nmore text")
    FakeHub([], list_error=err).install(monkeypatch)
    assert download.main(["--repo_id", "org/does-not-exist", "--checkpoint_dir", str(tmp_path)]) == 2
    line = _one_error_line(capsys)
    assert "org/does-not-exist not found" in line


def test_server_error(tmp_path, monkeypatch, capsys):
    err = _http_error(download.HfHubHTTPError, 503, "Service Unavailable\nretry later")
    FakeHub(["config.json", "model.safetensors"], download_error=err).install(monkeypatch)
    assert download.main(["--repo_id", "org/model", "--checkpoint_dir", str(tmp_path)]) == 2
    assert "HTTP 503" in _one_error_line(capsys)


# --------------------------------------------------------------------------------------
# the real huggingface_hub, with the network out of reach
# --------------------------------------------------------------------------------------


def _hub_env(tmp_path) -> dict:
    env = dict(os.environ)
    for k in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(k, None)
    env["HF_HOME"] = str(tmp_path / "hf_home")
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # never the real Hub, even if offline mode were ignored
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


def test_real_hub_offline_mode(tmp_path):
    # huggingface_hub reads HF_HUB_OFFLINE once, at import: use a fresh interpreter.
    env = _hub_env(tmp_path)
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "download.py"), "--repo_id", "org/model",
         "--checkpoint_dir", str(tmp_path / "ckpt")],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "cannot reach the Hugging Face Hub" in lines[0] and "HF_HUB_OFFLINE" in lines[0]
    assert proc.stdout == ""


def test_real_hub_unreachable_endpoint(tmp_path, monkeypatch, capsys):
    # In process: huggingface_hub caches HF_ENDPOINT at import, so patch its constant too.
    from huggingface_hub import constants

    for k, v in _hub_env(tmp_path).items():
        if k.startswith(("HF_", "NO_PROXY", "no_proxy")):
            monkeypatch.setenv(k, v)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False, raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    rc = download.main(["--repo_id", "org/model", "--checkpoint_dir", str(tmp_path / "ckpt"), "--hf_token", "x"])
    assert rc == 2
    line = _one_error_line(capsys)
    assert "cannot reach the Hugging Face Hub" in line and "check your network" in line


# --------------------------------------------------------------------------------------
# scripts/prepare.sh
# --------------------------------------------------------------------------------------


def test_prepare_sh_usage():
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "prepare.sh")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "usage: scripts/prepare.sh ORG/NAME" in proc.stderr


def test_prepare_sh_runs_download_then_convert(tmp_path):
    log = tmp_path / "calls.txt"
    fake_python = tmp_path / "fake-python"
    fake_python.write_text(f'#!/usr/bin/env bash\necho "$PYTHONPATH|$*" >> "{log}"\n')
    fake_python.chmod(0o755)
    env = dict(os.environ, PYTHON=str(fake_python))
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "prepare.sh"), "org/model", "--dtype", "bfloat16"],
        env=env, capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().splitlines()
    assert len(calls) == 2
    pythonpath, dl = calls[0].split("|")
    assert pythonpath.split(":")[0] == str(ROOT)
    assert dl == f"{ROOT}/scripts/download.py --repo_id org/model --checkpoint_dir {ROOT}/checkpoints"
    assert calls[1].split("|")[1] == (
        f"{ROOT}/scripts/convert_hf_checkpoint.py --checkpoint_dir {ROOT}/checkpoints/org/model --dtype bfloat16"
    )


def test_prepare_sh_stops_when_download_fails(tmp_path):
    log = tmp_path / "calls.txt"
    fake_python = tmp_path / "fake-python"
    fake_python.write_text(f'#!/usr/bin/env bash\necho "$*" >> "{log}"\nexit 2\n')
    fake_python.chmod(0o755)
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "prepare.sh"), "org/model"],
        env=dict(os.environ, PYTHON=str(fake_python)), capture_output=True, text=True,
    )
    assert proc.returncode == 2
    assert len(log.read_text().splitlines()) == 1  # convert never ran
