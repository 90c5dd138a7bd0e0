"""The typed errors: one line each, with the offending values."""

from __future__ import annotations

import math

from planner.errors import InfeasiblePlanError


def test_infeasible_plan_error_finds_the_smallest_memory_only_when_read() -> None:
    """Given as a function, the smallest memory is searched for when the value or the message is first read, once;
    a value given outright reads the same."""
    calls: list[int] = []

    def search() -> float:
        calls.append(1)
        return 12_345_678_901.0

    error = InfeasiblePlanError(8e9, search)
    assert calls == []
    assert str(error) == ("no plan fits in 8 GB per device; the smallest memory that admits a plan is 12.346 GB "
                          "(pass --memory 12.346GB or more, use more GPUs, a smaller --microbatch-size or "
                          "--global-batch-size, or an optimizer with less state)")
    assert error.smallest_memory_bytes == 12_345_678_901.0 and calls == [1]
    assert str(InfeasiblePlanError(8e9, 12_345_678_901.0)) == str(error) and calls == [1]


def test_infeasible_plan_error_asked_below_a_bound_searches_only_where_it_needs_less() -> None:
    """`smallest_memory_below(bound)`: inf where the search below the bound finds nothing (the value stays unread);
    the value where it is less, kept for the message; without a search below a bound, the whole search decides."""
    asked: list[float] = []

    def below(bound: float) -> float:
        asked.append(bound)
        return 5e9 if bound > 5e9 else math.inf

    error = InfeasiblePlanError(1e9, lambda: 5e9, smallest_below=below)
    assert error.smallest_memory_below(4e9) == math.inf and callable(error._smallest)
    assert error.smallest_memory_below(6e9) == 5e9 and asked == [4e9, 6e9]
    assert error.smallest_memory_bytes == 5e9 and error.smallest_memory_below(5e9) == math.inf and asked == [4e9, 6e9]
    plain = InfeasiblePlanError(1e9, lambda: 5e9)
    assert plain.smallest_memory_below(4e9) == math.inf and plain.smallest_memory_below(math.inf) == 5e9


def test_infeasible_plan_error_suggests_smaller_microbatches_either_way() -> None:
    """What would fix it names a smaller --microbatch-size or --global-batch-size beside more memory or GPUs, with or
    without a detail, in one line."""
    for error in (InfeasiblePlanError(1e6, 1.09e8), InfeasiblePlanError(1e6, 1.09e8, detail="once buffers count")):
        message = str(error)
        assert "a smaller --microbatch-size or --global-batch-size" in message and "\n" not in message
        assert "0.109" in message and message.endswith(("or an optimizer with less state", "with less state)"))
