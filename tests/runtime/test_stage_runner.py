"""StageRunner: a stage's forwards and backwards give plain autograd's gradients, with checkpointing and
weight stashing, for first, middle and last stages."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import fx, nn
from torch.nn import functional as F

from runtime.nested import map_tensors
from runtime.pipeline import Pipeline, PipelineError
from runtime.stage_runner import StageRunner, split_backward_refusal
from runtime.stages import split_model
from tests.checkpointed_blocks import CheckpointedBlocks
from tests.conftest import gpu_only

CPU = torch.device("cpu")


def mse(output: Any, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def mlp(dropout: float = 0.0) -> nn.Sequential:
    """A small seeded MLP whose weight gradients depend on the weights (tanh between two layers)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(4, 6), nn.Tanh()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(6, 3))
    return nn.Sequential(*layers)


def make_runner(module: nn.Module, *, last: bool = False, checkpoint: bool = False, stash: bool = False,
                seed: int = 0) -> StageRunner:
    runner = StageRunner(module, CPU, last=last, loss_fn=mse, checkpoint=checkpoint, stash_weights=stash)
    runner.reset(seed)
    return runner


def grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: None if p.grad is None else p.grad.clone() for name, p in module.named_parameters()}


def assert_grads_close(expected: dict[str, torch.Tensor | None], found: dict[str, torch.Tensor | None]) -> None:
    assert expected.keys() == found.keys()
    for name, grad in expected.items():
        assert (grad is None) == (found[name] is None), name
        if grad is not None:
            torch.testing.assert_close(found[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def batch(rows: int = 5, width: int = 4, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=generator)


def leaf(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone().requires_grad_(True)


def as_sent(args: Any) -> Any:
    """Arguments as a previous stage sends them: its floating-point outputs, made with grad, require grad."""
    return map_tensors(lambda tensor: tensor.detach().requires_grad_(tensor.is_floating_point()), args)


class Double(nn.Module):
    """Doubles its input in place (a stage must not change the tensors it keeps for the backward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2)


class ThreeInputs(nn.Module):
    """Uses a float input, ignores another, and uses an integer input (nested in a dict)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 3)
        self.embedding = nn.Embedding(10, 3)

    def forward(self, x: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.linear(x) + self.embedding(extra["index"])


class TwoOutputs(nn.Module):
    """Returns a float activation and an integer tensor passed through."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = torch.tanh(self.linear(x))
        return hidden, hidden * 3, index


class Tied(nn.Module):
    """One nn.Parameter used by two layers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def perturb(module: nn.Module) -> None:
    """Change the parameters in place, as an optimizer step would."""
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.mul_(1.5).add_(0.1)


# --- plain stages ------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpoint", [False, True])
def test_first_stage_gives_the_module_output_and_plain_parameter_gradients(checkpoint: bool) -> None:
    module, reference = mlp(), mlp()
    x, grad = batch(), batch(5, 3, seed=2)
    runner = make_runner(module, checkpoint=checkpoint)
    sent = runner.forward(0, (x,))
    expected = reference(x)
    assert isinstance(sent, tuple) and len(sent) == 1
    torch.testing.assert_close(sent[0], expected.detach())
    assert sent[0].is_leaf and sent[0].requires_grad  # detached from this stage's graph; its gradient is wanted back
    expected.backward(grad)
    runner.receive_grads(0, [grad])
    assert runner.backward(0) is None
    assert_grads_close(grads(reference), grads(module))


@pytest.mark.parametrize("checkpoint", [False, True])
def test_middle_stage_gives_plain_parameter_and_input_gradients(checkpoint: bool) -> None:
    module, reference = mlp(), mlp()
    x, grad = batch(), batch(5, 3, seed=2)
    runner = make_runner(module, checkpoint=checkpoint)
    runner.receive(0, as_sent((x,)))
    sent = runner.forward(0)
    x_ref = leaf(x)
    expected = reference(x_ref)
    torch.testing.assert_close(sent[0], expected.detach())
    expected.backward(grad)
    runner.receive_grads(0, [grad])
    input_grads = runner.backward(0)
    assert isinstance(input_grads, list) and len(input_grads) == 1
    torch.testing.assert_close(input_grads[0], x_ref.grad)
    assert_grads_close(grads(reference), grads(module))
    assert not x.requires_grad and x.grad is None  # the received tensor itself is left alone


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_last_stage_loss_is_loss_fn_times_scale_and_its_gradients_are_plain(checkpoint: bool, scale: float) -> None:
    module, reference = mlp(), mlp()
    x, target = batch(), batch(5, 3, seed=3)
    runner = make_runner(module, last=True, checkpoint=checkpoint)
    runner.receive(7, as_sent((x,)))
    assert runner.forward(7, target=target, scale=scale) is None
    x_ref = leaf(x)
    expected = mse(reference(x_ref), target) * scale
    input_grads = runner.backward(7)
    expected.backward()
    assert runner.losses[7] == pytest.approx(expected.item(), rel=1e-6)
    torch.testing.assert_close(input_grads[0], x_ref.grad)
    assert_grads_close(grads(reference), grads(module))


def test_last_stage_records_its_loss_at_the_forward_without_checkpointing() -> None:
    module, reference = mlp(), mlp()
    x, target = batch(), batch(5, 3, seed=3)
    runner = make_runner(module, last=True)
    runner.receive("a", as_sent((x,)))
    runner.forward("a", target=target, scale=0.5)
    assert runner.losses["a"] == pytest.approx(mse(reference(x), target).item() * 0.5, rel=1e-6)


@pytest.mark.parametrize("checkpoint", [False, True])
def test_single_stage_first_and_last_gives_plain_gradients_and_no_input_gradients(checkpoint: bool) -> None:
    module, reference = mlp(), mlp()
    x, target = batch(), batch(5, 3, seed=3)
    runner = make_runner(module, last=True, checkpoint=checkpoint)
    assert runner.forward(0, (x,), target, 0.5) is None
    assert runner.backward(0) is None
    (mse(reference(x), target) * 0.5).backward()
    assert_grads_close(grads(reference), grads(module))


def test_microbatches_in_flight_accumulate_their_gradients() -> None:
    module, reference = mlp(), mlp()
    xs = [batch(seed=s) for s in (1, 2, 3)]
    targets = [batch(5, 3, seed=s) for s in (4, 5, 6)]
    runner = make_runner(module, last=True)
    for key, x in enumerate(xs):
        runner.receive(key, as_sent((x,)))
        runner.forward(key, target=targets[key], scale=1 / 3)
    returned = {key: runner.backward(key) for key in (2, 0, 1)}
    for key, (x, target) in enumerate(zip(xs, targets)):
        x_ref = leaf(x)
        (mse(reference(x_ref), target) / 3).backward()
        torch.testing.assert_close(returned[key][0], x_ref.grad)
    assert_grads_close(grads(reference), grads(module))
    assert sorted(runner.losses) == [0, 1, 2]


class Reused(nn.Module):
    """A stage returning y = first(x), a view-free alias of it (`contiguous` returns y itself), and second(y): the
    second linear map saves y for its weight's gradient, so a stage that shrank y's values after the forward (as
    Megatron-LM's `deallocate_output_tensor` does) would give that gradient from the wrong values."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = self.first(x)
        return y, y.contiguous(), self.second(y)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu_only)])
def test_a_stage_keeps_stand_ins_of_its_outputs_and_their_values_live_only_as_long_as_their_messages(
        device: str) -> None:
    """Until its backward a microbatch keeps a one-element stand-in per output its graph made (the outputs' values
    belong to the messages sent): once the message of a linear stage's output is dropped, its storage is freed
    (Linear saves its input, not its output), and the backward still gives plain autograd's gradients. On a GPU
    the caching allocator's count of allocated bytes drops by the output's bytes too."""
    from torch.multiprocessing.reductions import StorageWeakRef

    module, reference = nn.Sequential(nn.Linear(4, 4096)), nn.Sequential(nn.Linear(4, 4096))
    reference.load_state_dict(module.state_dict())
    module.to(device)
    runner = StageRunner(module, torch.device(device), last=False, loss_fn=mse)
    runner.reset(0)
    inputs = [batch(seed=s).to(device) for s in (1, 2, 3)]
    freed, allocator_freed = [], []
    for key, x in enumerate(inputs):
        (sent,) = runner.forward(key, (x,))
        values = StorageWeakRef(sent.untyped_storage())
        before = torch.cuda.memory_allocated() if device == "cuda" else 0
        del sent  # as once sent
        freed.append(values.expired())
        if device == "cuda":
            allocator_freed.append(before - torch.cuda.memory_allocated())
    assert freed == [True, True, True]
    if device == "cuda":
        assert allocator_freed == [5 * 4096 * 4] * 3  # 80 KiB a microbatch, a multiple of the allocator's 512 B
    kept = [runner.micro[key].output[0] for key in range(3)]
    assert all(tuple(tensor.shape) == (5, 4096) and tensor.untyped_storage().nbytes() == 4 for tensor in kept)
    for key, x in enumerate(inputs):
        gradient = batch(5, 4096, seed=20 + key)
        runner.receive_grads(key, [gradient.to(device)])
        runner.backward(key)
        reference(x.cpu()).backward(gradient)
    assert_grads_close(grads(reference), {name: None if grad is None else grad.cpu()
                                          for name, grad in grads(module).items()})


def test_outputs_a_layer_also_saved_or_returned_twice_keep_their_values_for_it() -> None:
    """The Reused stage, 2 microbatches in flight with received inputs and gradients for all three outputs: the input
    and weight gradients of plain autograd."""
    module, reference = Reused(), Reused()
    runner = make_runner(module)
    xs = [batch(seed=s) for s in (1, 2)]
    grads_back = [[batch(5, 4, seed=10 * s + k) for k in range(3)] for s in (1, 2)]
    for key, x in enumerate(xs):
        runner.receive(key, as_sent((x,)))
        runner.forward(key)
    for key in (1, 0):
        runner.receive_grads(key, grads_back[key])
    returned = {key: runner.backward(key) for key in (1, 0)}
    for key, x in enumerate(xs):
        x_ref = leaf(x)
        torch.autograd.backward(list(reference(x_ref)), grads_back[key])
        torch.testing.assert_close(returned[key][0], x_ref.grad)
    assert_grads_close(grads(reference), grads(module))


@pytest.mark.parametrize("checkpoint", [False, True])
def test_middle_stage_may_modify_its_received_input_in_place(checkpoint: bool) -> None:
    """Every microbatch, not only the first (which finds out that the stage changes its inputs), runs on clones."""
    module, reference = nn.Sequential(Double(), mlp()), nn.Sequential(Double(), mlp())
    xs, grad = [batch(seed=s) for s in (1, 3, 5)], batch(5, 3, seed=2)
    kept = [x.clone() for x in xs]
    runner = make_runner(module, checkpoint=checkpoint)
    input_grads = []
    for key, x in enumerate(xs):
        runner.receive(key, as_sent((x,)))
        runner.forward(key)
        runner.receive_grads(key, [grad])
        input_grads.append(runner.backward(key))
    assert runner.changes_inputs is True
    for x, before, found in zip(xs, kept, input_grads):
        x_ref = leaf(x)
        reference(x_ref.clone()).backward(grad)
        assert torch.equal(x, before)
        torch.testing.assert_close(found[0], x_ref.grad)
    assert_grads_close(grads(reference), grads(module))


@pytest.mark.parametrize("checkpoint", [False, True])
def test_a_stage_that_leaves_its_inputs_alone_saves_the_received_tensor_itself(checkpoint: bool) -> None:
    """Every microbatch runs on the received leaf, the first too (its version counter shows that the stage changes
    nothing in place), so the stage's first Linear saves the leaf's storage and holds no copy of it (with
    checkpointing, the recomputations do)."""
    module, reference = mlp(), mlp()
    xs, grad = [batch(seed=s) for s in (1, 3)], batch(5, 3, seed=2)
    runner = make_runner(module, checkpoint=checkpoint)
    saved_pointers: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved_pointers.append(tensor.untyped_storage().data_ptr())
        return tensor

    input_grads = []
    for key, x in enumerate(xs):
        runner.receive(key, as_sent((x,)))
        received = runner.micro[key].args[0]
        saved_pointers.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            runner.forward(key)
            runner.receive_grads(key, [grad])
            input_grads.append(runner.backward(key))
        assert received.untyped_storage().data_ptr() in saved_pointers, key
    assert runner.changes_inputs is False
    for x, found in zip(xs, input_grads):
        x_ref = leaf(x)
        reference(x_ref).backward(grad)
        torch.testing.assert_close(found[0], x_ref.grad)
    assert_grads_close(grads(reference), grads(module))


def test_a_first_stage_on_cpu_runs_on_its_own_copy_of_a_microbatch_as_on_a_gpu() -> None:
    """A first stage's microbatch is a view of the caller's batch; the runner keeps a copy of it (what `.to` makes on
    a GPU), so that what it holds until the backward is a microbatch's worth, not the whole batch's storage; the last
    stage's target likewise. The batch is left as it was, and the gradients are those of the microbatch."""
    whole, targets = batch(8), batch(8, 3, seed=2)
    x, target = whole[4:], targets[4:]  # the second of two microbatches
    first, last = make_runner(mlp()), make_runner(mlp(), last=True)
    first.forward(0, (x,))
    kept = first.micro[0].args[0]
    assert kept.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()
    assert kept.untyped_storage().nbytes() == x.nbytes and torch.equal(kept, x)
    copies: list[int] = []

    def loss_fn(output: torch.Tensor, goal: torch.Tensor) -> torch.Tensor:
        copies.append(goal.untyped_storage().data_ptr())
        return mse(output, goal)

    last.loss_fn = loss_fn
    last.receive(0, as_sent((batch(4, 4, seed=5),)))
    last.forward(0, target=target)
    assert copies and copies[0] != targets.untyped_storage().data_ptr()


class NormsDropsThenDoubles(nn.Module):
    """Moves batch norm's statistics and draws a dropout mask, then doubles its input in place."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm, self.drop, self.linear = nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.norm(x + 1))
        x.mul_(2)
        return self.linear(h + x)


def test_a_first_microbatch_refused_an_in_place_change_runs_again_on_clones_from_the_same_state() -> None:
    """The first microbatch runs on the received leaf until autograd refuses the in-place change: batch norm's
    statistics and the random stream are put back, and it runs on clones, giving what a runner that cloned from
    the start gives (outputs, dropout masks, gradients, statistics), as do the later microbatches."""
    module, reference = NormsDropsThenDoubles(), NormsDropsThenDoubles()
    runner, cloning = make_runner(module), make_runner(reference)
    cloning.changes_inputs = True
    xs, grad = [batch(seed=s) for s in (1, 3)], batch(5, 3, seed=2)
    for key, x in enumerate(xs):
        found = []
        for each in (runner, cloning):
            each.receive(key, as_sent((x.clone().requires_grad_(),)))
            sent = each.forward(key)
            each.receive_grads(key, [grad])
            found.append((sent, each.backward(key)))
        (sent, input_grads), (expected, expected_grads) = found
        assert torch.equal(sent[0], expected[0]) and torch.equal(input_grads[0], expected_grads[0]), key
    assert runner.changes_inputs is True
    assert_grads_close(grads(reference), grads(module))
    assert torch.equal(module.norm.running_mean, reference.norm.running_mean)
    assert int(module.norm.num_batches_tracked) == 2


def test_checkpointed_first_stage_recomputes_on_unchanged_inputs() -> None:
    """A first stage that changes its input in place still gets plain gradients when recomputed, in every
    microbatch, and leaves the batch as it was."""
    module, reference = nn.Sequential(Double(), mlp()), nn.Sequential(Double(), mlp())
    xs, grad = [batch(seed=s) for s in (1, 3, 5)], batch(5, 3, seed=2)
    kept = [x.clone() for x in xs]
    runner = make_runner(module, checkpoint=True)
    for key, x in enumerate(xs):
        sent = runner.forward(key, (x,))
        runner.receive_grads(key, [grad])
        runner.backward(key)
        expected = reference(x.clone())
        expected.backward(grad)
        torch.testing.assert_close(sent[0], expected.detach())
        assert torch.equal(x, kept[key])
    assert runner.changes_inputs is True
    assert_grads_close(grads(reference), grads(module))


@pytest.mark.parametrize("checkpoint", [False, True])
def test_backward_returns_zeros_for_unused_float_inputs_and_none_for_integer_inputs(checkpoint: bool) -> None:
    module, reference = ThreeInputs(), ThreeInputs()
    x, unused, index = batch(), batch(5, 2, seed=4), torch.tensor([1, 4, 4, 0, 9])
    grad = batch(5, 3, seed=2)
    runner = make_runner(module, checkpoint=checkpoint)
    runner.receive(0, as_sent((x, {"unused": unused, "index": index})))
    runner.forward(0)
    runner.receive_grads(0, [grad])
    input_grads = runner.backward(0)
    x_ref = leaf(x)
    reference(x_ref, {"unused": unused, "index": index}).backward(grad)
    assert len(input_grads) == 3  # in `tensors` order: x, unused, index
    torch.testing.assert_close(input_grads[0], x_ref.grad)
    assert torch.equal(input_grads[1], torch.zeros(5, 2))
    assert input_grads[2] is None
    assert_grads_close(grads(reference), grads(module))


@pytest.mark.parametrize("checkpoint", [False, True])
def test_outputs_without_a_received_gradient_are_not_backpropagated(checkpoint: bool) -> None:
    module, reference = TwoOutputs(), TwoOutputs()
    x, index = batch(), torch.arange(5)
    grad = batch(5, 4, seed=2)
    runner = make_runner(module, checkpoint=checkpoint)
    runner.receive(0, as_sent((x, index)))
    sent = runner.forward(0)
    hidden, tripled, passed = sent[0]  # a plain module's tuple result is one argument of the next stage
    torch.testing.assert_close(tripled, hidden * 3)
    assert torch.equal(passed, index) and passed.dtype == torch.int64
    runner.receive_grads(0, [None, grad, None])
    input_grads = runner.backward(0)
    x_ref = leaf(x)
    reference(x_ref, index)[1].backward(grad)
    torch.testing.assert_close(input_grads[0], x_ref.grad)
    assert input_grads[1] is None
    assert_grads_close(grads(reference), grads(module))


def test_traced_stage_output_tuple_is_the_next_stage_arguments() -> None:
    traced = fx.symbolic_trace(TwoOutputs())
    runner = make_runner(traced)
    index = torch.arange(5)
    sent = runner.forward(0, (batch(), index))
    assert isinstance(sent, tuple) and len(sent) == 3
    assert torch.equal(sent[2], index)
    torch.testing.assert_close(sent[1], sent[0] * 3)


class WithTable(nn.Module):
    """A first stage that also returns a table computed without grad (as a Llama's rotary cos and sin)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            table = torch.cos(x)
        return self.linear(x), table


class ScaledByTable(nn.Module):
    """The next stage: a linear map of the hidden state times the table, and the table passed on."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.linear = nn.Linear(4, 4)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, table = pair
        return self.linear(hidden) * table, table


def saved_bytes(module: nn.Module, run: Any) -> int:
    """Bytes of the distinct storages autograd saves while `run()` runs, `module`'s parameters left out."""
    parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
    found: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            found[storage.data_ptr()] = storage.nbytes()
        return tensor.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(found.values())


def test_a_received_tensor_sent_without_grad_gets_no_gradient() -> None:
    """A table the first stage computes without grad (as a Llama's rotary cos and sin) arrives not requiring grad: the
    next stage saves nothing for its gradient and returns none; the hidden state's gradient and the weights' are
    autograd's."""
    first = StageRunner(WithTable(), CPU, last=False, loss_fn=mse)
    module, reference = ScaledByTable(), ScaledByTable()
    second = StageRunner(module, CPU, last=False, loss_fn=mse)
    x, grad = batch(), batch(5, 4, seed=2)
    (sent,) = first.forward(0, (x,))  # a plain module's tuple result is one argument of the next stage
    hidden, table = sent
    assert hidden.requires_grad and hidden.is_leaf and not table.requires_grad
    second.receive(0, (sent,))
    # 5 x 4 float32 = 80 bytes a tensor: the linear map saves its input (the received hidden state's clone) and the
    # product saves the table; the linear map's output would be saved too (80 more) were the table requiring grad
    assert saved_bytes(module, lambda: second.forward(0)) == 80 + 80
    second.receive_grads(0, [grad, None])
    input_grads = second.backward(0)
    hidden_ref = leaf(hidden.detach())
    reference((hidden_ref, table))[0].backward(grad)
    torch.testing.assert_close(input_grads[0], hidden_ref.grad)
    assert input_grads[1] is None
    assert_grads_close(grads(reference), grads(module))


def test_a_checkpointed_runner_flags_every_float_output() -> None:
    runner = StageRunner(TwoOutputs(), CPU, last=False, loss_fn=mse, checkpoint=True)
    (hidden, tripled, index), = runner.forward(0, (batch(), torch.arange(5)))  # its forward ran without grad
    assert hidden.requires_grad and tripled.requires_grad and not index.requires_grad


# --- checkpointing in training mode ----------------------------------------------------------------


def run_two_microbatches(module: nn.Module, checkpoint: bool, kind: str, seed: int = 5) -> dict[str, Any]:
    """Forward microbatches 0 and 1, then backward 1 and 0, as stage `kind`; what came out."""
    runner = make_runner(module, last=kind == "last", checkpoint=checkpoint, seed=seed)
    xs, targets = [batch(seed=1), batch(seed=2)], [batch(5, 3, seed=3), batch(5, 3, seed=4)]
    sent = []
    for key in (0, 1):
        if kind == "first":
            sent.append(runner.forward(key, (xs[key],)))
        else:
            runner.receive(key, as_sent((xs[key],)))
            sent.append(runner.forward(key, target=targets[key], scale=0.5))
    input_grads = {}
    for key in (1, 0):
        if kind != "last":
            runner.receive_grads(key, [targets[key]])
        input_grads[key] = runner.backward(key)
    return {"sent": sent, "input_grads": input_grads, "grads": grads(module), "losses": dict(runner.losses)}


@pytest.mark.parametrize("kind", ["first", "middle", "last"])
def test_checkpointing_with_dropout_replays_the_masks(kind: str) -> None:
    plain = run_two_microbatches(mlp(dropout=0.5).train(), False, kind)
    recomputed = run_two_microbatches(mlp(dropout=0.5).train(), True, kind)
    no_dropout = run_two_microbatches(mlp().train(), False, kind)
    some = next(iter(no_dropout["grads"]))
    assert not torch.allclose(plain["grads"][some], no_dropout["grads"][some])  # dropout did drop
    assert_grads_close(plain["grads"], recomputed["grads"])
    for key in (0, 1):
        if kind != "last":
            torch.testing.assert_close(recomputed["sent"][key], plain["sent"][key])
        if kind != "first":
            torch.testing.assert_close(recomputed["input_grads"][key], plain["input_grads"][key])
    assert recomputed["losses"] == pytest.approx(plain["losses"], rel=1e-6)


def test_same_seed_gives_the_same_dropout_and_another_seed_another() -> None:
    first = run_two_microbatches(mlp(dropout=0.5).train(), False, "middle", seed=5)
    again = run_two_microbatches(mlp(dropout=0.5).train(), False, "middle", seed=5)
    other = run_two_microbatches(mlp(dropout=0.5).train(), False, "middle", seed=6)
    assert torch.equal(first["sent"][0][0], again["sent"][0][0])
    assert not torch.equal(first["sent"][0][0], other["sent"][0][0])


def test_runner_forwards_leave_the_default_generator_alone() -> None:
    module = mlp(dropout=0.5).train()
    torch.manual_seed(8)
    expected = torch.rand(4)
    torch.manual_seed(8)
    run_two_microbatches(module, True, "middle")
    assert torch.equal(torch.rand(4), expected)


def batch_norm_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)).train()


@pytest.mark.parametrize("last", [False, True])
def test_checkpointing_batch_norm_updates_running_statistics_once(last: bool) -> None:
    module, reference = batch_norm_net(), batch_norm_net()
    xs = [batch(6, seed=1), batch(6, seed=2) * 3 + 1]
    targets = [batch(6, 3, seed=3), batch(6, 3, seed=4)]
    runner = make_runner(module, last=last, checkpoint=True)
    returned = {}
    for key in (0, 1):
        runner.receive(key, as_sent((xs[key],)))
        runner.forward(key, target=targets[key], scale=0.5)
    for key in (0, 1):
        if not last:
            runner.receive_grads(key, [targets[key]])
        returned[key] = runner.backward(key)
    for key in (0, 1):
        x_ref = leaf(xs[key])
        output = reference(x_ref)
        if last:
            (mse(output, targets[key]) * 0.5).backward()
        else:
            output.backward(targets[key])
        torch.testing.assert_close(returned[key][0], x_ref.grad)
    assert_grads_close(grads(reference), grads(module))
    found, expected = dict(module.named_buffers()), dict(reference.named_buffers())
    assert int(found["1.num_batches_tracked"]) == 2
    for name, buffer in expected.items():
        torch.testing.assert_close(found[name], buffer, rtol=1e-6, atol=1e-7, msg=name)


# --- weight stashing ------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("last", [False, True])
def test_stashed_forward_backpropagates_through_the_old_weights(last: bool, checkpoint: bool) -> None:
    module = mlp()
    old = copy.deepcopy(module)
    x, target = batch(), batch(5, 3, seed=3)
    runner = make_runner(module, last=last, checkpoint=checkpoint, stash=True)
    runner.receive(1, as_sent((x,)))
    runner.forward(1, target=target)
    perturb(module)
    new = copy.deepcopy(module)
    if not last:
        runner.receive_grads(1, [target])
    input_grads = runner.backward(1)

    expected_grads = {}
    for name, reference in (("old", old), ("new", new)):
        x_ref = leaf(x)
        output = reference(x_ref)
        if last:
            mse(output, target).backward()
        else:
            output.backward(target)
        expected_grads[name] = (grads(reference), x_ref.grad)
    assert_grads_close(expected_grads["old"][0], grads(module))
    torch.testing.assert_close(input_grads[0], expected_grads["old"][1])
    found = grads(module)
    for name in ("0.weight", "0.bias", "2.weight"):  # (a middle stage's last bias gradient is the output's)
        assert not torch.allclose(found[name], expected_grads["new"][0][name], rtol=1e-3, atol=1e-5), name
    for (name, parameter), changed in zip(module.named_parameters(), new.parameters()):
        assert torch.equal(parameter, changed), name  # the live weights stay the new ones


@pytest.mark.parametrize("checkpoint", [False, True])
def test_several_stashed_microbatches_in_flight_each_use_their_forward_weights(checkpoint: bool) -> None:
    module = mlp()
    x = [batch(seed=1), batch(seed=2)]
    target = [batch(5, 3, seed=3), batch(5, 3, seed=4)]
    runner = make_runner(module, last=True, checkpoint=checkpoint, stash=True)
    weights = []  # the module at each forward
    for key in (0, 1):
        runner.receive(key, as_sent((x[key],)))
        weights.append(copy.deepcopy(module))
        runner.forward(key, target=target[key])
        perturb(module)
    returned = {key: runner.backward(key) for key in (0, 1)}
    expected: dict[str, torch.Tensor] = {}
    for key in (0, 1):
        x_ref = leaf(x[key])
        mse(weights[key](x_ref), target[key]).backward()
        torch.testing.assert_close(returned[key][0], x_ref.grad)
        for name, grad in grads(weights[key]).items():
            expected[name] = grad if name not in expected else expected[name] + grad
    assert_grads_close(expected, grads(module))


class SelfCheckpointing(nn.Module):
    """An mlp whose forward checkpoints it (torch.utils.checkpoint): recomputed inside the backward."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inner, self.reentrant = mlp(), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_stashed_forward_the_model_checkpoints_recomputes_on_its_own_weights(reentrant: bool, tied: bool) -> None:
    module = SelfCheckpointing(reentrant)
    if tied:  # the checkpointed region reads a weight under a second name, which the stash lists once
        module.inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
        module.inner[2].weight = module.inner[0].weight
    old = copy.deepcopy(module)
    x, target = batch(), batch(5, 3, seed=3)
    runner = make_runner(module, last=True, stash=True)
    runner.receive(1, as_sent((x,)))
    runner.forward(1, target=target)
    perturb(module)  # an optimizer step between the forward and the backward
    input_grads = runner.backward(1)
    x_ref = leaf(x)
    mse(old(x_ref), target).backward()
    assert_grads_close(grads(old), grads(module))
    torch.testing.assert_close(input_grads[0], x_ref.grad)


def test_stashing_without_a_weight_change_gives_plain_gradients() -> None:
    module, reference = mlp(), mlp()
    x, target = batch(), batch(5, 3, seed=3)
    runner = make_runner(module, stash=True)
    sent = runner.forward(0, (x,))
    runner.receive_grads(0, [target])
    runner.backward(0)
    output = reference(x)
    output.backward(target)
    torch.testing.assert_close(sent[0], output.detach())
    assert_grads_close(grads(reference), grads(module))


@pytest.mark.parametrize("change", [False, True])
def test_stashing_with_a_tied_parameter_gives_the_plain_gradient(change: bool) -> None:
    module = Tied()
    assert module.first.weight is module.second.weight
    old = copy.deepcopy(module)
    x, target = batch(), batch(5, 4, seed=3)
    runner = make_runner(module, last=True, stash=True)
    runner.receive(0, as_sent((x,)))
    runner.forward(0, target=target)
    if change:
        perturb(module)
    runner.backward(0)
    mse(old(x), target).backward()
    assert_grads_close(grads(old), grads(module))
    assert module.first.weight is module.second.weight


# --- reset ----------------------------------------------------------------------------------------


def test_reset_forgets_microbatches_and_losses() -> None:
    module, reference = mlp(), mlp()
    x, target = batch(), batch(5, 3, seed=3)
    runner = make_runner(module, last=True)
    runner.receive(0, as_sent((x * 10,)))
    runner.forward(0, target=target)
    assert 0 in runner.losses
    runner.reset(0)
    assert runner.losses == {}
    with pytest.raises(KeyError):
        runner.backward(0)
    runner.receive(0, as_sent((x,)))
    runner.forward(0, target=target)
    runner.backward(0)
    mse(reference(x), target).backward()
    assert_grads_close(grads(reference), grads(module))  # nothing of the forgotten microbatch


def test_forward_before_any_reset_runs() -> None:
    module, reference = mlp(), mlp()
    runner = StageRunner(module, CPU, last=False, loss_fn=mse)
    sent = runner.forward(0, (batch(),))
    torch.testing.assert_close(sent[0], reference(batch()).detach())


# --- what a split backward cannot run --------------------------------------------------------------


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_split_backward_refuses_recomputed_stages_and_reentrant_checkpoints_in_one_line(reentrant: bool) -> None:
    stages = split_model(CheckpointedBlocks(reentrant), ["blocks.1"], (batch(),))
    refused = split_backward_refusal("zb-h1", stages, [False, False])
    if reentrant:
        assert refused is not None and "stage 0 checkpoints blocks.0 with use_reentrant=True" in refused
        with pytest.raises(PipelineError, match="use_reentrant=False"):  # before any thread starts
            Pipeline(stages, schedule="zb-h1", microbatches=2, loss_fn=mse)
    else:
        assert refused is None
        with Pipeline(stages, schedule="zb-h1", microbatches=2, loss_fn=mse) as pipe:
            pipe.train_step(batch(4), batch(4, 3, seed=3))
    assert split_backward_refusal("1f1b", stages, [False, False]) is None
    assert "recomputing stages" in (split_backward_refusal("zbv", stages, [True, False]) or "")


@pytest.mark.parametrize("first", [False, True], ids=["later-stage", "first-stage"])
def test_a_split_backward_through_a_layer_that_checkpoints_itself_reentrantly_fails_in_one_line(first: bool) -> None:
    """A layer checkpointing its own insides is no node the split sees (an nn.Sequential slice here): its stage's
    first B says what is wrong, as a first stage's W would have failed in torch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), SelfCheckpointing(True), nn.Linear(3, 3))
    stages = split_model(model, ["2" if first else "1"])
    assert split_backward_refusal("zb-h1", stages, [False, False]) is None  # not seen before the first step
    with Pipeline(stages, schedule="zb-h1", microbatches=2, loss_fn=mse) as pipe:
        with pytest.raises(PipelineError, match=rf"stage {0 if first else 1}, microbatch 0 failed: "
                                                r"ReentrantCheckpointError: .*use_reentrant=False"):
            pipe.train_step(batch(4), batch(4, 3, seed=3))


class NormedBlocks(nn.Module):
    """Linear, two blocks with batch norm that the forward checkpoints (non-reentrant), linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Linear(4, 8), nn.Linear(8, 3)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh()) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
        return self.head(h)


def test_a_split_backward_moves_a_recomputed_regions_statistics_as_one_backward_does() -> None:
    """B and W each recompute a checkpointed region; eager mode (and 1f1b) recompute it once per microbatch, so
    W's second update of batch norm's running statistics is undone. On the last stage the schedule keeps eager
    mode's order (F0 B0 F1 B1), so the statistics match exactly."""
    x, y = batch(8, 4, seed=1), batch(8, 3, seed=2)
    eager = NormedBlocks()
    for half in (slice(0, 4), slice(4, 8)):
        (mse(eager(x[half]), y[half]) * 0.5).backward()
    model = NormedBlocks()
    with Pipeline(split_model(model, ["blocks.1"], (x[:4],)), schedule="zb-h1", microbatches=2, loss_fn=mse) as pipe:
        pipe.train_step(x, y)
    found, wanted = model.blocks[1][1], eager.blocks[1][1]
    assert int(found.num_batches_tracked) == int(wanted.num_batches_tracked) == 4  # forward and recompute, twice
    torch.testing.assert_close(found.running_mean, wanted.running_mean, rtol=0, atol=0)
    torch.testing.assert_close(found.running_var, wanted.running_var, rtol=0, atol=0)
    assert_grads_close(grads(eager), grads(model))
