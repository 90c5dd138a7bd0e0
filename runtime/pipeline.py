"""In-process pipeline: one worker thread per stage walks its rank program of a gpipe, 1f1b or zb-h1 schedule.

`Pipeline(stages, devices, schedule, microbatches, checkpoint, loss_fn)` runs the stages of one
model (`runtime.stages.build_stages` / `split_model`) on `devices`, one worker thread per stage.
`train_step(inputs, target)` splits the mini-batch into `microbatches` chunks along dim 0 and
leaves in every parameter's `.grad` the gradient of the mean loss over the whole mini-batch
(each microbatch's loss is scaled by its share of the batch), as one forward and backward on the
whole batch would; the caller's optimizer then steps (the schedule's `step` action). It returns
the loss as a float.

Design:
- the order of work is the schedule's, as data: worker s walks `build_schedule(schedule, [1] * S,
  microbatches).programs[s].actions` (`planner.schedules.schedule`): receive, forward, send activation,
  receive gradient, backward, send gradient; `allreduce` and `step` are no-ops here;
- each worker has an inbox (`queue.Queue`) of steps and answers on the pipeline's reply queue;
  between workers, each step has one activation queue and one gradient queue per stage
  (sends never block, receives wait); the sender puts detached tensors, flagged requires_grad where
  the stage's outputs were, the receiver moves them to its device (`.to(device)`) and makes them leaves
  that require grad where they arrive flagged (`runtime.stage_runner`);
- a worker's exception comes back as a value on the reply queue; the caller then puts an abort
  marker on every queue of the step (so blocked receives end), waits for every worker, shuts the
  workers down and raises `PipelineError` naming the stage and microbatch, chained to the
  original. A pipeline that failed is closed: make a new one to go on;
- compute: each worker calls its stage's `runtime.stage_runner.StageRunner` (shared with the
  distributed engine), which does the activation checkpointing (`checkpoint[s]`: the forward
  keeps only the stage's input and is recomputed in the backward) and the random streams:
  each stage draws from its own stream (`runtime.rng`), seeded at every step from the global
  generator (so `torch.manual_seed` makes a pipeline reproducible), and a recomputed forward
  replays its stream, so dropout masks match.
"""

from __future__ import annotations

import queue
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from planner.errors import PlannerError
from planner.profiling.model_file import default_loss
from planner.schedules.schedule import (
    CHUNKED_SCHEDULES, RECV_ACTIVATION, SEND_ACTIVATION, SPLIT_BACKWARD_SCHEDULES, Action, RankProgram, build_schedule,
)
from runtime.export_split import ShapeGuard
from runtime.interpreter import UnknownActionError, run_program
from runtime.nested import split_minibatch
from runtime.stage_runner import LossFn, StageRunner, split_backward_refusal
from runtime.stages import StageSplitError, Stages, build_stages

__all__ = ["Pipeline", "PipelineError", "IN_PROCESS_SCHEDULES"]

IN_PROCESS_SCHEDULES = ("gpipe", "1f1b", "zb-h1")

_STOP = object()  # in a worker's inbox: exit the thread
_ABORT = object()  # in a step's queue: another stage failed, stop waiting


class PipelineError(PlannerError):
    """A pipeline cannot be built or a stage failed; `stage` and `microbatch` say where (None if unknown)."""

    def __init__(self, message: str, stage: int | None = None, microbatch: int | None = None) -> None:
        self.stage, self.microbatch = stage, microbatch
        super().__init__(message)


class _Aborted(Exception):
    """Raised in a worker whose receive found the abort marker."""


@dataclass
class _Step:
    """One train_step as every worker sees it: microbatch inputs, targets and the queues between stages."""

    inputs: list[tuple[Any, ...]]  # stage 0's arguments, per microbatch
    targets: list[Any]  # the last stage's targets, per microbatch
    scales: list[float]  # microbatch share of the mini-batch
    seed: int  # stage s's random stream starts from seed + s
    activations: list[queue.Queue]  # activations[s]: (microbatch, args) sent to stage s by stage s - 1
    gradients: list[queue.Queue]  # gradients[s]: (microbatch, grads) sent to stage s by stage s + 1


# --- workers -------------------------------------------------------------------------------------


class _Worker:
    """The thread of one stage: walks its program for every step put in its inbox."""

    def __init__(self, index: int, runner: StageRunner, program: RankProgram, replies: queue.Queue) -> None:
        self.index, self.runner, self.program, self.replies = index, runner, program, replies
        self.inbox: queue.Queue = queue.Queue()
        self.microbatch: int | None = None
        self._step: _Step | None = None  # the step being run, and messages that came before their turn
        self._early: dict[tuple[int, int], Any] = {}
        self.thread = threading.Thread(target=self._loop, name=f"pipeline-stage-{index}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            step = self.inbox.get()
            if step is _STOP:
                return
            self.microbatch = None
            try:
                losses = self._run(step)
            except _Aborted:
                self.replies.put(("aborted", self.index, None, None))
            except BaseException as exc:  # every failure goes back to the caller, which re-raises it
                self.replies.put(("error", self.index, exc, self.microbatch))
            else:
                self.replies.put(("done", self.index, losses, None))
            finally:
                self.runner.reset()  # drop what a failed step left
            del step

    def _run(self, step: _Step) -> dict[int, float]:
        """One step's actions in program order (`run_program`, this worker the transport); returns the last
        stage's loss per microbatch."""
        self.runner.reset(step.seed + self.index)
        self._step, self._early = step, {}
        try:
            run_program(self.program.actions, self.runner, self, step.inputs, step.targets, step.scales,
                        before=self._enter)
        except UnknownActionError as exc:
            raise PipelineError(str(exc), self.index, self.microbatch) from None
        finally:
            self._step, self._early = None, {}
        self.microbatch = None
        return {mb: loss for (_, mb), loss in self.runner.losses.items()}

    def _enter(self, action: Action) -> None:
        """Note the microbatch an action works on, for the error a failure becomes."""
        self.microbatch = action.microbatch if action.microbatch >= 0 else None

    # the Transport of run_program: queues between neighbouring stages' threads

    def receive(self, action: Action) -> Any:
        """The activation or gradients for the action's microbatch; others that came first are kept for later."""
        inbound = (self._step.activations if action.op == RECV_ACTIVATION else self._step.gradients)[self.index]
        key = (id(inbound), action.microbatch)
        while key not in self._early:
            message = inbound.get()
            if message is _ABORT:
                raise _Aborted()
            self._early[(id(inbound), message[0])] = message[1]
        return self._early.pop(key)

    def send(self, action: Action, value: Any) -> None:
        """Put the value on the neighbour's queue: the next stage's activations or the previous one's gradients."""
        if action.op == SEND_ACTIVATION:
            self._step.activations[self.index + 1].put((action.microbatch, value))
        else:
            self._step.gradients[self.index - 1].put((action.microbatch, value))

    def all_reduce(self, action: Action) -> None:
        """One replica per stage: nothing to reduce."""

    def step(self, action: Action) -> None:
        """The caller's optimizer steps."""


# --- the pipeline --------------------------------------------------------------------------------


def _stop_workers(workers: list[_Worker]) -> None:
    """Ask every worker to exit, then join them (also run when a pipeline is garbage collected)."""
    for worker in workers:
        worker.inbox.put(_STOP)
    for worker in workers:
        if worker.thread is not threading.current_thread():
            worker.thread.join()


def _device(device: torch.device | str) -> torch.device:
    """`device` as a torch.device; "cpu:0" is "cpu" (one CPU generator, one memory), "cuda" the current GPU."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _check_schedule(name: str) -> None:
    """PipelineError unless `name` is a schedule the in-process pipeline runs."""
    if name == "pipedream":
        raise PipelineError(
            "the pipedream schedule (no flush, weight stashing, an optimizer step after every backward) "
            "needs the distributed engine; the in-process pipeline runs gpipe, 1f1b or zb-h1")
    if name in CHUNKED_SCHEDULES:
        raise PipelineError(f"{name} runs several stages per device, and the in-process pipeline one: train the "
                            "plan with `planner train` (runtime.Engine), or re-plan with --schedule 1f1b")
    if name not in IN_PROCESS_SCHEDULES:
        raise PipelineError(f"unknown schedule {name!r}; the in-process pipeline runs "
                            f"{' or '.join(IN_PROCESS_SCHEDULES)}")


class Pipeline:
    """Trains `stages` as one pipeline in this process: one worker thread per stage; see the module docstring.

    `stages`: the model's stages in order (one replica each); `devices`: one per stage (default:
    all "cpu"; several stages may share a device); `schedule`: "gpipe", "1f1b" or "zb-h1" (with a flush);
    `microbatches` per `train_step`; `checkpoint`: per stage (or one bool for all), recompute its
    forward during the backward instead of keeping its activations; `loss_fn(output, target)`:
    a mean over the batch (default `planner.profiling.model_file.default_loss`).

    Not thread-safe: one `train_step` at a time. Use as a context manager or call `close()`.
    """

    def __init__(self, stages: Sequence[nn.Module], devices: Sequence[torch.device | str] | None = None,
                 schedule: str = "1f1b", microbatches: int = 4,
                 checkpoint: bool | Sequence[bool] | None = None, loss_fn: LossFn | None = None) -> None:
        count = len(stages)
        if count < 1:
            raise PipelineError("a pipeline needs at least one stage")
        _check_schedule(schedule)
        if not isinstance(microbatches, int) or microbatches < 1:
            raise PipelineError(f"microbatches must be a positive integer, got {microbatches!r}")
        devices = ["cpu"] * count if devices is None else list(devices)
        if len(devices) != count:
            raise PipelineError(f"{count} stages need {count} devices (one per stage), got {len(devices)}")
        if checkpoint is None or isinstance(checkpoint, bool):
            checkpoint = [bool(checkpoint)] * count
        checkpoint = [bool(flag) for flag in checkpoint]
        if len(checkpoint) != count:
            raise PipelineError(f"checkpoint needs one flag per stage ({count}), got {len(checkpoint)}")
        self.stages = stages
        self.devices = [_device(device) for device in devices]
        self.schedule = build_schedule(schedule, [1] * count, microbatches)
        self.microbatches = microbatches
        self.checkpoint = tuple(checkpoint)
        self.loss_fn: LossFn = loss_fn or default_loss
        refused = split_backward_refusal(schedule, stages, checkpoint)
        if refused is not None:
            raise PipelineError(refused)
        self._check_shared_devices()
        for stage, device in zip(stages, self.devices):
            stage.to(device)
        self._replies: queue.Queue = queue.Queue()
        programs = {program.stage: program for program in self.schedule.programs}
        # every runner first: one that cannot be built leaves no thread of an earlier stage running
        # the W's of stages sharing a parameter run one at a time (each adds into its .grad from its own thread)
        tied = {index for parameter in (self.stages.shared if isinstance(self.stages, Stages) else ())
                for index in parameter.stages}
        weights = threading.Lock()
        runners = [StageRunner(stage, device, last=index == count - 1, loss_fn=self.loss_fn, checkpoint=checkpoint[index],
                               split_backward=schedule in SPLIT_BACKWARD_SCHEDULES,
                               weight_lock=weights if index in tied else None)
                   for index, (stage, device) in enumerate(zip(stages, self.devices))]
        self._input_guard = ShapeGuard.of(stages[0])  # exported stages run at one shape: checked before a step
        self._workers = [_Worker(index, runner, programs[index], self._replies) for index, runner in enumerate(runners)]
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)

    @classmethod
    def from_plan(cls, model: nn.Module, plan: Any, devices: Sequence[torch.device | str] | None = None,
                  microbatches: int | None = None, loss_fn: LossFn | None = None,
                  example_inputs: Any = None) -> "Pipeline":
        """A pipeline of `plan`'s stages of `model` with the plan's schedule, microbatches and recompute flags.

        `example_inputs`: one microbatch of the model's inputs, for models torch.fx cannot trace
        (`runtime.stages.build_stages`).
        """
        replicated = [index for index, stage in enumerate(plan.stages) if stage.replicas > 1]
        if replicated:
            first = replicated[0]
            raise PipelineError(
                f"stage {first} of the plan has {plan.stages[first].replicas} replicas: the in-process pipeline "
                "runs one replica per stage; replicated stages need the distributed engine", stage=first)
        _check_schedule(plan.schedule)
        count = microbatches or plan.microbatches or 1
        return cls(build_stages(model, plan, example_inputs), devices, plan.schedule, count,
                   [stage.recompute for stage in plan.stages], loss_fn)

    def _check_shared_devices(self) -> None:
        """A tied parameter lives on one device: every stage using it must be on that device."""
        shared = self.stages.shared if isinstance(self.stages, Stages) else ()
        for parameter in shared:
            places = {self.devices[index] for index in parameter.stages}
            if len(places) > 1:
                raise PipelineError(
                    f"tied parameter {parameter.names[0]} is used by stages {list(parameter.stages)} on different "
                    f"devices ({', '.join(map(str, sorted(places, key=str)))}); in one process they must share a "
                    "device (the distributed engine sums the copies' gradients instead)")

    @property
    def closed(self) -> bool:
        """True once `close()` ran or a step failed."""
        return self._closed

    def train_step(self, inputs: Any, target: Any) -> float:
        """Forward and backward of the mini-batch through the pipeline; returns the loss (mean over the batch).

        Every parameter's `.grad` gets (added to it) the gradient of that loss, as `loss.backward()`
        on the whole batch would give. Raises PipelineError if a stage fails (the pipeline is closed then).
        """
        if self._closed:
            raise PipelineError("the pipeline is closed; make a new one")
        try:
            chunks, targets, scales = split_minibatch(inputs, target, self.microbatches)
            if self._input_guard is not None:
                self._input_guard.check_microbatches(chunks)
        except (ValueError, StageSplitError) as exc:
            raise PipelineError(str(exc)) from None
        count = len(self._workers)
        step = _Step(chunks, targets, scales, int(torch.randint(0, 2**62, (1,)).item()),
                     [queue.Queue() for _ in range(count)], [queue.Queue() for _ in range(count)])
        for worker in self._workers:
            worker.inbox.put(step)
        losses: dict[int, float] = {}
        failure: tuple[int, int | None, BaseException] | None = None
        waiting = set(range(count))
        try:
            while waiting:
                kind, index, payload, microbatch = self._replies.get()
                waiting.discard(index)
                if kind == "done":
                    losses.update(payload)
                elif kind == "error" and failure is None:
                    failure = (index, microbatch, payload)
                    self._abort(step)
        finally:
            if waiting:  # interrupted while waiting (KeyboardInterrupt): stop every worker
                self._abort(step)
                self.close()
        if failure is not None:
            index, microbatch, exc = failure
            self.close()
            where = f"stage {index}" + (f", microbatch {microbatch}" if microbatch is not None else "")
            raise PipelineError(f"{where} failed: {type(exc).__name__}: {exc}", index, microbatch) from exc
        return float(sum(losses[mb] for mb in sorted(losses)))

    @staticmethod
    def _abort(step: _Step) -> None:
        """Wake every worker waiting on one of the step's queues."""
        for inbound in (*step.activations, *step.gradients):
            inbound.put(_ABORT)

    def close(self) -> None:
        """Stop and join every worker thread (idempotent)."""
        if not self._closed:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
