"""runtime.opaque_calls.Arguments: a call's arguments rebuilt around the values a graph passes, None constants
kept apart from passed values, the capture device followed; an object holding a traced value refused, one holding
a real tensor (or a module) kept."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from runtime.opaque_calls import PASSED, Arguments, CallRefused


def _tensors(leaf: object) -> bool:
    return isinstance(leaf, torch.Tensor)


def test_arguments_rebuild_the_call_with_the_passed_values_in_their_places() -> None:
    x, y = torch.ones(2), torch.zeros(3)
    arguments, values = Arguments.of((x, None, [y, 2]), {"mask": None, "scale": 0.5},
                                     _tensors, "f")
    assert values == [x, y] and arguments.constants.count(PASSED) == 2 and None in arguments.constants
    a, b = torch.full((2,), 7.0), torch.full((3,), 8.0)
    args, kwargs = arguments.rebuild((a, b))
    assert args[0] is a and args[1] is None and args[2][0] is b and args[2][1] == 2
    assert kwargs == {"mask": None, "scale": 0.5}


def test_the_capture_device_follows_the_values_and_other_devices_stay() -> None:
    x = torch.ones(2)
    arguments, _ = Arguments.of((x, torch.device("cpu"), torch.device("meta")), {}, _tensors, "f")
    args, _ = arguments.rebuild((torch.ones(2, device="meta"),))
    assert args[1] == torch.device("meta") and args[2] == torch.device("meta")
    arguments, _ = Arguments.of((x, torch.device("meta")), {}, _tensors, "f")
    args, _ = arguments.rebuild((torch.ones(2),))
    assert args[1] == torch.device("meta")  # not the capture device: kept as given


def test_an_object_holding_a_traced_value_is_refused_naming_the_call_and_the_attribute() -> None:
    with FakeTensorMode() as fake_mode:
        fake = torch.ones(2)
    with pytest.raises(CallRefused, match=r"checkpointed blocks.1, .* SimpleNamespace object .*\(SimpleNamespace.parts\[1\]\)"):
        Arguments.of((torch.ones(2), SimpleNamespace(parts=[1.0, fake])), {}, _tensors, "checkpointed blocks.1")
    proxy = fx.Proxy(fx.Graph().placeholder("x"))
    with pytest.raises(CallRefused, match=r"\(SimpleNamespace.scale\)"):
        Arguments.of((), {"context": SimpleNamespace(scale=proxy)}, lambda leaf: isinstance(leaf, fx.Proxy), "f")
    del fake_mode


def test_an_object_holding_a_real_tensor_or_a_module_is_held() -> None:
    held = SimpleNamespace(table=torch.ones(3), layer=nn.Linear(2, 2))
    arguments, values = Arguments.of((torch.ones(2), held), {}, _tensors, "f")
    assert values and arguments.rebuild((torch.zeros(2),))[0][1] is held
