"""An optimizer's state keyed by parameter name instead of torch's integer index, so that a checkpoint loads into a
differently split model (a re-partitioned plan): `named_optimizer_state` and its inverse `load_named_optimizer_state`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from runtime.checkpoint import CheckpointError, same_value
from runtime.nested import map_tensors

__all__ = ["load_named_optimizer_state", "named_optimizer_state"]


def named_optimizer_state(optimizer: torch.optim.Optimizer,
                          named_parameters: Iterable[tuple[str, nn.Parameter]]) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name instead of torch's integer index.

    Returns {"state": {name: {key: value}}, "param_groups": [{hyper-parameters..., "params":
    [names]}], "shapes": {name: [dims]}}: torch's `optimizer.state_dict()` with every index
    replaced by the names `named_parameters` gives that parameter. Pass
    `module.named_parameters(remove_duplicate=False)`: a tied parameter is then recorded under
    every name (the same tensors, stored once by torch.save), so a stage that knows it by another
    name finds it. Tensors are the optimizer's own (not copied): save or copy before the next
    step. CheckpointError if an optimized parameter has no name.
    """
    names = _names_by_id(named_parameters)
    torch_state = optimizer.state_dict()
    index_names: dict[int, list[str]] = {}
    shapes: dict[str, list[int]] = {}
    groups = []
    for group_index, (group, saved) in enumerate(zip(optimizer.param_groups, torch_state["param_groups"])):
        group_names = []
        for position, (parameter, index) in enumerate(zip(group["params"], saved["params"])):
            aliases = _names_of(names, parameter, group_index, position)
            index_names[index] = aliases
            shapes.update((name, list(parameter.shape)) for name in aliases)
            group_names.extend(aliases)
        hyper = {key: value for key, value in saved.items() if key not in ("params", "param_names")}
        groups.append({**hyper, "params": group_names})
    state = {name: values for index, values in torch_state["state"].items() for name in index_names[index]}
    return {"state": state, "param_groups": groups, "shapes": shapes}


def load_named_optimizer_state(optimizer: torch.optim.Optimizer,
                               named_parameters: Iterable[tuple[str, nn.Parameter]],
                               state: dict[str, Any], source: str | Path = "optimizer state") -> None:
    """Load a `named_optimizer_state` (or `optimizer_state_of`) dict into `optimizer`, matching parameters by name.

    Each parameter takes the state saved under the first of its names that has some (copied,
    cast to its device and dtype as torch does; pass `named_parameters(remove_duplicate=False)` so
    that a tied parameter is looked up under every name); parameters the state lacks start fresh (no state). Each param group
    takes the hyper-parameters (lr, momentum, betas, ...) of the saved groups holding its
    parameters, and keeps its own if none does. CheckpointError (naming `source`) if a parameter
    has another shape than saved, the saved groups of one new group disagree on hyper-parameters,
    or an optimized parameter has no name.
    """
    names = _names_by_id(named_parameters)
    saved_state: dict[str, dict[str, Any]] = state["state"]
    saved_shapes: dict[str, list[int]] = state.get("shapes", {})
    saved_group_of = {name: group for group in state["param_groups"] for name in group["params"]}
    current = optimizer.state_dict()
    torch_state: dict[int, dict[str, Any]] = {}
    groups = []
    for group_index, (group, own) in enumerate(zip(optimizer.param_groups, current["param_groups"])):
        sources: list[tuple[str, dict[str, Any]]] = []
        for position, (parameter, index) in enumerate(zip(group["params"], own["params"])):
            all_names = _names_of(names, parameter, group_index, position, source)
            for name in all_names:
                if name in saved_shapes and list(parameter.shape) != list(saved_shapes[name]):
                    raise CheckpointError(
                        str(source), f"parameter {name!r} has shape {list(parameter.shape)} here but "
                        f"{list(saved_shapes[name])} in the checkpoint",
                        "resume with the model the checkpoint was made from",
                    )
            known = next((name for name in all_names if name in saved_state), None)
            if known is not None:
                # fresh tensors: the optimizer updates them in place, and tied names must not share them
                torch_state[index] = map_tensors(lambda t: t.detach().clone(), saved_state[known])
            grouped = next((name for name in all_names if name in saved_group_of), None)
            if grouped is not None:
                sources.append((grouped, saved_group_of[grouped]))
        groups.append({**own, **_hyper_parameters(sources, source)})
    optimizer.load_state_dict({"state": torch_state, "param_groups": groups})


def _hyper_parameters(sources: list[tuple[str, dict[str, Any]]], source: str | Path) -> dict[str, Any]:
    """The hyper-parameters the saved groups of one new group agree on; CheckpointError if they differ."""
    if not sources:
        return {}
    first_name, first = sources[0]
    chosen = {key: value for key, value in first.items() if key not in ("params", "param_names")}
    for name, group in sources[1:]:
        other = {key: value for key, value in group.items() if key not in ("params", "param_names")}
        if other.keys() != chosen.keys() or not all(same_value(chosen[key], other[key]) for key in chosen):
            raise CheckpointError(
                str(source), f"parameters {first_name!r} and {name!r} share a param group here but were saved "
                "with different hyper-parameters", "put them in separate param groups, as when saved",
            )
    return chosen


def _names_by_id(named_parameters: Iterable[tuple[str, nn.Parameter]]) -> dict[int, list[str]]:
    """Parameter id -> its names, in the order given, without repeats."""
    names: dict[int, list[str]] = {}
    for name, parameter in named_parameters:
        held = names.setdefault(id(parameter), [])
        if name not in held:
            held.append(name)
    return names


def _names_of(names: dict[int, list[str]], parameter: torch.Tensor, group_index: int, position: int,
              source: str | Path = "optimizer state") -> list[str]:
    """The names of an optimized parameter; CheckpointError (naming `source`) if `named_parameters` lacks it."""
    held = names.get(id(parameter))
    if not held:
        raise CheckpointError(
            str(source), f"the optimizer's parameter {position} of param group {group_index} (shape "
            f"{list(parameter.shape)}) is not among named_parameters",
            "pass the named_parameters() of the module the optimizer trains",
        )
    return held
