"""Resolves device and dtype names given by a user, and names the hardware for the profile."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

from planner.errors import DeviceError, ProfileError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def resolve_device(name: str) -> torch.device:
    """`auto`, `cpu`, `cuda` or `cuda:N` as a torch.device that exists here, else DeviceError.

    `auto` is the device `planner train` runs on by default: the current GPU where torch sees one, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise DeviceError(name, "not a device name; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise DeviceError(name, f"device type {device.type!r} is not supported; use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise DeviceError(name, "CUDA is not available on this machine (torch.cuda.is_available() is False); use --device cpu")
    count = torch.cuda.device_count()
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= count:
        raise DeviceError(name, f"this machine has {count} CUDA device(s), numbered 0..{count - 1}")
    return torch.device("cuda", index)


def resolve_dtype(name: str) -> torch.dtype:
    """A dtype from its name (float32, bfloat16, float16, float64), else ProfileError."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ProfileError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}") from None


def device_name(device: torch.device) -> str:
    """Human-readable hardware name: the GPU's name, or the CPU model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "cpu"
