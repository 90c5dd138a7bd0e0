"""Atomic training checkpoints of a pipeline job (one file per stage plus a manifest), and export to one state_dict.

Layout: `ROOT/step-00000012/stage-0.pt`, `stage-1.pt`, ..., `manifest.json`. After step k the first
replica rank of every stage calls `save_stage`; after a barrier rank 0 calls `write_manifest`. A
checkpoint is complete only when its manifest exists and every file it lists has the recorded size.

Every file is written to a temporary file in its folder (`.NAME.XXXX.tmp`), flushed and fsync'ed,
renamed over its final name (`os.replace`), and the folder is fsync'ed: a killed process leaves at
most a temporary file, never a final name with partial content, and the manifest is only renamed
into place after every stage file it lists is durable. Nothing in a complete checkpoint is ever
rewritten; only `prune` deletes, and never the newest complete checkpoint.

Optimizer state is stored keyed by parameter NAME (`runtime.optimizer_state`), not by torch's integer
index, so a checkpoint can be loaded into a differently split model (a re-partitioned plan).

Why one module of ~530 lines: writing, finding, reading and pruning follow one layout and one rule of
completeness (the manifest last); apart they could disagree about which checkpoint is complete.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch

from planner.errors import FileFormatError, FileProblemError
from planner.files.fileformat import fsync_folder, read_versioned_json, versioned_json_text, write_atomically
from runtime.nested import map_tensors

__all__ = [
    "MANIFEST_FORMAT", "MANIFEST_VERSION", "STAGE_FORMAT", "STAGE_VERSION", "Checkpoint", "CheckpointError",
    "check_writable", "export_checkpoint", "latest_complete", "list_complete", "load_stage", "load_stages",
    "merged_model_state", "merged_optimizer_state", "optimizer_state_of", "prune", "same_value", "save_stage",
    "stage_file", "step_dir", "write_manifest",
]

MANIFEST_FORMAT = "pipeline-planner/checkpoint"
MANIFEST_VERSION = 1
STAGE_FORMAT = "pipeline-planner/checkpoint-stage"
STAGE_VERSION = 1
MANIFEST_NAME = "manifest.json"
_STEP_DIR = re.compile(r"step-(\d+)")
_HASH_CHUNK_BYTES = 1 << 22  # 4 MiB reads when hashing a stage file
_WRITABLE_FIX = "choose a writable --checkpoint-dir (or fix its permissions, or free disk space)"
# what a stage file's rng_state and meta may hold: torch.load(weights_only=True) reads these back
_SAFE_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.Tensor, torch.dtype, torch.device)


class CheckpointError(FileProblemError):
    """A checkpoint file or folder cannot be written, is incomplete or corrupt, or does not fit the model."""


@dataclass(frozen=True)
class Checkpoint:
    """One complete checkpoint: `step` optimizer steps done, its step folder `path`, its parsed manifest."""

    step: int
    path: Path
    manifest: dict[str, Any] = field(compare=False, hash=False, repr=False)

    @property
    def num_stages(self) -> int:
        """Number of stage files the manifest lists."""
        return int(self.manifest["num_stages"])


# --- paths ---------------------------------------------------------------------------------------


def step_dir(root: str | Path, step: int) -> Path:
    """The folder of step `step` under `root`: ROOT/step-00000012 (8 digits, more if needed)."""
    return Path(root) / f"step-{step:08d}"


def stage_file(folder: str | Path, stage: int) -> Path:
    """The file of stage `stage` in a step folder: stage-{stage}.pt."""
    return Path(folder) / f"stage-{stage}.pt"


# --- writing -------------------------------------------------------------------------------------


def save_stage(root: str | Path, step: int, stage: int, *, model_state: dict[str, torch.Tensor],
               optimizer_state: dict[str, Any] | None, rng_state: dict[str, Any], plan_digest: str,
               meta: dict[str, Any] | None = None) -> Path:
    """Write ROOT/step-{step:08d}/stage-{stage}.pt atomically; returns its path.

    The file is `torch.save` of {format, version, step, stage, plan_digest, model_state,
    optimizer_state, rng_state, meta}, every tensor detached and on the CPU. `model_state` is the
    stage's `state_dict()` (keys: the whole model's names); `optimizer_state` is
    `named_optimizer_state(...)` or None; `rng_state` and `meta` may hold tensors, numbers,
    strings, bytes, dtypes, devices, lists, tuples, sets and dicts (what `load_stage` can read back
    safely). Raises CheckpointError if the step folder already holds a complete checkpoint (it is
    never rewritten) or the file cannot be written (the previous complete checkpoint is intact).
    """
    _check_index(root, "step", step)
    _check_index(root, "stage", stage)
    folder = step_dir(root, step)
    path = stage_file(folder, stage)
    if (folder / MANIFEST_NAME).exists():
        raise CheckpointError(
            str(folder), f"already holds a complete checkpoint of step {step}; stage {stage} is not rewritten",
            "resume from the latest checkpoint, or delete that step folder to write it again",
        )
    _check_safe(path, "rng_state", rng_state)
    _check_safe(path, "meta", meta)
    payload = {
        "format": STAGE_FORMAT, "version": STAGE_VERSION, "step": step, "stage": stage,
        "plan_digest": plan_digest, "model_state": _on_cpu(model_state),
        "optimizer_state": _on_cpu(optimizer_state), "rng_state": _on_cpu(rng_state), "meta": meta,
    }
    _make_step_dir(root, folder)
    return _write_atomically(path, lambda handle: torch.save(payload, handle), root)


def write_manifest(root: str | Path, step: int, *, num_stages: int, plan_digest: str,
                   meta: dict[str, Any] | None = None) -> Path:
    """Write ROOT/step-{step:08d}/manifest.json atomically once every stage file is in place; returns its path.

    The manifest: {format, version, planner_version, step, num_stages, plan_digest, files:
    {"s": {name, bytes, sha256}} for s < num_stages, meta, written (UTC ISO time)}. `meta` must be
    JSON-serializable. Raises CheckpointError listing the missing stage files, or if the manifest
    cannot be written (the previous complete checkpoint is intact).
    """
    _check_index(root, "step", step)
    if num_stages < 1:
        raise CheckpointError(str(step_dir(root, step)), f"num_stages is {num_stages}", "pass at least 1 stage")
    folder = step_dir(root, step)
    paths = [stage_file(folder, stage) for stage in range(num_stages)]
    missing = [path.name for path in paths if not path.is_file()]
    if missing:
        raise CheckpointError(
            str(folder), f"step {step} lacks {', '.join(missing)} of its {num_stages} stage files",
            "every stage's first replica rank must call save_stage before rank 0 writes the manifest "
            "(and ROOT must be a folder all ranks share)",
        )
    files = {str(stage): {"name": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path)}
             for stage, path in enumerate(paths)}
    body = {
        "step": step, "num_stages": num_stages, "plan_digest": plan_digest, "files": files, "meta": meta,
        "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        text = versioned_json_text(MANIFEST_FORMAT, MANIFEST_VERSION, body)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(str(folder / MANIFEST_NAME), f"meta is not JSON-serializable ({exc})",
                              "pass numbers, strings, lists and dicts in meta") from None
    return _write_atomically(folder / MANIFEST_NAME, lambda handle: handle.write(text.encode("utf-8")), root)


def check_writable(root: str | Path) -> None:
    """Create `root` if needed, then write, fsync and delete a probe file in it; CheckpointError if any step fails."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise CheckpointError(str(root), "is a file, not a folder", _WRITABLE_FIX)
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe.", suffix=".tmp", dir=root)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(b"probe\n")
                handle.flush()
                os.fsync(handle.fileno())
        finally:
            Path(probe).unlink(missing_ok=True)
    except OSError as exc:
        raise CheckpointError(str(root), f"cannot be written: {exc.strerror or exc}", _WRITABLE_FIX) from None


def _write_atomically(path: Path, write: Callable[[BinaryIO], Any], root: str | Path) -> Path:
    """`fileformat.write_atomically`, its error a CheckpointError naming `path` and the previous complete
    checkpoint under `root`, which is untouched."""
    try:
        return write_atomically(path, write)
    except FileFormatError as exc:
        raise CheckpointError(exc.path, f"{exc.problem}; {_previous(root)}", _WRITABLE_FIX) from None


def _make_step_dir(root: str | Path, folder: Path) -> None:
    """Create the step folder (and root) and make its entry durable; CheckpointError if that fails."""
    try:
        created = not folder.is_dir()
        folder.mkdir(parents=True, exist_ok=True)
        if created:
            fsync_folder(folder.parent)
    except OSError as exc:
        raise CheckpointError(str(folder), f"cannot be created: {exc.strerror or exc}; {_previous(root)}",
                              _WRITABLE_FIX) from None


def _previous(root: str | Path) -> str:
    """Words naming the previous complete checkpoint under `root`, for error messages."""
    try:
        previous = latest_complete(root)
    except OSError:
        return "the previous complete checkpoint, if any, is untouched"
    if previous is None:
        return "no complete checkpoint exists yet"
    return f"the previous complete checkpoint {previous.path} (step {previous.step}) is intact"


def _check_index(root: str | Path, what: str, value: int) -> None:
    """A step or stage index must be a non-negative int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(str(root), f"{what} is {value!r}", f"pass the {what} as a non-negative int")


def _check_safe(path: Path, what: str, value: Any, where: str = "") -> None:
    """CheckpointError naming the first value in `value` that torch.load(weights_only=True) would refuse."""
    where = where or what
    if isinstance(value, dict):
        for key, item in value.items():
            _check_safe(path, what, key, f"{where} key {key!r}")
            _check_safe(path, what, item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple, set, frozenset)):
        for index, item in enumerate(value):
            _check_safe(path, what, item, f"{where}[{index}]")
    elif not isinstance(value, _SAFE_LEAVES):
        raise CheckpointError(
            str(path), f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which a checkpoint "
            "cannot hold", "store tensors, numbers, strings, bytes, lists, tuples and dicts "
            "(e.g. torch.from_numpy(array) for a numpy array)",
        )


def _on_cpu(value: Any) -> Any:
    """`value` with every tensor detached and on the CPU (the same tensor when it already is)."""
    return map_tensors(lambda tensor: tensor.detach().cpu(), value)


def _sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


# --- finding checkpoints -------------------------------------------------------------------------


def list_complete(root: str | Path) -> list[Checkpoint]:
    """Every complete checkpoint under `root`, ascending by step ([] if `root` does not exist).

    Complete: the step folder's manifest exists, parses, names this step, and every stage file it
    lists exists with the recorded size (checksums are verified by `load_stage`, not here).
    """
    return [checkpoint for step, folder in _step_folders(root)
            if (checkpoint := _complete(folder, step)) is not None]


def latest_complete(root: str | Path) -> Checkpoint | None:
    """The complete checkpoint with the highest step under `root`, or None (see `list_complete`)."""
    for step, folder in reversed(_step_folders(root)):
        checkpoint = _complete(folder, step)
        if checkpoint is not None:
            return checkpoint
    return None


def _step_folders(root: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every step-NNNNNNNN folder directly under `root`, ascending by step."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.fullmatch(entry.name)
        if match is not None and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _complete(folder: Path, step: int) -> Checkpoint | None:
    """The checkpoint in `folder` if it is complete, else None."""
    manifest_path = folder / MANIFEST_NAME
    if not manifest_path.is_file():
        return None
    try:
        manifest = read_versioned_json(manifest_path, MANIFEST_FORMAT, MANIFEST_VERSION)
    except (FileFormatError, OSError):
        return None
    if _manifest_problem(manifest, step) is not None:
        return None
    for entry in manifest["files"].values():
        try:
            size = (folder / entry["name"]).stat().st_size
        except OSError:
            return None
        if size != entry["bytes"]:
            return None
    return Checkpoint(step, folder, manifest)


def _manifest_problem(manifest: dict[str, Any], step: int) -> str | None:
    """What is wrong with a parsed manifest of step `step`, or None if it is well formed."""
    num_stages = manifest.get("num_stages")
    files = manifest.get("files")
    if manifest.get("step") != step:
        return f"names step {manifest.get('step')!r}, but its folder is step {step}"
    if not isinstance(num_stages, int) or num_stages < 1 or not isinstance(files, dict):
        return "has no valid num_stages and files"
    if set(files) != {str(stage) for stage in range(num_stages)}:
        return f"lists files for stages {sorted(files)}, expected 0..{num_stages - 1}"
    for entry in files.values():
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str) and "/" not in entry["name"]
                and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str)):
            return f"has a malformed file entry {entry!r}"
    return None


# --- reading -------------------------------------------------------------------------------------


def load_stage(checkpoint: Checkpoint, stage: int) -> dict[str, Any]:
    """The dict `save_stage` wrote for `stage` (tensors on the CPU), after verifying its recorded sha256.

    Raises CheckpointError if the checkpoint has no such stage, or the file is missing, of another
    size or checksum than the manifest records (corrupt), or not a stage file of this step.
    """
    entry = checkpoint.manifest["files"].get(str(stage))
    if entry is None:
        raise CheckpointError(str(checkpoint.path), f"has no stage {stage} (it has {checkpoint.num_stages} stages)",
                              f"pass a stage in 0..{checkpoint.num_stages - 1}")
    path = checkpoint.path / entry["name"]
    older = "use an older checkpoint (see list_complete) or delete this step folder"
    try:
        found = _sha256(path)
    except OSError as exc:
        raise CheckpointError(str(path), f"cannot be read: {exc.strerror or exc}", older) from None
    if found != entry["sha256"]:
        raise CheckpointError(
            str(path), f"corrupt: its sha256 is {found[:12]}..., the manifest records {entry['sha256'][:12]}...",
            older,
        )
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # the checksum matched, so the writer wrote something torch cannot read
        raise CheckpointError(str(path), f"not a readable stage file ({type(exc).__name__}: {exc})", older) from None
    if not isinstance(payload, dict) or payload.get("format") != STAGE_FORMAT:
        raise CheckpointError(str(path), "not a pipeline-planner stage checkpoint", older)
    if payload.get("version", 0) > STAGE_VERSION:
        raise CheckpointError(str(path), f"stage file version {payload.get('version')} is newer than supported "
                              f"(1..{STAGE_VERSION})", "upgrade the planner")
    if payload.get("step") != checkpoint.step or payload.get("stage") != stage:
        raise CheckpointError(str(path), f"holds step {payload.get('step')} stage {payload.get('stage')}, "
                              f"expected step {checkpoint.step} stage {stage}", older)
    if payload.get("plan_digest") != checkpoint.manifest.get("plan_digest"):
        raise CheckpointError(str(path), f"was saved under plan {payload.get('plan_digest')!r}, but the manifest "
                              f"records plan {checkpoint.manifest.get('plan_digest')!r} (a stale file from "
                              "another run?)", older)
    return payload


def export_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """One state_dict of the whole model: the union of the stages' `model_state` (CPU tensors).

    `path`: a checkpoint root (its latest complete checkpoint is used) or a step folder. A name
    held by several stages (tied weights) is taken once; if their values differ, CheckpointError.
    Load it with `model.load_state_dict(state_dict)` into a model built by the model file.
    """
    checkpoint = _resolve(path)
    return merged_model_state(checkpoint, load_stages(checkpoint))


def optimizer_state_of(path: str | Path) -> dict[str, Any]:
    """The union of the stages' named optimizer states (`runtime.optimizer_state`), for resuming on a new plan.

    `path` as for `export_checkpoint`; see `merged_optimizer_state`.
    """
    checkpoint = _resolve(path)
    return merged_optimizer_state(checkpoint, load_stages(checkpoint))


def load_stages(checkpoint: Checkpoint) -> list[dict[str, Any]]:
    """Every stage file of `checkpoint`, each read and checked once (`load_stage`), stage by stage."""
    return [load_stage(checkpoint, stage) for stage in range(checkpoint.num_stages)]


def merged_model_state(checkpoint: Checkpoint, stages: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The union of the `model_state` of `stages` (`load_stages(checkpoint)`); a name several stages hold
    (tied weights) is taken once, and differing values are a CheckpointError."""
    merged: dict[str, torch.Tensor] = {}
    holder: dict[str, int] = {}
    for stage, payload in enumerate(stages):
        for name, tensor in payload["model_state"].items():
            if name in merged:
                _check_same(checkpoint, name, holder[name], stage, merged[name], tensor)
                continue
            merged[name] = tensor
            holder[name] = stage
    return merged


def merged_optimizer_state(checkpoint: Checkpoint, stages: list[dict[str, Any]]) -> dict[str, Any]:
    """The union of the named optimizer states of `stages` (`load_stages(checkpoint)`).

    Each new stage's optimizer takes the names it has with `load_named_optimizer_state`. Stages
    saved without optimizer state contribute nothing; if none has any, CheckpointError. A name in
    several stages (tied weights) is taken once; differing values are a CheckpointError.
    """
    state: dict[str, dict[str, Any]] = {}
    shapes: dict[str, list[int]] = {}
    groups: list[dict[str, Any]] = []
    holder: dict[str, int] = {}
    found_any = False
    for stage, payload in enumerate(stages):
        named = payload["optimizer_state"]
        if named is None:
            continue
        found_any = True
        for name, values in named["state"].items():
            if name in state:
                _check_same_state(checkpoint, name, holder[name], stage, state[name], values)
                continue
            state[name] = values
            holder[name] = stage
        shapes.update(named["shapes"])
        groups.extend(named["param_groups"])
    if not found_any:
        raise CheckpointError(str(checkpoint.path), "holds no optimizer state (every stage was saved without it)",
                              "resume with fresh optimizers, or from a checkpoint saved with optimizer state")
    return {"state": state, "param_groups": groups, "shapes": shapes}


def _resolve(path: str | Path) -> Checkpoint:
    """The checkpoint a path names: a step folder with a manifest, or a root's latest complete one."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(str(path), "no such folder", "pass a checkpoint root or one of its step-NNNNNNNN folders")
    match = _STEP_DIR.fullmatch(path.name)
    has_manifest = (path / MANIFEST_NAME).is_file()
    if match is not None and not has_manifest and not _step_folders(path):  # a step folder, not a root
        latest = latest_complete(path.parent)
        hint = f"use {latest.path}" if latest is not None else "no complete checkpoint exists beside it"
        raise CheckpointError(str(path), "is an incomplete checkpoint (no manifest.json)", hint)
    if has_manifest:
        try:
            manifest = read_versioned_json(path / MANIFEST_NAME, MANIFEST_FORMAT, MANIFEST_VERSION)
        except FileFormatError as exc:
            raise CheckpointError(exc.path, exc.problem, "use an older checkpoint") from None
        step = int(match.group(1)) if match is not None else manifest.get("step")
        problem = _manifest_problem(manifest, step) if isinstance(step, int) else "has no valid step"
        if problem is not None:
            raise CheckpointError(str(path / MANIFEST_NAME), problem, "use an older checkpoint")
        checkpoint = _complete(path, step)
        if checkpoint is None:
            raise CheckpointError(str(path), "is incomplete: a stage file it lists is missing or truncated",
                                  "use an older checkpoint (see list_complete)")
        return checkpoint
    latest = latest_complete(path)
    if latest is None:
        raise CheckpointError(str(path), "holds no complete checkpoint",
                              "pass the --checkpoint-dir a training job wrote, or a step folder with a manifest.json")
    return latest


def _check_same(checkpoint: Checkpoint, name: str, first: int, second: int,
                kept: torch.Tensor, other: torch.Tensor) -> None:
    """CheckpointError unless two stages' tensors of one name are identical (dtype, shape, values)."""
    if kept.dtype != other.dtype or kept.shape != other.shape or not torch.equal(kept, other):
        raise CheckpointError(
            str(checkpoint.path), f"stages {first} and {second} both hold {name!r} with different values",
            "tied weights must be kept identical by the training job; use an older checkpoint",
        )


def _check_same_state(checkpoint: Checkpoint, name: str, first: int, second: int,
                      kept: dict[str, Any], other: dict[str, Any]) -> None:
    """CheckpointError unless two stages' optimizer states of one parameter name are identical."""
    if kept.keys() != other.keys() or not all(same_value(kept[key], other[key]) for key in kept):
        raise CheckpointError(
            str(checkpoint.path), f"stages {first} and {second} both hold optimizer state of {name!r} with "
            "different values", "tied weights must be kept identical by the training job; use an older checkpoint",
        )


def same_value(first: Any, second: Any) -> bool:
    """Exact equality of two state values (tensors: dtype, shape and values; containers: elementwise)."""
    if isinstance(first, torch.Tensor) or isinstance(second, torch.Tensor):
        return (isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor)
                and first.dtype == second.dtype and first.shape == second.shape
                and torch.equal(first.cpu(), second.cpu()))
    if isinstance(first, dict) and isinstance(second, dict):
        return first.keys() == second.keys() and all(same_value(first[key], second[key]) for key in first)
    if isinstance(first, (list, tuple)) and isinstance(second, (list, tuple)):
        return (type(first) is type(second) and len(first) == len(second)
                and all(same_value(a, b) for a, b in zip(first, second)))
    return type(first) is type(second) and first == second


# --- pruning -------------------------------------------------------------------------------------


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete complete checkpoints older than the `keep` newest, and incomplete step folders older than the newest.

    Never deletes the newest complete checkpoint, nor any folder with a higher step (another rank
    may be writing it). A manifest is removed before its folder, so an interrupted prune leaves an
    incomplete folder, never a manifest listing missing files. Returns the removed folders,
    ascending by step. CheckpointError if `keep` < 1 or a folder cannot be removed.
    """
    if keep < 1:
        raise CheckpointError(str(root), f"keep is {keep}: that would delete the newest complete checkpoint",
                              "keep at least 1")
    complete = list_complete(root)
    if not complete:
        return []
    kept = {checkpoint.step for checkpoint in complete[-keep:]}
    newest = complete[-1].step
    removed = []
    for step, folder in _step_folders(root):
        if step >= newest or step in kept:
            continue
        try:
            (folder / MANIFEST_NAME).unlink(missing_ok=True)
            fsync_folder(folder)
            shutil.rmtree(folder)
        except OSError as exc:
            raise CheckpointError(str(folder), f"cannot be removed: {exc.strerror or exc}",
                                  "fix the folder's permissions or remove it by hand") from None
        removed.append(folder)
    return removed
