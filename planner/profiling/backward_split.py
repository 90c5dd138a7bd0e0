"""Splits a pipeline stage's backward into B (input gradients now) and W (weight gradients later).

Zero-bubble schedules (Qi et al., ICLR 2024) run a stage's backward in two parts: B computes the
gradients of the stage's *inputs* (the previous stage waits for them), W computes the gradients of
the stage's *weights* later, in what would otherwise be a bubble. `backward_inputs` is B,
`backward_weights` is W; B then W gives the same input gradients and parameter `.grad` as one plain
`torch.autograd.backward(outputs, grad_outputs)`, and W computes no gradient that B computed.

How. The autograd graph is walked from the outputs' gradient edges (`node.next_functions`).
A node that lies on a path to an input's gradient edge is a *B node*: `torch.autograd.grad`
with the inputs as targets runs exactly those nodes, and each computes only the outputs that lead
to an input (a linear's backward skips its weight's matmul). The other nodes that lead to a
parameter are *W nodes*; their subgraphs hold no B node. A B node with a W child is a
*boundary*: B captures the gradients arriving at it (targets of its one call). W then runs in two phases:

1. each boundary runs again from its recorded gradients, with the gradients flowing into its
   W children (the *frontier* edges) as the only targets, so it computes only those outputs
   (the weight matmul, not the input one) and no other node runs. Boundaries are batched into one
   `torch.autograd.grad` call when no child of one leads to a frontier edge of the batch (a chain of
   layers needs one call per layer: a B child that leads to a captured edge would run again and
   count its gradients twice). Each such call walks the graph below its boundaries, so batches of
   the nodes that Linear, convolution, layer and batch norm, scales and bias adds leave are computed
   from their saved tensors instead (`weight_formulas.frontier_grads`: the same gradients, no walk),
   the rest through autograd;
2. one `torch.autograd.backward` call onto the parameters runs every W node, from the frontier gradients
   of phase 1 and from the outputs that do not depend on any input; their AccumulateGrad adds each into
   `.grad` as a plain backward does. A frontier gradient that goes straight into a parameter's
   AccumulateGrad, or through a transpose into it (a Linear's weight), is added there without the
   call (most of them: the call's cost is its roots', 1.5 ms for the gpt example's 150).

A W node that a child of its own boundary also leads to (a parameter used directly by two layers,
e.g. a shared Linear's bias) cannot be separated that way; such a node is *promoted*: B targets it
like an input (its few incoming gradients, a bias sum, are then computed in B) and W starts there.
With no inputs (the first stage, whose inputs are data) B computes nothing and W is the whole
backward.

Limits. A custom `torch.autograd.Function` cannot tell which of its outputs a graph task needs
(`ctx.needs_input_grad` is fixed at forward), so one that is a boundary computes all its gradients
in B and again in W. Saved tensors of B nodes that are not boundaries stay until the caller drops
the graph (the outputs); W releases those of the nodes it runs. Hooks registered on parameters with
`register_post_accumulate_grad_hook` run for the parameters phase 2 reaches (all of a first stage's),
not for those a weight formula serves; tensor hooks run. W holds no lock while autograd runs: callers
whose threads share a parameter run their W's one at a time (`runtime.pipeline`). The `grad_outputs`
must not be modified in place before W.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.utils.checkpoint
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from planner.errors import PlannerError
from planner.profiling.weight_formulas import frontier_grads

__all__ = ["PendingWeights", "ReentrantCheckpointError", "backward_inputs", "backward_weights", "check_splittable",
           "held_gradients"]

_Edge = tuple[int, int]  # (node index in _Graph, input number of that node)
# boundaries are batched first-fit into the newest this many groups only: a chain of L layers fits none (each
# reaches the next one's frontier), and trying every group cost O(L^2) per backward (gpt: 75 boundaries)
GROUPS_TRIED = 16


@dataclass(eq=False)
class _WeightCall:
    """Phase 1 of W for a batch of boundaries: their recorded gradients to their frontier edges."""

    roots: list[GradientEdge]
    grads: list[torch.Tensor]
    captures: list[GradientEdge]
    keys: list[_Edge]  # the frontier edge each capture is, to sum captures over calls


@dataclass(eq=False)
class PendingWeights:
    """What W (`backward_weights`) still needs after B (`backward_inputs`); opaque to callers.

    Holds the recorded gradients and edges of the graph until W runs; W empties it.
    `boundaries`, `calls` and `promoted` count boundary nodes, phase-1 calls and promoted nodes.
    """

    weight_calls: list[_WeightCall] = field(default_factory=list, repr=False)
    roots: dict[_Edge, tuple[GradientEdge, torch.Tensor]] = field(default_factory=dict, repr=False)
    params: list[torch.Tensor] = field(default_factory=list, repr=False)
    foreign_storages: set[int] = field(default_factory=set, repr=False)
    boundaries: int = 0
    calls: int = 0
    promoted: int = 0
    done: bool = False


_REENTRANT_CHECKPOINT = "CheckpointFunctionBackward"  # the node of torch.utils.checkpoint's reentrant variant


class ReentrantCheckpointError(PlannerError):
    """A backward cannot be split into B and W: it holds torch's reentrant checkpoint, whose backward recomputes
    and differentiates the layer in one `torch.autograd.backward` (no `inputs`, no `torch.autograd.grad`)."""


def _refuse_reentrant(nodes: Sequence[Node]) -> None:
    """ReentrantCheckpointError if one of `nodes` is torch's reentrant checkpoint."""
    if any(type(node).__name__ == _REENTRANT_CHECKPOINT for node in nodes):
        raise ReentrantCheckpointError(
            "the backward runs a layer checkpointed by torch's reentrant checkpoint (use_reentrant=True), which "
            "computes no input gradient apart from the weights' ones: checkpoint with use_reentrant=False, or use a "
            "schedule that does not split the backward (gpipe, 1f1b)")


def check_splittable(outputs: Sequence[torch.Tensor]) -> None:
    """ReentrantCheckpointError if the graph behind `outputs` holds torch's reentrant checkpoint, whose backward
    no B and W can run: a stage's (`backward_inputs` checks those it splits, but a first stage's W is one
    backward restricted to the parameters, which that checkpoint refuses as well). Walks the whole graph: for
    a runtime, once per stage."""
    nodes = [output.grad_fn for output in outputs if output.grad_fn is not None]
    seen = {id(node) for node in nodes}
    for node in nodes:  # grows while iterating: a breadth-first walk
        for child, _ in node.next_functions:
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                nodes.append(child)
    _refuse_reentrant(nodes)


class _Graph:
    """The autograd graph reachable from some gradient edges, with nodes numbered.

    Holds the Python objects of the nodes, so that a node met twice is the same object.
    """

    def __init__(self, roots: Sequence[GradientEdge]) -> None:
        # (written with locals and no helper calls: it runs once per backward, over every node of the stage)
        nodes: list[Node] = []
        index: dict[int, int] = {}
        children: list[list[_Edge]] = []
        slots: list[set[int]] = []  # the input numbers by which edges (roots included) enter each node
        order: list[int] = []  # post-order: every node after all its children
        for root in roots:
            top = root.node
            known = index.get(id(top))
            if known is not None:
                slots[known].add(root.output_nr)
                continue
            start = len(nodes)
            index[id(top)] = start
            nodes.append(top)
            children.append([])
            slots.append({root.output_nr})
            stack = [(start, iter(top.next_functions))]
            while stack:
                parent, remaining = stack[-1]
                below = children[parent]
                for child, slot in remaining:
                    if child is None:
                        continue
                    known = index.get(id(child))
                    if known is None:  # first met: number it, then walk below it before the parent's next child
                        known = len(nodes)
                        index[id(child)] = known
                        nodes.append(child)
                        children.append([])
                        slots.append({slot})
                        below.append((known, slot))
                        stack.append((known, iter(child.next_functions)))
                        break
                    below.append((known, slot))
                    slots[known].add(slot)
                else:
                    stack.pop()
                    order.append(parent)
        self.nodes, self.index, self.children, self.slots, self.order = nodes, index, children, slots, order

    def find(self, node: Node) -> int | None:
        """The number of `node`, None if it is not in the graph."""
        return self.index.get(id(node))


@dataclass
class _Split:
    """Which nodes run in B, which are boundaries, and how W batches them."""

    in_b: list[bool]
    in_p: list[bool]
    frontier: dict[int, int]  # W node with a B parent -> its bit
    groups: list[list[int]]  # boundaries, batched for phase 1


def _classify(graph: _Graph, targets: set[int], param_nodes: set[int]) -> tuple[_Split, set[int]]:
    """Splits the graph for the given target nodes; returns the split and the nodes to promote."""
    count = len(graph.nodes)
    in_b = [False] * count  # leads (by at least one edge) to a target: runs in B
    in_p = [False] * count  # is or leads to a parameter's AccumulateGrad
    for node in graph.order:
        for child, _ in graph.children[node]:
            if child in targets or in_b[child]:
                in_b[node] = True
            if in_p[child]:
                in_p[node] = True
        if node in param_nodes:
            in_p[node] = True
    frontier: dict[int, int] = {}
    boundaries: list[int] = []
    for node in graph.order:
        if not in_b[node]:
            continue
        is_boundary = False
        for child, _ in graph.children[node]:
            if not in_b[child] and in_p[child] and child not in targets:
                frontier.setdefault(child, len(frontier))
                is_boundary = True
        if is_boundary:
            boundaries.append(node)
    # below[n]: bits of the frontier nodes reachable from n by at least one edge
    below = [0] * count
    for node in graph.order:
        bits = 0
        for child, _ in graph.children[node]:
            bits |= below[child]
            if child in frontier:
                bits |= 1 << frontier[child]
        below[node] = bits
    promote: set[int] = set()
    masks: dict[int, tuple[int, int]] = {}  # boundary -> (reached by its children, its frontier)
    for node in boundaries:
        reached = 0
        own = 0
        for child, _ in graph.children[node]:
            reached |= below[child]
            if child in frontier:
                own |= 1 << frontier[child]
        masks[node] = (reached, own)
        if reached & own:
            promote.update(child for child, bit in frontier.items() if (reached & own) >> bit & 1)
    groups: list[tuple[int, int, list[int]]] = []
    for node in reversed(boundaries):  # from the outputs down: first fit among the newest GROUPS_TRIED groups
        reached, own = masks[node]
        for position in range(max(len(groups) - GROUPS_TRIED, 0), len(groups)):
            group_reached, group_own, members = groups[position]
            if not (group_reached | reached) & (group_own | own):
                groups[position] = (group_reached | reached, group_own | own, members + [node])
                break
        else:
            groups.append((reached, own, [node]))
    return _Split(in_b, in_p, frontier, [members for _, _, members in groups]), promote


def _check_grad(position: int, output: object, grad: object) -> None:
    """Raises PlannerError unless `output` is a tensor and `grad` None or a tensor of its shape."""
    if not isinstance(output, torch.Tensor):
        raise PlannerError(f"backward_inputs: outputs[{position}] is a {type(output).__name__}, not a tensor")
    if grad is not None and not isinstance(grad, torch.Tensor):
        raise PlannerError(f"backward_inputs: grad_outputs[{position}] is a {type(grad).__name__}, "
                           "not a tensor or None")
    if isinstance(grad, torch.Tensor) and grad.shape != output.shape:
        raise PlannerError(f"backward_inputs: grad_outputs[{position}] has shape {tuple(grad.shape)} "
                           f"but outputs[{position}] has shape {tuple(output.shape)}")


def _roots(outputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor | None]
           ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (output, gradient) pairs to differentiate: skips None gradients and constant outputs."""
    if len(outputs) != len(grad_outputs):
        raise PlannerError(f"backward_inputs: {len(outputs)} outputs but {len(grad_outputs)} grad_outputs")
    pairs = []
    for position, (output, grad) in enumerate(zip(outputs, grad_outputs)):
        _check_grad(position, output, grad)
        if grad is None and len(outputs) == 1 and output.numel() == 1:
            grad = torch.ones_like(output)  # one scalar loss: d loss / d loss = 1
        if grad is None or not output.requires_grad:
            continue
        pairs.append((output, grad))
    return pairs


def _params(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters that require grad, each once; raises PlannerError for a non-leaf."""
    chosen: dict[int, torch.Tensor] = {}
    for position, param in enumerate(params):
        if not isinstance(param, torch.Tensor):
            raise PlannerError(f"backward_inputs: params[{position}] is a {type(param).__name__}, not a tensor")
        if not param.requires_grad:
            continue  # frozen: plain backward leaves its .grad alone too
        if param.grad_fn is not None:
            raise PlannerError(f"backward_inputs: params[{position}] (shape {tuple(param.shape)}) is not a leaf "
                               f"(it was computed by {param.grad_fn.name()}); pass the parameters themselves")
        chosen.setdefault(id(param), param)
    return list(chosen.values())


def _storage(tensor: torch.Tensor) -> int:
    """An id of the memory a strided tensor lives in (0 for other layouts)."""
    if tensor.layout != torch.strided:
        return 0
    return tensor.untyped_storage().data_ptr()


def backward_inputs(outputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor | None],
                    inputs: Sequence[torch.Tensor], params: Sequence[torch.nn.Parameter]
                    ) -> tuple[list[torch.Tensor | None], PendingWeights]:
    """B: the gradients of `inputs` (None for an input the outputs do not depend on), without computing
    any parameter gradient; what the parameters' gradients still need is returned (the graph is kept).

    `outputs` pairs with `grad_outputs`; a pair whose gradient is None or whose output does not require
    grad is skipped, except one scalar output with gradient None (a loss), which gets ones. An input
    that does not require grad gets None. `params` are the stage's parameters; frozen ones are ignored.
    Writes no `.grad`, neither of the parameters nor of the inputs. Pass the result to
    `backward_weights` (W) exactly once.
    """
    pairs = _roots(outputs, grad_outputs)
    chosen = _params(params)
    input_grads: list[torch.Tensor | None] = [None] * len(inputs)
    for position, tensor in enumerate(inputs):
        if not isinstance(tensor, torch.Tensor):
            raise PlannerError(f"backward_inputs: inputs[{position}] is a {type(tensor).__name__}, not a tensor")
    wanted = [position for position, tensor in enumerate(inputs) if tensor.requires_grad]
    pending = PendingWeights(params=chosen)
    pending.foreign_storages = {_storage(grad) for _, grad in pairs}
    if not pairs:
        return input_grads, pending
    root_edges = [get_gradient_edge(output) for output, _ in pairs]
    if not wanted:  # the first stage: W is the whole backward
        for number, (edge, (_, grad)) in enumerate(zip(root_edges, pairs)):
            pending.roots[(-1, number)] = (edge, grad)
        return input_grads, pending

    graph = _Graph(root_edges)
    _refuse_reentrant(graph.nodes)
    param_nodes = {number for number in (graph.find(get_gradient_edge(param).node) for param in chosen)
                   if number is not None}
    input_edges = [get_gradient_edge(inputs[position]) for position in wanted]
    targets = {number for number in (graph.find(edge.node) for edge in input_edges) if number is not None}
    promoted: set[int] = set()
    while True:
        split, promote = _classify(graph, targets | promoted, param_nodes)
        if not promote:
            break
        promoted |= promote
    # a promoted node that now leads to another target runs in B like any B node: nothing to capture
    promoted = {node for node in promoted if not split.in_b[node]}
    promoted_edges = [(node, slot) for node in sorted(promoted) for slot in sorted(graph.slots[node])]

    # the gradients arriving at each boundary are captured as targets of B's one call (no Python hook runs)
    boundaries = [node for group in split.groups for node in group]
    boundary_edges = [(node, slot) for node in boundaries for slot in sorted(graph.slots[node])]
    captured = torch.autograd.grad(
        [output for output, _ in pairs],
        [inputs[position] for position in wanted]
        + [GradientEdge(graph.nodes[node], slot) for node, slot in promoted_edges]
        + [GradientEdge(graph.nodes[node], slot) for node, slot in boundary_edges],
        [grad for _, grad in pairs], retain_graph=True, allow_unused=True)
    recorded: dict[int, dict[int, torch.Tensor]] = {}
    for (node, slot), grad in zip(boundary_edges, captured[len(wanted) + len(promoted_edges):]):
        if grad is not None:
            recorded.setdefault(node, {})[slot] = grad
    for position, grad in zip(wanted, captured):
        input_grads[position] = grad

    # W roots: outputs that lead to parameters but to no input, and the targets (inputs, promoted
    # nodes) that W nodes hang from, with the gradients B captured for them
    def add_root(key: _Edge, grad: torch.Tensor) -> None:
        if key in pending.roots:
            edge, earlier = pending.roots[key]
            pending.roots[key] = (edge, earlier + grad)
        else:
            pending.roots[key] = (GradientEdge(graph.nodes[key[0]], key[1]), grad)

    all_targets = targets | promoted
    for root, (_, grad) in zip(root_edges, pairs):
        node = graph.find(root.node)
        assert node is not None
        if not split.in_b[node] and split.in_p[node] and node not in all_targets:
            add_root((node, root.output_nr), grad)
    target_grads: dict[_Edge, torch.Tensor | None] = {}
    for edge, grad in zip(input_edges, captured):
        node = graph.find(edge.node)
        if node is not None and not split.in_b[node] and split.in_p[node]:
            target_grads[(node, edge.output_nr)] = grad  # the same edge twice: the same gradient
            if grad is not None:
                pending.foreign_storages.add(_storage(grad))  # the caller holds it too
    target_grads.update(zip(promoted_edges, captured[len(wanted):len(wanted) + len(promoted_edges)]))
    for key, grad in target_grads.items():
        if grad is not None:
            add_root(key, grad)

    for group in split.groups:
        call = _WeightCall([], [], [], [])
        for node in group:
            for slot, grad in sorted(recorded.get(node, {}).items()):  # none: no gradient reached it, nothing to do
                call.roots.append(GradientEdge(graph.nodes[node], slot))
                call.grads.append(grad)
            for child, slot in graph.children[node]:
                if child in split.frontier and (child, slot) not in call.keys:
                    call.keys.append((child, slot))
                    call.captures.append(GradientEdge(graph.nodes[child], slot))
        if call.roots and call.captures:
            pending.weight_calls.append(call)
    pending.boundaries = len(boundaries)
    pending.calls = len(pending.weight_calls)
    pending.promoted = len(promoted)
    return input_grads, pending


def held_gradients(pending: PendingWeights) -> list[tuple[Node, torch.Tensor]]:
    """The gradients `pending` keeps for W, each with the autograd node it enters (a boundary's recorded
    gradients, the gradients of W's roots), each tensor once; those the caller holds anyway (the
    `grad_outputs`, input gradients W also starts from) are left out. What a deferred W costs in memory
    beyond the graph's saved tensors (`planner.profiling.deferred_memory`)."""
    found: list[tuple[Node, torch.Tensor]] = []
    seen = set(pending.foreign_storages)
    pairs = [(edge.node, grad) for call in pending.weight_calls for edge, grad in zip(call.roots, call.grads)]
    pairs += [(edge.node, grad) for edge, grad in pending.roots.values()]
    for node, grad in pairs:
        key = _storage(grad) or id(grad)
        if key not in seen:
            seen.add(key)
            found.append((node, grad))
    return found


def weight_call_bytes(pending: PendingWeights) -> list[tuple[Node, int]]:
    """For each of W's batched calls (phase 1), a node it starts from and the bytes of the parameters its captured
    gradients lead to, each once: what the call holds at once before adding them into `.grad` (a layer's
    separate query, key and value projections are one call: three weights). What W holds beyond the gradients it
    starts from (`planner.profiling.deferred_memory`); phase 2 adds one gradient at a time."""
    found = []
    for call in pending.weight_calls:
        if not call.roots:
            continue
        seen: set[int] = set()
        nbytes = 0
        stack = [edge.node for edge in call.captures if edge.node is not None]
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            variable = getattr(node, "variable", None)  # an AccumulateGrad: its parameter
            if isinstance(variable, torch.Tensor):
                nbytes += variable.numel() * variable.element_size()
            stack += [child for child, _ in node.next_functions if child is not None]
        found.append((call.roots[0].node, nbytes))
    return found


_ACCUMULATING = threading.Lock()  # as AccumulateGrad's own mutex: stages in threads may share a parameter


def _accumulate(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], taken: set[int]) -> None:
    """Adds each `grad` into its `param.grad` as AccumulateGrad does; copies a gradient that others may hold.
    Additions into existing dense gradients go out as one `torch._foreach_add_` per device and dtype pair (a
    kernel launch or two for a stage's parameters, not one per parameter: W runs from the host, which a
    launch-bound GPU waits for). One thread at a time: the in-process pipeline runs gpt's embedding and its tied
    head, one Parameter, as W's of two stage threads, whose read-then-write of `.grad` could otherwise lose one."""
    with _ACCUMULATING, torch.no_grad():
        batched: dict[tuple[torch.device, torch.dtype, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        queued: set[int] = set()
        for param, grad in pairs:
            if param.grad is None:
                if grad.layout == torch.strided and (_storage(grad) in taken or grad.stride() != param.stride()):
                    grad = torch.empty_like(param, memory_format=torch.preserve_format).copy_(grad)
                taken.add(_storage(grad))
                param.grad = grad
            elif param.grad.layout != torch.strided:
                param.grad = param.grad + grad
            elif grad.layout != torch.strided or id(param) in queued:  # (a list holds a target once)
                param.grad.add_(grad)
            else:
                queued.add(id(param))
                targets, sources = batched.setdefault((grad.device, param.grad.dtype, grad.dtype), ([], []))
                targets.append(param.grad)
                sources.append(grad)
        for targets, sources in batched.values():
            torch._foreach_add_(targets, sources)


def _parameter_gradient(edge: GradientEdge, grad: torch.Tensor, chosen: dict[int, torch.Tensor]
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(parameter, its gradient) when a W root is a chosen parameter's AccumulateGrad, or a transpose right
    above it (a Linear's weight), so that phase 2 need not run autograd for it; None otherwise."""
    node = edge.node
    if node.name() == "TBackward0":
        below = node.next_functions
        if len(below) != 1 or below[0][0] is None:
            return None
        node, grad = below[0][0], grad.t()
    parameter = getattr(node, "variable", None)
    if (parameter is None or chosen.get(id(parameter)) is not parameter or grad.shape != parameter.shape
            or grad.dtype != parameter.dtype or grad.device != parameter.device):
        return None  # (what autograd would cast or move, it does)
    return parameter, grad


def backward_weights(pending: PendingWeights) -> None:
    """W: add the parameters' gradients to their `.grad` (as loss.backward() would: accumulate when .grad
    exists) and free the graph.

    Runs the boundaries again for their weight-side gradients only, then every node that leads only to
    parameters, once. Raises PlannerError when `pending` was already used. A caller's own
    `torch.utils.checkpoint.GraphExecGroup` around both B and W makes torch refuse W's second read of a
    checkpointed region's tensors (CheckpointError): hold one around W alone, or none.
    """
    if not isinstance(pending, PendingWeights):
        raise PlannerError(f"backward_weights: expected the PendingWeights of backward_inputs, "
                           f"got a {type(pending).__name__}")
    if pending.done:
        raise PlannerError(f"backward_weights: this PendingWeights (id {id(pending):#x}) was already used; "
                           "W runs once per backward_inputs")
    pending.done = True
    try:
        _run_weights(pending)
    finally:
        pending.weight_calls = []
        pending.roots = {}
        pending.params = []
        pending.foreign_storages = set()


def _recomputation_group() -> contextlib.AbstractContextManager[Any]:
    """A context, to enter around each of W's reads that take every saved tensor they read once, in which a
    region of the model checkpointed by torch's non-reentrant checkpoint is recomputed once for all of them
    (one `torch.utils.checkpoint.GraphExecGroup`). Torch recomputes once per graph task, and gives each read
    outside a backward call a task of its own: the weight formulas' reads re-ran a GPT-2 stage's checkpointed
    blocks once per tensor, 6x its whole backward. The group refuses a second read of a tensor, which W makes
    where a formula read some of a boundary's tensors before leaving it to autograd: those backward calls run
    outside it (T5's layer norms). A no-op where this torch has no such group, or the caller is in one."""
    group = getattr(torch.utils.checkpoint, "GraphExecGroup", None)
    if group is None or group._get_current_group() is not None:
        return contextlib.nullcontext()
    return group()


def _run_weights(pending: PendingWeights) -> None:
    """W's work (`backward_weights`). A weight formula's gradient for a parameter that has a `.grad` is added
    into it at once (one `_accumulate` per phase-1 call); the nodes left run as one `torch.autograd.backward`
    onto the parameters, whose AccumulateGrad adds each gradient as a plain backward does; a formula's gradient
    for a parameter without a `.grad` yet is put there last, copied where its storage is another's (a gradient
    W started from, one phase 2 put into a `.grad`). Collecting every gradient before adding any held one more
    copy of the stage's gradients at W's end from the second microbatch on (24 MiB against a plain backward's
    17 for 8 MiB of weights; a first stage's W, its whole backward, too); putting a formula's gradient into
    an empty `.grad` before phase 2 let phase 2 add into a tensor it still read (a parameter reached both by a
    formula and by autograd), or steal a view of it for another parameter."""
    roots = pending.roots
    reads = _recomputation_group()
    chosen = {id(param): param for param in pending.params}
    taken = set(pending.foreign_storages)
    first: list[tuple[torch.Tensor, torch.Tensor]] = []  # formula gradients of parameters without a .grad

    def direct(found: tuple[torch.Tensor, torch.Tensor], now: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        (now if found[0].grad is not None else first).append(found)

    for call in pending.weight_calls:
        with reads:
            grads = frontier_grads(call.roots, call.grads, call.captures)
        if grads is None:
            grads = torch.autograd.grad(call.roots, call.captures, call.grads, allow_unused=True)
        adds: list[tuple[torch.Tensor, torch.Tensor]] = []
        for key, edge, grad in zip(call.keys, call.captures, grads):
            if grad is None:
                continue
            found = _parameter_gradient(edge, grad, chosen) if key not in roots else None
            if found is not None:
                direct(found, adds)
            elif key in roots:
                roots[key] = (roots[key][0], roots[key][1] + grad)
            else:
                roots[key] = (edge, grad)
        _accumulate(adds, taken)
        del grads, adds
        found = grad = None  # (kept, the last gradient of this call would live on through the next one's)
    rest = {}
    adds = []
    for key, (edge, grad) in roots.items():
        found = _parameter_gradient(edge, grad, chosen)
        if found is None:
            rest[key] = (edge, grad)
        else:
            direct(found, adds)
    _accumulate(adds, taken)
    empty = [param for param in pending.params if param.grad is None]
    if rest and pending.params:
        with reads:  # the W nodes: none of them a boundary, whose tensors the formulas read
            torch.autograd.backward([edge for edge, _ in rest.values()], [grad for _, grad in rest.values()],
                                    inputs=pending.params)
    taken |= {_storage(param.grad) for param in empty if param.grad is not None and param.grad.layout == torch.strided}
    _accumulate(first, taken)
