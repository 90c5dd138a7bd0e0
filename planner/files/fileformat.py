"""Versioned JSON files: a `format`/`version` header on write, checked on read; atomic writes."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable

from planner.errors import FileFormatError
from planner.version import __version__


def write_versioned_json(path: str | Path, file_format: str, version: int, body: dict[str, Any]) -> Path:
    """Write `body` under a header {format, version, planner_version} atomically (`write_atomically`)."""
    text = versioned_json_text(file_format, version, body)
    return write_atomically(path, lambda handle: handle.write(text.encode("utf-8")), "e.g. ending in .json")


def versioned_json_text(file_format: str, version: int, body: dict[str, Any]) -> str:
    """The JSON text of `body` under the header {format, version, planner_version}; TypeError or
    ValueError if `body` is not JSON-serializable (NaN and infinities included)."""
    document = {"format": file_format, "version": version, "planner_version": __version__, **body}
    return json.dumps(document, indent=1, allow_nan=False) + "\n"


def kept_path(path: str | Path, digest: str) -> Path:
    """Where `keep_previous` moves a file of this content: `<stem>.<first 12 hex digits of digest><suffix>` beside it."""
    path = Path(path)
    return path.with_name(f"{path.stem}.{digest[:12]}{path.suffix}")


def keep_previous(path: str | Path, digest: Callable[[Path], str] | None = None) -> Path | None:
    """Move the file at `path`, if there is one, aside to `kept_path(path, digest(path))` before it is written
    again, so that writing an output never loses what a user had (a profile that plans were made from, a run's
    report); returns where it is now, None where there was no file. `digest` defaults to the SHA-256 of the file's
    bytes; one already kept there (the same content) stays and this file is dropped. FileFormatError naming
    `path` where it cannot be moved."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        found = digest(path) if digest is not None else hashlib.sha256(path.read_bytes()).hexdigest()
        kept = kept_path(path, found)
        if kept.exists():
            path.unlink()
        else:
            os.replace(path, kept)
    except OSError as exc:
        raise FileFormatError(str(path), f"cannot be moved aside before it is written again: {exc.strerror or exc}",
                              "choose another output file") from None
    return kept


def write_atomically(path: str | Path, write: Callable[[BinaryIO], Any], example: str = "") -> Path:
    """Create or replace the file `path` with what `write` puts into a binary handle; returns the path.

    The content goes to a temporary file in the same folder, is flushed and fsynced, renamed over
    `path`, and the folder is fsynced (`fsync_folder`): a crash or an error mid-write leaves the
    previous file intact and no temporary file behind. Unwritable places and directories are a
    FileFormatError naming the path (`example`: a file name to suggest instead of a directory).
    """
    path = Path(path)
    if path.is_dir():
        raise FileFormatError(str(path), "is a directory", f"give a file name{', ' + example if example else ''}")
    tmp_name: str | None = None
    fix = "choose a writable location"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        fix = "the previous file is unchanged"
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        # mkstemp makes the file private (0600); keep the mode of the file replaced, else rw-r--r--
        os.chmod(tmp_name, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        os.replace(tmp_name, path)
        tmp_name = None
        fsync_folder(path.parent)
    except OSError as exc:
        raise FileFormatError(str(path), f"cannot be written: {exc.strerror or exc}", fix) from None
    finally:
        if tmp_name is not None:
            Path(tmp_name).unlink(missing_ok=True)
    return path


def fsync_folder(folder: Path) -> None:
    """fsync a folder so that renames and new entries in it survive a crash (no-op where unsupported)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # e.g. Windows cannot open folders; the rename itself is still atomic
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):  # the filesystem does not sync folders
            raise
    finally:
        os.close(fd)


# what a user who passed one kind of file where another was expected runs first: (found, expected) -> hint, whose
# {path} is the file passed
_NEXT_STEP = {
    ("model file", "pipeline-planner/profile"): "profile it first (`planner profile {path}`) and pass the profile "
                                                 "it writes",
    ("model file", "pipeline-planner/plan"): "profile it and partition the profile first (`planner profile {path}`, "
                                              "then `planner partition PROFILE --gpus N`)",
    ("pipeline-planner/profile", "pipeline-planner/plan"): "this is a profile: make a plan of it first (`planner "
                                                            "partition {path} --gpus N`) and pass the plan",
    ("pipeline-planner/plan", "pipeline-planner/profile"): "this is a plan: pass the profile it was made from (the "
                                                            "plan names it under profile.path)",
}


def read_versioned_json(path: str | Path, file_format: str, max_version: int) -> dict[str, Any]:
    """Read a file written by `write_versioned_json`, refusing other formats and newer versions."""
    path = Path(path)
    if not path.is_file():
        raise FileFormatError(str(path), "no such file", "check the path")
    if path.suffix == ".py":
        hint = _NEXT_STEP.get(("model file", file_format), f"expected a {file_format} file")
        raise FileFormatError(str(path), f"a Python file, not a {file_format} file", hint.format(path=path))
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise FileFormatError(str(path), "not a text file", f"expected a JSON {file_format} file") from None
    except json.JSONDecodeError as exc:
        raise FileFormatError(
            str(path), f"not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})",
            f"expected a {file_format} file written by the planner",
        ) from None
    if not isinstance(document, dict) or "format" not in document:
        raise FileFormatError(str(path), "JSON without a 'format' field", f"expected a {file_format} file")
    found = document.get("format")
    if found != file_format:
        hint = _NEXT_STEP.get((str(found), file_format), "pass a file of the expected kind")  # (found: any JSON)
        raise FileFormatError(str(path), f"format is {found!r}, expected {file_format!r}", hint.format(path=path))
    version = document.get("version")
    if not isinstance(version, int) or version < 1:
        raise FileFormatError(str(path), f"invalid version {version!r}", f"supported: 1..{max_version}")
    if version > max_version:
        raise FileFormatError(
            str(path),
            f"{file_format} version {version} is newer than this planner supports (1..{max_version})",
            "upgrade the planner",
        )
    return document
