"""The all-reduce of gradients over a stage's replicas (`runtime.gradients.all_reduce_gradients`), on two gloo
processes."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from runtime.gradients import all_reduce_gradients
from tests.runtime.gloo_pair import run_gloo_pair

CPU = torch.device("cpu")


def _parameters(rank: int) -> list[nn.Parameter]:
    """Four parameters: `a` has a gradient on both ranks, `b` on rank 0 only, `c` on neither, `d` (float64, the
    widest dtype of the buffer) on rank 1 only."""
    a, b, c = (nn.Parameter(torch.zeros(3)) for _ in range(3))
    d = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    a.grad = torch.full((3,), 1.0 + 2 * rank)  # 1 and 3
    if rank == 0:
        b.grad = torch.full((3,), 2.0)
    else:
        d.grad = torch.full((2,), 4.0, dtype=torch.float64)
    return [a, b, c, d]


def _worker(rank: int, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        parameters = _parameters(rank)
        all_reduce_gradients(parameters, None, CPU, divide_by=2)
        torch.save([None if p.grad is None else p.grad.clone() for p in parameters], Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_replicas_sum_the_gradients_they_have_and_a_parameter_none_had_one_for_keeps_none(tmp_path: Path) -> None:
    """Both ranks end with the mean of the gradients (a missing one counts as zeros), in each parameter's dtype; the
    parameter no rank had a gradient for keeps `.grad` None, as on one device where nothing used it."""
    run_gloo_pair(_worker, tmp_path)
    for rank in range(2):
        a, b, c, d = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(a, torch.full((3,), 2.0))
        torch.testing.assert_close(b, torch.full((3,), 1.0))
        assert c is None
        torch.testing.assert_close(d, torch.full((2,), 2.0, dtype=torch.float64))
