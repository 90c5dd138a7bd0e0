"""Plan: stage boundaries, replication and predictions for a profile on a cluster; its JSON file.

Schema (format "pipeline-planner/plan", version 3, `PLAN_VERSION`):

- `profile`: {name, path, digest}: the profile the plan came from (`path` as given to
  `partition`, "" when it was not given); `digest` is the SHA-256 of
  the profile's canonical JSON body (`profile_digest`), so a plan is never applied to another.
- `cluster`: `Cluster.to_dict()`; `cost_model`: "planner" (`schedule_cost`) or "pipedream"
  (`pipedream_cost`); `schedule`: gpipe, 1f1b, zb-h1 or pipedream; `microbatches` per iteration (None for
  the asynchronous schedule, which has no flush); `microbatch_size` (samples; None when the
  profile does not know its batch size); `global_batch_size` (samples per optimizer step,
  microbatch_size x microbatches, in profiled mini-batches where the profile does not know its batch
  size; None for pipedream: written for readers, derived again on load); `straight`.
- `stages`: per stage, `layers` [start, stop) (indices into the profile's layer order),
  `first_layer`, `last_layer`, `replicas`, `ranks`, `recompute`, and predictions: `compute_ms`
  (forward + backward, plus the recomputed forward, of one microbatch on one device),
  `comm_ms` (its larger transfer per microbatch, in or out), `allreduce_ms` (the gradient
  all-reduce among its replicas), `tied_allreduce_ms` (summing tied weights' gradients with the
  other stages holding them, once per step; `schedule_cost.tied_allreduce_s`), `period_ms` (steady-state time per microbatch the stage
  allows; the planner model: max(compute, transfers) / replicas), `memory_bytes` (per device).
- `predicted`: `bottleneck_s` (the largest per-stage term the cost model minimises),
  `iteration_ms` (flush schedules: one iteration of `microbatches`; pipedream: time per
  microbatch; under the planner cost model simulated by `simulator`, which plays the schedule op
  by op), `objective_ms` (the closed form the optimizer minimised, same unit; in version 2 files
  equal to `iteration_ms`), `samples_per_s`, `bubble_fraction` (share of device time idle: not computing,
  all-reducing or stepping the optimizer, over the simulated iteration, `Timeline.idle_fraction`; pipedream: in
  steady state),
  `speedup_vs_single_device`, `speedup_vs_data_parallel` (one stage on every GPU, same
  schedule), `devices_used`, `peak_memory_bytes`.
- `chunks`: stages per rank (interleaved-1f1b: v, its stages round-robin, stage s on rank s mod p; 1 for
  every other schedule; absent in older files: 1).
- `notes`: sentences for the reader (e.g. that fewer devices than given were used and why).
- `optimizer`: adam or sgd, whose state the memory figures count (absent in older files: adam).
- `command`: the `planner partition` options that made the plan, as words (`--out` and `--compare` left
  out), so that a message asking for another plan can repeat them (`replan_command`); [] for a plan made
  through the Python API (absent in older files: []).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from planner.files.cluster import Cluster, cluster_from_dict
from planner.errors import FileFormatError, PlannerError
from planner.files.fileformat import kept_path, keep_previous, read_versioned_json, write_versioned_json
from planner.files.profile import Profile, load_profile
from planner.schedules.schedule import CHUNKED_SCHEDULES, FLUSH_SCHEDULES, SCHEDULES

COST_MODELS = ("planner", "pipedream")  # `costs.schedule_cost`, `costs.pipedream_cost`

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from planner.files.timeline import Timeline

PLAN_FORMAT = "pipeline-planner/plan"
PLAN_VERSION = 3  # 2: planner cost model, allreduce_ms, period_ms; 3: simulated iteration_ms, objective_ms


class PlanProfileMismatchError(PlannerError):
    """A plan given with a profile it was not made from."""

    def __init__(self, plan_path: str, profile_path: str, expected: str, found: str,
                 profile_option: bool = True) -> None:
        self.expected = expected
        self.found = found
        kept = kept_path(profile_path, expected)
        give = (f"give that one (`--profile {kept}`, or move it back)" if profile_option else
                f"move it back (`mv {kept} {profile_path}`)")
        fix = (f"the profile it was made from was kept as {kept} when {profile_path} was written again: {give}, or "
               f"re-run `planner partition {profile_path}` to plan for the new one" if kept.is_file() else
               f"re-run `planner partition {profile_path}` to plan for this profile")
        super().__init__(f"{plan_path}: made from a profile with digest {expected[:12]}, but {profile_path} has "
                         f"{found[:12]}; {fix}")


def profile_digest(profile: Profile) -> str:
    """SHA-256 of what a plan depends on in a profile, as canonical JSON: model name, batch size,
    input bytes, layers, shared parameters, optimizer step times, workspace, the split backward's cost, deferred
    bytes and what its B and W hold, the saved bytes made before each layer, the times at other batch sizes and
    the device's library bytes (not the date, path or settings, so re-importing or copying the same measurements
    keeps the digest)."""
    body = profile.to_dict()
    content = {key: body[key] for key in ("model_name", "batch_size", "input_bytes", "layers", "shared_params")}
    for key in ("optimizer_step_ms", "optimizer_scratch_bytes", "grad_accumulation_ms", "workspace_bytes",
                "optimizer_step_per_tensor_ms", "optimizer_step_per_call_ms", "param_tensors", "split_backward_ratio",
                "deferred_bytes", "size_times", "library_bytes", "input_workspace_bytes", "largest_param_bytes",
                "input_saved_bytes", "freed_by_b_bytes", "weight_workspace_bytes"):
        if body.get(key):  # (profiles from before they were measured keep their digest)
            content[key] = body[key]
    text = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def keep_previous_profile(path: str | Path) -> Path | None:
    """`keep_previous` for a profile file: kept under its `profile_digest` (the digest plans made from it record, so
    `PlanProfileMismatchError` can name it), or its bytes' SHA-256 where it does not load as a profile."""
    def digest(found: Path) -> str:
        try:
            return profile_digest(load_profile(found))
        except PlannerError:
            return hashlib.sha256(found.read_bytes()).hexdigest()
    return keep_previous(path, digest)


def plan_digest(plan: "Plan") -> str:
    """SHA-256 of the plan's canonical JSON body: names the plan a checkpoint or run was made with."""
    text = json.dumps(plan.to_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class ProfileRef:
    """Which profile a plan belongs to."""

    name: str
    path: str
    digest: str


@dataclass(frozen=True)
class StageLayout:
    """Where one stage is: layers [start, stop) and their names, its replicas and ranks, recompute."""

    start: int
    stop: int
    first_layer: str
    last_layer: str
    replicas: int
    ranks: tuple[int, ...]
    recompute: bool

    def layout(self) -> StageLayout:
        """This stage's layout alone (a StagePlan without its predictions)."""
        return StageLayout(self.start, self.stop, self.first_layer, self.last_layer, self.replicas, tuple(self.ranks),
                           self.recompute)

    def layout_dict(self) -> dict[str, Any]:
        """The layout as a file writes it: `layers` [start, stop), `first_layer`, `last_layer`,
        `replicas`, `ranks`, `recompute`; `layout_fields` reads it back."""
        return {"layers": [self.start, self.stop], "first_layer": self.first_layer, "last_layer": self.last_layer,
                "replicas": self.replicas, "ranks": list(self.ranks), "recompute": self.recompute}


def layout_fields(entry: dict[str, Any]) -> dict[str, Any]:
    """StageLayout's fields from a file's stage entry (`StageLayout.layout_dict`); KeyError or
    ValueError when one is missing or malformed."""
    return {"start": int(entry["layers"][0]), "stop": int(entry["layers"][1]), "first_layer": str(entry["first_layer"]),
            "last_layer": str(entry["last_layer"]), "replicas": int(entry["replicas"]),
            "ranks": tuple(int(r) for r in entry["ranks"]), "recompute": _strict_bool(entry["recompute"], "recompute")}


@dataclass(frozen=True)
class StagePlan(StageLayout):
    """One stage: its layout and predicted times (ms per micro-batch)."""

    compute_ms: float
    comm_ms: float
    allreduce_ms: float
    period_ms: float
    memory_bytes: int
    step_ms: float = 0.0  # one optimizer step over the stage's weights (0 where the profile did not time it)
    accumulate_ms: float = 0.0  # added to each backward after a replica's first of an iteration (flush schedules)
    tied_allreduce_ms: float = 0.0  # summing tied weights' gradients with the other stages holding them, per step


@dataclass(frozen=True)
class Prediction:
    """What the cost model predicts for the whole plan."""

    bottleneck_s: float
    iteration_ms: float
    samples_per_s: float
    bubble_fraction: float
    speedup_vs_single_device: float
    speedup_vs_data_parallel: float
    devices_used: int
    peak_memory_bytes: int
    objective_ms: float


@dataclass(frozen=True)
class Plan:
    """A pipeline plan; see the module docstring for the file schema."""

    profile: ProfileRef
    cluster: Cluster
    cost_model: str
    schedule: str
    microbatches: int | None
    microbatch_size: int | None
    straight: bool
    stages: tuple[StagePlan, ...]
    predicted: Prediction
    notes: tuple[str, ...] = field(default_factory=tuple)
    optimizer: str = "adam"
    chunks: int = 1  # stages per rank: v under interleaved-1f1b (stage s on rank s mod p), else 1
    command: tuple[str, ...] = ()  # the `planner partition` words that made it (`replan_command`)

    @property
    def global_batch_size(self) -> int | None:
        """Samples per optimizer step: microbatch_size x microbatches for synchronous schedules (profiled
        mini-batches where the profile does not know its batch size); None for pipedream (weights update
        after every microbatch)."""
        if self.microbatches is None or self.microbatch_size is None or self.schedule not in FLUSH_SCHEDULES:
            return None
        return self.microbatch_size * self.microbatches

    def to_dict(self) -> dict[str, Any]:
        """The file body (without the format header); inverse of `plan_from_dict`."""
        body = dataclasses.asdict(self)
        body["global_batch_size"] = self.global_batch_size
        body["cluster"] = self.cluster.to_dict()
        layout = {f.name for f in dataclasses.fields(StageLayout)}
        body["stages"] = [
            {**{k: v for k, v in dataclasses.asdict(stage).items() if k not in layout}, **stage.layout_dict()}
            for stage in self.stages
        ]
        return body

    def save(self, path: str | Path) -> Path:
        """Write the plan as versioned JSON (atomically); returns the path.

        The profile's path is kept as given (from the directory the plan was made in) and, where that
        file is there now, also from the plan's own folder (`profile.path_from_plan`), so that
        `load_plan` finds it from another directory too."""
        body = self.to_dict()
        if Path(self.profile.path).is_file() and not Path(self.profile.path).is_absolute():
            folder = Path(path).resolve().parent
            body["profile"]["path_from_plan"] = os.path.relpath(Path(self.profile.path).resolve(), folder)
        return write_versioned_json(path, PLAN_FORMAT, PLAN_VERSION, body)

    def _repr_html_(self) -> str:
        """Jupyter: the stage table and predictions (`html.plan_html`)."""
        from planner.display.html import plan_html  # html imports this module

        return plan_html(self)

    def simulate(self, profile: Profile | None = None, iterations: int = 1) -> "Timeline":
        """The simulated schedule (`plan_simulation.simulate`); `profile` defaults to the file at
        `self.profile.path` (PlannerError if it is not there or is another profile)."""
        from planner.simulation.plan_simulation import resolve_profile, simulate

        return simulate(self, resolve_profile(self, profile), iterations)

    def plot(self, profile: Profile | None = None) -> "Figure":
        """Partition, schedule and memory panels in one Figure (`plots.plan_figure`); `profile` as in `simulate`."""
        from planner.simulation.plan_simulation import resolve_profile, simulate
        from planner.display.plots import plan_figure

        found = resolve_profile(self, profile)
        return plan_figure(self, found, simulate(self, found))

    def mean_compute_ms(self, index: int) -> float:
        """What a run of this plan measures as stage `index`'s compute per microbatch, on average:
        compute_ms + accumulate_ms x (m - min(r, m)) / m (flush schedules: every microbatch but each
        replica's first accumulates gradients; pipedream: compute_ms)."""
        stage = self.stages[index]
        if self.microbatches is None or self.schedule not in FLUSH_SCHEDULES:
            return stage.compute_ms
        m = self.microbatches
        return stage.compute_ms + stage.accumulate_ms * (m - min(stage.replicas, m)) / m

    def with_notes(self, *notes: str) -> "Plan":
        """This plan with `notes` added after its own."""
        return dataclasses.replace(self, notes=self.notes + tuple(notes))

    def check_profile(self, profile: Profile, plan_path: str = "<plan>", profile_path: str = "<profile>",
                      profile_option: bool = True) -> None:
        """Raise PlanProfileMismatchError unless `profile` is the one this plan was made from (`profile_option`:
        whether the command takes --profile, which the error then offers)."""
        found = profile_digest(profile)
        if found != self.profile.digest:
            raise PlanProfileMismatchError(plan_path, profile_path, self.profile.digest, found, profile_option)


def replan_command(plan: Plan, schedule: str | None = None, add: Sequence[str] = ()) -> str:
    """The shell line of the `planner partition` command that made `plan` (`Plan.command`) with `--schedule
    schedule` (None: as it was) and the flags `add` it lacks; for a plan of the Python API, the command its
    own fields give (profile, GPUs, memory, straight, optimizer, microbatch size and count, schedule)."""
    words = list(plan.command) or _command_of(plan)
    if schedule is not None:
        at = next((i for i, word in enumerate(words) if word == "--schedule"), None)
        if at is None or at + 1 >= len(words):
            words += ["--schedule", schedule]
        else:
            words[at + 1] = schedule
    words += [flag for flag in add if flag not in words]
    return shlex.join(words)


def _command_of(plan: Plan) -> list[str]:
    """`planner partition` words that make a plan like `plan`, from what it records."""
    words = ["planner", "partition", plan.profile.path or "PROFILE", "--gpus", str(plan.cluster.num_devices)]
    if len(plan.cluster.levels) > 1:
        words += ["--gpus-per-node", str(plan.cluster.levels[0].size)]
    if plan.cluster.memory_bytes is not None:
        words += ["--memory", f"{plan.cluster.memory_bytes}B"]
    if plan.optimizer != "adam":
        words += ["--optimizer", plan.optimizer]
    if plan.straight:
        words.append("--straight")
    if plan.microbatch_size is not None:
        words += ["--microbatch-size", str(plan.microbatch_size)]
    if plan.microbatches is not None:
        words += ["--microbatches", str(plan.microbatches)]
    return words + ["--schedule", plan.schedule]


def plan_from_dict(body: dict[str, Any], source: str = "<dict>") -> Plan:
    """A Plan from `Plan.to_dict()` output; FileFormatError naming `source` if a field is bad."""
    try:
        stages = tuple(
            StagePlan(
                **layout_fields(s), compute_ms=float(s["compute_ms"]), comm_ms=float(s["comm_ms"]),
                allreduce_ms=float(s["allreduce_ms"]), period_ms=float(s["period_ms"]),
                memory_bytes=int(s["memory_bytes"]), step_ms=float(s.get("step_ms", 0.0)),
                accumulate_ms=float(s.get("accumulate_ms", 0.0)),
                tied_allreduce_ms=float(s.get("tied_allreduce_ms", 0.0)),
            )
            for s in body["stages"]
        )
        ref = body["profile"]
        predicted = body["predicted"]
        plan = Plan(
            profile=ProfileRef(str(ref["name"]), str(ref["path"]), str(ref["digest"])),
            cluster=cluster_from_dict(body["cluster"], source),
            cost_model=str(body["cost_model"]), schedule=str(body["schedule"]),
            microbatches=None if body["microbatches"] is None else int(body["microbatches"]),
            microbatch_size=None if body["microbatch_size"] is None else int(body["microbatch_size"]),
            straight=_strict_bool(body["straight"], "straight"), stages=stages,
            predicted=Prediction(**{f.name: _field_type(f)(predicted[f.name]) for f in dataclasses.fields(Prediction)
                                    if f.name != "objective_ms"},
                                 objective_ms=float(predicted.get("objective_ms", predicted["iteration_ms"]))),
            notes=tuple(str(n) for n in _strict_list(body.get("notes", []), "notes")),
            optimizer=str(body.get("optimizer", "adam")), chunks=int(body.get("chunks", 1)),
            command=tuple(str(word) for word in _strict_list(body.get("command", []), "command")),
        )
        _check_stages(plan.stages, source)
        if plan.schedule not in SCHEDULES:
            raise FileFormatError(source, f"plan has an unknown schedule {plan.schedule!r}",
                                  f"use one of {', '.join(SCHEDULES)}, or re-run `planner partition`")
        if plan.chunks < 1 or (plan.chunks > 1 and plan.schedule not in CHUNKED_SCHEDULES) \
                or len(plan.stages) % plan.chunks:
            raise FileFormatError(source, f"plan has chunks={plan.chunks} for {len(plan.stages)} stages under "
                                          f"{plan.schedule}", "chunks divide the stages, above 1 only for "
                                          f"{', '.join(CHUNKED_SCHEDULES)}; re-run `planner partition`")
        return plan
    except KeyError as exc:
        raise FileFormatError(source, f"plan is missing the field {exc.args[0]!r}") from None
    except (TypeError, ValueError, IndexError, ArithmeticError) as exc:
        raise FileFormatError(source, f"plan has a malformed field: {exc}") from None


def _strict_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def _strict_list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a list, got {value!r}")
    return value


def _check_stages(stages: tuple[StagePlan, ...], source: str) -> None:
    """Stages must cover [0, n) contiguously, each with replicas >= 1 and as many ranks."""
    if not stages:
        raise FileFormatError(source, "plan has no stages")
    expected_start = 0
    for index, stage in enumerate(stages):
        if stage.start != expected_start or stage.stop <= stage.start:
            raise FileFormatError(source, f"stage {index} covers layers [{stage.start}, {stage.stop}), "
                                          f"expected to start at {expected_start} and be non-empty")
        if stage.replicas < 1 or len(stage.ranks) != stage.replicas:
            raise FileFormatError(source, f"stage {index} has {stage.replicas} replicas and {len(stage.ranks)} ranks")
        expected_start = stage.stop


def _field_type(prediction_field: dataclasses.Field) -> type:
    """int or float, from a Prediction field's annotation."""
    return int if prediction_field.type in ("int", int) else float


def load_plan(path: str | Path) -> Plan:
    """Read a plan file; refuses other formats and newer versions with a FileFormatError.

    Its `profile.path` is the recorded one where that file is there from this directory, else the one
    recorded from the plan's folder where that is (`Plan.save`): `planner train plans/x.json` run from
    another directory than the partition still finds the profile's conditions."""
    body = read_versioned_json(path, PLAN_FORMAT, PLAN_VERSION)
    plan = plan_from_dict(body, str(path))
    from_plan = body["profile"].get("path_from_plan")
    if isinstance(from_plan, str) and not Path(plan.profile.path).is_file():
        found = Path(path).parent / from_plan
        if found.is_file():
            return dataclasses.replace(plan, profile=dataclasses.replace(plan.profile, path=os.path.normpath(found)))
    return plan
