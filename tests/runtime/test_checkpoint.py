"""runtime.checkpoint: stage files + manifest round-trip, export to one state_dict, resume on another split, atomicity."""

from __future__ import annotations

import copy
import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch import nn

from planner.errors import FileProblemError
from runtime.checkpoint import (
    Checkpoint,
    CheckpointError,
    check_writable,
    export_checkpoint,
    latest_complete,
    list_complete,
    load_stage,
    optimizer_state_of,
    prune,
    save_stage,
    stage_file,
    step_dir,
    write_manifest,
)
from runtime.optimizer_state import load_named_optimizer_state, named_optimizer_state
from runtime.stages import run_stages, split_model
from runtime_examples import model_file

REPO = Path(__file__).resolve().parents[2]
SPLITS = {"gpt": ["transformer.h.6"], "mlp": ["6"]}
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3, betas=(0.8, 0.95)),
}
DIGEST = "plan-digest-for-tests"


def build(name: str, seed: int) -> nn.Module:
    """The example model, seeded, in eval mode (no dropout: training is deterministic)."""
    torch.manual_seed(seed)
    return model_file(name).build_model().eval()


def batches(name: str, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` deterministic mini-batches of 2 samples."""
    torch.manual_seed(1234)
    return [model_file(name).example_batch(2) for _ in range(count)]


def loss_of(name: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The model file's loss, or cross entropy (mlp has none)."""
    loss_fn = model_file(name).loss_fn
    return loss_fn(output, target) if loss_fn is not None else nn.functional.cross_entropy(output, target)


def save_all(root: Path, step: int, stages: list[nn.Module], optimizers: list[torch.optim.Optimizer] | None) -> None:
    """What the training job does after `step`: every stage saves, then the manifest is written."""
    for index, stage in enumerate(stages):
        optimizer_state = None if optimizers is None else named_optimizer_state(
            optimizers[index], stage.named_parameters(remove_duplicate=False))
        save_stage(root, step, index, model_state=stage.state_dict(), optimizer_state=optimizer_state,
                   rng_state={"cpu": torch.get_rng_state()}, plan_digest=DIGEST, meta={"stage": index})
    write_manifest(root, step, num_stages=len(stages), plan_digest=DIGEST, meta={"note": "test"})


def tiny(seed: int = 0) -> nn.Module:
    """A small two-layer model for the file-handling tests."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def save_tiny(root: Path, step: int, seed: int = 0) -> nn.Sequential:
    """A complete 2-stage checkpoint of `tiny(seed)` at `step`; returns the model."""
    model = tiny(seed)
    save_all(root, step, list(split_model(model, ["2"])), None)
    return model


# --- export ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_export_gives_the_whole_models_state_dict(tmp_path: Path, name: str) -> None:
    original = build(name, seed=0)
    stages = split_model(original, SPLITS[name])
    save_all(tmp_path, 3, list(stages), None)

    exported = export_checkpoint(tmp_path)
    fresh = build(name, seed=1)
    assert not torch.equal(next(fresh.parameters()), next(original.parameters()))  # the load must do the work
    fresh.load_state_dict(exported, strict=True)

    expected = original.state_dict()
    assert list(exported) == [key for key in expected if key in exported] and set(exported) == set(expected)
    for key, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, expected[key]), key
    assert export_checkpoint(step_dir(tmp_path, 3)).keys() == exported.keys()  # a step folder works too


def test_export_takes_a_name_held_by_several_stages_once_and_refuses_different_values(tmp_path: Path) -> None:
    tied = torch.arange(6.0).reshape(2, 3)
    for stage, extra in enumerate([{"a": torch.ones(2)}, {"b": torch.zeros(3)}]):
        save_stage(tmp_path, 1, stage, model_state={"tied": tied.clone(), **extra}, optimizer_state=None,
                   rng_state={}, plan_digest=DIGEST)
    write_manifest(tmp_path, 1, num_stages=2, plan_digest=DIGEST)
    exported = export_checkpoint(tmp_path)
    assert list(exported) == ["tied", "a", "b"] and torch.equal(exported["tied"], tied)

    save_stage(tmp_path, 2, 0, model_state={"tied": tied}, optimizer_state=None, rng_state={}, plan_digest=DIGEST)
    save_stage(tmp_path, 2, 1, model_state={"tied": tied + 1}, optimizer_state=None, rng_state={},
               plan_digest=DIGEST)
    write_manifest(tmp_path, 2, num_stages=2, plan_digest=DIGEST)
    with pytest.raises(CheckpointError, match="stages 0 and 1 both hold 'tied' with different values"):
        export_checkpoint(tmp_path)


def test_a_stage_file_of_another_plan_is_refused(tmp_path: Path) -> None:
    for stage, digest in enumerate([DIGEST, "stale-plan"]):
        save_stage(tmp_path, 1, stage, model_state={}, optimizer_state=None, rng_state={}, plan_digest=digest)
    write_manifest(tmp_path, 1, num_stages=2, plan_digest=DIGEST)
    checkpoint = latest_complete(tmp_path)
    assert load_stage(checkpoint, 0)["plan_digest"] == DIGEST
    with pytest.raises(CheckpointError, match="stage-1.pt: was saved under plan 'stale-plan'"):
        load_stage(checkpoint, 1)


def test_stage_file_holds_what_was_saved_detached_on_the_cpu(tmp_path: Path) -> None:
    weight = nn.Parameter(torch.randn(3, 2))
    rng = {"cpu": torch.get_rng_state(), "python": (3, tuple(range(5)), None)}
    save_stage(tmp_path, 5, 0, model_state={"w": weight}, optimizer_state=None, rng_state=rng,
               plan_digest=DIGEST, meta={"epoch": 1})
    write_manifest(tmp_path, 5, num_stages=1, plan_digest=DIGEST, meta={"epoch": 1})
    checkpoint = latest_complete(tmp_path)
    assert checkpoint is not None and checkpoint.step == 5 and checkpoint.path == step_dir(tmp_path, 5)
    manifest = checkpoint.manifest
    assert manifest["format"] == "pipeline-planner/checkpoint" and manifest["version"] == 1
    assert manifest["num_stages"] == 1 and manifest["plan_digest"] == DIGEST and manifest["meta"] == {"epoch": 1}
    assert manifest["files"]["0"]["name"] == "stage-0.pt"
    assert manifest["files"]["0"]["bytes"] == stage_file(checkpoint.path, 0).stat().st_size
    payload = load_stage(checkpoint, 0)
    assert payload["step"] == 5 and payload["stage"] == 0 and payload["plan_digest"] == DIGEST
    assert payload["meta"] == {"epoch": 1} and payload["rng_state"]["python"] == rng["python"]
    assert torch.equal(payload["rng_state"]["cpu"], rng["cpu"])
    saved = payload["model_state"]["w"]
    assert type(saved) is torch.Tensor and not saved.requires_grad and torch.equal(saved, weight.detach())


def test_save_refuses_values_a_safe_load_cannot_read(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"rng_state\['numpy'\]\[1\] is a numpy.ndarray"):
        save_stage(tmp_path, 1, 0, model_state={}, optimizer_state=None,
                   rng_state={"numpy": ("MT19937", np.zeros(3))}, plan_digest=DIGEST)
    assert not stage_file(step_dir(tmp_path, 1), 0).exists()


# --- optimizer state by name: resume on another split -----------------------------------------------


def train(name: str, stages: list[nn.Module], optimizers: list[torch.optim.Optimizer],
          data: list[tuple[torch.Tensor, torch.Tensor]], tied: list[list[tuple[int, str]]]) -> None:
    """Train stages that each own a copy of their parameters, as ranks do: tied copies get the summed gradient.

    `tied`: for each tied parameter, its (stage, name in that stage) copies.
    """
    for inputs, target in data:
        loss_of(name, run_stages(stages, inputs), target).backward()
        for copies in tied:
            parameters = [stages[stage].get_parameter(parameter) for stage, parameter in copies]
            total = parameters[0].grad
            for parameter in parameters[1:]:
                total = total + parameter.grad
            for parameter in parameters:
                parameter.grad = total.clone()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def separate_stages(model: nn.Module, split_points: list[str]) -> tuple[list[nn.Module], list[list[tuple[int, str]]]]:
    """Stage k cut from its own deep copy of `model` (no parameter shared between stages), and the tied copies."""
    stages = [split_model(copy.deepcopy(model), split_points)[index] for index in range(len(split_points) + 1)]
    shared = split_model(model, split_points).shared
    tied = [list(zip(item.stages, item.stage_names)) for item in shared]
    return stages, tied


RESUMES = [  # (model, optimizer, split points saved, split points resumed)
    ("gpt", "sgd", ["transformer.h.6"], ["transformer.h.3", "transformer.h.9"]),
    ("gpt", "adam", ["transformer.h.6"], ["transformer.h.3", "transformer.h.9"]),
    ("gpt", "adam", [], ["transformer.h.6"]),  # the tied weight's state saved under both names by one stage
    ("mlp", "sgd", ["6"], ["4", "8"]),
    ("mlp", "adam", ["6"], ["4", "8"]),
]


@pytest.mark.parametrize(("name", "optimizer_name", "saved_split", "resumed_split"), RESUMES,
                         ids=[f"{name}-{optimizer}-{len(saved) + 1}to{len(resumed) + 1}"
                              for name, optimizer, saved, resumed in RESUMES])
def test_resume_on_another_split_continues_bit_identically(tmp_path: Path, name: str, optimizer_name: str,
                                                           saved_split: list[str], resumed_split: list[str]) -> None:
    make_optimizer = OPTIMIZERS[optimizer_name]
    before, after = 2, 2
    data = batches(name, before + after)

    reference = build(name, seed=0)  # the whole model, never stopped
    reference_optimizer = make_optimizer(reference.parameters())
    train(name, [reference], [reference_optimizer], data, [])

    saved_stages, tied = separate_stages(build(name, seed=0), saved_split)
    saved_optimizers = [make_optimizer(stage.parameters()) for stage in saved_stages]
    train(name, saved_stages, saved_optimizers, data[:before], tied)
    save_all(tmp_path, before, saved_stages, saved_optimizers)
    del saved_stages, saved_optimizers

    resumed_model = build(name, seed=7)
    resumed_model.load_state_dict(export_checkpoint(tmp_path))
    resumed_stages, tied = separate_stages(resumed_model, resumed_split)
    resumed_optimizers = []
    named_state = optimizer_state_of(tmp_path)
    for stage in resumed_stages:
        optimizer = torch.optim.SGD(stage.parameters(), lr=123.0) if optimizer_name == "sgd" \
            else torch.optim.Adam(stage.parameters(), lr=123.0)  # saved hyper-parameters must replace these
        load_named_optimizer_state(optimizer, stage.named_parameters(remove_duplicate=False), named_state)
        resumed_optimizers.append(optimizer)
    assert all(group["lr"] != 123.0 for optimizer in resumed_optimizers for group in optimizer.param_groups)
    train(name, resumed_stages, resumed_optimizers, data[before:], tied)

    expected = reference.state_dict()
    for stage in resumed_stages:
        for key, tensor in stage.state_dict().items():
            assert torch.equal(tensor, expected[key]), key
    assert {key for stage in resumed_stages for key in stage.state_dict()} == set(expected)


# --- completeness, atomicity and failures --------------------------------------------------------------


def temporary_files(root: Path) -> list[Path]:
    """Leftover temporary files anywhere under root."""
    return sorted(root.rglob("*.tmp"))


@pytest.mark.parametrize("failing", ["os.replace", "os.fsync"])
def test_a_failed_stage_write_leaves_the_previous_checkpoint_intact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str) -> None:
    model = save_tiny(tmp_path, 2)
    save_stage(tmp_path, 4, 1, model_state={}, optimizer_state=None, rng_state={}, plan_digest=DIGEST)

    def disk_full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, failing.split(".")[1], disk_full)
    with pytest.raises(CheckpointError) as caught:
        save_stage(tmp_path, 4, 0, model_state=model.state_dict(), optimizer_state=None, rng_state={},
                   plan_digest=DIGEST)
    monkeypatch.undo()
    message = str(caught.value)
    assert message.startswith(f"{stage_file(step_dir(tmp_path, 4), 0)}: cannot be written: No space left on device")
    assert f"the previous complete checkpoint {step_dir(tmp_path, 2)} (step 2) is intact" in message
    assert isinstance(caught.value, FileProblemError)
    assert temporary_files(tmp_path) == [] and not stage_file(step_dir(tmp_path, 4), 0).exists()
    checkpoint = latest_complete(tmp_path)
    assert checkpoint is not None and checkpoint.step == 2
    assert torch.equal(export_checkpoint(tmp_path)["2.weight"], model[2].weight)


def test_a_failed_manifest_write_leaves_the_step_incomplete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny()
    for stage, module in enumerate(split_model(model, ["2"])):
        save_stage(tmp_path, 1, stage, model_state=module.state_dict(), optimizer_state=None, rng_state={},
                   plan_digest=DIGEST)

    def read_only(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(os, "replace", read_only)
    with pytest.raises(CheckpointError, match="manifest.json: cannot be written: Permission denied; "
                                              "no complete checkpoint exists yet"):
        write_manifest(tmp_path, 1, num_stages=2, plan_digest=DIGEST)
    monkeypatch.undo()
    assert latest_complete(tmp_path) is None and temporary_files(tmp_path) == []
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        export_checkpoint(step_dir(tmp_path, 1))


def test_stage_files_without_a_manifest_are_not_a_checkpoint(tmp_path: Path) -> None:
    save_tiny(tmp_path, 2)
    save_stage(tmp_path, 4, 0, model_state=tiny().state_dict(), optimizer_state=None, rng_state={},
               plan_digest=DIGEST)
    (step_dir(tmp_path, 6)).mkdir()
    (step_dir(tmp_path, 6) / ".stage-0.pt.abc123.tmp").write_bytes(b"half a file")
    assert [checkpoint.step for checkpoint in list_complete(tmp_path)] == [2]
    assert latest_complete(tmp_path).step == 2
    with pytest.raises(CheckpointError, match=r"step 4 lacks stage-1.pt, stage-2.pt of its 3 stage files"):
        write_manifest(tmp_path, 4, num_stages=3, plan_digest=DIGEST)
    assert not (step_dir(tmp_path, 4) / "manifest.json").exists()


def test_a_truncated_stage_file_is_incomplete_and_a_changed_one_corrupt(tmp_path: Path) -> None:
    save_tiny(tmp_path, 2)
    save_tiny(tmp_path, 4, seed=1)
    path = stage_file(step_dir(tmp_path, 4), 1)
    content = path.read_bytes()

    path.write_bytes(content[:-10])  # truncated: a size mismatch, found without reading the file
    assert latest_complete(tmp_path).step == 2
    assert [checkpoint.step for checkpoint in list_complete(tmp_path)] == [2]
    with pytest.raises(CheckpointError, match="is incomplete: a stage file it lists is missing or truncated"):
        export_checkpoint(step_dir(tmp_path, 4))

    changed = bytearray(content)
    changed[len(changed) // 2] ^= 0xFF  # same size, other bytes: only the checksum finds it
    path.write_bytes(bytes(changed))
    checkpoint = latest_complete(tmp_path)
    assert checkpoint.step == 4
    load_stage(checkpoint, 0)
    with pytest.raises(CheckpointError, match=rf"{path}: corrupt: .*use an older checkpoint"):
        load_stage(checkpoint, 1)


def test_a_killed_writer_leaves_only_a_temporary_file(tmp_path: Path) -> None:
    save_tiny(tmp_path, 2)
    script = textwrap.dedent(f"""
        import os, signal, torch
        import runtime.checkpoint as checkpoint

        def killed_midway(obj, handle):
            handle.write(b"PK" + bytes(1000))
            handle.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        torch.save = killed_midway
        checkpoint.save_stage({str(tmp_path)!r}, 4, 0, model_state={{"w": torch.ones(3)}}, optimizer_state=None,
                              rng_state={{}}, plan_digest="x")
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == -9, result.stderr
    folder = step_dir(tmp_path, 4)
    left = [path.name for path in folder.iterdir()]
    assert len(left) == 1 and left[0].startswith(".stage-0.pt.") and left[0].endswith(".tmp")
    assert latest_complete(tmp_path).step == 2


def test_a_complete_checkpoint_is_never_rewritten(tmp_path: Path) -> None:
    save_tiny(tmp_path, 2)
    before = stage_file(step_dir(tmp_path, 2), 0).read_bytes()
    with pytest.raises(CheckpointError, match="already holds a complete checkpoint of step 2"):
        save_stage(tmp_path, 2, 0, model_state=tiny(seed=5).state_dict(), optimizer_state=None, rng_state={},
                   plan_digest=DIGEST)
    assert stage_file(step_dir(tmp_path, 2), 0).read_bytes() == before


def test_missing_roots_and_bad_paths(tmp_path: Path) -> None:
    assert latest_complete(tmp_path / "absent") is None and list_complete(tmp_path / "absent") == []
    with pytest.raises(CheckpointError, match="no such folder"):
        export_checkpoint(tmp_path / "absent")
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        export_checkpoint(tmp_path)
    save_tiny(tmp_path, 3)
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        optimizer_state_of(tmp_path)
    with pytest.raises(CheckpointError, match=r"has no stage 2 \(it has 2 stages\)"):
        load_stage(latest_complete(tmp_path), 2)


# --- prune -------------------------------------------------------------------------------------------


def test_prune_keeps_the_newest_complete_and_folders_being_written(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        save_tiny(tmp_path, step)
    for step in (3, 7, 10):  # incomplete: stage files, no manifest
        save_stage(tmp_path, step, 0, model_state={}, optimizer_state=None, rng_state={}, plan_digest=DIGEST)
    (tmp_path / "notes").mkdir()

    removed = prune(tmp_path, keep=2)
    assert removed == [step_dir(tmp_path, step) for step in (2, 3, 4, 7)]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["notes", "step-00000006", "step-00000008",
                                                                "step-00000010"]
    assert [checkpoint.step for checkpoint in list_complete(tmp_path)] == [6, 8]
    assert prune(tmp_path, keep=1) == [step_dir(tmp_path, 6)]
    with pytest.raises(CheckpointError, match="keep is 0"):
        prune(tmp_path, keep=0)
    assert latest_complete(tmp_path).step == 8


def test_prune_without_a_complete_checkpoint_removes_nothing(tmp_path: Path) -> None:
    save_stage(tmp_path, 1, 0, model_state={}, optimizer_state=None, rng_state={}, plan_digest=DIGEST)
    assert prune(tmp_path, keep=1) == [] and step_dir(tmp_path, 1).is_dir()


def test_bad_indices_are_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="step is -1"):
        save_stage(tmp_path, -1, 0, model_state={}, optimizer_state=None, rng_state={}, plan_digest=DIGEST)
    with pytest.raises(CheckpointError, match="num_stages is 0"):
        write_manifest(tmp_path, 1, num_stages=0, plan_digest=DIGEST)


# --- check_writable ------------------------------------------------------------------------------------


def test_check_writable_creates_the_root_and_leaves_nothing(tmp_path: Path) -> None:
    root = tmp_path / "a" / "b"
    check_writable(root)
    assert root.is_dir() and list(root.iterdir()) == []


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root ignores file permissions")
def test_check_writable_on_a_read_only_folder(tmp_path: Path) -> None:
    root = tmp_path / "readonly"
    root.mkdir()
    root.chmod(0o500)
    try:
        with pytest.raises(CheckpointError, match="cannot be written: Permission denied; choose a writable"):
            check_writable(root)
    finally:
        root.chmod(0o700)


def test_check_writable_reports_a_refused_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr("tempfile.mkstemp", refused)
    with pytest.raises(CheckpointError, match=rf"^{tmp_path}: cannot be written: Permission denied; "
                                              "choose a writable --checkpoint-dir"):
        check_writable(tmp_path)


def test_check_writable_under_a_regular_file(tmp_path: Path) -> None:
    plain = tmp_path / "file"
    plain.write_text("x")
    with pytest.raises(CheckpointError, match="cannot be written: Not a directory"):
        check_writable(plain / "checkpoints")
    with pytest.raises(CheckpointError, match="is a file, not a folder"):
        check_writable(plain)


def test_checkpoint_is_hashable_and_compares_by_step_and_path(tmp_path: Path) -> None:
    save_tiny(tmp_path, 1)
    first, second = latest_complete(tmp_path), list_complete(tmp_path)[0]
    assert isinstance(first, Checkpoint) and first == second and len({first, second}) == 1
    assert first.num_stages == 2
