"""Optimizer state by parameter name: names for indices, hyper-parameters kept, missing parameters start fresh,
and mismatches are errors naming the parameter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runtime.checkpoint import CheckpointError
from runtime.optimizer_state import load_named_optimizer_state, named_optimizer_state


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_named_state_keys_are_names_and_keep_hyper_parameters() -> None:
    model = tiny()
    optimizer = torch.optim.Adam([{"params": model[0].parameters(), "lr": 0.1},
                                  {"params": model[2].parameters(), "lr": 0.2}], betas=(0.7, 0.9))
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    named = named_optimizer_state(optimizer, model.named_parameters())
    assert set(named["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert torch.equal(named["state"]["2.weight"]["exp_avg"], optimizer.state[model[2].weight]["exp_avg"])
    assert [group["params"] for group in named["param_groups"]] == [["0.weight", "0.bias"], ["2.weight", "2.bias"]]
    assert [group["lr"] for group in named["param_groups"]] == [0.1, 0.2]
    assert named["param_groups"][0]["betas"] == (0.7, 0.9)
    assert named["shapes"]["0.weight"] == [8, 4]


def test_parameters_the_state_lacks_start_fresh() -> None:
    source = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(source.parameters(), lr=0.5, momentum=0.9)
    source(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    named = named_optimizer_state(optimizer, source.named_parameters())

    target = nn.ModuleDict({"lin": nn.Linear(3, 2), "extra": nn.Linear(2, 2)})
    target_optimizer = torch.optim.SGD(target.parameters(), lr=0.01, momentum=0.5)
    renamed = {"state": {f"lin.{key}": value for key, value in named["state"].items()},
               "param_groups": [{**named["param_groups"][0], "params": ["lin.weight", "lin.bias"]}],
               "shapes": {f"lin.{key}": value for key, value in named["shapes"].items()}}
    load_named_optimizer_state(target_optimizer, target.named_parameters(), renamed)
    momentum = target_optimizer.state[target["lin"].weight]["momentum_buffer"]
    assert torch.equal(momentum, optimizer.state[source.weight]["momentum_buffer"])
    assert momentum is not optimizer.state[source.weight]["momentum_buffer"]  # a copy, not the saved tensor
    assert target["extra"].weight not in target_optimizer.state
    assert target_optimizer.param_groups[0]["lr"] == 0.5 and target_optimizer.param_groups[0]["momentum"] == 0.9


def test_a_parameter_of_another_shape_is_an_error_naming_it() -> None:
    source = nn.Linear(4, 3)
    optimizer = torch.optim.Adam(source.parameters())
    named = named_optimizer_state(optimizer, source.named_parameters())
    target = nn.Linear(5, 3)
    with pytest.raises(CheckpointError, match=r"parameter 'weight' has shape \[3, 5\] here but \[3, 4\]"):
        load_named_optimizer_state(torch.optim.Adam(target.parameters()), target.named_parameters(), named)


def test_unnamed_parameters_and_disagreeing_groups_are_errors() -> None:
    model = tiny()
    stray = nn.Parameter(torch.zeros(2))
    with pytest.raises(CheckpointError, match=r"parameter 0 of param group 1 \(shape \[2\]\) is not among"):
        named_optimizer_state(torch.optim.SGD([{"params": model.parameters()}, {"params": [stray]}], lr=0.1),
                              model.named_parameters())
    saved = named_optimizer_state(torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1},
                                                   {"params": model[2].parameters(), "lr": 0.2}]),
                                  model.named_parameters())
    with pytest.raises(CheckpointError, match="'0.weight' and '2.weight' share a param group here"):
        load_named_optimizer_state(torch.optim.SGD(model.parameters(), lr=1.0), model.named_parameters(), saved)
