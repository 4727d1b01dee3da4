"""Redline's checkpoint format: one .safetensors file whose metadata says what it is.

Metadata keys (all strings, as safetensors requires):
  redline_format   format version
  config           ModelArgs as JSON
  dtype            dtype of the floating-point weights
  quantization     JSON: {"scheme": "none"} or {"scheme": "int8", ...}
Nothing is ever guessed from the file name.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import secrets
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NoReturn

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from redline.model import ModelArgs, Transformer

FORMAT_VERSION = 1
CHECKPOINT_SUFFIX = ".safetensors"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise ValueError(f"unsupported dtype {name}; choose one of {', '.join(DTYPES)}")
        return name
    key = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(name, name)
    if key not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class CheckpointInfo:
    """What a Redline checkpoint's metadata says about it."""

    path: Path
    args: ModelArgs
    dtype: torch.dtype
    quantization: dict[str, Any] = field(default_factory=lambda: {"scheme": "none"})
    format_version: int = FORMAT_VERSION

    @property
    def scheme(self) -> str:
        return self.quantization["scheme"]

    def metadata(self) -> dict[str, str]:
        return {
            "redline_format": str(self.format_version),
            "config": json.dumps(self.args.to_dict()),
            "dtype": dtype_name(self.dtype),
            "quantization": json.dumps(self.quantization),
        }


# Temp files of an atomic write are `.NAME.tmp-<pid>-<hex>` beside the target: the pid lets a later write tell
# the leftovers of a killed process (pid gone) from a write still in progress.
TEMP_FILE = re.compile(r"\.(?P<name>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]+")


def pid_is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def remove_stale_temp_files(folder: Path) -> list[Path]:
    """Delete the temp files that killed writes left in `folder`; returns what was removed."""
    removed = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = TEMP_FILE.fullmatch(entry.name)
        if match and int(match["pid"]) != os.getpid() and not pid_is_alive(int(match["pid"])):
            try:
                entry.unlink()
                removed.append(entry)
            except OSError:
                pass
    return removed


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (through symlinks and hard links too)."""
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def check_output_path(path: Path, inputs: Iterable[Path] = (), flag: str = "--out") -> None:
    """Refuse an output path that would destroy an input or cannot be written, before any work is done."""
    for source in inputs:
        if same_file(path, source) or Path(os.path.abspath(path)) == Path(os.path.abspath(source)):
            raise ValueError(f"{flag} {path} is an input of this command ({source}); writing it would overwrite the "
                             f"input, choose another file name")
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; name a file inside it")
    folder = Path(os.path.abspath(path)).parent
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"cannot write {flag} {path}: {existing} is a file, not a folder; choose another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write {flag} {path}: folder {existing} is not writable; choose another path")


def _create_temp_file(path: Path) -> Path:
    while True:
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to any new file
        except FileExistsError:
            continue
        os.close(fd)
        return tmp


def write_atomically(path: Path, write: Any) -> None:
    """Call write(tmp_path) on a temp file in the target folder, flush it to disk, then rename it into place.

    Stale temp files of killed writes in that folder are removed first. An interrupted write leaves no file."""
    path = Path(path)
    check_output_path(path, flag="output")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot create folder {path.parent} ({exc.strerror}); choose another output path") from None
    remove_stale_temp_files(path.parent)
    tmp = _create_temp_file(path)
    try:
        mode = tmp.stat().st_mode & 0o777  # 0o666 less the umask
        write(tmp)
        os.chmod(tmp, mode)  # some writers (safetensors) recreate the file as 0600
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def progress(items: Iterable[Any], total: int | None = None, desc: str = "") -> Iterable[Any]:
    """`items`, with a tqdm progress bar on stderr when stderr is a terminal."""
    if not sys.stderr.isatty():
        return items
    from tqdm import tqdm

    return tqdm(items, total=total, desc=desc, unit="tensor", leave=False, file=sys.stderr)


def save_checkpoint(path: str | os.PathLike, tensors: dict[str, torch.Tensor], info: CheckpointInfo) -> Path:
    path = Path(path)
    if path.suffix != CHECKPOINT_SUFFIX:
        raise ValueError(f"output file {path} must end with {CHECKPOINT_SUFFIX}")
    contiguous = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    write_atomically(path, lambda tmp: save_file(contiguous, str(tmp), metadata=info.metadata()))
    return path


def resolve_checkpoint_path(path: str | os.PathLike) -> Path:
    """A checkpoint file, or a folder that holds exactly one Redline checkpoint."""
    path = Path(path)
    try:
        exists, is_file, is_dir = path.exists(), path.is_file(), path.is_dir()
        candidates = [p for p in sorted(path.glob(f"*{CHECKPOINT_SUFFIX}")) if is_redline_file(p)] if is_dir else []
    except OSError as exc:
        raise ValueError(f"cannot read checkpoint {path} ({exc.strerror}); check that path and its permissions") from None
    if not exists:
        raise FileNotFoundError(f"checkpoint {path} does not exist; convert one with scripts/convert_hf_checkpoint.py")
    if is_file and path.suffix.lower() == ".gguf":
        raise ValueError(f"{path} is a GGUF file; convert it first: python scripts/convert_gguf.py --gguf {path}")
    if is_file:
        return path
    if not is_dir:
        raise ValueError(f"checkpoint {path} is neither a file nor a folder; pass a Redline .safetensors file")
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise FileNotFoundError(
            f"no Redline checkpoint in {path}; run scripts/convert_hf_checkpoint.py --checkpoint_dir {path} first"
        )
    names = ", ".join(p.name for p in candidates)
    raise ValueError(f"{path} holds several Redline checkpoints ({names}); pass the file you want")


def check_checkpoint_output(path: Path, inputs: Iterable[Path] = ()) -> None:
    """Refuse, before any work, a checkpoint output that is an input, cannot be written, or would replace a file
    that is not a Redline checkpoint (HF weights, someone else's data)."""
    if path.suffix != CHECKPOINT_SUFFIX:
        raise ValueError(f"output file {path} must end with {CHECKPOINT_SUFFIX}")
    check_output_path(path, inputs)
    if path.exists() and not is_redline_file(path):
        raise ValueError(f"--out {path} exists and is not a Redline checkpoint; refusing to replace it, choose another "
                         f"file name")


def run_cli(body: Callable[[], int], interrupted: str = "interrupted") -> int:
    """Run a command-line tool's body: bad input and file-system errors become one `error:` line and exit status 2,
    Ctrl-C one line and 130, never a traceback."""
    try:
        return body()
    except KeyboardInterrupt:
        print(f"error: {interrupted}", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except OSError as exc:  # the disk or the file system, not the input: say which file and why
        print(f"error: {exc.strerror or exc} ({exc.filename or 'output'})", file=sys.stderr)
        return 2


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors raise ValueError, so that a CLI prints them as one line and exits with 2."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(f"{message} (see --help)")


def is_redline_file(path: Path) -> bool:
    if path.suffix != CHECKPOINT_SUFFIX:
        return False
    try:
        with safe_open(str(path), "pt") as f:
            return "redline_format" in (f.metadata() or {})
    except (SafetensorError, OSError, ValueError):
        return False


def read_checkpoint_info(path: str | os.PathLike) -> CheckpointInfo:
    """What a Redline checkpoint says about itself; its metadata and tensor dtypes are checked, never trusted."""
    path = resolve_checkpoint_path(path)
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensor_dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"{path} is not a readable safetensors file ({exc}); re-convert or re-download it") from None
    if "redline_format" not in meta:
        raise ValueError(f"{path} has no Redline metadata; convert it with scripts/convert_hf_checkpoint.py")
    try:
        version, args, dtype, quantization = _parse_metadata(meta)
    except (KeyError, json.JSONDecodeError, TypeError, ValueError) as exc:
        problem = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ValueError(f"{path} has malformed Redline metadata ({problem}); re-convert it") from None
    if version > FORMAT_VERSION:
        raise ValueError(f"{path} uses checkpoint format {version}, newer than this Redline ({FORMAT_VERSION}); upgrade")
    _check_tensor_dtypes(path, tensor_dtypes, quantization["scheme"])
    return CheckpointInfo(path=path, args=args, dtype=dtype, quantization=quantization, format_version=version)


# Safetensors dtype names of the floating-point tensors a checkpoint may hold.
FLOAT_TENSOR_DTYPES = ("F32", "F16", "BF16")
# Metadata config fields that ModelArgs does not type-check itself, with what they must be.
CONFIG_NUMBERS = ("rope_base", "norm_eps")


def _finite_numbers(values: list) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)


def _parse_metadata(meta: dict[str, str]) -> tuple[int, ModelArgs, torch.dtype, dict[str, Any]]:
    if not meta["redline_format"].isdigit():
        raise ValueError(f"redline_format {meta['redline_format']!r} is not a version number")
    version = int(meta["redline_format"])
    config = json.loads(meta["config"])
    if not isinstance(config, dict):
        raise ValueError("config is not a JSON object")
    for name in CONFIG_NUMBERS:
        value = config.get(name, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"config {name} must be a finite number, got {value!r}")
    if not isinstance(config.get("tie_word_embeddings", False), bool):
        raise ValueError(f"config tie_word_embeddings must be true or false, got {config['tie_word_embeddings']!r}")
    scaling = config.get("rope_scaling")
    if scaling is not None and not (isinstance(scaling, dict) and all(
            _finite_numbers(v if isinstance(v, list) else [v]) for k, v in scaling.items() if k != "rope_type")):
        raise ValueError(f"config rope_scaling must be null or rope scaling numbers, got {scaling!r}")
    args = ModelArgs.from_dict(config)
    quantization = json.loads(meta.get("quantization", '{"scheme": "none"}'))
    if not isinstance(quantization, dict) or not isinstance(quantization.get("scheme"), str):
        raise ValueError(f"quantization must be a JSON object with a 'scheme' string, got {quantization!r}")
    return version, args, dtype_from_name(meta["dtype"]), quantization


def _check_tensor_dtypes(path: Path, tensor_dtypes: dict[str, str], scheme: str) -> None:
    """Unquantized checkpoints hold only float tensors; a quantized one holds integer weights only beside scales."""
    for name, dtype in tensor_dtypes.items():
        if dtype in FLOAT_TENSOR_DTYPES:
            continue
        prefix = name.removesuffix(".weight")
        if scheme == "none" or not name.endswith(".weight") or f"{prefix}.scales" not in tensor_dtypes:
            raise ValueError(f"{path}: tensor {name} is {dtype}, which quantization scheme {scheme!r} does not allow; "
                             f"the file is damaged or mislabelled, re-convert it")


def load_tensors(info: CheckpointInfo, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(info.path), "pt", device=str(device)) as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"cannot read the tensors of {info.path} ({exc}); the file may be truncated, re-convert it") from None


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor of an unquantized Redline checkpoint and its shape (read off a model built on the meta device,
    so each family's extra tensors are included)."""
    with torch.device("meta"):
        model = Transformer(args)
    return {name: tuple(t.shape) for name, t in model_state_dict(model).items()}


def model_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint stores (a tied output weight is stored once, as the embedding)."""
    state = model.state_dict()
    if model.args.tie_word_embeddings:
        state.pop("output.weight", None)
    return state
