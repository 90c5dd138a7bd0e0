"""planner.profiling.checkpoint_regions: code run by torch.utils.checkpoint (either variant, nested, however the
checkpoint function was imported) sees the depth, code outside sees 0, and torch is put back, also on error."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint  # bound before the block: still counted

from planner.profiling.checkpoint_regions import checkpoint_depth, counting_checkpoints


def _seen(depths: list[int]) -> torch.Tensor:
    depths.append(checkpoint_depth())
    return torch.ones(1, requires_grad=True) * 2


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_code_sees_how_deep_it_runs(reentrant: bool) -> None:
    depths: list[int] = []
    x = torch.ones(1, requires_grad=True)
    with counting_checkpoints():
        _seen(depths)
        checkpoint(lambda h: h * _seen(depths), x, use_reentrant=reentrant)
        checkpoint(lambda h: checkpoint(lambda g: g * _seen(depths), h, use_reentrant=False), x,
                   use_reentrant=reentrant)
    _seen(depths)
    assert depths == [0, 1, 2, 0]


def test_torch_is_put_back_after_an_error() -> None:
    before = (torch.utils.checkpoint._checkpoint_without_reentrant_generator,
              torch.utils.checkpoint.CheckpointFunction.__dict__["forward"])
    with pytest.raises(ValueError), counting_checkpoints():
        raise ValueError("the model failed")
    assert (torch.utils.checkpoint._checkpoint_without_reentrant_generator,
            torch.utils.checkpoint.CheckpointFunction.__dict__["forward"]) == before


class _SelfCheckpointing(torch.nn.Module):
    """Checkpoints its own forward from inside its call, as transformers 5.x layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)

    def twice(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        import functools
        return checkpoint(functools.partial(type(self).forward, self), x, use_reentrant=False)


def test_the_modules_checkpointed_are_named_by_module_bound_method_or_partial() -> None:
    a, b, c = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), _SelfCheckpointing()
    x = torch.ones(1, 2, requires_grad=True)
    helper = _SelfCheckpointing()
    with counting_checkpoints() as checkpointed:
        checkpoint(a, x, use_reentrant=True)
        checkpoint(b.forward, x, use_reentrant=False)
        c(x)
        checkpoint(lambda h: h * 2, x, use_reentrant=False)
        checkpoint(helper.twice, x, use_reentrant=False)  # a helper of a module: not the module's whole call
    assert list(checkpointed.values()) == [a, b, c]
