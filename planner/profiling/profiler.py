"""Profiles a model file on one device: layers, per-layer times, bytes and memory -> Profile."""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
from torch import nn

from planner.profiling.attention_masks import masks_without_padding
from planner.profiling.batch_coupling import find_batch_coupling
from planner.profiling.companions import companions
from planner.profiling.conditions import (busy_cores_between, cpu_reading, current_conditions, default_cpu_processes,
                                          default_cpu_threads, keep_freed_memory)
from planner.profiling.optimizer_step import time_grad_accumulation, time_optimizer_steps
from planner.profiling.dataflow import Dataflow, measure_dataflow
from planner.profiling.devices import device_name, resolve_device, resolve_dtype
from planner.errors import ModelFileError, PlannerError, ProfileError
from planner.profiling.layers import Layer, NoLayersError, find_layers
from planner.profiling.backward_split import ReentrantCheckpointError
from planner.profiling.deferred_memory import SplitMemory, measure_split_memory
from planner.profiling.memory import library_bytes, measure_peak_memory, measure_workspace
from planner.profiling.model_file import (
    ModelFile,
    build_checked_model,
    checked_example_batch,
    default_loss,
)
from planner.files.profile import LayerProfile, Profile, SharedParam, SizeTimes
from planner.profiling.tensors import tensor_nbytes
from planner.profiling.timing import (
    INPUT_GRADIENT_ITERS,
    StepTimes,
    clock_for,
    time_input_gradients,
    time_layers,
    time_split_backward,
)

Progress = Callable[[str, int, int], None]
T = TypeVar("T")
NAMED_WITHOUT_GRADIENT = 3  # parameters without a gradient a profile names (`_Step.no_gradient`)


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """`--batch-size` as given, "8" or a comma list "1,2,4,8", as distinct sizes ascending; ProfileError naming
    the offending value for anything but whole numbers of at least 1, each once."""
    items = [item.strip() for item in str(text).split(",")]
    sizes: list[int] = []
    for item in items:
        try:
            size = int(item)
        except ValueError:
            raise ProfileError(f"--batch-size takes whole numbers of samples separated by commas (e.g. 8 or "
                               f"1,2,4,8), got {item!r} in {text!r}") from None
        if size < 1:
            raise ProfileError(f"--batch-size must be at least 1, got {size}" + (f" in {text!r}" if len(items) > 1 else ""))
        if size in sizes:
            raise ProfileError(f"--batch-size lists {size} twice in {text!r}; give each size once")
        sizes.append(size)
    return tuple(sorted(sizes))


def smaller_batch_sizes(batch_size: int) -> tuple[int, ...]:
    """The sizes `planner profile` also times the layers at when given one batch size B: B // 4, B // 16, ... and 1,
    ascending (8: 1, 2; 32: 1, 2, 8; 1: none). A plan that cuts a global batch into microbatches smaller than B reads
    their times interpolated between measured sizes (`planner.costs.layer_arrays.interpolate_ms`) instead of B's
    scaled down, which is optimistic: on the gpt example on CPU, B = 8 scaled to 2 and 1 samples read 0.80 and 0.55
    of the measured times; measured at 1 and 8, 2 and 4 interpolate to 1.08 and 0.98 of theirs."""
    sizes = {1} if batch_size > 1 else set()
    size = batch_size // 4
    while size >= 1:
        sizes.add(size)
        size //= 4
    return tuple(sorted(sizes))


@dataclass(frozen=True)
class ProfileSettings:
    """What to measure and how: batch size, device, dtype, repetitions, threads and layer choice.

    `batch_size` is the size everything is measured at; `other_batch_sizes` are sizes at which the layers'
    times are measured too (`Profile.size_times`; `planner profile --batch-size 1,2,4,8` makes the largest
    `batch_size` and the others these).
    `threads` None: on CPU, `conditions.default_cpu_threads()` (cores / 2: what `planner train`
    gives each of two processes on this machine); on CUDA, torch's current setting.
    `processes`: on CPU, how many processes compute at once while the layers are timed, this one and
    `processes - 1` companions training the model beside it (`planner.profiling.companions`), as that
    many training processes will; None: `conditions.default_cpu_processes` (2 where the cores hold
    them: `planner profile`'s default). A GPU profile takes 1 (each training process has its own GPU)."""

    batch_size: int = 8
    other_batch_sizes: tuple[int, ...] = ()
    device: str = "auto"
    dtype: str = "float32"
    warmup: int = 3
    iters: int = 10
    min_seconds: float = 0.0  # timing runs more than `iters` steps if they take less (`timing.time_layers`)
    threads: int | None = None
    processes: int | None = 1
    depth: int | None = None
    split_points: tuple[str, ...] = ()

    def check(self) -> None:
        """Raise ProfileError for values that cannot work."""
        if self.batch_size < 1:
            raise ProfileError(f"--batch-size must be at least 1, got {self.batch_size}")
        for size in self.other_batch_sizes:
            if size < 1 or size == self.batch_size or self.other_batch_sizes.count(size) > 1:
                raise ProfileError(f"--batch-size: the other batch sizes {list(self.other_batch_sizes)} must be at "
                                   f"least 1, each once and none the main size {self.batch_size}; got {size}")
        if self.iters < 1:
            raise ProfileError(f"--iters must be at least 1, got {self.iters}")
        if not self.min_seconds >= 0:
            raise ProfileError(f"--min-seconds must be 0 or more, got {self.min_seconds}")
        if self.warmup < 0:
            raise ProfileError(f"--warmup must be 0 or more, got {self.warmup}")
        if self.threads is not None and self.threads < 1:
            raise ProfileError(f"--threads must be at least 1, got {self.threads}")
        if self.processes is not None and self.processes < 1:
            raise ProfileError(f"--processes must be at least 1, got {self.processes}")
        if self.processes is not None and self.processes > 1 and self.device != "auto" and \
                not self.device.startswith("cpu"):  # refused before the model file is imported
            raise _one_process_per_gpu(self.processes, self.device)
        if self.depth is not None and self.depth < 1:
            raise ProfileError(f"--depth must be at least 1, got {self.depth}")


class _Step:
    """One training step of the user's model on its example batch: forward and loss."""

    def __init__(self, model_file: ModelFile, model: nn.Module, inputs: tuple[torch.Tensor, ...],
                 target: torch.Tensor) -> None:
        self.model_file = model_file
        self.model = model
        self.inputs = inputs
        self.target = target
        self.loss_fn = model_file.loss_fn or default_loss
        self.with_grad: set[int] = set()  # ids of the parameters a backward gave a gradient, seen at `zero_grad`

    def forward(self) -> Any:
        """The model on the example inputs."""
        return self.model(*self.inputs)

    def loss(self) -> torch.Tensor:
        """Forward and loss: what one instrumented step runs before backward."""
        return self.loss_fn(self.forward(), self.target)

    def zero_grad(self) -> None:
        """Drop the gradients (set to None), as between training steps; note first which parameters had one."""
        self.with_grad.update(id(p) for p in self.model.parameters() if p.grad is not None)
        self.model.zero_grad(set_to_none=True)

    def no_gradient(self) -> dict[str, Any] | None:
        """The trainable parameters no backward of the profile gave a gradient (seen at each `zero_grad`): their
        tensor count, bytes and first names; None where every one had one. They are planned as training all the
        same (`_attribute_params`); this says the example batch did not reach them."""
        missed = [(name, p) for name, p in self.model.named_parameters()
                  if p.requires_grad and id(p) not in self.with_grad]
        if not missed:
            return None
        return {"tensors": len(missed), "bytes": sum(tensor_nbytes(p) for _, p in missed),
                "names": [name for name, _ in missed[:NAMED_WITHOUT_GRADIENT]]}

    def check(self) -> None:
        """Run forward, loss and backward once; a failure becomes a ModelFileError with the model's message."""
        path = self.model_file.path
        try:
            output = self.forward()
        except (Exception, SystemExit) as exc:
            raise ModelFileError(path, f"the model raised {type(exc).__name__} in forward: {exc}",
                                 "fix the model or example_batch()") from exc
        try:
            loss = self.loss_fn(output, self.target)
        except (Exception, SystemExit) as exc:
            source = "loss_fn" if self.model_file.loss_fn else "the default loss"
            raise ModelFileError(path, f"{source} raised {type(exc).__name__}: {exc}",
                                 "define loss_fn(output, target) that returns a scalar tensor") from exc
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ModelFileError(path, f"the loss is not a scalar tensor (got {_shape_of(loss)})",
                                 "make loss_fn return a scalar tensor")
        if not loss.requires_grad:
            raise ModelFileError(path, "the loss does not depend on any trainable parameter",
                                 "check that the model's output comes from its parameters")
        try:
            loss.backward()
        except (Exception, SystemExit) as exc:
            raise ModelFileError(path, f"the model raised {type(exc).__name__} in backward: {exc}",
                                 "fix the model's backward") from exc
        self.zero_grad()


def _shape_of(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _to_device(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Move to `device`; floating-point tensors also take `dtype`."""
    if tensor.is_floating_point():
        return tensor.to(device=device, dtype=dtype)
    return tensor.to(device=device)


def training_step(model_file: ModelFile, model: nn.Module, size: int, device: torch.device, dtype: torch.dtype) -> _Step:
    """A training step of `model` on `example_batch(size)`, moved to `device` (floating point to `dtype`)."""
    raw_inputs, raw_target = checked_example_batch(model_file, size)
    inputs = tuple(_to_device(t, device, dtype) for t in raw_inputs)
    return _Step(model_file, model, inputs, _to_device(raw_target, device, dtype))


def profile_model(model_file: ModelFile, settings: ProfileSettings, progress: Progress | None = None) -> Profile:
    """Measure every layer of the model in `model_file` as `settings` say; see `Profile` for fields.

    `progress(phase, done, total)` is called as work advances (phases: "check", "layers",
    "dataflow", "memory", "timing", "timing input gradients", "timing the split backward", and for each
    of `settings.other_batch_sizes` "timing at batch size N", "timing input gradients at batch size N").
    """
    settings.check()
    device = resolve_device(settings.device)
    if device.type == "cpu":  # as `planner profile` and `planner train` run (a process of the API's own otherwise)
        keep_freed_memory()
    dtype = resolve_dtype(settings.dtype)
    report = progress or (lambda phase, done, total: None)
    previous_threads = torch.get_num_threads()
    threads = settings.threads if settings.threads is not None or device.type != "cpu" else default_cpu_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    processes = _processes(settings.processes, device, torch.get_num_threads())
    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            return _measure(model_file, settings, device, dtype, report, processes)
    finally:
        torch.set_num_threads(previous_threads)


def _processes(asked: int | None, device: torch.device, threads: int) -> int:
    """The processes computing at once while timing (`ProfileSettings.processes`); ProfileError for more than one
    on a GPU."""
    if device.type != "cpu":
        if asked is not None and asked > 1:
            raise _one_process_per_gpu(asked, str(device))
        return 1
    return asked if asked is not None else default_cpu_processes(threads)


def _one_process_per_gpu(asked: int, device: str) -> ProfileError:
    """The error for `--processes` above 1 on a GPU."""
    return ProfileError(f"--processes {asked} applies to CPU profiles only: on {device} each training process has "
                        "a GPU of its own; leave --processes out")


def _phase(model_file: ModelFile, phase: str, action: Callable[[], T]) -> T:
    """Run one measuring phase; an error from the model's code becomes a one-line ModelFileError."""
    try:
        return action()
    except PlannerError:
        raise
    except (Exception, SystemExit) as exc:
        raise ModelFileError(
            model_file.path, f"the model raised {type(exc).__name__} while the profiler was {phase}: {exc}",
            "the model ran once without instrumentation; rerun with --debug to see where it failed",
        ) from exc


def _measure(
    model_file: ModelFile, settings: ProfileSettings, device: torch.device, dtype: torch.dtype, report: Progress,
    processes: int,
) -> Profile:
    """The measuring phases of `profile_model`, with the device and threads already set: the model is checked,
    then `processes - 1` companions start (`planner.profiling.companions`) and the rest runs beside them."""
    report("check", 0, 1)
    model = build_checked_model(model_file).to(device=device, dtype=dtype)
    model.train()
    step = training_step(model_file, model, settings.batch_size, device, dtype)
    step.check()
    report("check", 1, 1)
    with companions(model_file.path, processes - 1, settings.batch_size, torch.get_num_threads(),
                    settings.dtype) as companions_ready:
        return _measure_checked(model_file, settings, device, dtype, report, processes, companions_ready, model, step)


def _measure_checked(
    model_file: ModelFile, settings: ProfileSettings, device: torch.device, dtype: torch.dtype, report: Progress,
    processes: int, companions_ready: Callable[[], None], model: nn.Module, step: _Step,
) -> Profile:
    """`_measure` once the model ran a step: layers, bytes and memory, then (once the companions have started)
    the timings."""
    inputs = step.inputs
    split_points = list(settings.split_points) or None
    try:
        layers = _phase(model_file, "finding layers",
                        lambda: find_layers(model, step.forward, settings.depth, split_points))
    except NoLayersError as exc:
        raise ModelFileError(model_file.path, str(exc),
                             "build it of submodules that its forward calls (the layers a plan splits between), "
                             "e.g. an nn.Sequential") from None
    report("layers", 1, 1)
    dataflow = _phase(model_file, "tracing tensors", lambda: measure_dataflow(model, layers, inputs, step.loss))
    coupling = _phase(model_file, "running halves of the batch",
                      lambda: find_batch_coupling(model, inputs, step.target, step.loss_fn))
    report("dataflow", 1, 1)
    peak_bytes, peak_method = _phase(
        model_file, "measuring memory",
        lambda: measure_peak_memory(model, (*inputs, step.target), step.loss, device),
    )
    step.zero_grad()
    library = library_bytes(model, (*inputs, step.target), device)
    workspace, forward_workspace = _phase(model_file, "measuring each layer's working memory",
                                          lambda: measure_workspace(model, layers, (*inputs, step.target), step.loss))
    step.zero_grad()
    report("memory", 1, 1)
    if processes > 1:
        report(f"starting {processes - 1} process{'es' if processes > 2 else ''} to train beside the profile", 0, 1)
        companions_ready()
    start = cpu_reading() if device.type == "cpu" else None  # what other processes use while it times (a CPU profile)
    times, bwd_input_ms = _time_layers(model_file, step, layers, settings, device, report)
    input_iters = min(settings.iters, INPUT_GRADIENT_ITERS)
    # B + W against a plain backward (zero-bubble schedules' extra cost): as many pairs, or a quarter of --min-seconds
    try:
        split_backward_ratio: float | None = _phase(model_file, "timing the split backward", lambda: time_split_backward(
            layers, step.loss, step.zero_grad, clock_for(device), model.parameters(), input_iters,
            progress=lambda done, total: report("timing the split backward", done, total),
            min_seconds=settings.min_seconds / 4,
        ))
        split_memory: SplitMemory | None = _phase(model_file, "measuring what a split backward holds",
                                                  lambda: measure_split_memory(model, layers, (*inputs, step.target),
                                                                               step.loss, step.zero_grad,
                                                                               model.parameters()))
    except ReentrantCheckpointError:  # no zero-bubble schedule can train it: their costs stay unmeasured (None)
        step.zero_grad()
        split_backward_ratio, split_memory = None, None
    accumulate_ms = _phase(model_file, "timing gradient accumulation", lambda: time_grad_accumulation(
        model, lambda: step.loss().backward(), clock_for(device), settings.iters))
    step.zero_grad()
    # each timed step follows a whole training step: as few as the input gradients' pairs, or a quarter of
    # --min-seconds per optimizer (at --iters 12, 24 steps had taken a third of the gpt example's profile)
    optimizer_ms, optimizer_scratch, per_tensor_ms, per_call_ms = _phase(model_file, "timing the optimizer step", lambda: time_optimizer_steps(
        model, lambda: step.loss().backward(), clock_for(device), input_iters, device,
        min_seconds=settings.min_seconds / 4))
    step.zero_grad()
    end = cpu_reading() if start is not None else None  # (the conditions of the main size's times)
    size_times, not_timed = _sizes_times(model_file, model, layers, settings, device, dtype, report)
    threads = torch.get_num_threads()
    conditions = current_conditions(threads, processes if device.type == "cpu" else None)
    if start is not None and end is not None:
        own, others = busy_cores_between(start, end)
        conditions |= {"own_busy_cores": round(own, 2), "others_busy_cores": round(others, 2)}
    param_bytes, param_tensors, frozen, largest, shared = _attribute_params(model, layers, dataflow)
    missed = step.no_gradient()
    unpadded = masks_without_padding(model, inputs)
    workspace = _without_pending_tied_gradients(workspace, shared)
    layer_profiles = tuple(
        LayerProfile(
            name=layer.name, kind=layer.kind, fwd_ms=times.fwd_ms[i], bwd_ms=times.bwd_ms[i],
            output_bytes=dataflow.output_bytes[i], cut_bytes=dataflow.cut_bytes[i],
            param_bytes=param_bytes[i], saved_bytes=dataflow.saved_bytes[i], bwd_input_ms=bwd_input_ms[i],
        )
        for i, layer in enumerate(layers)
    )
    return Profile(
        model_name=model_file.name, source=model_file.path, device=str(device),
        device_name=device_name(device), torch_version=torch.__version__, dtype=settings.dtype,
        batch_size=settings.batch_size, threads=threads,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        layers=layer_profiles, step_ms=times.step_ms, peak_memory_bytes=peak_bytes,
        peak_memory_method=peak_method, input_bytes=sum(tensor_nbytes(t) for t in inputs),
        shared_params=shared,
        settings={
            "warmup": settings.warmup, "iters": settings.iters, "min_seconds": settings.min_seconds,
            "depth": settings.depth,
            "split_points": list(settings.split_points), "loss": "loss_fn" if model_file.loss_fn else "default",
            "instrumented_ratio": times.instrumented_ratio, "forward_share": times.forward_share,
            "instrumented_forward_share": times.instrumented_forward_share,
            "conditions": conditions,
            **({} if missed is None else {"no_gradient": missed}),
            **({"masks_without_padding": list(unpadded)} if unpadded else {}),
            **({"batch_sizes_not_timed": not_timed} if not_timed else {}),
        },
        optimizer_step_ms=optimizer_ms, optimizer_scratch_bytes=optimizer_scratch, grad_accumulation_ms=accumulate_ms,
        workspace_bytes=tuple(workspace), forward_workspace_bytes=tuple(forward_workspace),
        optimizer_step_per_tensor_ms=per_tensor_ms, optimizer_step_per_call_ms=per_call_ms,
        param_tensors=tuple(param_tensors), frozen_param_bytes=tuple(frozen) if any(frozen) else (),
        split_backward_ratio=split_backward_ratio,
        deferred_bytes=tuple(split_memory.deferred_bytes) if split_memory else (),
        input_workspace_bytes=tuple(split_memory.input_workspace_bytes) if split_memory else (),
        freed_by_b_bytes=tuple(split_memory.freed_by_b_bytes) if split_memory else (),
        weight_workspace_bytes=tuple(split_memory.weight_workspace_bytes) if split_memory else (),
        largest_param_bytes=tuple(largest), input_saved_bytes=tuple(dataflow.input_saved_bytes),
        size_times=size_times, library_bytes=library, batch_coupling=coupling,
    )


def _time_layers(
    model_file: ModelFile, step: _Step, layers: list[Layer], settings: ProfileSettings, device: torch.device,
    report: Progress, at: str = "",
) -> tuple[StepTimes, list[float]]:
    """Each layer's forward and backward ms (`timing.time_layers`) and input-gradient ms
    (`timing.time_input_gradients`) per mini-batch of `step`'s batch; `at` ends the phase names
    (" at batch size N" for `ProfileSettings.other_batch_sizes`)."""
    times = _phase(model_file, f"timing layers{at}", lambda: time_layers(
        layers, step.loss, step.zero_grad, clock_for(device), settings.warmup, settings.iters,
        progress=lambda done, total: report(f"timing{at}", done, total), min_seconds=settings.min_seconds,
    ))
    # a few pairs of steps, more for fast models (a quarter of --min-seconds): ~10-20% more profiling time
    bwd_input_ms = _phase(model_file, f"timing input gradients{at}", lambda: time_input_gradients(
        layers, step.loss, step.zero_grad, clock_for(device), step.model.parameters(), times.bwd_ms,
        min(settings.iters, INPUT_GRADIENT_ITERS),
        progress=lambda done, total: report(f"timing input gradients{at}", done, total),
        min_seconds=settings.min_seconds / 4,
    ))
    return times, bwd_input_ms


def _sizes_times(
    model_file: ModelFile, model: nn.Module, layers: list[Layer], settings: ProfileSettings, device: torch.device,
    dtype: torch.dtype, report: Progress,
) -> tuple[tuple[SizeTimes, ...], dict[str, str]]:
    """The layers' times at each of `settings.other_batch_sizes`, and for each size the model could not run at (a
    batch norm over one sample, an example_batch that needs more) what it raised, by size: that size is left out,
    as the minutes already measured would be lost, and plans read the nearest measured sizes instead."""
    measured: list[SizeTimes] = []
    failed: dict[str, str] = {}
    for size in sorted(settings.other_batch_sizes):
        try:
            measured.append(_size_times(model_file, model, layers, size, settings, device, dtype, report))
        except ModelFileError as exc:
            model.zero_grad(set_to_none=True)
            failed[str(size)] = (exc.problem.splitlines() or [""])[0]  # a note of one line
    return tuple(measured), failed


def _size_times(
    model_file: ModelFile, model: nn.Module, layers: list[Layer], size: int, settings: ProfileSettings,
    device: torch.device, dtype: torch.dtype, report: Progress,
) -> SizeTimes:
    """The layers' times on a batch of `size` samples (`example_batch(size)`), measured as at the main size."""
    step = training_step(model_file, model, size, device, dtype)
    times, bwd_input_ms = _time_layers(model_file, step, layers, settings, device, report, f" at batch size {size}")
    step.zero_grad()
    return SizeTimes(batch_size=size, fwd_ms=tuple(times.fwd_ms), bwd_ms=tuple(times.bwd_ms),
                     bwd_input_ms=tuple(bwd_input_ms), step_ms=times.step_ms)


def _without_pending_tied_gradients(workspace: list[int], shared: tuple[SharedParam, ...]) -> list[int]:
    """`workspace` less, at the layers from a shared parameter's first user up to (not including) its
    last, its bytes: in the whole model autograd holds the later users' gradient of a tied weight
    until the first user's backward adds its own, while in a pipeline each stage holding the weight
    has its own copy and gradient (counted as weights'). A frozen one has no gradient to hold."""
    found = list(workspace)
    for parameter in shared:
        if parameter.frozen:
            continue
        first, last = min(parameter.layers), max(parameter.layers)
        for layer in range(first, last):
            found[layer] = max(found[layer] - parameter.nbytes, 0)
    return found


def _attribute_params(
    model: nn.Module, layers: list[Layer], dataflow: Dataflow
) -> tuple[list[int], list[int], list[int], list[int], tuple[SharedParam, ...]]:
    """Parameter bytes, tensors that need a gradient, and bytes that need none, per layer (each parameter at the
    first layer using it), the largest parameter each layer uses that needs a gradient (a shared one at every
    layer using it), and the shared ones.

    A parameter the forward never used goes to the layer whose module holds it (or layer 0), and is planned as
    training (gradient and optimizer state) if it requires a gradient: the example batch need not reach every
    parameter that real data reaches (a mixture of experts routes it to some experts only), and planning a stage
    short of memory costs more than planning it a few unused parameters' state too many.
    """
    names_of: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(parameter), []).append(name)
        tensors[id(parameter)] = parameter
    param_bytes, param_tensors, frozen = [0] * len(layers), [0] * len(layers), [0] * len(layers)
    largest = [0] * len(layers)
    shared: list[SharedParam] = []
    for key, names in names_of.items():
        used_by: set[int] = set()
        for name in names:
            used_by.update(dataflow.param_layers.get(name, []))
        owners = {i for i, layer in enumerate(layers) for name in names if name.startswith(layer.name + ".")}
        holders = sorted(used_by or owners or {0})
        nbytes = tensor_nbytes(tensors[key])
        trains = tensors[key].requires_grad
        param_bytes[holders[0]] += nbytes
        param_tensors[holders[0]] += int(trains)
        frozen[holders[0]] += 0 if trains else nbytes
        for holder in holders if trains else ():
            largest[holder] = max(largest[holder], nbytes)
        if len(names) > 1 or len(holders) > 1:
            shared.append(SharedParam(names=tuple(names), nbytes=nbytes, layers=tuple(holders), frozen=not trains))
    return param_bytes, param_tensors, frozen, largest, tuple(shared)
