"""Runtime tests: tiny tensors run faster, and steadier on shared cores, with one torch thread."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread for each runtime test module, restored after it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
