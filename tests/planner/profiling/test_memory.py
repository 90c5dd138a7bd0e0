"""Peak memory of one step on CPU, and each layer's backward workspace, tracked from live tensor storages."""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from planner.profiling.layers import find_layers
from planner.profiling.memory import measure_peak_memory, measure_workspace, peak_memory_of

FLOAT = 4


def test_cpu_peak_counts_weights_gradients_and_activations() -> None:
    model = nn.Linear(1000, 1000, bias=False)
    x = torch.randn(10, 1000)
    peak, method = measure_peak_memory(model, (x,), lambda: model(x).square().sum(), torch.device("cpu"))
    assert method == "live-tensors"
    weights = grads = 1000 * 1000 * FLOAT
    activation = 10 * 1000 * FLOAT
    scalar = FLOAT
    # The peak is when the weight gradient is made: weights, input x, the gradient of the
    # linear's output (its output, saved by square, was released when square's backward ran;
    # square's output was never saved) and the new weight gradient; plus the loss and its
    # gradient (scalars). The forward's peak, weights + 3 activations, is lower.
    assert peak == weights + grads + 2 * activation + 2 * scalar

def test_cpu_peak_sees_a_large_temporary() -> None:
    model = nn.Linear(10, 10)
    x = torch.randn(4, 10)

    def step() -> torch.Tensor:
        big = torch.zeros(1_000_000)  # 4 MB that lives only inside the step
        return model(x).sum() + big.sum()

    peak, _ = measure_peak_memory(model, (x,), step, torch.device("cpu"))
    assert peak >= 1_000_000 * FLOAT


def test_cpu_peak_counts_what_another_thread_reports_allocating_while_the_step_runs() -> None:
    """The tracking is thread-local: a 4 MB buffer another thread allocates (as a receiver thread does) counts only
    where that thread reports it (`other_threads`), from then until it is freed, and the report is withdrawn after."""
    model = nn.Linear(10, 10)
    x = torch.randn(4, 10)
    watcher: list[Any] = [None]

    def step() -> None:
        made: list[torch.Tensor] = []

        def allocate() -> None:
            made.append(torch.empty(1_000_000))
            if watcher[0] is not None:
                watcher[0](made)

        thread = threading.Thread(target=allocate)
        thread.start()
        thread.join()
        made.clear()  # freed here, on this thread

    cpu = torch.device("cpu")
    alone, _ = peak_memory_of(step, model, (x,), cpu)
    reported, _ = peak_memory_of(step, model, (x,), cpu, other_threads=lambda report: watcher.__setitem__(0, report))
    assert reported - alone == 1_000_000 * FLOAT
    assert watcher[0] is None


def test_cpu_peak_leaves_out_the_host_tensors_also_where_an_operation_reads_them() -> None:
    """`host` (the caller's batch): its storage is not counted even with `count_inputs`, where any other tensor first
    seen as an input is; what an operation makes of it (a microbatch's copy) is."""
    model = nn.Linear(10, 10)
    whole = torch.randn(250_000, 10)  # 10 MB
    microbatch = whole[:1000]

    def step() -> None:
        model(microbatch.clone()).sum()

    cpu = torch.device("cpu")
    counted, _ = peak_memory_of(step, model, (), cpu, count_inputs=True)
    hosted, _ = peak_memory_of(step, model, (), cpu, count_inputs=True, host=(whole,))
    assert counted - hosted == whole.nbytes
    assert hosted >= microbatch.nbytes + sum(p.nbytes for p in model.parameters())


# --- each layer's backward workspace -------------------------------------------------------------


class _TemporaryInBackward(torch.autograd.Function):
    """Identity whose backward makes a 4 MB temporary."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        big = torch.ones(1_000_000)
        return grad * big[0]


class _SavesALot(torch.autograd.Function):
    """Identity that saves 4 MB for a backward that makes nothing large."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(torch.ones(1_000_000))
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (kept,) = ctx.saved_tensors
        return grad * kept[0]


class _Apply(nn.Module):
    def __init__(self, function: type[torch.autograd.Function]) -> None:
        super().__init__()
        self.function = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function.apply(x)


def _workspaces(model: nn.Sequential, x: torch.Tensor) -> tuple[list[int], list[int]]:
    layers = find_layers(model, lambda: model(x), None, None)
    assert len(layers) == len(model)
    return measure_workspace(model, layers, (x,), lambda: model(x).square().sum())


def _workspace(model: nn.Sequential, x: torch.Tensor) -> list[int]:
    return _workspaces(model, x)[0]


class _TemporaryInForward(nn.Module):
    """Makes and drops a 4 MB temporary in its forward; saves nothing when nothing needs a gradient."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        big = x.repeat(1, 100_000)  # 4 x 1e6 floats: 16 MB
        return big[:, :10] * 2


def test_forward_workspace_is_what_a_layer_holds_while_its_forward_runs() -> None:
    model = nn.Sequential(nn.Linear(10, 10), _TemporaryInForward(), nn.Linear(10, 10)).requires_grad_(False)
    model[2].requires_grad_(True)  # only the last layer trains: the first two save nothing
    backward, forward = _workspaces(model, torch.randn(4, 10))
    assert forward[1] >= 4 * 1_000_000 * FLOAT  # the temporary, though nothing was saved
    assert forward[0] < 10_000 and forward[2] < 10_000
    assert backward[1] < 10_000


def test_workspace_is_the_temporary_of_the_layer_whose_backward_makes_it() -> None:
    model = nn.Sequential(nn.Linear(10, 10), _Apply(_TemporaryInBackward), nn.Linear(10, 10))
    found = _workspace(model, torch.randn(4, 10))
    assert found[1] >= 1_000_000 * FLOAT
    assert found[0] < 10_000 and found[2] < 10_000  # gradients of 4 x 10 activations and 10 x 10 weights
    assert all(p.grad is None for p in model.parameters())  # the zero gradients it made are gone again


def test_workspace_leaves_out_what_autograd_saved() -> None:
    model = nn.Sequential(nn.Linear(10, 10), _Apply(_SavesALot))
    found = _workspace(model, torch.randn(4, 10))
    assert found[1] < 10_000  # the 4 MB it saved are activations (saved_bytes), not workspace


def test_workspace_leaves_out_existing_and_made_weight_gradients() -> None:
    model = nn.Sequential(nn.Linear(1000, 1000, bias=False), nn.ReLU())
    x = torch.randn(2, 1000)
    model(x).sum().backward()  # a gradient exists for the weight: it is a weight's, not workspace
    found = _workspace(model, x)
    # the linear's backward makes its weight's gradient (4 MB) before adding it into .grad
    assert 1000 * 1000 * FLOAT <= found[0] < 1000 * 1000 * FLOAT + 100_000
    assert found[1] < 100_000
