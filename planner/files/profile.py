"""Profile: per-layer measurements of one model on one device, its JSON file format and table.

Times are milliseconds per mini-batch of `batch_size` samples; sizes are bytes. A profile may also hold
the layers' times at other batch sizes (`SizeTimes`), which the cost model interpolates between.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.errors import FileFormatError
from planner.files.fileformat import read_versioned_json, write_versioned_json

if TYPE_CHECKING:
    import pandas as pd

PROFILE_FORMAT = "pipeline-planner/profile"
# 2: layers may hold `bwd_input_ms`, the profile `split_backward_ratio`; version 1 loads them None.
# 3: the profile may hold `size_times`, the layers' times at more batch sizes; versions 1 and 2 load it empty.
PROFILE_VERSION = 3

LAYER_COLUMNS = (
    "name", "kind", "fwd_ms", "bwd_ms", "output_bytes", "cut_bytes", "param_bytes", "saved_bytes", "bwd_input_ms",
)
# the Profile's fields with one number per layer (or none)
PER_LAYER_FIELDS = (
    "workspace_bytes", "forward_workspace_bytes", "param_tensors", "frozen_param_bytes", "deferred_bytes",
    "input_workspace_bytes", "largest_param_bytes", "input_saved_bytes", "freed_by_b_bytes", "weight_workspace_bytes",
)


@dataclass(frozen=True)
class LayerProfile:
    """One layer, in execution order.

    - `name`: fully qualified module name (usable as a torch.distributed.pipelining split point).
    - `kind`: the module's class name (or PipeDream's module description).
    - `fwd_ms`, `bwd_ms`: median forward / backward time of the layer, including the functional
      operations that run after it and before the next layer (residual adds, reshapes; the loss
      for the last layer), in ms per mini-batch.
    - `output_bytes`: bytes of the tensors the layer's module returns.
    - `cut_bytes`: bytes of every tensor produced at or before this layer and consumed after it:
      what crosses a stage boundary placed right after this layer (0 for the last layer).
    - `param_bytes`: bytes of the parameters the layer uses; a parameter shared by several layers
      is counted once, at the first layer that uses it (see `Profile.shared_params`).
    - `saved_bytes`: bytes autograd saves for backward inside the layer (activation memory held
      per in-flight micro-batch); parameters are not counted.
    - `bwd_input_ms`: the part of `bwd_ms` that computes the gradients of the layer's inputs
      (zero-bubble schedules' B), in ms per mini-batch, 0 <= bwd_input_ms <= bwd_ms: bwd_ms times
      the median ratio of the layer's backward with every parameter frozen to its backward in a
      normal step (`planner.profiling.timing.time_input_gradients`); 0 for a layer whose input
      needs no gradient (the first layer fed by data). None: not measured (version-1 files,
      PipeDream imports). The weights' part is `bwd_weight_ms`.
    """

    name: str
    kind: str
    fwd_ms: float
    bwd_ms: float
    output_bytes: int
    cut_bytes: int
    param_bytes: int
    saved_bytes: int
    bwd_input_ms: float | None = None

    @property
    def bwd_weight_ms(self) -> float | None:
        """The part of `bwd_ms` that computes the weights' gradients (zero-bubble schedules' W),
        ms per mini-batch: `bwd_ms - bwd_input_ms`; None where `bwd_input_ms` was not measured."""
        return None if self.bwd_input_ms is None else self.bwd_ms - self.bwd_input_ms


@dataclass(frozen=True)
class SharedParam:
    """A parameter used by several layers (tied weights): its names, size and the layers using it; `frozen`: it
    needs no gradient (`requires_grad=False`: no gradient, optimizer state or sum across its users)."""

    names: tuple[str, ...]
    nbytes: int
    layers: tuple[int, ...]
    frozen: bool = False


@dataclass(frozen=True)
class SizeTimes:
    """The layers' times measured at one more batch size than the profile's `batch_size`.

    `batch_size`: samples per mini-batch of these times; `fwd_ms[i]`, `bwd_ms[i]`, `bwd_input_ms[i]`: layer i's
    forward, backward and input-gradient times (as `LayerProfile`'s, same layer order), ms per mini-batch of
    `batch_size` samples; `bwd_input_ms` empty: not measured. `step_ms`: the median uninstrumented step at this
    size, ms (0.0: not measured). Bytes are not measured again: they grow linearly with the batch.
    """

    batch_size: int
    fwd_ms: tuple[float, ...]
    bwd_ms: tuple[float, ...]
    bwd_input_ms: tuple[float, ...] = ()
    step_ms: float = 0.0


@dataclass(frozen=True)
class BatchCoupling:
    """What makes a pipeline's microbatches train differently from the whole batch
    (`planner.profiling.batch_coupling`): `batch_norm`, the batch norm modules that normalise with the batch's
    statistics; `across_samples`, how the outputs or the loss of the batch differ from those of its two halves
    (None: they do not, or it was not checked); `unchecked`, why that could not be checked (None: it was)."""

    batch_norm: tuple[str, ...] = ()
    across_samples: str | None = None
    unchecked: str | None = None

    def notes(self, microbatch_size: int | None = None, microbatches: int | None = None) -> list[str]:
        """What a pipeline changes, one sentence per finding: about any pipeline (no microbatch size; then also
        what could not be checked), or about a plan of microbatches of `microbatch_size` samples, `microbatches`
        of them per optimizer step (None: a schedule that steps after every microbatch; 1: the batch is not cut,
        nothing changes)."""
        if microbatches == 1:
            return []
        if microbatch_size is None:
            each, whole = "each microbatch", "plain PyTorch on the whole batch"
        else:
            each = f"each microbatch of {microbatch_size} samples"
            whole = ("plain PyTorch" if microbatches is None else
                     f"plain PyTorch on batches of {microbatch_size * microbatches}")
        notes = []
        if self.batch_norm:
            shown = ", ".join(self.batch_norm[:3]) + (", ..." if len(self.batch_norm) > 3 else "")
            notes.append(f"batch norm ({len(self.batch_norm)} module{'s' if len(self.batch_norm) != 1 else ''}: "
                         f"{shown}) normalises {each} with that microbatch's statistics, and moves running statistics "
                         f"once per microbatch: training differs from {whole}")
        if self.across_samples is not None:
            notes.append(f"the samples of a batch are not independent ({self.across_samples}): a pipeline computes "
                         f"that over {each}, so training differs from {whole}")
        if self.unchecked is not None and microbatch_size is None:
            notes.append(f"whether the samples of a batch are independent was not checked: {self.unchecked}")
        return notes


@dataclass(frozen=True)
class Profile:
    """Measurements of a model's layers on one device at one mini-batch size.

    `step_ms` is the median end-to-end training step (forward, loss and backward; no optimizer)
    measured without instrumentation; the layers' `fwd_ms + bwd_ms` add up to it (`settings["instrumented_ratio"]`:
    how much longer the instrumented steps that shared it out were; before 2026-11-26 the layers added up to
    `step_ms` x that ratio).
    `peak_memory_bytes` is the peak of memory during one such step, measured as
    `peak_memory_method` says ("cuda-allocator": torch.cuda.max_memory_allocated;
    "live-tensors": peak bytes of live tensor storage tracked per operation on CPU;
    "pipedream-estimate" and "unknown" for imported profiles).
    `batch_size` is None when unknown (imported profiles without one).
    `optimizer_step_ms`: one optimizer step over all the model's parameters, per optimizer name
    ("sgd": momentum 0.9, "adam"), ms; `optimizer_scratch_bytes`: the temporary bytes such a step
    holds beyond weights, gradients and state. `grad_accumulation_ms`: adding one more batch's
    gradients into every `.grad` (each backward after a stage's first in a step does).
    `optimizer_step_per_tensor_ms`: per optimizer, its step's cost per parameter tensor, ms (timed over
    many one-element tensors); `optimizer_step_per_call_ms`: per optimizer, what a step costs once per call
    whatever it steps, ms (timed right after a backward; empty in older files: 0), the rest of
    `optimizer_step_ms` being per byte; `param_tensors[i]`: the
    parameter tensors layer i holds that need a gradient, counted as `param_bytes` is.
    `frozen_param_bytes[i]`: the part of layer i's `param_bytes` that needs no gradient (`requires_grad=False`,
    as in fine-tuning with a frozen backbone or LoRA): weights only, no gradient, optimizer state or all-reduce;
    empty: none frozen (older files, PipeDream imports).
    `workspace_bytes[i]`: the most bytes live while layer i's backward runs beyond weights, their
    gradients, the batch and the saved activations (gradients between layers, temporaries;
    `planner.profiling.memory.measure_workspace`). Empty or 0 in older and imported profiles.
    `forward_workspace_bytes[i]`: the same while layer i's forward runs (its input, output and temporaries beyond
    what autograd saves: all a layer that saves nothing holds); empty in older and imported profiles.
    `split_backward_ratio`: how much longer a backward takes run as zero-bubble schedules' B then W
    (`planner.profiling.backward_split`) than run whole: the median over pairs of steps of
    split_k / plain_k, each the backward of the whole model after its first layer (that layer's
    outputs received as a pipeline stage's input; `planner.profiling.timing.time_split_backward`);
    as measured, so noise can put it slightly below 1. None: not measured (older files, PipeDream
    imports).
    `deferred_bytes[i]`: what a zero-bubble schedule keeps for layer i from a microbatch's B to its W
    beyond the saved activations (the gradients recorded at its boundary nodes), bytes per mini-batch
    (`planner.profiling.deferred_memory.measure_split_memory`); 0 for the first layer. Empty: not
    measured (older files, PipeDream imports).
    `input_workspace_bytes[i]`: what that split backward's B holds while it runs layer i beyond weights, the batch,
    saved activations and the gradients the layers after i keep for W (the gradient flowing in, temporaries and
    the gradients layer i keeps as it goes), bytes per mini-batch
    (`planner.profiling.deferred_memory.measure_split_memory`); 0 for the first layer. Empty: not measured.
    `freed_by_b_bytes[i]`: the saved tensors of layer i that are gone once B has run (a loss's log-softmax, which
    only the input gradients read), bytes per mini-batch; a microbatch waiting for its W holds its
    `deferred_bytes` less these. `weight_workspace_bytes[i]`: the most parameter bytes one of W's calls for
    layer i holds before adding them into `.grad` (separate query, key and value projections: one call). Both
    from the same step; empty: not measured.
    `largest_param_bytes[i]`: the largest parameter tensor layer i uses that needs a gradient (a shared one at
    every layer using it), bytes: the gradient a zero-bubble W makes for it before adding it into `.grad`.
    Empty: not recorded (older files, PipeDream imports).
    `input_saved_bytes[i]`: the part of `saved_bytes[i]` made before layer i (by earlier layers, or the model's
    inputs), per mini-batch (`planner.profiling.dataflow`): a stage starting at layer i receives those tensors
    and holds them once, as its inputs; 0 where layer i changes such a tensor in place (the stage then runs on
    clones of them). Empty: not measured (older files, PipeDream imports; the model then counts them twice, an
    upper bound).
    `size_times`: the layers' times at other batch sizes than `batch_size` (`planner profile --batch-size
    1,2,4,8` measures them; `batch_size` is then the largest, where memory was measured), which the cost
    model interpolates between (`planner.costs.layer_arrays.times_at_batch_size`); empty: measured at
    `batch_size` only (older files, PipeDream imports).
    `library_bytes`: what the device holds beyond tensors once a step has run (CUDA: the cuBLAS and cuBLASLt
    workspaces in PyTorch's allocator; `planner.profiling.memory.library_bytes`), once per device on top of
    every plan's memory; 0 on CPU, in older files and in PipeDream imports.
    `batch_coupling`: what the model computes across the samples of a batch (`BatchCoupling`); None: not
    checked (older files, PipeDream imports).
    """

    model_name: str
    source: str
    device: str
    device_name: str
    torch_version: str
    dtype: str
    batch_size: int | None
    threads: int
    created: str
    layers: tuple[LayerProfile, ...]
    step_ms: float
    peak_memory_bytes: int
    peak_memory_method: str
    input_bytes: int
    shared_params: tuple[SharedParam, ...] = ()
    settings: dict[str, Any] = field(default_factory=dict)
    optimizer_step_ms: dict[str, float] = field(default_factory=dict)
    optimizer_scratch_bytes: dict[str, int] = field(default_factory=dict)
    grad_accumulation_ms: float = 0.0
    workspace_bytes: tuple[int, ...] = ()
    forward_workspace_bytes: tuple[int, ...] = ()
    optimizer_step_per_tensor_ms: dict[str, float] = field(default_factory=dict)
    optimizer_step_per_call_ms: dict[str, float] = field(default_factory=dict)
    param_tensors: tuple[int, ...] = ()
    frozen_param_bytes: tuple[int, ...] = ()
    split_backward_ratio: float | None = None
    deferred_bytes: tuple[int, ...] = ()
    input_workspace_bytes: tuple[int, ...] = ()
    freed_by_b_bytes: tuple[int, ...] = ()
    weight_workspace_bytes: tuple[int, ...] = ()
    largest_param_bytes: tuple[int, ...] = ()
    input_saved_bytes: tuple[int, ...] = ()
    size_times: tuple[SizeTimes, ...] = ()
    library_bytes: int = 0
    batch_coupling: BatchCoupling | None = None

    def __post_init__(self) -> None:
        for name in PER_LAYER_FIELDS:
            values = getattr(self, name)
            if values and len(values) != len(self.layers):
                raise ValueError(f"{len(values)} {name} for {len(self.layers)} layers (one per layer, or none)")
        for index, (layer, nbytes) in enumerate(zip(self.layers, self.frozen_param_bytes)):
            if not 0 <= nbytes <= layer.param_bytes:
                raise ValueError(f"frozen_param_bytes[{index}] {nbytes} is not within layer {index}'s "
                                 f"param_bytes ({layer.param_bytes}): they are the part of them that needs no gradient")
        self._check_size_times()
        self._check_shared_params()
        if self.library_bytes < 0:
            raise ValueError(f"library_bytes {self.library_bytes} is negative")

    def _check_size_times(self) -> None:
        """ValueError naming `size_times[k]` where an entry has not one time per layer, or a batch size
        below 1, repeated, or measured without a known `batch_size`."""
        if self.size_times and self.batch_size is None:
            raise ValueError("size_times without a batch_size: the other sizes' times compare with nothing")
        seen = {self.batch_size}
        for index, sized in enumerate(self.size_times):
            if sized.batch_size < 1 or sized.batch_size in seen:
                raise ValueError(f"size_times[{index}].batch_size {sized.batch_size} is "
                                 f"{'below 1' if sized.batch_size < 1 else 'measured twice'}")
            seen.add(sized.batch_size)
            for name in ("fwd_ms", "bwd_ms", "bwd_input_ms"):
                values = getattr(sized, name)
                if (values or name != "bwd_input_ms") and len(values) != len(self.layers):
                    raise ValueError(f"size_times[{index}] has {len(values)} {name} for {len(self.layers)} layers "
                                     f"(one per layer{', or none' if name == 'bwd_input_ms' else ''})")

    def _check_shared_params(self) -> None:
        """ValueError naming `shared_params[k]` where its layers are not ascending, distinct layer indices, or
        naming the layer whose shared parameters outweigh its parameter bytes: a shared parameter is counted once,
        in its first layer's `param_bytes` (and `frozen_param_bytes` where it is frozen)."""
        count = len(self.layers)
        frozen = self.frozen_param_bytes or (0,) * count
        trainable_at, frozen_at = [0] * count, [0] * count
        for index, shared in enumerate(self.shared_params):
            if not shared.layers or list(shared.layers) != sorted(set(shared.layers)) or shared.layers[0] < 0 \
                    or shared.layers[-1] >= count:
                raise ValueError(f"shared_params[{index}].layers {list(shared.layers)} are not ascending, distinct "
                                 f"layer indices in 0..{count - 1}")
            if shared.nbytes < 0:
                raise ValueError(f"shared_params[{index}].nbytes {shared.nbytes} is negative")
            (frozen_at if shared.frozen else trainable_at)[shared.layers[0]] += shared.nbytes
        for layer, name in enumerate(layer.name for layer in self.layers):
            for kind, counted, holds, field_name in (
                    ("trainable", trainable_at[layer], self.layers[layer].param_bytes - frozen[layer], "param_bytes"),
                    ("frozen", frozen_at[layer], frozen[layer], "frozen_param_bytes")):
                if counted > holds:
                    raise ValueError(f"shared_params count {counted} {kind} bytes first used by layer {layer} "
                                     f"({name}), which holds {holds}: a shared parameter is counted once, in its "
                                     f"first layer's {field_name}")

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """Every batch size the layers' times were measured at, ascending: `batch_size` and those of
        `size_times`; empty when `batch_size` is unknown."""
        if self.batch_size is None:
            return ()
        return tuple(sorted([self.batch_size, *(sized.batch_size for sized in self.size_times)]))

    @property
    def num_layers(self) -> int:
        """Number of layers."""
        return len(self.layers)

    @property
    def total_fwd_ms(self) -> float:
        """Sum of the layers' forward times, ms per mini-batch."""
        return sum(layer.fwd_ms for layer in self.layers)

    @property
    def total_bwd_ms(self) -> float:
        """Sum of the layers' backward times, ms per mini-batch."""
        return sum(layer.bwd_ms for layer in self.layers)

    @property
    def total_bwd_input_ms(self) -> float | None:
        """Sum of the layers' input-gradient times (`LayerProfile.bwd_input_ms`), ms per mini-batch;
        None unless every layer has one."""
        if any(layer.bwd_input_ms is None for layer in self.layers):
            return None
        return sum(layer.bwd_input_ms or 0.0 for layer in self.layers)

    @property
    def total_param_bytes(self) -> int:
        """Bytes of all parameters, shared ones counted once."""
        return sum(layer.param_bytes for layer in self.layers)

    @property
    def trainable_param_bytes(self) -> int:
        """Bytes of the parameters that need a gradient (`total_param_bytes` less `frozen_param_bytes`)."""
        return self.total_param_bytes - sum(self.frozen_param_bytes)

    def to_dataframe(self) -> "pd.DataFrame":
        """One row per layer in execution order, columns `LAYER_COLUMNS`."""
        rows = [dataclasses.asdict(layer) for layer in self.layers]
        import pandas as pd  # only here: reading and writing profiles needs no pandas

        return pd.DataFrame(rows, columns=list(LAYER_COLUMNS))

    def _repr_html_(self) -> str:
        """Jupyter: the layer table and summary (`html.profile_html`)."""
        from planner.display.html import profile_html  # html imports this module

        return profile_html(self)

    def to_dict(self) -> dict[str, Any]:
        """The file body (without the format header); inverse of `from_dict`. A layer's unmeasured
        `bwd_input_ms`, an unmeasured `split_backward_ratio` (None), empty `deferred_bytes` and `size_times` (and a
        size's empty `bwd_input_ms`), `library_bytes` 0, an unchecked `batch_coupling` (None), empty
        `frozen_param_bytes`, `forward_workspace_bytes`, `optimizer_step_per_call_ms`, `input_workspace_bytes`,
        `largest_param_bytes`, `input_saved_bytes`, `freed_by_b_bytes` and `weight_workspace_bytes` and a shared
        parameter's
        `frozen` False are left out, so
        that a profile without them has the same body, and the same digest (`planner.files.plan.profile_digest`),
        as when it was made before they were measured."""
        body = dataclasses.asdict(self)
        if not body["size_times"]:
            del body["size_times"]
        for sized in body.get("size_times", ()):
            if not sized["bwd_input_ms"]:
                del sized["bwd_input_ms"]
        for row in body["layers"]:
            if row["bwd_input_ms"] is None:
                del row["bwd_input_ms"]
        if body["split_backward_ratio"] is None:
            del body["split_backward_ratio"]
        if not body["deferred_bytes"]:
            del body["deferred_bytes"]
        if not body["library_bytes"]:
            del body["library_bytes"]
        if body["batch_coupling"] is None:
            del body["batch_coupling"]
        for name in ("frozen_param_bytes", "forward_workspace_bytes", "optimizer_step_per_call_ms",
                     "input_workspace_bytes", "largest_param_bytes", "input_saved_bytes", "freed_by_b_bytes",
                     "weight_workspace_bytes"):
            if not body[name]:
                del body[name]
        for shared in body["shared_params"]:
            if not shared["frozen"]:
                del shared["frozen"]
        return body

    @classmethod
    def from_dict(cls, body: dict[str, Any], source_path: str = "<dict>") -> "Profile":
        """Build a Profile from `to_dict` output; FileFormatError names `source_path` if a field is bad."""
        try:
            layers = tuple(
                LayerProfile(
                    name=str(row["name"]), kind=str(row["kind"]),
                    fwd_ms=float(row["fwd_ms"]), bwd_ms=float(row["bwd_ms"]),
                    output_bytes=int(row["output_bytes"]), cut_bytes=int(row["cut_bytes"]),
                    param_bytes=int(row["param_bytes"]), saved_bytes=int(row["saved_bytes"]),
                    bwd_input_ms=None if row.get("bwd_input_ms") is None else float(row["bwd_input_ms"]),
                )
                for row in body["layers"]
            )
            shared = tuple(
                SharedParam(
                    names=tuple(str(n) for n in p["names"]), nbytes=int(p["nbytes"]),
                    layers=tuple(int(i) for i in p["layers"]), frozen=bool(p.get("frozen", False)),
                )
                for p in body.get("shared_params", [])
            )
            size_times = tuple(_size_times_from(index, row) for index, row in enumerate(body.get("size_times", [])))
            batch_size = body["batch_size"]
            profile = cls(
                model_name=str(body["model_name"]), source=str(body["source"]), device=str(body["device"]),
                device_name=str(body["device_name"]), torch_version=str(body["torch_version"]),
                dtype=str(body["dtype"]), batch_size=None if batch_size is None else int(batch_size),
                threads=int(body["threads"]), created=str(body["created"]), layers=layers,
                step_ms=float(body["step_ms"]), peak_memory_bytes=int(body["peak_memory_bytes"]),
                peak_memory_method=str(body["peak_memory_method"]), input_bytes=int(body["input_bytes"]),
                shared_params=shared, settings=dict(body.get("settings", {})),
                optimizer_step_ms={str(name): float(ms) for name, ms in body.get("optimizer_step_ms", {}).items()},
                optimizer_scratch_bytes={str(name): int(nbytes)
                                         for name, nbytes in body.get("optimizer_scratch_bytes", {}).items()},
                grad_accumulation_ms=float(body.get("grad_accumulation_ms", 0.0)),
                workspace_bytes=tuple(int(nbytes) for nbytes in body.get("workspace_bytes", ())),
                forward_workspace_bytes=tuple(int(nbytes) for nbytes in body.get("forward_workspace_bytes", ())),
                optimizer_step_per_tensor_ms={str(name): float(ms) for name, ms
                                              in body.get("optimizer_step_per_tensor_ms", {}).items()},
                optimizer_step_per_call_ms={str(name): float(ms) for name, ms
                                            in body.get("optimizer_step_per_call_ms", {}).items()},
                param_tensors=tuple(int(count) for count in body.get("param_tensors", ())),
                frozen_param_bytes=tuple(int(nbytes) for nbytes in body.get("frozen_param_bytes", ())),
                split_backward_ratio=None if body.get("split_backward_ratio") is None
                else float(body["split_backward_ratio"]),
                deferred_bytes=tuple(int(nbytes) for nbytes in body.get("deferred_bytes", ())),
                input_workspace_bytes=tuple(int(nbytes) for nbytes in body.get("input_workspace_bytes", ())),
                largest_param_bytes=tuple(int(nbytes) for nbytes in body.get("largest_param_bytes", ())),
                input_saved_bytes=tuple(int(nbytes) for nbytes in body.get("input_saved_bytes", ())),
                freed_by_b_bytes=tuple(int(nbytes) for nbytes in body.get("freed_by_b_bytes", ())),
                weight_workspace_bytes=tuple(int(nbytes) for nbytes in body.get("weight_workspace_bytes", ())),
                size_times=size_times, library_bytes=int(body.get("library_bytes", 0)),
                batch_coupling=_batch_coupling_from(body.get("batch_coupling")),
            )
        except KeyError as exc:
            raise FileFormatError(source_path, f"profile is missing the field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise FileFormatError(source_path, f"profile has a malformed field: {exc}") from None
        return profile

    def save(self, path: str | Path) -> Path:
        """Write the profile as versioned JSON, version `PROFILE_VERSION` (atomically); returns the path."""
        return write_versioned_json(path, PROFILE_FORMAT, PROFILE_VERSION, self.to_dict())


def _size_times_from(index: int, row: Any) -> SizeTimes:
    """Entry `index` of a file's `size_times`; ValueError naming `size_times[index]` where it is malformed."""
    try:
        return SizeTimes(
            batch_size=int(row["batch_size"]), fwd_ms=tuple(float(ms) for ms in row["fwd_ms"]),
            bwd_ms=tuple(float(ms) for ms in row["bwd_ms"]),
            bwd_input_ms=tuple(float(ms) for ms in row.get("bwd_input_ms", ())),
            step_ms=float(row.get("step_ms", 0.0)),
        )
    except KeyError as exc:
        raise ValueError(f"size_times[{index}] is missing the field {exc.args[0]!r}") from None
    except (AttributeError, TypeError, ValueError) as exc:
        raise ValueError(f"size_times[{index}] is malformed: {exc}") from None


def _batch_coupling_from(entry: Any) -> BatchCoupling | None:
    """A file's `batch_coupling` (None where absent); ValueError where it is malformed."""
    if entry is None:
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("batch_norm", []), list) or not all(
            isinstance(entry.get(key), (str, type(None))) for key in ("across_samples", "unchecked")):
        raise ValueError("batch_coupling must be {'batch_norm': [names], 'across_samples': text or null, "
                         f"'unchecked': text or null}}, got {entry!r}")
    return BatchCoupling(tuple(str(name) for name in entry.get("batch_norm", [])), entry.get("across_samples"),
                         entry.get("unchecked"))


def load_profile(path: str | Path) -> Profile:
    """Read a profile file of version 1..PROFILE_VERSION; refuses other formats and newer versions
    with a FileFormatError (a PipeDream graph.txt passed as a profile: with the command that converts it)."""
    try:
        document = read_versioned_json(path, PROFILE_FORMAT, PROFILE_VERSION)
    except FileFormatError as error:
        if _is_pipedream_graph(Path(path)):
            raise FileFormatError(str(path), "a PipeDream profile (graph.txt), not a planner profile",
                                  f"convert it first: planner import-pipedream {path} --out PROFILE.json, "
                                  "then pass PROFILE.json") from None
        raise error
    return Profile.from_dict(document, source_path=str(path))


def _is_pipedream_graph(path: Path) -> bool:
    """Whether the file's first line is a PipeDream graph node ("nodeK -- ... -- forward_compute_time=...")."""
    try:
        with path.open(encoding="utf-8") as file:
            first = file.readline(4096)
    except (OSError, UnicodeDecodeError):
        return False
    return first.startswith("node") and " -- " in first and "forward_compute_time=" in first
