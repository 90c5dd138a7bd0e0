"""RandomStream: a stage's own stream, independent of the default generator's state and of other streams."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from runtime.rng import RandomStream
from tests.conftest import gpu_only

CPU = torch.device("cpu")


def draw() -> torch.Tensor:
    return torch.rand(8)


def dropout_mask() -> torch.Tensor:
    return torch.nn.functional.dropout(torch.ones(64), p=0.5, training=True) != 0


def stream(seed: int, device: torch.device = CPU) -> RandomStream:
    made = RandomStream(device)
    made.reseed(seed)
    return made


def test_reseed_leaves_the_default_generator_as_it_was() -> None:
    torch.manual_seed(3)
    torch.rand(5)  # not at the start of a seed: a mid-stream state
    before = torch.get_rng_state()
    stream(11)
    assert torch.equal(torch.get_rng_state(), before)


def test_run_restores_the_default_generator() -> None:
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    made = stream(11)
    made.run(lambda: torch.rand(100))
    assert torch.equal(torch.rand(4), expected)


def test_run_restores_the_default_generator_when_the_function_raises() -> None:
    made = stream(11)
    torch.manual_seed(3)
    before = torch.get_rng_state()

    def failing() -> None:
        torch.rand(10)
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        made.run(failing)
    assert torch.equal(torch.get_rng_state(), before)


def test_draws_do_not_depend_on_the_default_generator_state() -> None:
    torch.manual_seed(1)
    first, _ = stream(5).run(draw)
    torch.manual_seed(2)
    torch.rand(7)
    second, _ = stream(5).run(draw)
    assert torch.equal(first, second)


def test_same_seed_gives_the_same_draws_and_another_seed_others() -> None:
    one, two, other = stream(5), stream(5), stream(6)
    for _ in range(3):
        a, _ = one.run(draw)
        b, _ = two.run(draw)
        c, _ = other.run(draw)
        assert torch.equal(a, b)
        assert not torch.equal(a, c)


def test_successive_runs_continue_the_stream_and_reseed_starts_it_again() -> None:
    made = stream(5)
    first, _ = made.run(draw)
    second, _ = made.run(draw)
    assert not torch.equal(first, second)
    made.reseed(5)
    again, _ = made.run(draw)
    assert torch.equal(again, first)


def test_run_returns_the_function_result() -> None:
    result, _ = stream(0).run(lambda: ("value", 3))
    assert result == ("value", 3)


def test_replaying_the_start_state_reproduces_the_dropout_mask() -> None:
    made = stream(9)
    mask, start = made.run(dropout_mask)
    assert 0 < int(mask.sum()) < mask.numel()  # a real mask: the check below can fail
    made.run(dropout_mask)  # the stream moves on
    torch.manual_seed(123)  # and so does the default generator
    replayed, replay_start = made.run(dropout_mask, replay=start)
    assert torch.equal(replayed, mask)
    assert torch.equal(replay_start, start)


def test_replay_does_not_advance_the_stream() -> None:
    plain = stream(9)
    expected = [plain.run(draw)[0] for _ in range(3)]
    made = stream(9)
    first, start = made.run(draw)
    second, _ = made.run(draw)
    made.run(draw, replay=start)  # replays the first draw: the stream stays after the second
    third, _ = made.run(draw)
    assert [torch.equal(a, b) for a, b in zip([first, second, third], expected)] == [True] * 3


def test_replay_leaves_the_default_generator_as_it_was() -> None:
    made = stream(9)
    _, start = made.run(draw)
    torch.manual_seed(4)
    before = torch.get_rng_state()
    made.run(draw, replay=start)
    assert torch.equal(torch.get_rng_state(), before)


def test_two_streams_on_one_device_interleaved_draw_as_each_alone() -> None:
    a, b = stream(1), stream(2)
    alone_a = [a.run(draw)[0] for _ in range(3)]
    alone_b = [b.run(draw)[0] for _ in range(3)]
    a, b = stream(1), stream(2)
    interleaved_a, interleaved_b = [], []
    for _ in range(3):
        interleaved_a.append(a.run(draw)[0])
        torch.rand(3)  # default-generator draws in between change nothing either
        interleaved_b.append(b.run(draw)[0])
    for expected, found in zip(alone_a + alone_b, interleaved_a + interleaved_b):
        assert torch.equal(expected, found)


def test_streams_used_from_concurrent_threads_draw_as_each_alone() -> None:
    seeds = [1, 2, 3, 4]
    rounds = 40
    expected = {seed: [made.run(draw)[0] for made in [stream(seed)] for _ in range(rounds)] for seed in seeds}
    found: dict[int, list[torch.Tensor]] = {}
    barrier = threading.Barrier(len(seeds))

    def work(seed: int) -> None:
        made = stream(seed)
        barrier.wait()
        found[seed] = [made.run(draw)[0] for _ in range(rounds)]

    threads = [threading.Thread(target=work, args=(seed,)) for seed in seeds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(found) == seeds
    for seed in seeds:
        assert all(torch.equal(e, f) for e, f in zip(expected[seed], found[seed])), seed


def test_streams_on_two_spellings_of_one_device_take_turns() -> None:
    """A run on "cpu:0" must not start while a run on "cpu" (the same generator) is in its function."""
    first, second = stream(1, torch.device("cpu")), stream(2, torch.device("cpu:0"))
    expected_first, expected_second = stream(1).run(draw)[0], stream(2).run(draw)[0]
    first_inside, second_inside, first_drew = threading.Event(), threading.Event(), threading.Event()
    found: dict[str, torch.Tensor] = {}

    def first_function() -> torch.Tensor:
        first_inside.set()
        second_inside.wait(timeout=3)  # with one lock the second run cannot start: this times out
        values = draw()
        first_drew.set()
        return values

    def second_function() -> torch.Tensor:
        second_inside.set()
        first_drew.wait(timeout=3)
        return draw()

    def run_second() -> None:
        first_inside.wait(timeout=30)
        found["second"] = second.run(second_function)[0]

    thread = threading.Thread(target=run_second)
    thread.start()
    found["first"] = first.run(first_function)[0]
    thread.join(timeout=30)
    assert torch.equal(found["first"], expected_first)
    assert torch.equal(found["second"], expected_second)


def test_a_device_type_without_a_generator_just_runs_the_function() -> None:
    made = RandomStream(torch.device("meta"))
    made.reseed(1)
    calls: list[int] = []
    result, start = made.run(lambda: calls.append(1) or "done")
    assert (result, start, calls) == ("done", None, [1])


@gpu_only
def test_cuda_stream_is_independent_of_the_cuda_default_generator() -> None:
    device = torch.device("cuda", 0)
    gpu_draw: Callable[[], torch.Tensor] = lambda: torch.rand(8, device=device)
    torch.cuda.manual_seed(1)
    first, start = stream(5, device).run(gpu_draw)
    torch.cuda.manual_seed(2)
    before = torch.cuda.get_rng_state(device)
    made = stream(5, device)
    second, _ = made.run(gpu_draw)
    assert torch.equal(first, second)
    assert torch.equal(made.run(gpu_draw, replay=start)[0], first)
    assert torch.equal(torch.cuda.get_rng_state(device), before)
