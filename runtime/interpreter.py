"""One rank's schedule program walked action by action: the one interpreter behind `runtime.pipeline` (a thread
per stage, queues between them) and `runtime.engine` (a process per rank, torch.distributed), which differ only in
their `Transport`.

A rank runs one stage, or several under a chunked schedule (interleaved-1f1b): each action goes to the
`StageRunner` of its `stage`. Microbatches are keyed (iteration, microbatch) in a runner (one runner per
stage); values computed and not sent yet are keyed (stage, iteration, microbatch), as a rank may hold the
output of one of its stages and the input gradient of another for the same microbatch. The first stage's
forward takes `inputs[microbatch]`, the last stage's loss `targets[microbatch]` scaled by `scales[microbatch]`.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Mapping, Protocol, Sequence

from planner.schedules.schedule import (
    ALLREDUCE, BACKWARD, FORWARD, RECV_ACTIVATION, RECV_GRADIENT, SENDS, STEP, WEIGHT, Action,
)
from runtime.stage_runner import StageRunner

__all__ = ["Transport", "UnknownActionError", "run_program"]


class UnknownActionError(ValueError):
    """A program holds an action no runtime knows (a schedule built by hand, not by `build_schedule`)."""


class Transport(Protocol):
    """Where a stage's messages and collectives go."""

    def receive(self, action: Action) -> Any:
        """The activation (RECV_ACTIVATION) or the output gradients (RECV_GRADIENT) the action names."""

    def send(self, action: Action, value: Any) -> None:
        """Send an activation (SEND_ACTIVATION) or input gradients (SEND_GRADIENT, None where there is none)."""

    def all_reduce(self, action: Action) -> None:
        """The replicas' gradient all-reduce (ALLREDUCE)."""

    def step(self, action: Action) -> None:
        """The end of an iteration on this stage (STEP): tied weights, the optimizer."""


def run_program(actions: Sequence[Action], runner: StageRunner | Mapping[int, StageRunner], transport: Transport,
                inputs: Sequence[Any], targets: Sequence[Any], scales: Sequence[float],
                before: Callable[[Action], None] = lambda action: None,
                after: Callable[[Action], None] = lambda action: None) -> None:
    """Carry out `actions` in order, messages and collectives through `transport`, compute on `runner`: one
    runner for every action, or a mapping stage -> runner (a rank of several stages).

    `before(action)` and `after(action)` run around each action (the engine times them and names
    the microbatch a failure happened in). UnknownActionError for an op no runtime knows.
    """
    outgoing: dict[Hashable, Any] = {}  # outputs or input gradients computed, not sent yet
    for action in actions:
        mb, key = action.microbatch, (action.iteration, action.microbatch)
        sending = (action.stage, *key)
        before(action)
        compute = runner[action.stage] if isinstance(runner, Mapping) else runner
        if action.op == RECV_ACTIVATION:
            compute.receive(key, transport.receive(action))
        elif action.op == FORWARD:
            output = compute.forward(key, inputs[mb], targets[mb], scales[mb])
            if output is not None:
                outgoing[sending] = output
        elif action.op in SENDS:
            transport.send(action, outgoing.pop(sending))
        elif action.op == RECV_GRADIENT:
            compute.receive_grads(key, transport.receive(action))
        elif action.op == BACKWARD:
            grads = compute.backward(key)
            if grads is not None:
                outgoing[sending] = grads
        elif action.op == WEIGHT:
            compute.backward_weight(key)
        elif action.op == ALLREDUCE:
            transport.all_reduce(action)
        elif action.op == STEP:
            transport.step(action)
        else:
            raise UnknownActionError(f"unknown action {action.op!r} in the program of stage {action.stage}")
        after(action)
