"""Modules torch.export cannot capture, kept whole: one operation of the exported graph that calls the module.

Export fails on control flow that depends on tensor values: a mixture of experts' loop over the experts a batch
hits (`for expert in expert_hit`, transformers 4.x), `if mask.any():`, `.item()` for a size. Where the failing code
runs inside a module that encloses no split point, nothing needs to be traced inside it: `failing_modules` names
the innermost such module on the failure's traceback (and every other module of its class that encloses no split
point, since they run the same code), and `KeptModules` exports again with each of them as one opaque operation
(`runtime.opaque_calls.opaque_call`). The shapes of its outputs come from one eager run of the model on the
example microbatch (its state and random state put back after). In the stage the operation becomes a call of the
module itself, which the stage holds under its name in the model (its parameters train there), so it runs
eagerly, as written.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
import torch.utils.checkpoint
from torch import fx, nn

from runtime.opaque_calls import Arguments, opaque_call, output_tensors, real_module
from runtime.patches import Patches
from runtime.model_state import model_state, restore_model_state

__all__ = ["KeptModule", "KeptModules", "failing_modules"]


class KeptModule:
    """One call of a module kept whole, as the target of a graph node: `node(module, *values)` calls `function`
    (the module's own `nn.Module.__call__`, or the function the model checkpointed, which takes the module first)
    on the call's `arguments` with the graph's values in their places, through
    `torch.utils.checkpoint.checkpoint(..., **checkpoint)` where the model checkpoints the call
    (`runtime.checkpointed`); returns its output's tensors as a list, or with `flat` False (torch.fx) the output."""

    def __init__(self, path: str, module: nn.Module, arguments: Arguments,
                 function: Callable[..., Any] = nn.Module.__call__, checkpoint: dict[str, Any] | None = None,
                 flat: bool = True) -> None:
        self.path = path
        self.module = module
        self.arguments = arguments
        self.outputs: list[torch.Tensor] = []  # during the capture (`opaque_call`): the output's tensors
        self.function = function
        self.checkpoint = checkpoint
        self.flat = flat
        self.__name__ = f"call_{path.replace('.', '_')}"  # torch.fx's generated code names its targets by these
        self.__module__ = __name__

    def __call__(self, module: nn.Module, *values: Any) -> Any:
        args, kwargs = self.arguments.rebuild(values)
        call = functools.partial(self.function, module, **kwargs)
        output = call(*args) if self.checkpoint is None else torch.utils.checkpoint.checkpoint(call, *args,
                                                                                              **self.checkpoint)
        return output_tensors(output) if self.flat else output

    def run_whole(self, module: nn.Module, *values: Any) -> list[torch.Tensor]:
        """The call's output tensors, made without checkpointing (to compare outputs, not to train)."""
        args, kwargs = self.arguments.rebuild(values)
        return output_tensors(self.function(module, *args, **kwargs))

    def place(self, graph: fx.Graph, node: fx.Node, tensors: Sequence[fx.Node], attributes: dict[str, Any]) -> None:
        """Make `node` call the module, read by a get_attr node just before it (so its stage holds the module)."""
        with graph.inserting_before(node):
            holder = graph.get_attr(self.path)
        attributes[self.path] = self.module
        node.target = self
        node.args = (holder, *tensors)

    def __repr__(self) -> str:
        how = "checkpointed" if self.checkpoint is not None else "kept whole"
        return f"{self.path} ({type(self.module).__name__}, {how})"


class KeptModules(Patches):
    """Within the block, a call of each module in `paths` is one opaque operation of the graph export records."""

    def __init__(self, model: nn.Module, paths: Sequence[str], example_inputs: tuple[Any, ...]) -> None:
        super().__init__()
        self.model = model
        self.paths = list(paths)
        self.example_inputs = example_inputs

    def patch(self) -> None:
        if not self.paths:
            return
        outputs = _eager_outputs(self.model, self.paths, self.example_inputs)
        for path in self.paths:
            module = self.model.get_submodule(path)
            self.replace(module, "forward", _stand_in(path, module, outputs[path]))


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
            owner = real_module(frame.tb_frame.f_locals.get("self"))
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
        arguments, tensors = Arguments.of(args, kwargs, lambda leaf: isinstance(leaf, torch.Tensor), path)
        return opaque_call(KeptModule(path, module, arguments), tensors, output)

    return forward
