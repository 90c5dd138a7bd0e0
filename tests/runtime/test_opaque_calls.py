"""runtime.opaque_calls.Arguments: a call's arguments rebuilt around the values a graph passes, None constants
kept apart from passed values, the capture device followed."""

from __future__ import annotations

import torch

from runtime.opaque_calls import PASSED, Arguments


def test_arguments_rebuild_the_call_with_the_passed_values_in_their_places() -> None:
    x, y = torch.ones(2), torch.zeros(3)
    arguments, values = Arguments.of((x, None, [y, 2]), {"mask": None, "scale": 0.5},
                                     lambda leaf: isinstance(leaf, torch.Tensor))
    assert values == [x, y] and arguments.constants.count(PASSED) == 2 and None in arguments.constants
    a, b = torch.full((2,), 7.0), torch.full((3,), 8.0)
    args, kwargs = arguments.rebuild((a, b))
    assert args[0] is a and args[1] is None and args[2][0] is b and args[2][1] == 2
    assert kwargs == {"mask": None, "scale": 0.5}


def test_the_capture_device_follows_the_values_and_other_devices_stay() -> None:
    x = torch.ones(2)
    arguments, _ = Arguments.of((x, torch.device("cpu"), torch.device("meta")), {}, lambda leaf: isinstance(leaf, torch.Tensor))
    args, _ = arguments.rebuild((torch.ones(2, device="meta"),))
    assert args[1] == torch.device("meta") and args[2] == torch.device("meta")
    arguments, _ = Arguments.of((x, torch.device("meta")), {}, lambda leaf: isinstance(leaf, torch.Tensor))
    args, _ = arguments.rebuild((torch.ones(2),))
    assert args[1] == torch.device("meta")  # not the capture device: kept as given
