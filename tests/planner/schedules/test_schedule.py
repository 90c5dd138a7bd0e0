"""Schedules as data: gpipe, 1f1b and pipedream programs cover their microbatches, pair their messages,
keep the documented order and in-flight counts, and the validator rejects broken copies."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from typing import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.errors import PlannerError
from planner.schedules.schedule import (
    ALLREDUCE,
    BACKWARD,
    FORWARD,
    RECV_ACTIVATION,
    RECV_GRADIENT,
    SEND_ACTIVATION,
    SEND_GRADIENT,
    STEP,
    WEIGHT,
    Action,
    RankProgram,
    Schedule,
    ScheduleError,
    build_schedule,
    pipedream_microbatches,
    receive_order,
    stage_placement,
    validate,
)

REPLICA_LISTS = ([1], [1, 1, 1, 1], [2, 1], [1, 3, 2], [3])
FLUSH_MICROBATCHES = (1, 4, 7)
PIPEDREAM_MICROBATCHES = (6, 12)  # every replica count above divides them
SENDS = {SEND_ACTIVATION: FORWARD, SEND_GRADIENT: BACKWARD}  # a send follows the computation producing it
RECEIVES = {RECV_ACTIVATION: (SEND_ACTIVATION, -1), RECV_GRADIENT: (SEND_GRADIENT, +1)}  # (matching send, stage offset)

Work = tuple[int, int]  # (iteration, microbatch)


def work(program: RankProgram, op: str) -> list[Work]:
    """(iteration, microbatch) of every `op` action of the program, in program order."""
    return [(a.iteration, a.microbatch) for a in program.actions if a.op == op]


def expected_work(schedule: Schedule, program: RankProgram) -> list[Work]:
    """The round-robin share of the rank: microbatch i on replica i mod r, once per iteration.

    Flush schedules number microbatches 0..m-1 in each iteration; pipedream numbers them across
    iterations (microbatch i belongs to iteration i // m).
    """
    replicas, m = len(schedule.stage_ranks[program.stage]), schedule.microbatches
    if schedule.name == "pipedream":
        return sorted((i // m, i) for i in range(m * schedule.iterations) if i % replicas == program.replica)
    return sorted((it, i) for it in range(schedule.iterations) for i in range(m) if i % replicas == program.replica)


def check_coverage(schedule: Schedule) -> None:
    """Every rank runs exactly its round-robin share forward and backward, on its own stage."""
    for stage, group in enumerate(schedule.stage_ranks):
        for replica, rank in enumerate(group):
            program = next(p for p in schedule.programs if p.rank == rank)
            assert (program.stage, program.replica) == (stage, replica)
    assert len(schedule.programs) == sum(len(group) for group in schedule.stage_ranks)
    for program in schedule.programs:
        assert all(action.stage == program.stage for action in program.actions)
        expected = expected_work(schedule, program)
        assert sorted(work(program, FORWARD)) == expected
        assert sorted(work(program, BACKWARD)) == expected


def check_messages(schedule: Schedule) -> None:
    """Receives and sends pair up one to one, each naming the rank that owns the microbatch next door."""
    programs = {program.rank: program for program in schedule.programs}
    sends: Counter[tuple[str, int, int, int, int]] = Counter()  # (send op, from rank, to rank, microbatch, iteration)
    receives: Counter[tuple[str, int, int, int, int]] = Counter()
    for program in schedule.programs:
        for action in program.actions:
            if action.op in SENDS:
                target = action.stage + (1 if action.op == SEND_ACTIVATION else -1)
                assert action.peer == schedule.owner(target, action.microbatch)
                assert programs[action.peer].stage == target
                sends[action.op, program.rank, action.peer, action.microbatch, action.iteration] += 1
            elif action.op in RECEIVES:
                kind, offset = RECEIVES[action.op]
                assert action.peer == schedule.owner(action.stage + offset, action.microbatch)
                assert programs[action.peer].stage == action.stage + offset
                receives[kind, action.peer, program.rank, action.microbatch, action.iteration] += 1
            else:
                assert action.peer == -1
    assert sends == receives
    assert all(count == 1 for count in sends.values())


def check_order(schedule: Schedule) -> None:
    """A send follows the forward / backward producing it; a receive precedes the one consuming it."""
    consumer = {RECV_ACTIVATION: FORWARD, RECV_GRADIENT: BACKWARD}
    for program in schedule.programs:
        done: set[tuple[str, int, int]] = set()
        for index, action in enumerate(program.actions):
            key = (action.iteration, action.microbatch)
            if action.op in SENDS:
                assert (SENDS[action.op], *key) in done, f"rank {program.rank} sends {action.short()} too early"
            if action.op in consumer:
                later = [(a.op, a.iteration, a.microbatch) for a in program.actions[index + 1:]]
                assert (consumer[action.op], *key) in later
                assert (consumer[action.op], *key) not in done
            done.add((action.op, *key))
        last = program.stage == schedule.num_stages - 1
        # every forward but the first stage's waits for its activation, every backward but the last stage's for its gradient
        assert len(work(program, RECV_ACTIVATION)) == (0 if program.stage == 0 else len(work(program, FORWARD)))
        assert len(work(program, RECV_GRADIENT)) == (0 if last else len(work(program, BACKWARD)))


def peak_in_flight(program: RankProgram) -> int:
    """The most microbatches forwarded but not yet backwarded at any point of the program."""
    peak = flight = 0
    for action in program.actions:
        flight += (action.op == FORWARD) - (action.op == BACKWARD)
        peak = max(peak, flight)
    return peak


def with_actions(schedule: Schedule, rank: int, actions: Sequence[Action]) -> Schedule:
    """A copy of the schedule with rank's program replaced by `actions`."""
    programs = tuple(replace(p, actions=tuple(actions)) if p.rank == rank else p for p in schedule.programs)
    return replace(schedule, programs=programs)


def actions_of(schedule: Schedule, rank: int) -> list[Action]:
    """A mutable copy of rank's actions."""
    return list(next(p for p in schedule.programs if p.rank == rank).actions)


def index_of(actions: Sequence[Action], op: str, microbatch: int) -> int:
    """Position of the first `op` of `microbatch`."""
    return next(k for k, a in enumerate(actions) if a.op == op and a.microbatch == microbatch)


@st.composite
def schedule_args(draw: st.DrawFn) -> tuple[str, list[int], int, int]:
    """(name, stage replicas, microbatches, iterations); pipedream's total divides among every stage's replicas."""
    name = draw(st.sampled_from(("gpipe", "1f1b", "pipedream")))
    replicas = draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
    iterations = draw(st.integers(1, 2))
    if name != "pipedream":
        return name, replicas, draw(st.integers(1, 8)), iterations
    unit = math.lcm(*replicas)
    step = unit // math.gcd(unit, iterations)  # microbatches * iterations is a multiple of unit iff step | microbatches
    return name, replicas, step * draw(st.integers(1, 8 // step)), iterations


# 1. every schedule on fixed shapes


@pytest.mark.parametrize("iterations", [1, 2])
@pytest.mark.parametrize("replicas", REPLICA_LISTS, ids=str)
@pytest.mark.parametrize(
    "name, microbatches",
    [(name, m) for name in ("gpipe", "1f1b") for m in FLUSH_MICROBATCHES] + [("pipedream", m) for m in PIPEDREAM_MICROBATCHES],
)
def test_schedules_validate_and_cover_round_robin(name: str, microbatches: int, replicas: list[int], iterations: int) -> None:
    """Each schedule validates and runs every rank's round-robin microbatches forward and backward once per iteration."""
    schedule = build_schedule(name, replicas, microbatches, iterations)
    assert (schedule.name, schedule.microbatches, schedule.iterations) == (name, microbatches, iterations)
    assert [len(group) for group in schedule.stage_ranks] == replicas
    assert [p.rank for p in schedule.programs] == list(range(sum(replicas)))  # contiguous from 0 by default
    validate(schedule)
    check_coverage(schedule)


# 2. random shapes


@settings(max_examples=300, deadline=None)
@given(args=schedule_args())
def test_random_schedules_validate_and_pair_messages(args: tuple[str, list[int], int, int]) -> None:
    """Random shapes validate; every receive has exactly one matching send from the right rank, after its producer."""
    name, replicas, microbatches, iterations = args
    schedule = build_schedule(name, replicas, microbatches, iterations)
    validate(schedule)
    check_coverage(schedule)
    check_messages(schedule)
    check_order(schedule)


# 3. gpipe


@pytest.mark.parametrize("replicas", REPLICA_LISTS, ids=str)
@pytest.mark.parametrize("microbatches", FLUSH_MICROBATCHES)
def test_gpipe_runs_all_forwards_before_any_backward(replicas: list[int], microbatches: int) -> None:
    """gpipe: on each rank, every forward of an iteration precedes every backward of it, in the same order."""
    schedule = build_schedule("gpipe", replicas, microbatches, iterations=2)
    for program in schedule.programs:
        for iteration in range(2):
            ops = [(k, a) for k, a in enumerate(program.actions) if a.iteration == iteration]
            forwards = [k for k, a in ops if a.op == FORWARD]
            backwards = [k for k, a in ops if a.op == BACKWARD]
            if forwards:
                assert max(forwards) < min(backwards)
            assert [i for it, i in work(program, FORWARD) if it == iteration] == \
                [i for it, i in work(program, BACKWARD) if it == iteration]


# 4. 1f1b in flight


@settings(max_examples=200, deadline=None)
@given(replicas=st.lists(st.integers(1, 3), min_size=1, max_size=4), microbatches=st.integers(1, 12),
       iterations=st.integers(1, 2))
def test_1f1b_in_flight_is_bounded(replicas: list[int], microbatches: int, iterations: int) -> None:
    """1f1b: a rank holds at most (and at its peak exactly) min(own microbatches, ceil(D / r)) in flight."""
    schedule = build_schedule("1f1b", replicas, microbatches, iterations)
    for program in schedule.programs:
        r = replicas[program.stage]
        own = len(range(program.replica, microbatches, r))
        devices = sum(replicas[program.stage:])
        assert peak_in_flight(program) == min(own, -(-devices // r))


@pytest.mark.parametrize("stages, microbatches", [(1, 1), (2, 2), (3, 5), (4, 4), (4, 9), (5, 8)])
def test_1f1b_straight_pipeline_peaks_at_stages_left(stages: int, microbatches: int) -> None:
    """1f1b on p single-device stages with m >= p microbatches: stage s peaks at exactly p - s in flight."""
    schedule = build_schedule("1f1b", [1] * stages, microbatches)
    assert [peak_in_flight(p) for p in schedule.programs] == [stages - s for s in range(stages)]
    gpipe = build_schedule("gpipe", [1] * stages, microbatches)
    assert [peak_in_flight(p) for p in gpipe.programs] == [microbatches] * stages  # gpipe holds them all


# 5. updates


@pytest.mark.parametrize("replicas", REPLICA_LISTS, ids=str)
@pytest.mark.parametrize("microbatches, iterations", [(6, 1), (6, 2), (12, 1), (3, 2)])
def test_pipedream_updates_after_every_backward(replicas: list[int], microbatches: int, iterations: int) -> None:
    """pipedream: an all-reduce (replicated stages only) and a step follow every backward and nothing else."""
    schedule = build_schedule("pipedream", replicas, microbatches, iterations)
    validate(schedule)
    for program in schedule.programs:
        replicated = replicas[program.stage] > 1
        update = [ALLREDUCE, STEP] if replicated else [STEP]
        ops = [a.op for a in program.actions if a.op != SEND_GRADIENT]
        backwards = [k for k, op in enumerate(ops) if op == BACKWARD]
        assert backwards
        for k in backwards:
            assert ops[k + 1:k + 1 + len(update)] == update
        assert ops.count(STEP) == len(backwards)
        assert ops.count(ALLREDUCE) == (len(backwards) if replicated else 0)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("replicas", REPLICA_LISTS, ids=str)
@pytest.mark.parametrize("microbatches", FLUSH_MICROBATCHES)
def test_flush_schedules_step_once_per_iteration(name: str, replicas: list[int], microbatches: int) -> None:
    """gpipe / 1f1b: one step per iteration per rank, after its backwards, preceded by an all-reduce iff replicated."""
    iterations = 3
    schedule = build_schedule(name, replicas, microbatches, iterations)
    for program in schedule.programs:
        replicated = replicas[program.stage] > 1
        ops = [a.op for a in program.actions]
        steps = [k for k, a in enumerate(program.actions) if a.op == STEP]
        assert [program.actions[k].iteration for k in steps] == list(range(iterations))
        assert ops.count(ALLREDUCE) == (iterations if replicated else 0)
        assert steps[-1] == len(ops) - 1
        for iteration, k in enumerate(steps):
            assert (ops[k - 1] == ALLREDUCE) == replicated
            # the step closes its iteration: nothing of it after, nothing of a later one before
            assert all(a.iteration <= iteration for a in program.actions[:k])
            assert all(a.iteration > iteration for a in program.actions[k + 1:])


# 6. the validator rejects broken schedules


def test_validator_catches_backward_before_forward() -> None:
    """Swapping a rank's F0 and B0 fails at the backward: 'before its forward', with rank, step and [B0]."""
    schedule = build_schedule("gpipe", [1, 1], 2)
    actions = actions_of(schedule, 1)
    f, b = index_of(actions, FORWARD, 0), index_of(actions, BACKWARD, 0)
    actions[f], actions[b] = actions[b], actions[f]
    with pytest.raises(ScheduleError) as caught:
        validate(with_actions(schedule, 1, actions))
    error = caught.value
    assert "before its forward" in error.problem
    assert (error.rank, error.step) == (1, f)
    assert "[B0]" in error.grid and error.grid.count("[") == 1
    assert str(error).startswith(f"rank 1, action {f}: ")
    assert isinstance(error, PlannerError)


def test_validator_catches_missing_send_as_deadlock() -> None:
    """Deleting sa0 leaves rank 1 waiting on ra0 and rank 0 on rg0: a deadlock naming both places."""
    schedule = build_schedule("gpipe", [1, 1], 2)
    actions = actions_of(schedule, 0)
    del actions[index_of(actions, SEND_ACTIVATION, 0)]
    with pytest.raises(ScheduleError) as caught:
        validate(with_actions(schedule, 0, actions))
    error = caught.value
    assert "deadlock" in str(error) and "2 ranks" in error.problem
    assert (error.rank, error.step) == (0, index_of(actions, RECV_GRADIENT, 0))
    assert "[rg0]" in error.grid and "[ra0]" in error.grid
    assert str(error).startswith("rank 0, ")


def test_validator_catches_a_send_nobody_receives() -> None:
    """Deleting rank 1's ra1 leaves rank 0's sa1 unreceived: named at the send."""
    schedule = build_schedule("gpipe", [1, 1], 2)
    actions = actions_of(schedule, 1)
    del actions[index_of(actions, RECV_ACTIVATION, 1)]
    with pytest.raises(ScheduleError, match="send_activation of stage 0, microbatch 1 .* to rank 1 is never received"
                       ) as caught:
        validate(with_actions(schedule, 1, actions))
    assert (caught.value.rank, caught.value.step) == (0, index_of(actions_of(schedule, 0), SEND_ACTIVATION, 1))


def test_validator_catches_cyclic_wait() -> None:
    """Rank 0 awaits g0 before sending a1 while rank 1 awaits a1 before sending g0: each program is fine alone, together they deadlock."""
    one_f_one_b = build_schedule("1f1b", [1, 1], 2)
    # stage 0 in the order 1f1b gives a one-in-flight stage, stage 1 in gpipe order
    stage0 = [a for i in (0, 1) for a in (Action(FORWARD, 0, i), Action(SEND_ACTIVATION, 0, i, peer=1),
                                          Action(RECV_GRADIENT, 0, i, peer=1), Action(BACKWARD, 0, i))]
    stage1 = actions_of(build_schedule("gpipe", [1, 1], 2), 1)
    broken = with_actions(with_actions(one_f_one_b, 0, stage0 + [Action(STEP, 0)]), 1, stage1)
    validate(with_actions(one_f_one_b, 0, stage0 + [Action(STEP, 0)]))  # rank 0's order works with 1f1b's stage 1
    validate(with_actions(build_schedule("gpipe", [1, 1], 2), 1, stage1))  # and rank 1's with gpipe's stage 0
    with pytest.raises(ScheduleError) as caught:
        validate(broken)
    error = caught.value
    assert "deadlock" in error.problem
    assert (error.rank, error.step) == (0, index_of(stage0, RECV_GRADIENT, 0))
    assert "[rg0]" in error.grid and "[ra1]" in error.grid
    assert str(error).startswith("rank 0, ")


def test_validator_catches_receive_from_wrong_peer() -> None:
    """A receive naming a rank that does not own the microbatch upstream fails there."""
    schedule = build_schedule("gpipe", [1, 2], 2)  # rank 0: stage 0; ranks 1, 2: stage 1 (microbatches 0, 1)
    actions = actions_of(schedule, 1)
    k = index_of(actions, RECV_ACTIVATION, 0)
    assert actions[k].peer == 0
    actions[k] = replace(actions[k], peer=2)
    with pytest.raises(ScheduleError) as caught:
        validate(with_actions(schedule, 1, actions))
    error = caught.value
    assert "expects rank 2" in error.problem
    assert (error.rank, error.step) == (1, k)
    assert "[ra0]" in error.grid
    assert str(error).startswith(f"rank 1, action {k}: ")


def test_validator_catches_send_to_wrong_peer() -> None:
    """A send addressed to the wrong replica never reaches its receiver: deadlock at that receive."""
    schedule = build_schedule("gpipe", [1, 2], 2)
    actions = actions_of(schedule, 0)
    k = index_of(actions, SEND_ACTIVATION, 0)
    actions[k] = replace(actions[k], peer=2)
    with pytest.raises(ScheduleError) as caught:
        validate(with_actions(schedule, 0, actions))
    assert "deadlock" in caught.value.problem
    assert "[ra0]" in caught.value.grid  # rank 1 waits on it


def test_validator_catches_duplicate_and_missing_work() -> None:
    """A forward run twice, a backward left out, or a microbatch run on another replica all fail."""
    schedule = build_schedule("1f1b", [1, 2], 4)
    actions = actions_of(schedule, 1)
    twice = actions[:index_of(actions, FORWARD, 0) + 1] + [Action(FORWARD, 1, 0)] + actions[index_of(actions, FORWARD, 0) + 1:]
    with pytest.raises(ScheduleError, match="runs twice"):
        validate(with_actions(schedule, 1, twice))
    without = [a for a in actions if not (a.op == BACKWARD and a.microbatch == 2)]
    with pytest.raises(ScheduleError, match="microbatch 2 .* never runs its backward"):
        validate(with_actions(schedule, 1, without))
    stolen = [replace(a, microbatch=1) if a.microbatch == 0 else a for a in actions]  # microbatch 1 is rank 2's
    with pytest.raises(ScheduleError, match="does not belong to this rank"):
        validate(with_actions(schedule, 1, stolen))


def test_validator_waits_for_every_replica_in_allreduce() -> None:
    """An all-reduce that one replica never reaches deadlocks the others."""
    schedule = build_schedule("gpipe", [2], 2)
    actions = [a for a in actions_of(schedule, 1) if a.op != ALLREDUCE]
    with pytest.raises(ScheduleError, match="deadlock") as caught:
        validate(with_actions(schedule, 1, actions))
    assert (caught.value.rank, "[AR]" in caught.value.grid) == (0, True)


# 7. bad input


@pytest.mark.parametrize(
    "name, replicas, microbatches, iterations, stage_ranks, message",
    [
        ("zero-bubble", [1], 4, 1, None, "unknown schedule 'zero-bubble'"),
        ("gpipe", [1, 1], 0, 1, None, "microbatches >= 1"),
        ("1f1b", [1], 4, 0, None, "iterations >= 1"),
        ("gpipe", [], 4, 1, None, "replicas >= 1"),
        ("1f1b", [2, 0], 4, 1, None, "replicas >= 1"),
        ("gpipe", [2, 1], 4, 1, [(0,), (1,)], "do not match replicas"),
        ("gpipe", [1, 1], 4, 1, [(0,)], "do not match replicas"),
        ("pipedream", [1, 2], 5, 1, None, "do not divide among 2 replicas"),
        ("pipedream", [1, 3, 2], 3, 1, None, "do not divide among 2 replicas"),
    ],
)
def test_build_schedule_refuses_bad_input(
    name: str, replicas: list[int], microbatches: int, iterations: int,
    stage_ranks: list[tuple[int, ...]] | None, message: str,
) -> None:
    """Unknown names, empty counts, mismatched ranks and uneven pipedream splits raise PlannerError."""
    with pytest.raises(PlannerError, match=message.replace("(", r"\(")):
        build_schedule(name, replicas, microbatches, iterations, stage_ranks)


def test_pipedream_counts_microbatches_across_iterations() -> None:
    """pipedream only needs microbatches * iterations to divide among the replicas (3 x 2 on 2 replicas)."""
    schedule = build_schedule("pipedream", [2], 3, iterations=2)
    validate(schedule)
    assert [work(p, BACKWARD) for p in schedule.programs] == [[(0, 0), (0, 2), (1, 4)], [(0, 1), (1, 3), (1, 5)]]


# 8. custom ranks


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "pipedream"])
def test_custom_stage_ranks_are_respected(name: str) -> None:
    """Stages on ranks ((4, 5), (2,), (7,)): programs sorted by rank, every peer a rank of the neighbouring stage."""
    stage_ranks = ((4, 5), (2,), (7,))
    schedule = build_schedule(name, [2, 1, 1], 6, iterations=2, stage_ranks=stage_ranks)
    assert schedule.stage_ranks == stage_ranks
    assert [(p.rank, p.stage, p.replica) for p in schedule.programs] == [(2, 1, 0), (4, 0, 0), (5, 0, 1), (7, 2, 0)]
    validate(schedule)
    check_coverage(schedule)
    check_messages(schedule)
    for program in schedule.programs:
        upstream = set(stage_ranks[program.stage - 1]) if program.stage > 0 else set()
        downstream = set(stage_ranks[program.stage + 1]) if program.stage < 2 else set()
        for action in program.actions:
            if action.op in (RECV_ACTIVATION, SEND_GRADIENT):
                assert action.peer in upstream
            elif action.op in (SEND_ACTIVATION, RECV_GRADIENT):
                assert action.peer in downstream
    peers = {p.rank: {a.peer for a in p.actions if a.peer >= 0} for p in schedule.programs}
    assert peers == {4: {2}, 5: {2}, 2: {4, 5, 7}, 7: {2}}


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "pipedream"])
@pytest.mark.parametrize("replicas", [[1, 1], [2, 1], [1, 2], [1, 3, 2], [2, 2, 1, 1]])
def test_every_channel_receives_in_the_order_it_sends(name: str, replicas: list[int]) -> None:
    assert_receives_in_send_order(build_schedule(name, replicas, 12, iterations=2))


def assert_receives_in_send_order(schedule: Schedule) -> None:
    """Every rank's program receives from each peer in the order that peer sends (`receive_order`)."""
    for program in schedule.programs:
        for peer, receives in receive_order(schedule, program.rank).items():
            assert receives == [a for a in program.actions if a.op in RECEIVES and a.peer == peer]


def swapped_receives() -> tuple[Schedule, int]:
    """gpipe on 2 ranks, 2 microbatches, rank 1 receiving microbatch 1 before 0; and where it first waits."""
    schedule = build_schedule("gpipe", [1, 1], 2)
    first, second = schedule.programs
    receives = [k for k, a in enumerate(second.actions) if a.op == RECV_ACTIVATION]
    actions = list(second.actions)
    actions[receives[0]], actions[receives[1]] = actions[receives[1]], actions[receives[0]]
    swapped = Schedule(schedule.name, schedule.microbatches, schedule.iterations, schedule.stage_ranks,
                       (first, RankProgram(second.rank, second.stage, second.replica, tuple(actions))))
    return swapped, receives[0]


def test_receives_swapped_against_their_sends_come_in_the_senders_order() -> None:
    swapped, first_receive = swapped_receives()
    validate(swapped)  # every receive has its send and nothing deadlocks with buffered sends
    program = swapped.programs[1]
    assert program.actions[first_receive].microbatch == 1  # the program takes microbatch 1 first ...
    assert [a.microbatch for a in receive_order(swapped, 1)[0]] == [0, 1]  # ... the channel delivers 0 first
    assert [a.op for a in receive_order(swapped, 0)[1]] == [RECV_GRADIENT] * 2  # rank 0: the gradients, in order


@pytest.mark.parametrize("replicas, at_least, expected", [
    ([1, 1], 4, 4), ([2, 1], 3, 4), ([2, 3], 1, 6), ([2, 3], 7, 12), ([1], 0, 1),
])
def test_pipedream_microbatches_are_whole_rounds_of_every_replica(replicas: list[int], at_least: int,
                                                                  expected: int) -> None:
    assert pipedream_microbatches(replicas, at_least) == expected



# 7. zb-h1: the backward split into B and W, W deferred by the stage's place


@pytest.mark.parametrize("replicas", REPLICA_LISTS)
@pytest.mark.parametrize("microbatches", (1, 4, 8))
def test_zb_h1_is_1f1b_with_a_w_after_each_b(replicas: list[int], microbatches: int) -> None:
    """Without its W's, each zb-h1 program is the 1f1b program; each W follows its own B, and the step follows every W."""
    split, plain = build_schedule("zb-h1", replicas, microbatches), build_schedule("1f1b", replicas, microbatches)
    validate(split)
    for ours, theirs in zip(split.programs, plain.programs):
        assert [a for a in ours.actions if a.op != WEIGHT] == list(theirs.actions)
        assert sorted(work(ours, WEIGHT)) == sorted(work(ours, BACKWARD))
        for it, mb in work(ours, WEIGHT):
            assert index_of(ours.actions, WEIGHT, mb) > index_of(ours.actions, BACKWARD, mb)
        weights = [k for k, a in enumerate(ours.actions) if a.op == WEIGHT]
        assert all(k < index_of(ours.actions, STEP, -1) for k in weights)


@pytest.mark.parametrize("stages,microbatches", [(4, 8), (3, 7), (2, 2)])
def test_zb_h1_stage_s_runs_w_of_k_after_b_of_k_plus_s(stages: int, microbatches: int) -> None:
    """Straight pipeline: stage s runs W of microbatch k right after B of k + s (and its send), then its last s W's."""
    schedule = build_schedule("zb-h1", [1] * stages, microbatches)
    for program in schedule.programs:
        deferral, actions = min(program.stage, microbatches), program.actions
        for k in range(microbatches - deferral):
            after = index_of(actions, BACKWARD, k + deferral) + (2 if program.stage > 0 else 1)  # B, its send
            assert (actions[after].op, actions[after].microbatch) == (WEIGHT, k)
        ops = [a.op for a in actions if a.op in (BACKWARD, WEIGHT)]
        last_b = len(ops) - 1 - ops[::-1].index(BACKWARD)
        assert ops[last_b + 1:] == [WEIGHT] * min(deferral + 1, microbatches)  # the one placed after it, the tail


def test_validator_catches_w_out_of_place() -> None:
    """A W before its B, a W missing or after the step, and a W in 1f1b are each named."""
    schedule = build_schedule("zb-h1", [1, 1], 2)
    actions = actions_of(schedule, 1)
    w, b = index_of(actions, WEIGHT, 0), index_of(actions, BACKWARD, 0)
    early = actions[:b] + [actions[w]] + [a for k, a in enumerate(actions[b:], b) if k != w]
    missing = [a for k, a in enumerate(actions) if k != w]
    late = missing + [actions[w]]
    for broken, problem in ((early, "W of microbatch 0 before its backward"),
                            (missing, "S before W of microbatch 0"), (late, "S before W of microbatch 0")):
        with pytest.raises(ScheduleError, match=problem):
            validate(with_actions(schedule, 1, broken))
    plain = build_schedule("1f1b", [1, 1], 2)
    extra = actions_of(plain, 1)
    extra.insert(index_of(extra, BACKWARD, 0) + 1, Action(WEIGHT, 1, 0))
    with pytest.raises(ScheduleError, match="runs whole backwards"):
        validate(with_actions(plain, 1, extra))


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 5), st.integers(1, 4), st.integers(1, 4), st.integers(1, 2))
def test_interleaved_1f1b_is_valid_and_keeps_each_channel_in_order(ranks: int, chunks: int, rounds: int,
                                                                    iterations: int) -> None:
    """p ranks, v chunks each (stage s on rank s mod p), m a multiple of p: every chunk runs every
    microbatch forward then backward once, sends match receives in FIFO order per pair of ranks, no deadlock."""
    schedule = build_schedule("interleaved-1f1b", [1] * (ranks * chunks), ranks * rounds, iterations, chunks=chunks)
    validate(schedule)
    assert_receives_in_send_order(schedule)
    assert [program.stages for program in schedule.programs] == [tuple(range(r, ranks * chunks, ranks))
                                                                 for r in range(ranks)]
    for program in schedule.programs:
        computed = Counter((a.op, a.stage) for a in program.actions if a.op in (FORWARD, BACKWARD, STEP))
        assert all(computed[(op, stage)] == (1 if op == STEP else ranks * rounds) * iterations
                   for op in (FORWARD, BACKWARD, STEP) for stage in program.stages)


def test_interleaved_1f1b_warms_up_as_megatron_does() -> None:
    """Rank r runs (p - r - 1) 2 + (v - 1) p warm-up forwards, then a forward and a backward in turn; the
    forwards go through the chunks in groups of p microbatches (chunk 0 of microbatches 0..p-1, then chunk 1
    of them, ...), the backwards through the chunks in reverse."""
    ranks, chunks = 4, 2
    schedule = build_schedule("interleaved-1f1b", [1] * 8, 8, chunks=chunks)
    for program in schedule.programs:
        computes = [a for a in program.actions if a.op in (FORWARD, BACKWARD)]
        warmup = next(k for k, a in enumerate(computes) if a.op == BACKWARD)
        assert warmup == (ranks - program.rank - 1) * 2 + (chunks - 1) * ranks + 1
        order = [(chunk, group * ranks + i) for group in range(2) for chunk in range(chunks) for i in range(ranks)]
        forwards = [(a.stage // ranks, a.microbatch) for a in computes if a.op == FORWARD]
        backwards = [(chunks - 1 - a.stage // ranks, a.microbatch) for a in computes if a.op == BACKWARD]
        assert forwards == order and backwards == order


@pytest.mark.parametrize("stages,replicas,microbatches,chunks,fragment", [
    (4, 1, 3, 2, "use a multiple of 2"),
    (4, 2, 4, 2, "one device each"),
    (5, 1, 4, 2, "whole number of chunks"),
])
def test_interleaved_1f1b_refuses_what_it_cannot_run(stages: int, replicas: int, microbatches: int, chunks: int,
                                                     fragment: str) -> None:
    with pytest.raises(PlannerError, match=fragment):
        build_schedule("interleaved-1f1b", [replicas] * stages, microbatches, chunks=chunks)


def test_chunks_are_only_for_chunked_schedules() -> None:
    with pytest.raises(PlannerError, match="one stage per rank"):
        build_schedule("1f1b", [1] * 4, 4, chunks=2)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 5), st.integers(1, 12), st.integers(1, 2))
def test_zbv_is_valid_in_a_v_for_any_microbatch_count(ranks: int, microbatches: int, iterations: int) -> None:
    """p ranks, 2 chunks each in a V (rank r holds stages r and 2p - 1 - r), any m: every chunk runs every
    microbatch's F, B and W once (W after B, all before the step), every receive has its send, no deadlock."""
    schedule = build_schedule("zbv", [1] * (2 * ranks), microbatches, iterations, chunks=2)
    validate(schedule)
    assert [program.stages for program in schedule.programs] == [(r, 2 * ranks - 1 - r) for r in range(ranks)]
    assert [group[0] for group in schedule.stage_ranks] == list(stage_placement("zbv", 2 * ranks, 2))
    for program in schedule.programs:
        computed = Counter((a.op, a.stage) for a in program.actions if a.op in (FORWARD, BACKWARD, WEIGHT, STEP))
        assert all(computed[(op, stage)] == (1 if op == STEP else microbatches) * iterations
                   for op in (FORWARD, BACKWARD, WEIGHT, STEP) for stage in program.stages)


def test_zbv_phases_on_the_first_and_last_rank() -> None:
    """p = 3, m = 6. Rank 0 (stages 0 and 5) runs 2p - 1 = 5 forwards of stage 0, then its first F, B, W of
    stage 5 (the loss is there); rank 2 (stages 2 and 3, the turn of the V) one forward of stage 2, then
    F of 3 and F of 2 twice. The turn is a message from a rank to itself; channels between neighbours
    carry both legs, so a rank's program may receive in another order than its neighbour sends."""
    schedule = build_schedule("zbv", [1] * 6, 6, chunks=2)
    computes = [[(a.short(), a.stage) for a in program.actions if a.op in (FORWARD, BACKWARD, WEIGHT)]
                for program in schedule.programs]
    assert computes[0][:8] == [(f"F{i}", 0) for i in range(5)] + [("F0", 5), ("B0", 5), ("W0", 5)]
    assert computes[2][:5] == [("F0", 2), ("F0", 3), ("F1", 2), ("F1", 3), ("F2", 2)]
    turn = [a for a in schedule.programs[2].actions if a.op == SEND_ACTIVATION and a.stage == 2]
    assert {a.peer for a in turn} == {2}
    crossed = [(program.rank, peer) for program in schedule.programs
               for peer, receives in receive_order(schedule, program.rank).items()
               if receives != [a for a in program.actions if a.op in RECEIVES and a.peer == peer]]
    assert crossed  # why the engine posts receives in the sender's order


@pytest.mark.parametrize("stages,replicas,chunks,fragment", [
    (6, 1, 3, "exactly 2 chunks per rank"),
    (4, 2, 2, "one device each"),
])
def test_zbv_refuses_what_it_cannot_run(stages: int, replicas: int, chunks: int, fragment: str) -> None:
    with pytest.raises(PlannerError, match=fragment):
        build_schedule("zbv", [replicas] * stages, 4, chunks=chunks)
