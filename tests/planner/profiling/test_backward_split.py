"""B then W (planner.profiling.backward_split) against one plain backward, and W not redoing B's work."""

from __future__ import annotations

import copy
import gc
import threading
import weakref
from typing import Any, Callable, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from planner.errors import PlannerError
from planner.profiling.memory import LiveStorageMode, peak_memory_of
from planner.profiling.backward_split import (PendingWeights, ReentrantCheckpointError, _accumulate, backward_inputs,
                                             backward_weights)
from tests.conftest import gpu_only

Forward = Callable[..., Sequence[torch.Tensor]]


def _same(actual: torch.Tensor | None, expected: torch.Tensor | None, what: str) -> None:
    """Equal within fp32 1e-6 relative to the expected tensor's largest element."""
    assert (actual is None) == (expected is None), f"{what}: {actual} vs {expected}"
    if actual is None or expected is None:
        return
    if expected.layout != torch.strided:
        actual, expected = actual.to_dense(), expected.to_dense()
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * max(scale, 1e-6), msg=what)


def _copies(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]


def _plain(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and (g is not None or o.numel() == 1)]
    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def split_vs_plain(module: nn.Module, forward: Forward, inputs: Sequence[torch.Tensor],
                   stage_inputs: Sequence[int] | None = None, loss: bool = False,
                   microbatches: int = 1) -> PendingWeights:
    """Runs `forward` on a copy with plain backward and on `module` with B then W; asserts they agree.

    `stage_inputs`: which of `inputs` are the stage's inputs (default: those requiring grad).
    With several microbatches, all B run first, then all W (as a zero-bubble schedule may).
    """
    reference = copy.deepcopy(module)
    for param, ref in zip(module.parameters(), reference.parameters()):  # deepcopy leaves .grad behind
        ref.grad = None if param.grad is None else param.grad.clone()
    chosen = [i for i, t in enumerate(inputs) if t.requires_grad] if stage_inputs is None else list(stage_inputs)
    expected_inputs = []
    batches = []
    for _ in range(microbatches):
        ref_inputs = _copies(inputs)
        ref_outputs = list(forward(reference, *ref_inputs))
        grads = [None if loss else torch.randn_like(o) for o in ref_outputs]
        _plain(ref_outputs, grads)
        expected_inputs.append([ref_inputs[i].grad for i in chosen])
        batches.append(grads)
    pendings = []
    for grads in batches:
        own = _copies(inputs)
        before = {name: (None if p.grad is None else p.grad.clone()) for name, p in module.named_parameters()}
        outputs = list(forward(module, *own))
        got, pending = backward_inputs(outputs, grads, [own[i] for i in chosen], list(module.parameters()))
        for name, param in module.named_parameters():  # B writes no .grad
            _same(param.grad, before[name], f"{name}.grad after B")
        assert all(t.grad is None for t in own), "B wrote an input's .grad"
        assert len(got) == len(chosen)
        for k, (g, e) in enumerate(zip(got, expected_inputs[len(pendings)])):
            _same(g, e, f"gradient of input {chosen[k]}")
        pendings.append(pending)
    for pending in pendings:
        backward_weights(pending)
    for (name, param), ref in zip(module.named_parameters(), reference.parameters()):
        _same(param.grad, ref.grad, f"{name}.grad")
    return pendings[0]


def test_mlp_stage() -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    pending = split_vs_plain(mlp, lambda m, x: [m(x)], [torch.randn(5, 6, requires_grad=True)])
    assert pending.boundaries == 3 and pending.calls == 3 and pending.promoted == 0
    assert pending.done and not pending.weight_calls and not pending.roots and not pending.params


class MixedStage(nn.Module):
    """A convolution, batch norm, Linear on tokens, layer norm, a scale and a bias: every weight formula of
    `weight_formulas` in one stage."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv1d(3, 4, 3, padding=1), nn.BatchNorm1d(4)
        self.linear, self.layer_norm = nn.Linear(4, 8), nn.LayerNorm(8)
        self.scale, self.shift = nn.Parameter(torch.randn(8)), nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.norm(self.conv(x)).transpose(1, 2)
        return self.layer_norm(self.linear(tokens)) * self.scale + self.shift


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu_only)])
def test_every_weight_formula_in_one_stage(device: str) -> None:
    """B then W of a stage whose boundaries all have formulas equals plain backward, on the CPU and on a GPU
    (float64 there: TF32 convolutions would round B's and plain backward's products differently)."""
    torch.manual_seed(19)
    dtype = torch.float64 if device == "cuda" else torch.float32
    stage = MixedStage().to(device, dtype)
    split_vs_plain(stage, lambda m, x: [m(x)], [torch.randn(2, 3, 5, device=device, dtype=dtype, requires_grad=True)],
                   microbatches=2)


class PositionStage(nn.Module):
    """x @ W1 + pos_embedding(arange): a branch that depends on parameters only."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(8, 8) / 3)
        self.pos = nn.Embedding(10, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x @ self.w1 + self.pos(torch.arange(x.shape[1])))


def test_parameter_only_branch() -> None:
    torch.manual_seed(1)
    split_vs_plain(PositionStage(), lambda m, x: [m(x)], [torch.randn(2, 5, 8, requires_grad=True)])


class BiasStage(nn.Module):
    """A bias added directly, and a second output that depends on the bias alone."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4, bias=False)
        self.bias = nn.Parameter(torch.randn(4))
        self.unused = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [torch.tanh(self.linear(x) + self.bias), self.bias * 3]


def test_bias_only_path_and_unused_parameter() -> None:
    torch.manual_seed(2)
    stage = BiasStage()
    split_vs_plain(stage, lambda m, x: m(x), [torch.randn(3, 4, requires_grad=True)])
    assert stage.unused.grad is None


def test_conv_batchnorm_in_train_mode() -> None:
    torch.manual_seed(3)
    stage = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1))
    stage.train()
    split_vs_plain(stage, lambda m, x: [m(x)], [torch.randn(2, 3, 6, 6, requires_grad=True)])


def test_linear_used_twice_gets_the_sum_of_both_uses() -> None:
    torch.manual_seed(4)
    shared = nn.Linear(5, 5)
    pending = split_vs_plain(shared, lambda m, x: [m(torch.relu(m(x)))], [torch.randn(3, 5, requires_grad=True)])
    assert pending.promoted == 1  # the bias, used directly by both addmm: its sum moves to B


def test_tied_parameter_used_directly_and_through_a_sibling_edge() -> None:
    # addcmul(p, x, p * 2): the backward node has two edges that lead to p, one through the other
    torch.manual_seed(5)
    holder = nn.Module()
    holder.p = nn.Parameter(torch.randn(4))
    split_vs_plain(holder, lambda m, x: [torch.addcmul(m.p, x, m.p * 2)], [torch.randn(3, 4, requires_grad=True)])


def test_unused_input_gets_none() -> None:
    torch.manual_seed(6)
    linear = nn.Linear(4, 2)
    x, unused = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    split_vs_plain(linear, lambda m, a, b: [m(a)], [x, unused], stage_inputs=[0, 1])
    got, pending = backward_inputs([linear(x)], [torch.ones(3, 2)], [x, unused, torch.zeros(2)],
                                   list(linear.parameters()))
    assert got[1] is None and got[2] is None and got[0] is not None  # unused, and not requiring grad
    backward_weights(pending)


class TokenStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 8)
        self.linear = nn.Linear(8, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.linear(self.embedding(tokens))


def test_first_stage_with_token_inputs_does_everything_in_w() -> None:
    torch.manual_seed(7)
    stage = TokenStage()
    tokens = torch.randint(0, 20, (3, 5))
    reference = copy.deepcopy(stage)
    grad = torch.randn(3, 5, 8)
    reference(tokens).backward(grad)
    out = stage(tokens)
    with _Ops() as ops:
        got, pending = backward_inputs([out], [grad], [], list(stage.parameters()))
    assert got == [] and ops.names == []
    assert all(p.grad is None for p in stage.parameters())
    backward_weights(pending)
    for p, q in zip(stage.parameters(), reference.parameters()):
        _same(p.grad, q.grad, "parameter")


def test_last_stage_with_a_scalar_loss() -> None:
    torch.manual_seed(8)
    head = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 5))
    target = torch.randint(0, 5, (4,))
    split_vs_plain(head, lambda m, h: [nn.functional.cross_entropy(m(h), target)],
                   [torch.randn(4, 8, requires_grad=True)], loss=True)


def test_two_microbatches_accumulate_into_existing_grads() -> None:
    torch.manual_seed(9)
    mlp = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    for p in mlp.parameters():
        p.grad = torch.randn_like(p)  # gradients of an earlier step, kept (no zero_grad)
    split_vs_plain(mlp, lambda m, x: [m(x)], [torch.randn(5, 4, requires_grad=True)], microbatches=2)


def test_first_microbatch_grads_are_not_shared_with_the_caller() -> None:
    # the output is the bias plus something: the bias's gradient is the caller's tensor itself
    torch.manual_seed(10)
    holder = nn.Module()
    holder.b = nn.Parameter(torch.zeros(3, 4))
    x = torch.randn(3, 4, requires_grad=True)
    grad = torch.ones(3, 4)
    _, pending = backward_inputs([x * 2 + holder.b], [grad], [x], [holder.b])
    backward_weights(pending)
    _, pending = backward_inputs([x * 2 + holder.b], [grad], [x], [holder.b])
    backward_weights(pending)
    assert torch.equal(grad, torch.ones(3, 4)) and torch.equal(holder.b.grad, torch.full((3, 4), 2.0))


def test_non_leaf_input_carries_gradients_into_earlier_parameters() -> None:
    torch.manual_seed(11)
    stage = nn.ModuleDict({"pre": nn.Linear(3, 4), "post": nn.Linear(4, 2)})

    def forward(m: nn.ModuleDict, x: torch.Tensor) -> list[torch.Tensor]:
        return [m["post"](torch.relu(m["pre"](x)))]

    reference = copy.deepcopy(stage)
    x = torch.randn(5, 3, requires_grad=True)
    grad = torch.randn(5, 2)
    h_ref = reference["pre"](x.detach().clone())
    h_ref.retain_grad()
    reference["post"](torch.relu(h_ref)).backward(grad)
    h = stage["pre"](x.detach().clone())
    (got,), pending = backward_inputs([stage["post"](torch.relu(h))], [grad], [h], list(stage.parameters()))
    _same(got, h_ref.grad, "non-leaf input")
    backward_weights(pending)
    for p, q in zip(stage.parameters(), reference.parameters()):
        _same(p.grad, q.grad, "parameter")


def test_multi_output_node_and_output_reused() -> None:
    torch.manual_seed(12)
    linear = nn.Linear(4, 8)

    def forward(m: nn.Linear, x: torch.Tensor) -> list[torch.Tensor]:
        a, b = m(x).chunk(2, dim=1)
        return [a * b, b, m.weight.sum(0)]

    split_vs_plain(linear, forward, [torch.randn(3, 4, requires_grad=True)])


def test_sparse_embedding_gradient() -> None:
    torch.manual_seed(13)
    stage = nn.ModuleDict({"emb": nn.Embedding(10, 4, sparse=True), "lin": nn.Linear(4, 4)})
    tokens = torch.randint(0, 10, (3,))
    split_vs_plain(stage, lambda m, x: [m["lin"](x + m["emb"](tokens))],
                   [torch.randn(3, 4, requires_grad=True)], microbatches=2)


class Scale(torch.autograd.Function):
    """y = x * w, counting its backward calls."""

    calls = 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        Scale.calls += 1
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(0)


def test_custom_function_boundary_runs_once_per_phase() -> None:
    torch.manual_seed(14)
    holder = nn.Module()
    holder.w = nn.Parameter(torch.randn(4))
    Scale.calls = 0
    split_vs_plain(holder, lambda m, x: [Scale.apply(torch.sin(x), m.w)], [torch.randn(3, 4, requires_grad=True)])
    # plain once; B once and W once: a Python Function cannot skip the gradients no one needs
    assert Scale.calls == 3


@pytest.fixture(scope="module")
def gpt2() -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers


def _gpt2_config(transformers: Any) -> Any:
    return transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                   eos_token_id=0, attn_implementation="sdpa")


def test_gpt2_block(gpt2: Any) -> None:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    torch.manual_seed(15)
    block = GPT2Block(_gpt2_config(gpt2), layer_idx=0)

    def forward(m: nn.Module, h: torch.Tensor) -> list[torch.Tensor]:
        out = m(h)
        return [out[0] if isinstance(out, tuple) else out]

    pending = split_vs_plain(block, forward, [torch.randn(2, 7, 32, requires_grad=True)])
    assert pending.promoted == 0


def test_gpt2_lm_head_with_tied_weights_from_inputs_embeds(gpt2: Any) -> None:
    torch.manual_seed(16)
    model = gpt2.GPT2LMHeadModel(_gpt2_config(gpt2))
    assert model.lm_head.weight is model.transformer.wte.weight
    split_vs_plain(model, lambda m, e: [m(inputs_embeds=e).logits], [torch.randn(2, 7, 32, requires_grad=True)])
    tokens = torch.randint(0, 64, (2, 7))  # and as a first stage, from tokens (inputs=[])
    reference = copy.deepcopy(model)
    for p in model.parameters():
        p.grad = None
    grad = torch.randn(2, 7, 64)
    reference(input_ids=tokens).logits.backward(grad)
    got, pending = backward_inputs([model(input_ids=tokens).logits], [grad], [], list(model.parameters()))
    backward_weights(pending)
    for p, q in zip(model.parameters(), reference.parameters()):
        _same(p.grad, q.grad, "parameter")


@settings(max_examples=25, deadline=None)
@given(widths=st.lists(st.integers(1, 6), min_size=2, max_size=5), batch=st.integers(1, 4),
       activation=st.sampled_from([nn.ReLU, nn.Tanh, nn.Sigmoid]), bias=st.booleans(),
       share=st.booleans(), skip=st.booleans(), seed=st.integers(0, 1000))
def test_random_mlps(widths: list[int], batch: int, activation: type[nn.Module], bias: bool,
                     share: bool, skip: bool, seed: int) -> None:
    torch.manual_seed(seed)
    layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b in zip(widths, widths[1:]))
    square = nn.Linear(widths[-1], widths[-1], bias=bias)

    def forward(m: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
        h = x
        for layer in m[0]:
            h = m[2](layer(h))
        for _ in range(2 if share else 1):  # a square layer, maybe used twice, maybe with a skip
            h = m[2](m[1](h)) + (h if skip else 0)
        return [h]

    stage = nn.ModuleList([layers, square, activation()])
    split_vs_plain(stage, forward, [torch.randn(batch, widths[0], requires_grad=True)])


class _Ops(TorchDispatchMode):
    """Records the names of the aten operations that run (backward included)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _all_nodes(tensor: torch.Tensor) -> list[Any]:
    seen: dict[int, Any] = {}
    stack = [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        stack.extend(child for child, _ in node.next_functions)
    return list(seen.values())


@pytest.mark.parametrize("layer", ["linear", "prelu"])
def test_w_does_not_redo_the_work_of_b(layer: str) -> None:
    """No node runs twice in a phase. A Linear's boundary (AddmmBackward0) has a formula (`weight_formulas`): B runs
    one input-gradient product per layer, W one weight-gradient product from the saved input, without running the
    node again, and adds it to the weight's `.grad` without running the transpose and AccumulateGrad nodes. A PReLU's
    boundary has none: W runs it again through autograd (its kernel computes both sides at once, in B as in W),
    with the weights' AccumulateGrad as a plain backward, and nothing else of B."""
    torch.manual_seed(17)
    depth = 4
    if layer == "linear":
        chain = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(8, 8), nn.ReLU())])
        x = torch.randn(5, 8, requires_grad=True)
        product, in_b, in_w = "mm", {"AddmmBackward0", "ReluBackward0"}, set()  # W: formulas, straight into .grad
    else:
        chain = nn.Sequential(*[nn.PReLU(3) for _ in range(depth)])
        x = torch.randn(2, 3, 7, requires_grad=True)
        product, in_b = "_prelu_kernel_backward", {"PreluKernelBackward0"}
        in_w = {"PreluKernelBackward0", "ViewBackward0", "torch::autograd::AccumulateGrad"}  # into .grad as it comes
    with _Ops() as plain:
        copy.deepcopy(chain)(x.detach().clone().requires_grad_()).sum().backward()
    out = chain(x)
    nodes = _all_nodes(out)
    runs: dict[str, dict[int, int]] = {"B": {}, "W": {}}
    phase = ["B"]

    def count(node: Any) -> Callable[[Any], None]:
        def hook(grads: Any) -> None:
            runs[phase[0]][id(node)] = runs[phase[0]].get(id(node), 0) + 1
        return hook

    handles = [node.register_prehook(count(node)) for node in nodes]
    with _Ops() as b_ops:
        _, pending = backward_inputs([out], [torch.ones_like(out)], [x], list(chain.parameters()))
    phase[0] = "W"
    with _Ops() as w_ops:
        backward_weights(pending)
    for handle in handles:
        handle.remove()
    by_id = {id(node): node.name() for node in nodes}
    assert {by_id[i] for i in runs["B"]} == in_b and {by_id[i] for i in runs["W"]} == in_w
    assert all(n == 1 for counts in runs.values() for n in counts.values())  # no node twice in a phase
    assert b_ops.names.count(product) == depth and w_ops.names.count(product) == depth
    if layer == "linear":  # one matmul per layer for the input gradients in B, one per layer for the weights in W
        assert plain.names.count("mm") == 2 * depth
        assert w_ops.names.count("threshold_backward") == 0 and b_ops.names.count("sum") == 0


def test_w_adds_each_calls_gradients_into_existing_ones_with_one_foreach_call() -> None:
    """The second microbatch's W adds the gradients of each of its phase-1 calls with one `_foreach_add_` (one
    kernel launch or two on a GPU), not an `add_` per parameter, and the sums equal plain backward's."""
    torch.manual_seed(23)
    chain = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.LayerNorm(8))
    reference = copy.deepcopy(chain)
    ops, calls = [], []
    for _ in range(2):
        x = torch.randn(5, 8, requires_grad=True)
        out = chain(x)
        grad = torch.randn_like(out)
        reference(x.detach().clone().requires_grad_()).backward(grad)
        _, pending = backward_inputs([out], [grad], [x], list(chain.parameters()))
        calls.append(pending.calls)
        with _Ops() as w_ops:
            backward_weights(pending)
        ops.append(w_ops.names)
    assert ops[0].count("_foreach_add_") == 0  # the first W assigns .grad
    assert 1 <= ops[1].count("_foreach_add_") == calls[1] and ops[1].count("add_") == 0 and ops[1].count("add") == 0
    for param, expected in zip(chain.parameters(), reference.parameters()):
        _same(param.grad, expected.grad, "accumulated .grad")


@pytest.mark.parametrize("first", [True, False], ids=["first stage", "later stage"])
def test_w_holds_no_more_gradients_than_a_plain_backward_beyond_one_layers(first: bool) -> None:
    """W adds gradients into `.grad` as they come, as a plain backward does: a first stage's W (its whole backward)
    peaks where a plain backward does, a later stage's within one layer's weights (one phase-1 call's) and the
    gradients B keeps for W of it, not a whole second copy of the stage's gradients (24 MiB against 17 for these
    8 MiB of weights before)."""
    torch.manual_seed(29)
    chain = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(8)])
    layer_bytes = sum(p.numel() * p.element_size() for p in chain[0].parameters())
    cpu = torch.device("cpu")

    def steps(split: bool) -> None:
        for _ in range(2):  # the second adds into existing gradients
            x = torch.randn(4, 512, requires_grad=not first)
            out = chain(x).sum()
            if split:
                _, pending = backward_inputs([out], [None], [] if first else [x], list(chain.parameters()))
                backward_weights(pending)
            else:
                out.backward()

    chain.zero_grad(set_to_none=True)
    plain = peak_memory_of(lambda: steps(False), chain, (), cpu)[0]
    chain.zero_grad(set_to_none=True)
    split = peak_memory_of(lambda: steps(True), chain, (), cpu)[0]
    kept = 8 * 4 * 512 * 4  # B keeps the gradient arriving at each Linear for W (the profile's deferred_bytes)
    assert split <= plain + (0 if first else layer_bytes + kept)


def test_w_drops_the_graph() -> None:
    torch.manual_seed(18)
    l1, l2 = nn.Linear(4, 16), nn.Linear(16, 2)
    x = torch.randn(3, 4, requires_grad=True)
    h = torch.relu(l1(x))
    out = l2(h)
    watch = weakref.ref(h)
    _, pending = backward_inputs([out], [torch.ones(3, 2)], [x], [*l1.parameters(), *l2.parameters()])
    del out, h
    gc.collect()
    assert watch() is not None  # W still needs the activation for l2's weight gradient
    backward_weights(pending)
    gc.collect()
    assert watch() is None  # and nothing of the graph stays with the (kept) pending


def test_misuse_raises_planner_errors() -> None:
    linear = nn.Linear(3, 2)
    x = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(PlannerError, match="1 outputs but 2 grad_outputs"):
        backward_inputs([linear(x)], [None, None], [x], list(linear.parameters()))
    with pytest.raises(PlannerError, match=r"shape \(4, 3\) but outputs\[0\] has shape \(4, 2\)"):
        backward_inputs([linear(x)], [torch.ones(4, 3)], [x], list(linear.parameters()))
    with pytest.raises(PlannerError, match="not a leaf"):
        backward_inputs([linear(x)], [torch.ones(4, 2)], [x], [linear.weight * 2])
    _, pending = backward_inputs([linear(x)], [torch.ones(4, 2)], [x], list(linear.parameters()))
    backward_weights(pending)
    with pytest.raises(PlannerError, match="already used"):
        backward_weights(pending)
    with pytest.raises(PlannerError, match="PendingWeights"):
        backward_weights("pending")  # type: ignore[arg-type]


def test_nothing_to_differentiate() -> None:
    linear = nn.Linear(3, 2)
    x = torch.randn(4, 3, requires_grad=True)
    got, pending = backward_inputs([linear(x).detach(), linear(x)], [torch.ones(4, 2), None], [x],
                                   list(linear.parameters()))
    assert got == [None]
    backward_weights(pending)
    assert linear.weight.grad is None


def test_threads_adding_into_one_parameter_lose_nothing() -> None:
    """The in-process pipeline runs W's of two stages sharing a parameter (gpt's tied embedding and head) in
    two threads: 4 threads x 200 additions of ones into one `.grad`, starting from none, sum to 800
    everywhere, in each of 10 trials (unserialised, every run of this test lost an addition somewhere)."""
    for _ in range(10):
        parameter = torch.nn.Parameter(torch.zeros(256, 256))
        start = threading.Barrier(4)

        def add() -> None:
            start.wait()
            for _ in range(200):
                _accumulate([(parameter, torch.ones(256, 256))], set())

        threads = [threading.Thread(target=add) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert torch.equal(parameter.grad, torch.full((256, 256), 800.0))


def test_a_backward_through_torchs_reentrant_checkpoint_is_refused_and_a_non_reentrant_one_splits() -> None:
    """Reentrant checkpoint's backward recomputes and differentiates in one torch.autograd.backward: no B apart."""
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    for reentrant in (True, False):
        x = torch.randn(3, 4, requires_grad=True)
        loss = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant).square().sum()
        if reentrant:
            with pytest.raises(ReentrantCheckpointError, match="use_reentrant=False"):
                backward_inputs([loss], [None], [x], list(block.parameters()))
        else:
            block.zero_grad(set_to_none=True)
            (grad,), pending = backward_inputs([loss], [None], [x], list(block.parameters()))
            backward_weights(pending)
            found = {name: parameter.grad.clone() for name, parameter in block.named_parameters()}
            block.zero_grad(set_to_none=True)
            x_ref = x.detach().requires_grad_()
            block(x_ref).square().sum().backward()
            torch.testing.assert_close(grad, x_ref.grad)
            for name, parameter in block.named_parameters():
                torch.testing.assert_close(found[name], parameter.grad, msg=name)


class _Counted(torch.nn.Module):
    """Two linears with a tanh between, counting its forward calls."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.calls = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.down(torch.tanh(self.up(x)))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu_only)])
def test_w_recomputes_a_non_reentrant_checkpointed_region_once(device: str) -> None:
    """B recomputes the region once for its input gradients, W once for the weights' (torch's GraphExecGroup):
    not once per weight formula's saved tensor and per backward call, as each would count as its own task (on a
    GPU, autograd runs the nodes on its device thread: the group follows)."""
    torch.manual_seed(0)
    block, head = _Counted().to(device), torch.nn.Linear(4, 2).to(device)
    x = torch.randn(3, 4, device=device, requires_grad=True)
    loss = head(torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)).square().sum()
    params = [*block.parameters(), *head.parameters()]
    (grad,), pending = backward_inputs([loss], [None], [x], params)
    assert block.calls == 2
    backward_weights(pending)
    assert block.calls == 3
    found = [parameter.grad.clone() for parameter in params]
    for parameter in params:
        parameter.grad = None
    x_ref = x.detach().requires_grad_()
    head(block(x_ref)).square().sum().backward()
    torch.testing.assert_close(grad, x_ref.grad)
    for parameter, expected in zip(params, found):
        torch.testing.assert_close(expected, parameter.grad)


class _ReachedTwice(nn.Module):
    """p reaches the output through a formula (an add, whose gradient passes on unchanged) and through autograd
    (q = p * w3), and the add's gradient also feeds r = w5 * 2: W must not add into a gradient it still reads."""

    def __init__(self) -> None:
        super().__init__()
        for name in ("w1", "p", "w3", "w4", "w5"):
            setattr(self, name, nn.Parameter(torch.randn(5)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.w5 * 2.0  # (made first: autograd runs its node after q's)
        q = self.p * self.w3
        return (((x * self.w1 + self.p) + q) + r) * self.w4


class _ViewedTwice(nn.Module):
    """p1's gradient is the add's own gradient; p2's a view of it through autograd: two `.grad`s must not share
    one storage, or the next microbatch adds into both."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.p1, self.w4 = (nn.Parameter(torch.randn(5)) for _ in range(3))
        self.p2 = nn.Parameter(torch.randn(5, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.w1 + self.p1 + self.p2.view(5)) * self.w4


@pytest.mark.parametrize("model_type", [_ReachedTwice, _ViewedTwice], ids=["reached twice", "viewed twice"])
def test_w_adds_no_gradient_into_one_it_still_reads_or_another_parameter_holds(model_type: type) -> None:
    """Two microbatches of B then W against two plain backwards (found by a review of W adding gradients as they
    come: both models read wrong gradients then, 7.2 and 0.98 off)."""
    torch.manual_seed(0)
    model = model_type()
    reference = copy.deepcopy(model)
    for _ in range(2):
        x, grad = torch.randn(5), torch.randn(5)
        reference(x.clone().requires_grad_()).backward(grad)
        received = x.clone().requires_grad_()
        _, pending = backward_inputs([model(received)], [grad], [received], list(model.parameters()))
        backward_weights(pending)
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        _same(param.grad, expected.grad, name)
    storages = [param.grad.untyped_storage().data_ptr() for param in model.parameters()]
    assert len(set(storages)) == len(storages)


def test_w_holds_one_calls_gradients_at_a_time() -> None:
    """A chain of four 256 x 256 linears (one W call each, their .grad there already): W's new tensors peak at one
    weight's gradient and its bias's, 257 x 256 floats, and one 32 x 256 activation-sized temporary; holding the
    previous call's gradients through the next (the loop's variables) had made it 558,080 bytes."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(4)))
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    x = torch.randn(32, 256, requires_grad=True)
    loss = model(x).square().sum()
    _, pending = backward_inputs([loss], [None], [x], list(model.parameters()))
    del loss
    mode = LiveStorageMode(set(), 0)  # (counts the storages operations make; the kept gradients are W's inputs)
    with mode:
        backward_weights(pending)
    assert mode.peak_bytes == 257 * 256 * 4 + 32 * 256 * 4
