"""Finds the execution-ordered layers of any nn.Module, named by fully qualified module names.

One forward pass is recorded as a tree of module calls: a module appears once, at its first call,
as a child of the module that was running then, under the name `named_modules()` gives it first
(a module shared by two parents, e.g. one embedding used by an encoder and a decoder, is one call
and one name). Modules that are never called (`nn.ModuleList`, `nn.ModuleDict`, unused ones) are
not in the tree, so every layer is a module the forward calls.

A *layer* begins at its module's first call and lasts until the next layer begins; functional
operations in between (residual adds, reshapes, the loss) and later calls of modules already seen
belong to it. Layers are listed in first-call order, which is execution order. They are chosen:

- by default: start from the calls the model's forward makes, looking through a forward that calls
  just one module (repeatedly, while that module calls modules of its own). Then, recursively, a
  call is replaced by the calls it makes if
  (a) its module is an `nn.Sequential` (or subclass),
  (b) it holds a *stack*: it calls two or more non-leaf modules of one class that are members of
      one indexed container (named `<container>.<index>`, e.g. an `nn.ModuleList` or
      `nn.Sequential`); two same-class blocks held as separate attributes (self_attn, cross_attn)
      are not a stack, or
  (c) a call anywhere below it holds a stack.
  The members of a stack are *blocks*: they, and everything inside them, are opened only where
  they are `nn.Sequential`s, never for (b) or (c), so a mixture-of-experts block keeps its experts
  and a block looping over same-class sub-layers stays whole. So the blocks are found at any depth,
  and the modules around them come out as the stack's callers call them: a GPT-2 as
  `transformer.wte, transformer.wpe, transformer.drop, transformer.h.0 ... transformer.ln_f,
  lm_head`; a BERT classifier held in an attribute `bert` as `bert.bert.embeddings,
  bert.bert.encoder.layer.0 ... bert.bert.pooler, bert.dropout, bert.classifier`; a T5 as
  `encoder.embed_tokens, encoder.dropout, encoder.block.0 ... encoder.final_layer_norm,
  decoder.embed_tokens, decoder.dropout, decoder.block.0 ... decoder.final_layer_norm, lm_head`.
  A model that is a plain `nn.Sequential` (its forward is `nn.Sequential.forward`, which calls
  every child in order) is split into its children without recording a forward.
- `depth=N`: the calls N levels below the model's forward (leaves above that depth stay, and
  checkpointed calls).
- `split_points=[...]`: layers begin exactly at these modules (and at the forward's first call); a
  module inside a checkpointed call is refused.
  `depth` and `split_points` cannot be combined.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from planner.errors import ProfileError
from planner.profiling.checkpoint_regions import checkpoint_depth, counting_checkpoints


class NoLayersError(ProfileError):
    """The model's forward calls no submodule: there is nothing to split it between."""


@dataclass(frozen=True)
class Layer:
    """One layer: the module that begins it, its fully qualified name and class name."""

    name: str
    kind: str
    module: nn.Module = field(compare=False, repr=False)


@dataclass
class _Call:
    """A module's first call in the recorded forward, with the modules it called in turn."""

    name: str
    module: nn.Module
    order: int
    depth: int
    children: list["_Call"] = field(default_factory=list)
    inside_checkpoints: int = 0  # `checkpoint_depth()` at the call
    checkpointed: bool = False  # the forward checkpoints this call (it is deeper in checkpoints than its caller)


def record_call_tree(model: nn.Module, run_forward: Callable[[], Any]) -> _Call:
    """Run `run_forward` once (no grad) with hooks on every module; return the tree of first calls."""
    names = {module: name for name, module in model.named_modules()}
    root = _Call(name="", module=model, order=0, depth=0)
    calls: dict[nn.Module, _Call] = {model: root}
    stack: list[_Call] = []

    def pre_hook(module: nn.Module, _args: Any) -> None:
        call = calls.get(module)
        if call is None:
            parent = stack[-1] if stack else root
            inside = checkpoint_depth()
            call = _Call(names[module], module, order=len(calls), depth=parent.depth + 1, inside_checkpoints=inside,
                         checkpointed=inside > parent.inside_checkpoints)
            calls[module] = call
            parent.children.append(call)
        stack.append(call)

    def post_hook(_module: nn.Module, _args: Any, _output: Any) -> None:
        stack.pop()

    handles = []
    for module in names:
        if module is not model:
            handles.append(module.register_forward_pre_hook(pre_hook))
            handles.append(module.register_forward_hook(post_hook, always_call=True))
    try:
        with counting_checkpoints() as checkpointed:
            run_forward()  # with autograd on: some models differentiate inside their forward
    finally:
        for handle in handles:
            handle.remove()
    for call in calls.values():  # a layer that checkpoints its own forward is called before the checkpoint begins
        call.checkpointed = call.checkpointed or id(call.module) in checkpointed
    return root


def choose_layers(
    root: _Call, depth: int | None = None, split_points: list[str] | None = None
) -> list[Layer]:
    """Pick layers from a call tree (see the module docstring); in execution order."""
    if depth is not None and split_points:
        raise ProfileError("give either --depth or --split-points, not both")
    if not root.children:
        raise NoLayersError("the model's forward calls no submodule, so it cannot be split into layers")
    if split_points:
        calls = _split_point_calls(root, split_points)
    elif depth is not None:
        calls = _calls_at_depth(root, depth)
    else:
        calls = _default_calls(root)
    calls = sorted(calls, key=lambda call: call.order)
    return [Layer(call.name, type(call.module).__name__, call.module) for call in calls]


def find_layers(
    model: nn.Module, run_forward: Callable[[], Any], depth: int | None = None,
    split_points: list[str] | None = None,
) -> list[Layer]:
    """The execution-ordered layers of `model` (one forward through `run_forward` is recorded)."""
    plain_sequential = isinstance(model, nn.Sequential) and type(model).forward is nn.Sequential.forward
    if plain_sequential and depth is None and not split_points:
        return [Layer(name, type(child).__name__, child) for name, child in model.named_children()]
    return choose_layers(record_call_tree(model, run_forward), depth, split_points)


def _default_calls(root: _Call) -> list[_Call]:
    """Root's calls, expanding Sequentials and stack holders; descend while there is only one."""
    calls = root.children
    while len(calls) == 1 and calls[0].children and not calls[0].checkpointed:
        calls = calls[0].children
    expanded: list[_Call] = []
    for call in calls:
        expanded.extend(_expand(call))
    return expanded


def _expand(call: _Call, in_block: bool = False) -> list[_Call]:
    """The call, or its children expanded in turn; `in_block`: within a stack member (only Sequentials open)."""
    if not call.children or call.checkpointed:
        return [call]
    stack = not in_block and _holds_stack(call)
    if isinstance(call.module, nn.Sequential) or stack or (not in_block and _has_stack_below(call)):
        members = _stack_members(call) if stack else set()
        return [leaf for child in call.children for leaf in _expand(child, in_block or id(child) in members)]
    return [call]


def _has_stack_below(call: _Call) -> bool:
    """True if a call anywhere below `call` holds a stack."""
    return any(_holds_stack(child) or _has_stack_below(child) for child in call.children)


def _holds_stack(call: _Call) -> bool:
    """True if the call runs two or more non-leaf modules of one class from one indexed container."""
    return bool(_stack_members(call))


def _stack_members(call: _Call) -> set[int]:
    """ids of the child calls that are members of a stack (see `_holds_stack`)."""
    groups: dict[tuple[type, str], list[_Call]] = {}
    for child in call.children:
        container, _, index = child.name.rpartition(".")
        if child.children and index.isdigit():
            groups.setdefault((type(child.module), container), []).append(child)
    return {id(member) for members in groups.values() if len(members) > 1 for member in members}


def _calls_at_depth(root: _Call, depth: int) -> list[_Call]:
    """Calls `depth` levels below the root, or leaves above that depth."""
    result: list[_Call] = []

    def walk(call: _Call) -> None:
        if call.depth == depth or not call.children or call.checkpointed:
            result.append(call)
        else:
            for child in call.children:
                walk(child)

    for child in root.children:
        walk(child)
    return result


def _split_point_calls(root: _Call, split_points: list[str]) -> list[_Call]:
    """Calls of the named modules, plus the forward's first call so that layer 0 starts at the start."""
    by_name: dict[str, _Call] = {}
    within: dict[str, str] = {}  # a module called inside a checkpointed call -> that call's module

    def index(call: _Call, checkpointed: str | None) -> None:
        by_name[call.name] = call
        if checkpointed is not None:
            within[call.name] = checkpointed
        for child in call.children:
            index(child, checkpointed if checkpointed is not None else call.name if call.checkpointed else None)

    index(root, None)
    del by_name[""]
    chosen: dict[str, _Call] = {}
    for name in split_points:
        if name not in by_name:
            known = ", ".join(list(by_name)[:8])
            raise ProfileError(
                f"split point {name!r} is not a module the model's forward calls; "
                f"called modules include: {known}"
            )
        if name in within:
            raise ProfileError(f"split point {name!r} is inside {within[name]}, which the forward checkpoints "
                               f"(torch.utils.checkpoint) as one call: split at {within[name]} or outside it")
        chosen[name] = by_name[name]
    first = root.children[0]
    if all(call.order > first.order for call in chosen.values()):
        chosen[first.name] = first
    return list(chosen.values())
