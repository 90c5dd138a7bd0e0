"""Device names a user gives: `auto` is where `planner train` runs by default; bad names are DeviceError."""

from __future__ import annotations

import pytest
import torch

from planner.errors import DeviceError
from planner.profiling.devices import resolve_device


def test_auto_is_the_gpu_where_torch_sees_one_else_the_cpu() -> None:
    expected = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    assert resolve_device("auto") == expected


@pytest.mark.parametrize("name, expected", [("cpu", torch.device("cpu")), ("cpu:0", torch.device("cpu"))])
def test_cpu_names(name: str, expected: torch.device) -> None:
    assert resolve_device(name) == expected


@pytest.mark.parametrize("name, message", [("nonsense", "not a device name"), ("meta", "is not supported")])
def test_bad_names_say_what_to_use(name: str, message: str) -> None:
    with pytest.raises(DeviceError, match=message) as raised:
        resolve_device(name)
    assert name in str(raised.value)
