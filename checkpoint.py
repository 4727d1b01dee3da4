"""Redline's checkpoint format: one .safetensors file whose metadata says what it is.

Metadata keys (all strings, as safetensors requires):
  redline_format   format version
  config           ModelArgs as JSON
  dtype            dtype of the floating-point weights
  quantization     JSON: {"scheme": "none"} or {"scheme": "int8", ...}
Nothing is ever guessed from the file name.
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
import secrets
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from redline.model import ModelArgs, Transformer
from redline.outputs import (EXIT_OUTPUT_CLOSED, OneLineArgumentParser, check_output, check_writable,  # noqa: F401
                             file_identity, output_closed, run_cli)

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
    return file_identity(a) is not None and file_identity(a) == file_identity(b)


def check_output_path(path: Path, inputs: Iterable[Path] = (), flag: str = "--out") -> None:
    """outputs.check_output for an output that may replace an earlier file of its own (the older interface)."""
    check_output(path, inputs, flag, overwrite=True, replaceable=lambda p: True)


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
    check_writable(path)
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
    check_context(info.args.block_size, "the checkpoint to write", "fix the source's context length")
    contiguous = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    write_atomically(path, lambda tmp: write_safetensors(tmp, contiguous, info.metadata()))
    return path


# Safetensors' names of the dtypes a checkpoint holds.
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int8: "I8",
                      torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL",
                      torch.float8_e4m3fn: "F8_E4M3"}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write `tensors` to `path` in the safetensors format, into that file alone (safetensors' own writer makes a
    temp file of its own beside it, which a killed process would leave behind)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    names = sorted(tensors)
    for name in names:
        t = tensors[name]
        if t.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name} has dtype {t.dtype}, which a Redline checkpoint cannot hold")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in names:
            f.write(memoryview(tensors[name].reshape(-1).view(torch.uint8).numpy()))


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
    unquantized = [p for p in candidates if checkpoint_scheme(p) == "none"]
    if len(unquantized) != 1:
        raise ValueError(f"{path} holds several Redline checkpoints ({names}); pass the file you want")
    say_once(f"note: {path} holds several Redline checkpoints ({names}); using the unquantized {unquantized[0].name} "
             f"(pass a file to choose another)")
    return unquantized[0]


@functools.lru_cache(maxsize=None)
def say_once(line: str) -> None:
    """Print a note on stderr the first time this process has it to say (a folder is resolved several times)."""
    print(line, file=sys.stderr)


def checkpoint_inputs(path: str | os.PathLike | None) -> list[Path]:
    """Every file a command that loads the checkpoint at `path` reads: the checkpoint itself and the tokenizer,
    chat-template and config files beside it (what an output flag of that command must never name); [] for None."""
    from redline.tokenizer import TOKENIZER_SIDE_FILES

    if path is None:
        return []
    try:
        file = resolve_checkpoint_path(path)
    except (ValueError, FileNotFoundError):
        return [Path(path)]
    return [Path(path), file, *(file.parent / name for name in TOKENIZER_SIDE_FILES)]


def checkpoint_scheme(path: Path) -> str | None:
    """The quantization scheme a Redline file's metadata names, or None when it cannot be read."""
    try:
        with safe_open(str(path), "pt") as f:
            return json.loads((f.metadata() or {}).get("quantization", '{"scheme": "none"}')).get("scheme")
    except (SafetensorError, OSError, ValueError, AttributeError, RecursionError):
        return None


def check_checkpoint_output(path: Path, inputs: Iterable[Path] = (), overwrite: bool = False) -> None:
    """Refuse, before any work, a checkpoint output that is an input, cannot be written, or would replace a file:
    an earlier Redline checkpoint only with --overwrite, anything else (HF weights, someone else's data) never."""
    if path.suffix != CHECKPOINT_SUFFIX:
        raise ValueError(f"output file {path} must end with {CHECKPOINT_SUFFIX}")
    check_output(path, inputs, "--out", overwrite=overwrite, replaceable=is_redline_file, kind="Redline checkpoint")


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
            embedding_shape = f.get_slice("tok_embeddings.weight").get_shape() if "tok_embeddings.weight" in tensor_dtypes else None
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"{path} is not a readable safetensors file ({exc}); re-convert or re-download it") from None
    if "redline_format" not in meta:
        raise ValueError(f"{path} has no Redline metadata; convert it with scripts/convert_hf_checkpoint.py")
    try:
        version, args, dtype, quantization = _parse_metadata(meta)
    except (KeyError, json.JSONDecodeError, TypeError, ValueError, RecursionError) as exc:
        problem = {KeyError: f"missing {exc}", RecursionError: "JSON nested too deeply"}.get(type(exc), str(exc))
        raise ValueError(f"{path} has malformed Redline metadata ({problem}); re-convert it") from None
    if version > FORMAT_VERSION:
        raise ValueError(f"{path} uses checkpoint format {version}, newer than this Redline ({FORMAT_VERSION}); upgrade")
    _check_tensor_dtypes(path, tensor_dtypes, quantization["scheme"])
    check_layer_count(tensor_dtypes, args.n_layer, str(path))
    check_context(args.block_size, str(path), "the metadata is damaged, re-convert it")
    if embedding_shape is not None and tuple(embedding_shape) != (args.vocab_size, args.dim):
        raise ValueError(f"{path}: tok_embeddings.weight has shape {tuple(embedding_shape)}, but the metadata declares "
                         f"({args.vocab_size}, {args.dim}); the metadata is damaged, re-convert it")
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
        scales = f"{prefix}.scales" if name.endswith(".weight") else f"{name}_scales"  # int8 experts: w13_scales
        fp8_mismatch = (dtype == "F8_E4M3") != (scheme == "fp8")  # FP8 codes only in an fp8 checkpoint, and only they
        if scheme == "none" or fp8_mismatch or not name.endswith((".weight", ".w13", ".w2")) or scales not in tensor_dtypes:
            raise ValueError(f"{path}: tensor {name} is {dtype}, which quantization scheme {scheme!r} does not allow; "
                             f"the file is damaged or mislabelled, re-convert it")


def load_tensors(info: CheckpointInfo, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(info.path), "pt", device=str(device)) as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"cannot read the tensors of {info.path} ({exc}); the file may be truncated, re-convert it") from None


# A layer's index in Redline, HF and GGUF tensor names.
LAYER_INDEX = re.compile(r"(?:model\.)?(?:layers|blk)\.(\d+)\.")
# The longest context a checkpoint may declare (its rope tables and cache are sized from it).
MAX_CONTEXT = 1 << 24


def check_context(block_size: int, source: str, fix: str) -> None:
    """Refuse a context longer than any loader accepts, naming where it came from and what to do."""
    if block_size > MAX_CONTEXT:
        raise ValueError(f"{source} declares a context of {block_size} tokens, above Redline's limit of "
                         f"{MAX_CONTEXT}; {fix}")


def check_layer_count(names: Iterable[str], n_layer: int, source: str) -> None:
    """Refuse a declared layer count that the tensors present do not have, before anything loops over layers or
    allocates for them (a small config can declare a billion layers)."""
    present = {int(m.group(1)) for name in names if (m := LAYER_INDEX.match(name))}
    if len(present) != n_layer or (present and (min(present) != 0 or max(present) != n_layer - 1)):
        raise ValueError(f"{source} declares {n_layer} layers, but its weights hold {len(present)} "
                         f"(layers {min(present, default=0)}..{max(present, default=-1)}); the files do not belong "
                         f"together, re-download or re-convert them")


def meta_model(args: ModelArgs) -> Transformer:
    """args' model on the meta device, for a checkpoint's (or the caller's random) weights to replace. The embedding's
    random initialization is skipped: normal_ on a meta tensor runs torch's Python reference, whose first call
    imports torch._dynamo, about 3 s of a CPU server's start for values nobody reads."""
    from unittest import mock

    with torch.device("meta"), mock.patch.object(torch.nn.Embedding, "reset_parameters", lambda self: None):
        return Transformer(args)


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor of an unquantized Redline checkpoint and its shape (read off a model built on the meta device,
    so each family's extra tensors are included)."""
    model = meta_model(args)
    return {name: tuple(t.shape) for name, t in model_state_dict(model).items()}


@functools.lru_cache(maxsize=4)
def model_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """expected_shapes, built once per config (it builds a model on the meta device); callers must not change it."""
    return expected_shapes(args)


def model_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint stores (a tied output weight is stored once, as the embedding)."""
    state = model.state_dict()
    if model.args.tie_word_embeddings:
        state.pop("output.weight", None)
    return state
