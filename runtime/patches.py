"""Attributes replaced for the length of a block, and put back after: the split's hooks into code it traces."""

from __future__ import annotations

from types import TracebackType
from typing import Any

__all__ = ["Patches"]

_ABSENT = object()


class Patches:
    """`replace(owner, name, value)` sets an attribute; `restore()` puts every one back as it was, last first (an
    attribute the owner did not hold itself, e.g. one it inherited, is deleted again).

    As a context manager: entering calls `patch()` (what a subclass replaces; all put back if it raises), leaving
    restores."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def patch(self) -> None:
        """The replacements to make on entering (none here)."""

    def __enter__(self) -> "Patches":
        try:
            self.patch()
        except BaseException:
            self.restore()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.restore()

    def replace(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, owner.__dict__.get(name, _ABSENT)))
        setattr(owner, name, value)

    def restore(self) -> None:
        for owner, name, value in reversed(self._saved):
            if value is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        self._saved.clear()
