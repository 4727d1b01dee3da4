#!/usr/bin/env python3
"""Download the files of a Hugging Face checkpoint that the converter needs.

    python scripts/download.py --repo_id ORG/NAME [--checkpoint_dir checkpoints] [--hf_token TOKEN]

Only config.json, generation_config.json, the top-level safetensors weights (+ index) and
the tokenizer files are fetched into <checkpoint_dir>/ORG/NAME.  pytorch_model*.bin weights
(+ index) are fetched only when the repository has no safetensors weights.  `original/`
(Meta's consolidated .pth copies) and consolidated*.safetensors duplicates are never fetched,
except `original/tokenizer.model` (the Llama 3 tiktoken file) when there is no top-level
tokenizer.model; it is then copied to <dir>/tokenizer.model.

Failures (offline, gated, not found, bad repo id) print one line on stderr and exit with 2.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import os
import re
import shutil
import socket
import sys
from pathlib import Path

from huggingface_hub import HfApi, snapshot_download  # module names, so that tests can monkeypatch them
# huggingface_hub.utils holds every one of these from 0.24 on (1.x and 2.x define them in huggingface_hub.errors and
# re-export them here; 0.24 has the HTTP ones only here), so one import serves every supported version.
from huggingface_hub.utils import (GatedRepoError, HfHubHTTPError, HFValidationError, LocalEntryNotFoundError,
                                   OfflineModeIsEnabled, RepositoryNotFoundError, RevisionNotFoundError)

EXIT_ERROR = 2

CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.model",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
LLAMA3_TOKENIZER = "original/tokenizer.model"

# ORG/NAME: letters, digits, '-', '_', '.'; no leading/trailing '-' or '.', no '--' or '..'.
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_REPO_ID_RE = re.compile(rf"^{_NAME}/{_NAME}$")


class DownloadError(Exception):
    """A failure that is reported as one line on stderr (exit code 2)."""


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The connection-failure base classes of the HTTP library the installed huggingface_hub talks through."""
    found: list[type[BaseException]] = []
    # huggingface_hub 0.x uses requests, 1.x httpx and 2.x httpx2; only the one in use need be installed.
    with contextlib.suppress(ImportError):
        import requests

        found += [requests.ConnectionError, requests.Timeout]
    with contextlib.suppress(ImportError):
        import httpx

        found.append(httpx.TransportError)
    with contextlib.suppress(ImportError):
        import httpx2

        found.append(httpx2.TransportError)
    return tuple(found)


# What "the Hub cannot be reached" looks like, anywhere in an exception's chain: offline mode, a file missing from the
# cache while the Hub was out of reach, the socket-level errors, and the HTTP library's connect/timeout failures.
CONNECTION_ERRORS = (OfflineModeIsEnabled, LocalEntryNotFoundError, ConnectionError, TimeoutError, socket.gaierror,
                     *_transport_errors())


def _exception_chain(err: BaseException):
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo.append(e.__cause__)
        todo.append(e.__context__)


def _is_connection_error(err: BaseException) -> bool:
    return any(isinstance(e, CONNECTION_ERRORS) for e in _exception_chain(err))


def _root_cause(err: BaseException) -> str:
    """Short text of the innermost exception (e.g. 'ConnectError: [Errno 111] Connection refused')."""
    chain = list(_exception_chain(err))
    inner = chain[-1]
    text = _one_line(inner, 100)
    return f"{type(inner).__name__}: {text}" if text else type(inner).__name__


def _status_code(err: BaseException) -> int | None:
    response = getattr(err, "response", None)
    code = getattr(response, "status_code", None)
    return code if isinstance(code, int) else None


def _offline_mode() -> bool:
    try:
        from huggingface_hub import constants

        if getattr(constants, "HF_HUB_OFFLINE", False):
            return True
    except ImportError:  # pragma: no cover
        pass
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}


def _login_command() -> str:
    """`huggingface-cli login` was replaced by `hf auth login` in huggingface_hub 1.0."""
    try:
        import huggingface_hub

        major = int(str(huggingface_hub.__version__).split(".")[0])
    except (ImportError, ValueError):  # pragma: no cover
        major = 0
    return "`hf auth login`" if major >= 1 else "`huggingface-cli login`"


def _one_line(text: object, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _describe(err: BaseException, repo_id: str, local_dir: Path | None) -> str:
    """Turn a huggingface_hub / network error into one actionable line."""
    url = f"https://huggingface.co/{repo_id}"
    status = _status_code(err)
    if isinstance(err, GatedRepoError) or (
        status in (401, 403) and not isinstance(err, RepositoryNotFoundError)
    ):
        return (
            f"access to {repo_id} was denied (gated or private repository, HTTP {status or 'auth'}): "
            f"accept the license at {url} and pass --hf_token or run {_login_command()}"
        )
    if isinstance(err, RevisionNotFoundError):
        return f"revision not found in {repo_id}: {_one_line(err, 120)}"
    if isinstance(err, RepositoryNotFoundError):
        return (
            f"repository {repo_id} not found on the Hugging Face Hub: check the spelling; "
            f"if it is private or gated, accept the license at {url} and pass --hf_token "
            f"or run {_login_command()}"
        )
    if _is_connection_error(err):
        where = f"{local_dir} is not a complete download" if local_dir is not None else "nothing is downloaded"
        if _offline_mode():
            return (
                f"cannot reach the Hugging Face Hub to download {repo_id}: offline mode is enabled "
                f"(HF_HUB_OFFLINE) and {where}; unset HF_HUB_OFFLINE to download it, or use an "
                "already-downloaded directory"
            )
        return (
            f"cannot reach the Hugging Face Hub to download {repo_id} ({_root_cause(err)}): "
            "check your network or set HF_HUB_OFFLINE and use an already-downloaded directory"
        )
    if isinstance(err, HFValidationError):
        return f"invalid repo id {repo_id!r}: {_one_line(err, 160)} (expected ORG/NAME)"
    if isinstance(err, HfHubHTTPError):
        return f"Hugging Face Hub error for {repo_id} (HTTP {status or '?'}): {_one_line(err, 200)}"
    return f"{type(err).__name__}: {_one_line(err)}"


# --------------------------------------------------------------------------------------
# file selection
# --------------------------------------------------------------------------------------


def validate_repo_id(repo_id: str) -> tuple[str, str]:
    if not isinstance(repo_id, str) or not _REPO_ID_RE.match(repo_id) or ".." in repo_id or "--" in repo_id:
        raise DownloadError(
            f"invalid repo id {repo_id!r}: expected ORG/NAME, e.g. meta-llama/Llama-3.2-1B"
        )
    org, name = repo_id.split("/")
    return org, name


def _is_safetensors_weight(path: str) -> bool:
    return "/" not in path and path.endswith(".safetensors") and not path.startswith("consolidated")


def _is_bin_weight(path: str) -> bool:
    return "/" not in path and path.startswith("pytorch_model") and path.endswith(".bin")


def select_files(repo_files: list[str]) -> tuple[list[str], bool]:
    """Pick the files the converter needs from a repository listing.

    Returns (files, copy_llama3_tokenizer): the exact repository paths to fetch, and whether
    original/tokenizer.model must be copied to the top level afterwards.
    Raises DownloadError when the repository has no usable config or weights.
    """
    present = set(repo_files)
    if "config.json" not in present:
        raise DownloadError(
            "the repository has no top-level config.json; is it a Hugging Face transformers checkpoint?"
        )
    files = [f for f in CONFIG_FILES + TOKENIZER_FILES if f in present]
    weights = sorted(f for f in present if _is_safetensors_weight(f))
    if weights:
        files += weights
        if SAFETENSORS_INDEX in present:
            files.append(SAFETENSORS_INDEX)
    else:
        weights = sorted(f for f in present if _is_bin_weight(f))
        if not weights:
            raise DownloadError(
                "the repository has no top-level *.safetensors or pytorch_model*.bin weights"
            )
        files += weights
        if BIN_INDEX in present:
            files.append(BIN_INDEX)
    copy_llama3 = "tokenizer.model" not in present and LLAMA3_TOKENIZER in present
    if copy_llama3:
        files.append(LLAMA3_TOKENIZER)
    return files, copy_llama3


def allow_patterns_for(files: list[str]) -> list[str]:
    """Exact-name fnmatch patterns (so `*.safetensors` cannot pull consolidated/original copies)."""
    return [glob.escape(f) for f in files]


def _local_download_complete(local_dir: Path) -> bool:
    """True when local_dir already holds a config and weights (used when the Hub is unreachable)."""
    if not (local_dir / "config.json").is_file():
        return False
    import json

    for index_name in (SAFETENSORS_INDEX, BIN_INDEX):
        index = local_dir / index_name
        if index.is_file():
            try:
                shards = set(json.loads(index.read_text())["weight_map"].values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
                return False
            return bool(shards) and all((local_dir / s).is_file() for s in shards)
    return any(local_dir.glob("*.safetensors")) or any(local_dir.glob("pytorch_model*.bin"))


def _copy_llama3_tokenizer(local_dir: Path) -> None:
    src = local_dir / LLAMA3_TOKENIZER
    dst = local_dir / "tokenizer.model"
    if src.is_file() and not dst.exists():
        tmp = dst.with_name(dst.name + ".tmp")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)


def list_repo_files(repo_id: str, token: str | None = None) -> list[str]:
    """All file paths of the repository (one Hub request: model_info's siblings)."""
    api = HfApi()
    info = api.model_info(repo_id, token=token)
    siblings = getattr(info, "siblings", None)
    if siblings is None:  # metadata without a file list: ask for the tree instead
        return list(api.list_repo_files(repo_id, token=token))
    return [s.rfilename for s in siblings]


def download_checkpoint(
    repo_id: str, checkpoint_dir: str | os.PathLike = "checkpoints", token: str | None = None
) -> Path:
    """Download what the converter needs from `repo_id` into <checkpoint_dir>/ORG/NAME.

    Returns the local directory. Raises DownloadError (with a one-line, actionable message)
    for bad repo ids and for Hub / network failures.
    """
    org, name = validate_repo_id(repo_id)
    local_dir = Path(checkpoint_dir) / org / name
    try:
        repo_files = list_repo_files(repo_id, token)
    except Exception as err:  # noqa: BLE001 - classified below, re-raised if unknown
        if _status_code(err) is None and _is_connection_error(err):
            if _local_download_complete(local_dir):
                print(
                    f"warning: cannot reach the Hugging Face Hub; using the existing download in {local_dir}",
                    file=sys.stderr,
                )
                return local_dir
            raise DownloadError(_describe(err, repo_id, local_dir)) from err
        if isinstance(err, (HfHubHTTPError, HFValidationError, OSError)):
            raise DownloadError(_describe(err, repo_id, None)) from err
        raise
    try:
        files, copy_llama3 = select_files(list(repo_files))
    except DownloadError as err:
        raise DownloadError(f"{repo_id}: {err}") from None
    local_dir.mkdir(parents=True, exist_ok=True)
    try:
        snapshot_download(
            repo_id,
            local_dir=str(local_dir),
            allow_patterns=allow_patterns_for(files),
            token=token,
        )
    except Exception as err:  # noqa: BLE001
        if isinstance(err, (HfHubHTTPError, HFValidationError, OSError)) or _is_connection_error(err):
            raise DownloadError(_describe(err, repo_id, local_dir)) from err
        raise
    if copy_llama3:
        _copy_llama3_tokenizer(local_dir)
    return local_dir


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Download the files of a Hugging Face checkpoint that convert_hf_checkpoint.py needs."
    )
    p.add_argument("--repo_id", required=True, help="ORG/NAME, e.g. meta-llama/Llama-3.2-1B")
    p.add_argument(
        "--checkpoint_dir",
        default="checkpoints",
        help="root folder; files go to <checkpoint_dir>/ORG/NAME (default: checkpoints)",
    )
    p.add_argument(
        "--hf_token",
        default=None,
        help="Hugging Face access token for gated/private repos (default: HF_TOKEN or the cached login)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        path = download_checkpoint(args.repo_id, args.checkpoint_dir, args.hf_token)
    except DownloadError as err:
        print(f"error: {_one_line(err, 400)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    print(path)
    return 0


if __name__ == "__main__":
    # Run the package's copy of this module, so the classes it defines are the ones every other module imports.
    from redline.scripts.download import main as package_main

    sys.exit(package_main())
