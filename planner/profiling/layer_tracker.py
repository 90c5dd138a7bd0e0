"""Follows which layer is running during a forward pass, through hooks on the layers' modules.

Layer i *begins* at the first call of its module in a step and lasts until the next layer begins
(layers only move forward: a module called again later, such as a shared activation or a tied
embedding reused as the output head, runs inside whichever layer is current).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from torch.utils.hooks import RemovableHandle

from planner.profiling.layers import Layer

EnterHook = Callable[[int, tuple[Any, ...], dict[str, Any]], None]
ExitHook = Callable[[int, Any], None]


class LayerTracker:
    """Hooks on the layers' modules; `current` is the running layer's index (-1 before the first).

    `on_enter(index, args, kwargs)` runs when layer `index` begins (its module's first call in the
    step, before it runs); `on_exit(index, output)` runs when that call returns. Call `reset()`
    before each step and `remove()` (or leave the `with` block) when done.
    """

    def __init__(
        self, layers: Sequence[Layer], on_enter: EnterHook | None = None, on_exit: ExitHook | None = None
    ) -> None:
        self.current = -1
        self._exited: set[int] = set()
        self._on_enter = on_enter
        self._on_exit = on_exit
        self._handles: list[RemovableHandle] = []
        for index, layer in enumerate(layers):
            self._handles.append(
                layer.module.register_forward_pre_hook(self._pre_hook(index), with_kwargs=True)
            )
            if on_exit is not None:
                self._handles.append(layer.module.register_forward_hook(self._post_hook(index)))

    def reset(self) -> None:
        """Forget the previous step: no layer has begun."""
        self.current = -1
        self._exited.clear()

    def remove(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> "LayerTracker":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def _pre_hook(self, index: int) -> Callable[..., None]:
        def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if index > self.current:
                self.current = index
                if self._on_enter is not None:
                    self._on_enter(index, args, kwargs)
        return hook

    def _post_hook(self, index: int) -> Callable[..., None]:
        def hook(_module: Any, _args: Any, output: Any) -> None:
            if index == self.current and index not in self._exited and self._on_exit is not None:
                self._exited.add(index)
                self._on_exit(index, output)
        return hook
