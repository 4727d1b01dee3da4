"""The one check every output flag of every command goes through, before any work is done.

An output may not be one of the files the command reads (compared as files: through symlinks and hard links, by
st_dev/st_ino), may not be a folder or sit where nothing can be written, and may not replace an existing file the
command did not write. A file of the kind the command writes (a Redline checkpoint, a perplexity record, a trace) is
replaced only when the user passed --overwrite.

Beside it: the files written next to an output (tokenizer files), the rule that files of a checkpoint folder are
read only from inside it, and the wrapper that gives every command-line tool one error line and its exit status.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NoReturn


def file_identity(path: str | os.PathLike) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the file `path` names after following symlinks, or None when there is none."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def input_identities(inputs: Iterable[str | os.PathLike]) -> dict[tuple[int, int], Path]:
    """Every input that exists, by the identity of the real file it names."""
    found: dict[tuple[int, int], Path] = {}
    for source in inputs:
        identity = file_identity(source)
        if identity is not None:
            found.setdefault(identity, Path(source))
    return found


def check_writable(path: Path, flag: str = "output") -> None:
    """Refuse an output path that is a folder, sits under a file, or lies in a folder that cannot be written."""
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; name a file inside it")
    existing = Path(os.path.abspath(path)).parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"cannot write {flag} {path}: {existing} is a file, not a folder; choose another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write {flag} {path}: folder {existing} is not writable; choose another path")


def check_output(path: str | os.PathLike, inputs: Iterable[str | os.PathLike] = (), flag: str = "--out", *,
                 overwrite: bool = False, replaceable: Callable[[Path], bool] | None = None,
                 kind: str = "file this command writes") -> None:
    """Refuse, before any work, an output that is one of `inputs`, cannot be written, or exists already.

    An existing file is replaced only when `replaceable(path)` says it is of the kind this command writes (`kind`
    names it) and `overwrite` (the user's --overwrite) is set."""
    path = Path(path)
    inputs = list(inputs)
    sources = input_identities(inputs)
    identity = file_identity(path)
    if identity is not None and identity in sources:
        raise ValueError(f"{flag} {path} is an input of this command ({sources[identity]}); writing it would "
                         f"overwrite the input, choose another file name")
    absolute = Path(os.path.abspath(path))
    for source in inputs:
        if absolute == Path(os.path.abspath(source)):
            raise ValueError(f"{flag} {path} is an input of this command; writing it would overwrite the input, "
                             f"choose another file name")
    check_writable(path, flag)
    if not (path.exists() or path.is_symlink()):
        return
    if replaceable is None or not path.is_file() or not replaceable(path):
        raise ValueError(f"{flag} {path} exists and is not a {kind}; refusing to replace it, choose another file name")
    if not overwrite:
        raise ValueError(f"{flag} {path} exists; pass --overwrite to replace it, or choose another file name")


def any_file(path: Path) -> bool:
    """A `replaceable` for outputs whose every earlier version this command may replace with --overwrite."""
    return path.is_file()


def inside_folder(path: Path, folder: Path) -> bool:
    """Whether `path`, through every symlink, is a file inside `folder` (itself resolved)."""
    real_folder = os.path.realpath(folder)
    return os.path.commonpath([os.path.realpath(path), real_folder]) == real_folder


def check_inside(path: Path, folder: Path) -> Path:
    """`path`, refused when it leads (through a symlink) out of the checkpoint folder it was found in."""
    if not inside_folder(path, folder):
        raise ValueError(f"{path} is a symlink to {os.path.realpath(path)}, outside the checkpoint folder {folder}; "
                         f"Redline reads only files inside it, copy the file into the folder")
    return path


def same_contents(path: Path, data: bytes | Path) -> bool:
    """Whether the file at `path` holds exactly `data` (bytes, or another file's contents)."""
    try:
        if isinstance(data, Path):
            if path.stat().st_size != data.stat().st_size:
                return False
            data = data.read_bytes()
        return path.stat().st_size == len(data) and path.read_bytes() == data
    except OSError:
        return False


def side_files_to_write(files: dict[str, bytes | Path], folder: Path, inputs: Iterable[str | os.PathLike] = (),
                        overwrite: bool = False, exclusive: Iterable[str] = ()) -> dict[str, bytes | Path]:
    """The files (by name: contents, or the file to copy) to write into `folder` beside an output, checked before
    any work: a file there with other contents is replaced only with --overwrite, never when it is an input, and a
    file named in `exclusive` that this set lacks (another tokenizer, which would be loaded instead of or mixed with
    this one) is refused without --overwrite. Files already there with the same contents are left out."""
    inputs = list(inputs)
    todo = {}
    for name, data in files.items():
        target = folder / name
        if target.is_file() and same_contents(target, data):
            continue
        check_output(target, inputs, f"{name} beside the output", overwrite=overwrite, replaceable=any_file,
                     kind="regular file")
        todo[name] = data
    for name in exclusive:
        if name not in files and (folder / name).exists() and not overwrite:
            raise ValueError(f"{folder} holds {name} of another model, which would be loaded instead of (or mixed "
                             f"with) this one; pass --overwrite to remove it, or choose another folder")
    return todo


# Command-line tools: one line and a documented exit status for every failure.


def run_cli(body: Callable[[], int], interrupted: str = "interrupted",
            report: Callable[[str], None] | None = None) -> int:
    """Run a command-line tool's body: bad input and file-system errors (a full disk) become one `error:` line and
    exit status 2, Ctrl-C one line and 130, a closed output pipe one line and 141, never a traceback. `report`
    prints the line (default: to stderr)."""
    report = report or (lambda line: print(line, file=sys.stderr))
    try:
        if sys.stdout is None:
            raise ValueError("stdout is closed; give the command somewhere to print (a terminal, a file or a pipe)")
        return body()
    except KeyboardInterrupt:
        report(f"error: {interrupted}")
        return 130
    except BrokenPipeError:
        return output_closed()
    except (ValueError, FileNotFoundError) as exc:
        report(f"error: {' '.join(str(exc).split())}")
        return 2
    except OSError as exc:  # the disk or the file system, not the input: say which file and why
        report(f"error: {exc.strerror or exc} ({exc.filename or 'output'})")
        return 2


# The exit status of a command whose output pipe was closed by its reader (`| head`), as a shell reports SIGPIPE.
EXIT_OUTPUT_CLOSED = 141


def output_closed() -> int:
    """One line for a command whose stdout reader went away; stdout is pointed at /dev/null so that the
    interpreter's last flush cannot print a traceback of its own."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, AttributeError, ValueError):
        pass
    print("error: the output was closed before the command finished (stdout pipe closed)", file=sys.stderr)
    return EXIT_OUTPUT_CLOSED


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with every optional flag's default (a required flag has none to show)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.required else super()._get_help_string(action)


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors raise ValueError, so that a CLI prints them as one line and exits with 2, and
    whose --help shows every flag's default."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise ValueError(f"{message} (see --help)")
