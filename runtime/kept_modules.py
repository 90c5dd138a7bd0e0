"""Modules torch.export cannot capture, kept whole: one operation of the exported graph that calls the module.

Export fails on control flow that depends on tensor values: a mixture of experts' loop over the experts a batch
hits (`for expert in expert_hit`, transformers 4.x), `if mask.any():`, `.item()` for a size. Where the failing code
runs inside a module that encloses no split point, nothing needs to be traced inside it: `failing_modules` names
the innermost such module on the failure's traceback (and every other module of its class that encloses no split
point, since they run the same code), and `KeptModules` exports again with each of them as one opaque operation
(`runtime.custom_functions.opaque_call`). The shapes of its outputs come from one eager run of the model on the
example microbatch (its state and random state put back after). In the stage the operation becomes a call of the
module itself, which the stage holds under its name in the model (its parameters train there), so it runs
eagerly, as written.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Sequence

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from runtime.custom_functions import opaque_call, output_tensors
from runtime.model_state import model_state, restore_model_state

__all__ = ["KeptModule", "KeptModules", "failing_modules"]


class KeptModule:
    """One call of a module kept whole, as the target of a graph node: `node(module, *tensors)` calls the module
    on the call's arguments with `tensors` in the places the graph fills (`spec`: the pytree of (args, kwargs);
    `constants`: its leaves, None where a tensor goes) and returns its output's tensors as a list."""

    def __init__(self, path: str, module: nn.Module, spec: pytree.TreeSpec, constants: list[Any],
                 outputs: list[torch.Tensor]) -> None:
        self.path = path
        self.module = module
        self.spec = spec
        self.constants = constants
        self.outputs = outputs  # the output's tensors in the eager run: the operator's fake kernel copies their shapes
        self.__name__ = f"call_{path.replace('.', '_')}"  # torch.fx's generated code names its targets by these
        self.__module__ = __name__

    def __call__(self, module: nn.Module, *tensors: torch.Tensor) -> list[torch.Tensor]:
        given = iter(tensors)
        args, kwargs = pytree.tree_unflatten([next(given) if constant is None else constant
                                              for constant in self.constants], self.spec)
        return output_tensors(module(*args, **kwargs))

    def place(self, graph: fx.Graph, node: fx.Node, tensors: Sequence[fx.Node], attributes: dict[str, Any]) -> None:
        """Make `node` call the module, read by a get_attr node just before it (so its stage holds the module)."""
        with graph.inserting_before(node):
            holder = graph.get_attr(self.path)
        attributes[self.path] = self.module
        node.target = self
        node.args = (holder, *tensors)

    def __repr__(self) -> str:
        return f"{self.path} ({type(self.module).__name__}, kept whole)"


class KeptModules:
    """Within the block, a call of each module in `paths` is one opaque operation of the graph export records."""

    def __init__(self, model: nn.Module, paths: Sequence[str], example_inputs: tuple[Any, ...]) -> None:
        self.model = model
        self.paths = list(paths)
        self.example_inputs = example_inputs
        self._saved: list[tuple[nn.Module, Any]] = []

    def __enter__(self) -> "KeptModules":
        if not self.paths:
            return self
        outputs = _eager_outputs(self.model, self.paths, self.example_inputs)
        for path in self.paths:
            module = self.model.get_submodule(path)
            self._saved.append((module, module.__dict__.get("forward", _ABSENT)))
            module.forward = _stand_in(path, module, outputs[path])
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        for module, forward in reversed(self._saved):
            if forward is _ABSENT:
                del module.forward
            else:
                module.forward = forward
        self._saved.clear()


def failing_modules(model: nn.Module, exc: BaseException, split_points: Sequence[str],
                    kept: Sequence[str]) -> list[str]:
    """The innermost module of `model` (not the model itself) on `exc`'s traceback (causes included) that encloses
    no split point and is not kept yet, with every other module of its class that encloses none; [] if there is none."""
    names = {id(module): name for name, module in model.named_modules()}
    enclosing = {".".join(point.split(".")[:end]) for point in split_points for end in range(len(point.split(".")))}
    innermost: nn.Module | None = None
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        frame = error.__traceback__
        while frame is not None:
            owner = frame.tb_frame.f_locals.get("self")
            name = names.get(id(owner)) if isinstance(owner, nn.Module) else None
            if name and name not in enclosing and name not in kept:  # never the model itself
                innermost = owner
            frame = frame.tb_next
        error = error.__cause__ or error.__context__
    if innermost is None:
        return []
    return [name for name, module in model.named_modules()
            if type(module) is type(innermost) and name not in enclosing and name not in kept
            and not any(name.startswith(f"{other}.") for other in kept)]


_ABSENT = object()


def _eager_outputs(model: nn.Module, paths: Sequence[str], inputs: tuple[Any, ...]) -> dict[str, list[Any]]:
    """What each module of `paths` returns at each of its calls when the model runs on `inputs` (no autograd;
    the model's state and the random state put back after)."""
    found: dict[str, list[Any]] = {path: [] for path in paths}
    hooks = [model.get_submodule(path).register_forward_hook(
        lambda _module, _args, output, path=path: found[path].append(output)) for path in paths]
    saved = model_state(model)
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            model(*inputs)
    finally:
        for hook in hooks:
            hook.remove()
        restore_model_state(saved)
    return found


def _stand_in(path: str, module: nn.Module, outputs: list[Any]) -> Any:
    """The module's forward during the capture: its k-th call is one operation shaped like its k-th eager output."""
    calls = iter(outputs)

    def forward(*args: Any, **kwargs: Any) -> Any:
        output = next(calls, None)
        if output is None:
            raise RuntimeError(f"{path} is called more often under torch.export than when the model runs")
        leaves, spec = pytree.tree_flatten((args, kwargs))
        constants = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        output_leaves, output_spec = pytree.tree_flatten(output)
        kept = KeptModule(path, module, spec, constants, output_tensors(output))
        given = iter(opaque_call(kept, tensors))
        return pytree.tree_unflatten([next(given) if isinstance(leaf, torch.Tensor) else leaf
                                      for leaf in output_leaves], output_spec)

    return forward
