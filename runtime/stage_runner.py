"""One stage's forwards and backwards, microbatch by microbatch: checkpointing and weight stashing.

A `StageRunner` is what a pipeline worker (`runtime.pipeline`) or an engine rank
(`runtime.engine`) calls for the compute actions of its schedule program; it does no
communication. Microbatches are named by any hashable key. Per key it keeps what the backward
needs, between `forward(key)` and `backward(key)`:
- default: a stand-in of each of the stage's outputs (`_stand_in`: its autograd graph, not its values);
- `checkpoint`: only the stage's inputs and the random stream state the forward started from;
  the forward runs under `torch.no_grad()` and the backward runs it again with grad (same
  dropout masks), then puts batch-norm buffers back as the first forward left them;
- `split_backward` (zero-bubble schedules): `backward(key)` is B, the gradients of the received
  inputs only (`planner.profiling.backward_split.backward_inputs`), and `backward_weight(key)` is W,
  the parameters' gradients, later; between them the microbatch's graph is kept. A first stage
  (inputs that are data) has no input gradient: its B does nothing and its W the whole backward. A region the
  model checkpoints is recomputed by B and again by W: buffers B's recomputation moves (batch norm's running
  statistics; found on the first B) are put back after each W, so they move once per microbatch as in one
  backward. A reentrant checkpoint cannot be split: the first B says so (`check_splittable`).
- `stash_weights` (PipeDream's weight stashing): the forward runs on a copy of the parameters
  taken at that moment (`torch.func.functional_call`), so optimizer steps between a
  microbatch's forward and its backward do not change the weights its backward differentiates;
  the gradient is then added to the live parameters' `.grad`. The backward runs with the copy in
  the module's place too, so that layers the model checkpoints itself (recomputed inside the
  backward, `runtime.checkpointed`) recompute on the weights their forward used. Memory: one copy of
  the stage's parameters per microbatch in flight.

The last stage computes `loss_fn(output, target) * scale` (scale: the microbatch's share of the
mini-batch, so summed gradients are those of the mini-batch mean).

Which received tensors require grad: those that arrive requiring grad (the engine's messages carry the flag,
`p2p.TensorSpec`; the in-process pipeline's queues pass the tensors themselves), and `forward` returns outputs
that keep their own flag (a checkpointed stage, whose forward runs without grad, flags every floating-point
output). An output that needs no gradient, such as a Llama's rotary cos and sin tables passed from stage to
stage, so gets none downstream: when every received floating-point tensor became a leaf requiring grad, it made
every layer after it save its query and key products for that gradient, 0.79 MB a layer and microbatch on
`examples/llama.py`, 15% over the activations the profile counts.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Sequence

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module  # what torch.func.functional_call swaps weights with

from planner.profiling.backward_split import PendingWeights, backward_inputs, backward_weights, check_splittable
from planner.schedules.schedule import SPLIT_BACKWARD_SCHEDULES
from runtime.checkpointed import reentrant_checkpoints
from runtime.nested import map_tensors, tensors
from runtime.rng import RandomStream
from runtime.stages import stage_args

__all__ = ["StageRunner", "LossFn", "split_backward_refusal"]

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def split_backward_refusal(schedule: str, stages: Sequence[nn.Module], checkpoint: Sequence[bool]) -> str | None:
    """Why `schedule`, if it splits each backward into B and W, cannot run these stages (one line), else None:
    a stage the plan recomputes keeps no graph from B to W, and a layer the model checkpoints with torch's
    reentrant variant cannot have its input gradients computed apart (`torch.autograd.grad` refuses it)."""
    if schedule not in SPLIT_BACKWARD_SCHEDULES:
        return None
    if any(checkpoint):
        return (f"{schedule} keeps each microbatch's graph from its B to its W, which recomputing stages do not "
                "have: plan without recompute (no checkpoint flags), or use gpipe or 1f1b")
    for index, stage in enumerate(stages):
        reentrant = reentrant_checkpoints(stage)
        if reentrant:
            return (f"{schedule} computes a stage's input gradients apart from its weights', which torch's reentrant "
                    f"checkpoint cannot: stage {index} checkpoints {reentrant[0]} with use_reentrant=True; checkpoint "
                    "with use_reentrant=False (transformers: gradient_checkpointing_enable(gradient_checkpointing_"
                    "kwargs={'use_reentrant': False})), or use gpipe or 1f1b")
    return None


@dataclass
class _Micro:
    """What the runner keeps of one microbatch between its forward and its backward."""

    args: tuple[Any, ...] = ()  # the stage's inputs (received ones are leaves requiring grad)
    received: bool = False  # args came from the previous stage (their gradients go back to it)
    output: Any = None  # not checkpointed: the stage's outputs as `_stand_in`s (last stage: the scaled loss)
    rng: Any = None  # checkpointed: the random stream state the forward started from
    weights: dict[str, torch.Tensor] | None = None  # stash_weights: the parameters the forward used
    target: Any = None  # last stage: the microbatch's target
    scale: float = 1.0  # last stage: the microbatch's share of the mini-batch
    grads: list[Any] | None = None  # received gradients of the outputs


def _own_copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A part of the caller's batch (a microbatch's input or target) as this stage's own tensor on `device`: the copy
    `.to` makes from the host to a GPU, and on CPU the same copy, so that a CPU rank holds what a GPU rank holds (a
    microbatch's worth until its backward) and not a view keeping the whole batch's storage."""
    return tensor.to(device, copy=device.type == "cpu")


def _leaf(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A received tensor on `device`: a leaf that requires grad if it arrived requiring grad."""
    return tensor.to(device).detach().requires_grad_(tensor.requires_grad)


def _differentiable(tensor: torch.Tensor) -> bool:
    """Whether `tensor` can have a gradient: floating point or complex."""
    return tensor.is_floating_point() or tensor.is_complex()


class _StandIn(torch.autograd.Function):
    """An output's place as a backward's root, without its values: forward returns a tensor of the output's shape,
    dtype and device that is one element expanded (no storage of its own to speak of), backward passes the gradient
    on to the output's graph unchanged."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor) -> torch.Tensor:
        return torch.empty((), dtype=output.dtype, device=output.device).expand(output.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _stand_in(tensor: torch.Tensor) -> torch.Tensor:
    """What a stage keeps of an output until its backward: for one made by the stage's graph, a `_StandIn`, so
    that the output's values live only as long as its message (or a layer's saved tensors) holds them; other
    tensors (received leaves passed through, tensors that need no gradient) themselves.

    Megatron-LM frees a stage's sent outputs likewise (`deallocate_output_tensor`, by shrinking `.data` in place);
    a stand-in changes no tensor, so an output that a layer of the stage also saved, or returned under another
    name (`x.contiguous()` is x), keeps its values for that layer. torch.distributed.pipelining keeps its outputs
    whole until their backward: a microbatch's cut, e.g. 0.52 MB a microbatch on vgg's first stage (2.1 MB at
    its peak under gpipe, m = 4), that the planner's memory model never counted."""
    if tensor.grad_fn is None:
        return tensor
    return _StandIn.apply(tensor)


def _or_zeros(grad: torch.Tensor | None, leaf: torch.Tensor) -> torch.Tensor:
    """`grad`, or zeros like `leaf` if the stage did not use it (receivers expect one tensor per float input)."""
    return grad if grad is not None else torch.zeros_like(leaf)


class StageRunner:
    """Forward and backward of one stage on `device`; see the module docstring.

    `last`: the stage computes the loss; `checkpoint`: recompute the forward in the backward;
    `stash_weights`: each forward runs on its own copy of the parameters; `split_backward`: `backward`
    computes input gradients only and `backward_weight` the parameters' (not with the other two).
    Received tensors and returned outputs keep their requires_grad flag (module docstring).
    """

    def __init__(self, module: nn.Module, device: torch.device, *, last: bool, loss_fn: LossFn,
                 checkpoint: bool = False, stash_weights: bool = False, split_backward: bool = False,
                 weight_lock: contextlib.AbstractContextManager[Any] | None = None) -> None:
        if split_backward and (checkpoint or stash_weights):
            raise ValueError("split_backward runs neither with checkpoint nor with stash_weights")
        self.module, self.device, self.last, self.loss_fn = module, device, last, loss_fn
        self.checkpoint, self.stash_weights, self.split_backward = checkpoint, stash_weights, split_backward
        self._split_checked = False  # split_backward: whether a first B has looked for reentrant checkpoints
        self.stream = RandomStream(device)
        self.micro: dict[Hashable, _Micro] = {}
        self.pending: dict[Hashable, PendingWeights] = {}  # split_backward: W still to run, per microbatch
        self.recomputed_buffers: list[torch.Tensor] | None = None  # split_backward: what B's recomputations move
        self.changes_inputs: bool | None = None  # whether the module changes its arguments in place (`_call`)
        self.losses: dict[Hashable, float] = {}  # last stage: the scaled loss of each microbatch
        # held around each W: the in-process pipeline's stages sharing a parameter (a tied embedding) in two threads
        self.weight_lock = weight_lock or contextlib.nullcontext()

    def reset(self, seed: int | None = None) -> None:
        """Forget every microbatch and loss; the random stream starts again from `seed` (if given)."""
        self.micro.clear()
        self.pending.clear()
        self.losses.clear()
        if seed is not None:
            self.stream.reseed(seed)

    def receive(self, key: Hashable, args: tuple[Any, ...]) -> None:
        """Arguments of microbatch `key` from the previous stage: they become leaves on this device."""
        self.micro[key] = _Micro(args=map_tensors(lambda t: _leaf(t, self.device), args), received=True)

    def receive_grads(self, key: Hashable, grads: list[Any]) -> None:
        """Gradients of microbatch `key`'s outputs (in `tensors` order; None for outputs without one)."""
        self.micro[key].grads = [None if g is None else g.to(self.device) for g in grads]

    def forward(self, key: Hashable, inputs: tuple[Any, ...] | None = None, target: Any = None,
                scale: float = 1.0) -> tuple[Any, ...] | None:
        """Run the stage on microbatch `key` (`inputs`: the model's arguments, first stage only).

        Returns the next stage's arguments, detached (None on the last stage, which keeps the loss): each a leaf
        that requires grad where the output does (checkpointed: where it is floating point)."""
        state = self.micro.get(key)
        if state is None:
            state = self.micro[key] = _Micro(args=map_tensors(lambda t: _own_copy(t, self.device), inputs))
        state.target, state.scale = target, scale
        if self.stash_weights:
            state.weights = {name: parameter.detach().clone().requires_grad_(parameter.requires_grad)
                             for name, parameter in self.module.named_parameters()}
        if self.checkpoint:  # a first stage's inputs too must come out unchanged: the recomputation reads them
            with torch.no_grad():
                output, state.rng = self.stream.run(lambda: self._call(state, fresh=True))
        else:
            output, _ = self.stream.run(lambda: self._call(state, fresh=state.received))
        if self.last:
            if not self.checkpoint:  # checkpointed: the loss is computed after the recomputation
                state.output = self._loss(state, output)
                self.losses[key] = float(state.output.detach())
            return None
        output = stage_args(self.module, output)
        sent = map_tensors(lambda t: t.detach().requires_grad_(_differentiable(t) if self.checkpoint
                                                                else t.requires_grad), output)
        state.output = None if self.checkpoint else map_tensors(_stand_in, output)
        return sent

    def backward(self, key: Hashable) -> list[torch.Tensor | None] | None:
        """Backpropagate microbatch `key` and forget it; its parameters' gradients add to their `.grad`.

        Returns the gradients of the received arguments (in `tensors` order; zeros for floating
        point arguments the stage did not use, None for the others), or None if the arguments
        were the model's inputs.
        """
        state = self.micro.pop(key)
        buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        if self.checkpoint:
            # the recomputation must not update buffers twice (batch norm's running statistics):
            # they are put back after the backward (autograd may have saved them, so not before)
            buffers = _snapshot(self.module.buffers())
            with torch.enable_grad():
                output, _ = self.stream.run(lambda: self._call(state, fresh=True), replay=state.rng)
                output = self._loss(state, output) if self.last else stage_args(self.module, output)
            if self.last:
                self.losses[key] = float(output.detach())
        else:
            output, state.output = state.output, None
        roots, grads = self._roots(state, output)
        if self.split_backward:
            return self._backward_inputs(key, state, roots, grads)
        if roots:
            with self._weights_in_place(state):
                torch.autograd.backward(roots, grads)
        del output, roots
        _put_back(buffers)
        if state.weights is not None:
            self._add_stashed_grads(state.weights)
        if not state.received:
            return None
        return [_or_zeros(leaf.grad, leaf) if leaf.requires_grad else None for leaf in tensors(state.args)]

    def backward_weight(self, key: Hashable) -> None:
        """W of microbatch `key` (split_backward): its parameters' gradients add to their `.grad`; forgets it.
        Buffers that B's recomputation of a checkpointed region updated (batch norm's running statistics) are
        put back as W found them: W recomputes the region again, and eager mode recomputes it once."""
        saved = _snapshot(self.recomputed_buffers or ())
        with self.weight_lock:
            backward_weights(self.pending.pop(key))
        _put_back(saved)

    def _roots(self, state: _Micro, output: Any) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Where a backward starts, with the gradients it starts from: the loss (last stage; None: ones),
        else each output that requires grad and got a gradient back."""
        if self.last:
            return [output], [None]
        pairs = [(tensor, grad) for tensor, grad in zip(tensors(output), state.grads or [])
                 if grad is not None and tensor.requires_grad]
        return [tensor for tensor, _ in pairs], [grad for _, grad in pairs]

    def _backward_inputs(self, key: Hashable, state: _Micro, roots: list[torch.Tensor],
                         grads: list[torch.Tensor | None]) -> list[torch.Tensor | None] | None:
        """B of a split backward: the received inputs' gradients (as `backward` returns them), W kept for later."""
        if not state.received and not self._split_checked:  # (backward_inputs itself checks the stages it splits)
            check_splittable(roots)  # a first stage's W is one backward, which a reentrant checkpoint refuses too
            self._split_checked = True
        leaves = [leaf for leaf in tensors(state.args) if leaf.requires_grad] if state.received else []
        before = None if self.recomputed_buffers is not None else _snapshot(self.module.buffers())  # which move?
        found, self.pending[key] = backward_inputs(roots, grads, leaves,
                                                   [p for p in self.module.parameters() if p.requires_grad])
        if before is not None:  # (batch norm moves its statistics in kernels that leave no version count)
            self.recomputed_buffers = [buffer for buffer, value in before if not torch.equal(buffer, value)]
        if not state.received:
            return None
        by_leaf = {id(leaf): grad for leaf, grad in zip(leaves, found)}
        return [None if not leaf.requires_grad else _or_zeros(by_leaf[id(leaf)], leaf) for leaf in tensors(state.args)]

    def _call(self, state: _Micro, fresh: bool) -> Any:
        """The stage on the microbatch's arguments, on its stashed weights if any. `fresh`: the arguments must
        come out unchanged (received leaves, or inputs a recomputation reads again), so a stage that changes
        them in place runs on clones of them; whether it does is found on the first such call (version
        counters, `_first_call`), and later calls with grad run on the arguments themselves unless it did: no
        second copy of every received tensor, as torch's pipelining keeps none. A checkpointed stage's forward
        without grad always runs on clones (they are not saved, so they cost no memory past the call): a change
        made there could not be seen by autograd and would feed the recomputation changed inputs. Changes that
        move no version counter (writes through `.data`) are not seen, as autograd does not see them."""
        grad = torch.is_grad_enabled()
        if not fresh or (grad and self.changes_inputs is False):
            return self._apply(state, state.args)
        if grad and self.changes_inputs is None:
            return self._first_call(state)
        clones = map_tensors(torch.Tensor.clone, state.args)
        versions = [tensor._version for tensor in tensors(clones)]
        output = self._apply(state, clones)
        if self.changes_inputs is None:
            self.changes_inputs = [tensor._version for tensor in tensors(clones)] != versions
        return output

    def _first_call(self, state: _Micro) -> Any:
        """`_call`'s first call with grad on arguments that must come out unchanged: on the arguments themselves,
        so that the first microbatch holds no more than the later ones. Autograd refuses an in-place change of
        a received leaf that requires grad before making it: the buffers and the random stream are then put
        back as they were and the call runs on clones. A change it allows (a received tensor without grad) is
        seen on the version counters, and later calls run on clones."""
        args = list(tensors(state.args))
        versions = [tensor._version for tensor in args]
        buffers = _snapshot(self.module.buffers())
        generator = self.stream.generator
        random = None if generator is None else generator.get_state()
        try:
            output = self._apply(state, state.args)
        except RuntimeError as exc:
            if "leaf Variable that requires grad" not in str(exc):
                raise
            _put_back(buffers)
            if generator is not None:
                generator.set_state(random)
            self.changes_inputs = True
            return self._call(state, fresh=True)
        self.changes_inputs = [tensor._version for tensor in args] != versions
        return output

    def _apply(self, state: _Micro, args: tuple[Any, ...]) -> Any:
        """The stage's module on `args`, on the microbatch's stashed weights if it has them."""
        if state.weights is None:
            return self.module(*args)
        return torch.func.functional_call(self.module, state.weights, args)

    def _weights_in_place(self, state: _Micro) -> contextlib.AbstractContextManager[Any]:
        """For the block, the module's parameters are the microbatch's stashed copy, if it has one."""
        if state.weights is None:
            return contextlib.nullcontext()
        return _reparametrize_module(self.module, state.weights, tie_weights=True)  # as functional_call does

    def _loss(self, state: _Micro, output: Any) -> torch.Tensor:
        target = map_tensors(lambda t: _own_copy(t, self.device), state.target)
        return self.loss_fn(output, target) * state.scale

    def _add_stashed_grads(self, weights: dict[str, torch.Tensor]) -> None:
        """Add the gradients of a forward's stashed weights to the live parameters' `.grad`."""
        with torch.no_grad():
            for name, parameter in self.module.named_parameters():
                grad = weights[name].grad
                if grad is None:
                    continue
                if parameter.grad is None:
                    parameter.grad = grad
                else:
                    parameter.grad.add_(grad)


def _snapshot(buffers: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each buffer with a copy of its value now (`_put_back` restores them)."""
    return [(buffer, buffer.detach().clone()) for buffer in buffers]


def _put_back(snapshot: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Give each buffer of a `_snapshot` the value it had then."""
    with torch.no_grad():
        for buffer, saved in snapshot:
            buffer.copy_(saved)
