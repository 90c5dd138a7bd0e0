"""Event-driven simulation of a schedule: when each op runs, per rank, and what memory it holds (pure).

`simulate_schedule(schedule, stage_times, cluster, library_bytes)` plays the `schedule.Schedule` with op
durations in seconds: each rank runs its compute ops (forward, backward, all-reduce, step) one
at a time in program order; a send starts a transfer on the sender's channel for that direction
(activations, gradients: one transfer at a time each, overlapped with compute; under a chunked schedule
one channel per peer too, as zbv's rank sends both legs' activations, to its two neighbours; none for a
message between two stages of one rank) as soon as the
sent data exists and the channel is free; a receive waits for its transfer to arrive; an
all-reduce starts when every replica of the stage has reached it. In flush schedules it occupies
each replica (nothing else is left to do); in `pipedream` it runs on its own channel per rank,
one at a time, overlapped with the next forwards and backwards (the step, `step_s` long on the
compute thread, applies when it ends;
weight stashing keeps every backward on its forward's weights), so replicas that take turns on
the microbatches never wait for each other; a forward waits only while two of its rank's
all-reduces are unfinished (at most one update pending, so weights are never more than one
update behind). A stage holding a copy of tied weights (`tied_s` > 0) sums their gradients with
the other holders before its step: when every holder rank has reached its step, an all-reduce row
`tied_s` long (one sync among all holder ranks, whichever tied parameters they hold).
Transfer time = latency + bytes / bandwidth of the link between the two ranks (`schedule_cost.link_terms`); 0 between
two stages of one rank (zbv's turn of the V, interleaved-1f1b on one rank).

Memory per device (bytes): the profile's `library_bytes` (once per device), `base_bytes` of each of its
stages, plus `held_bytes` per microbatch from the start of its
forward to the end of its backward (zero-bubble schedules: its W; and `deferred_bytes` from the end of
its B to the end of its W), plus `rebuilt_bytes` during a backward (its workspace, and what a recomputing one rebuilds;
a zero-bubble B what it holds with its later layers' kept gradients, a W its weight gradients, `stage_times`): the terms of
`schedule_cost.StageCost`, so the cost model's memory formula played out over time; and each message from another
rank from when the receiver thread allocates its buffer until the op that needs it starts (`receive_buffers`).
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import pandas as pd

from planner.files.cluster import Cluster
from planner.errors import PlannerError
from planner.files.timeline import BUFFER_COLUMNS, COLUMNS, StageTimes, Timeline, posted_buffers
from planner.schedules.schedule import (
    ALLREDUCE,
    BACKWARD,
    CHUNKED_SCHEDULES,
    FORWARD,
    RECEIVES,
    RECV_ACTIVATION,
    SEND_ACTIVATION,
    SEND_GRADIENT,
    SENDS,
    SPLIT_BACKWARD_SCHEDULES,
    STEP,
    WEIGHT,
    Schedule,
    build_schedule,
    pipedream_microbatches,
    receive_orders,
)
from planner.costs.schedule_cost import (
    CostInputs, Stage, StageMemo, first_ranks, link_terms, replicas_of, stage_costs,
)
from planner.costs.schedule_cost import transfer_s as message_s

def simulate_schedule(schedule: Schedule, stage_times: Sequence[StageTimes], cluster: Cluster | None = None,
                      library_bytes: float = 0.0) -> Timeline:
    """Play `schedule` with these durations (module docstring); links from `cluster` (None: instant)."""
    receipts: list[tuple] = []
    rows = _play(schedule, stage_times, cluster, receipts)
    events = pd.DataFrame(rows, columns=list(COLUMNS))
    events = events.sort_values(["start_s", "rank"], kind="stable")
    buffers = pd.DataFrame(receive_buffers(schedule, rows, receipts), columns=list(BUFFER_COLUMNS))
    return Timeline(events.reset_index(drop=True), schedule.name, schedule.microbatches, schedule.iterations,
                    tuple(stage_times), library_bytes, buffers)


def receive_buffers(schedule: Schedule, rows: Sequence[tuple], receipts: Sequence[tuple]) -> list[tuple]:
    """When each message from another rank has a buffer on its receiver (`timeline.posted_buffers`, with
    `timeline.RECEIVES_AHEAD` receives posted): rows (rank, stage, start_s, end_s, bytes) (`timeline.BUFFER_COLUMNS`),
    from `_play`'s `rows` and `receipts` (rank, peer, op, stage, microbatch, iteration, arrival_s, taken_s, bytes).
    A channel delivers the messages in the order the peer sends them (`schedule.receive_orders`); a rank starts
    a step at the end of its last op of the step before. So a stage holds up to two messages a channel beyond
    those that arrived and are not taken yet: a last stage under 1f1b, at its first backward, the next
    microbatch's activation and two more."""
    starts: dict[tuple[int, int], float] = {}  # (rank, iteration) -> when the rank starts it
    for row in rows:
        key = (row[0], row[4] + 1)
        starts[key] = max(starts.get(key, 0.0), row[-1])
    by_key = {receipt[:6]: receipt for receipt in receipts}
    found: list[tuple] = []
    for rank, peers in receive_orders(schedule).items():
        for peer, actions in peers.items():
            keys = ((rank, peer, a.op, a.stage, a.microbatch, a.iteration) for a in actions)
            channel = [(r[0], r[3], r[5], r[6], r[7], r[8]) for r in map(by_key.get, keys) if r is not None]
            found.extend(posted_buffers(channel, starts))  # (none: the schedule deadlocked)
    return found


def _play(schedule: Schedule, stage_times: Sequence[StageTimes], cluster: Cluster | None,
          receipts: list[tuple] | None = None) -> list[tuple]:
    """The rows (`timeline.COLUMNS`) of every op `schedule` runs with these durations, in the order played;
    with `receipts`, appends there each message received from another rank (`receive_buffers`)."""
    if len(stage_times) != schedule.num_stages:
        raise ValueError(f"{len(stage_times)} stage times for a schedule of {schedule.num_stages} stages")
    programs = {program.rank: program for program in schedule.programs}
    position = dict.fromkeys(programs, 0)
    free_at = dict.fromkeys(programs, 0.0)  # when the rank's compute is next free
    channel_free: dict[tuple[int, str], float] = {}
    arrival: dict[tuple[str, int, int, int, int], float] = {}  # (send op, sender's stage, microbatch, iteration,
    # receiver) -> time
    waiting: dict[tuple[int, int], dict[int, float]] = {}  # (stage, n-th all-reduce) -> rank -> ready time
    reductions = dict.fromkeys(programs, 0)
    reduce_ends: dict[int, list[float]] = {rank: [] for rank in programs}  # end of each all-reduce, in order
    backwards: dict[tuple[int, int, int], int] = {}  # (rank, stage, iteration) -> backwards run
    tied_ranks = [rank for rank, program in programs.items() if any(stage_times[s].tied_s > 0 for s in program.stages)]
    tied_waiting: dict[int, dict[int, float]] = {}  # n-th step of a tied stage -> rank -> when it reached it
    tied_steps = dict.fromkeys(programs, 0)  # steps of stages holding tied weights each rank has run
    rows: list[tuple] = []
    accumulating = WEIGHT if schedule.name in SPLIT_BACKWARD_SCHEDULES else BACKWARD  # the op adding into .grad
    chunked = schedule.name in CHUNKED_SCHEDULES  # a rank sends to two neighbours (zbv's legs): a channel per peer

    links: dict[tuple[int, int], tuple[float, float]] = {}  # (low rank, high rank) -> (bandwidth, latency)
    messages: dict[tuple[float, int, int], float] = {}  # (bytes, source, target) -> seconds

    def transfer_s(action_bytes: float, source: int, target: int) -> float:
        if cluster is None or source == target:  # a message between two stages of one rank stays in its memory
            return 0.0
        key = (action_bytes, source, target)
        if key not in messages:
            pair = (min(source, target), max(source, target))
            if pair not in links:
                links[pair] = tuple(float(value) for value in link_terms(cluster, *pair))
            messages[key] = float(message_s(action_bytes, *links[pair]))
        return messages[key]

    progress = True
    while progress:
        progress = False
        for rank, program in programs.items():
            while position[rank] < len(program.actions):
                action = program.actions[position[rank]]
                times = stage_times[action.stage]
                base = (rank, action.stage, program.replica, action.microbatch, action.iteration, action.op, action.peer)
                if action.op in (FORWARD, BACKWARD, WEIGHT):
                    duration = {FORWARD: times.forward_s, BACKWARD: times.backward_s, WEIGHT: times.weight_s}[action.op]
                    if action.op == accumulating and schedule.name != "pipedream":  # after the first of the
                        done = backwards.get((rank, action.stage, action.iteration), 0)  # rank's stage in the
                        backwards[(rank, action.stage, action.iteration)] = done + 1  # iteration, it accumulates
                        duration += times.accumulate_s if done else 0.0
                    if action.op == FORWARD and len(reduce_ends[rank]) >= 2:  # at most one update pending
                        free_at[rank] = max(free_at[rank], reduce_ends[rank][-2])
                    rows.append(base + (free_at[rank], free_at[rank] + duration))
                    free_at[rank] += duration
                elif action.op in SENDS:
                    channel = (rank, action.op, action.peer if chunked else -1)
                    start = max(free_at[rank], channel_free.get(channel, 0.0))
                    if action.peer == rank:  # to another stage of this rank: its memory, no channel
                        start = free_at[rank]
                    end = start + transfer_s(times.activation_bytes if action.op == SEND_ACTIVATION
                                             else stage_times[action.stage - 1].activation_bytes, rank, action.peer)
                    if action.peer != rank:
                        channel_free[channel] = end
                    arrival[(action.op, action.stage, action.microbatch, action.iteration, action.peer)] = end
                    rows.append(base + (start, end))
                elif action.op in RECEIVES:
                    kind, source = ((SEND_ACTIVATION, action.stage - 1) if action.op == RECV_ACTIVATION
                                    else (SEND_GRADIENT, action.stage + 1))
                    ready = arrival.get((kind, source, action.microbatch, action.iteration, rank))
                    if ready is None:
                        break
                    free_at[rank] = max(free_at[rank], ready)
                    if receipts is not None and action.peer != rank:
                        size = stage_times[source if kind == SEND_ACTIVATION else action.stage].activation_bytes
                        receipts.append((rank, action.peer, action.op, action.stage, action.microbatch,
                                         action.iteration, ready, free_at[rank], size))
                elif action.op == ALLREDUCE:
                    arrived = waiting.setdefault((action.stage, reductions[rank]), {})
                    arrived[rank] = free_at[rank]
                    if len(arrived) < len(schedule.stage_ranks[action.stage]):
                        break
                    start = max(arrived.values())
                    if schedule.name == "pipedream":
                        start = max(start, reduce_ends[rank][-1] if reduce_ends[rank] else 0.0)
                    else:
                        free_at[rank] = start + times.allreduce_s
                    rows.append(base + (start, start + times.allreduce_s))
                    reduce_ends[rank].append(start + times.allreduce_s)
                    reductions[rank] += 1
                elif action.op == STEP:  # applies the last all-reduce's result
                    at = max(free_at[rank], reduce_ends[rank][-1]) if reduce_ends[rank] else free_at[rank]
                    if schedule.name == "pipedream":  # the compute thread steps while the all-reduce
                        at = free_at[rank]  # runs on its channel (its result applies when both are done)
                    if times.tied_s > 0:  # tied weights: every rank holding a copy sums their gradients first
                        arrived = tied_waiting.setdefault(tied_steps[rank], {})
                        arrived[rank] = at
                        if len(arrived) < len(tied_ranks):
                            break
                        start = max(arrived.values())
                        rows.append(base[:5] + (ALLREDUCE, -1, start, start + times.tied_s))
                        at = start + times.tied_s
                        tied_steps[rank] += 1
                    rows.append(base + (at, at + times.step_s))
                    free_at[rank] = at + times.step_s
                position[rank] += 1
                progress = True
    stuck = [rank for rank in programs if position[rank] < len(programs[rank].actions)]
    if stuck:
        raise ValueError(f"the schedule deadlocks on ranks {stuck}; run schedule.validate for where")
    return rows


def stage_times(inputs: CostInputs, stages: Sequence[Stage], memo: StageMemo | None = None) -> tuple[StageTimes, ...]:
    """Each stage's durations and memory terms under the planner cost model (`schedule_cost`; `memo` as there).

    Zero-bubble schedules: a B holds b (`schedule_cost.backward_top_terms`: at a layer what B holds there with
    what the stage's layers after it keep for W; a recomputing stage's B its rebuilt activations and all it
    keeps). A W holds the rebuilt bytes where it is the whole backward (a first stage, whose B computes nothing,
    keeps nothing) or where the stage recomputes (its B rebuilt the activations W reads); elsewhere it starts
    from the gradients B kept and holds v beyond them, the weight gradients one of its calls makes before adding
    them into `.grad` (the mlp example's stage from layer 7, live tensors: W's peak 4.2 MB over what B kept, one
    1024 x 1024 weight). So the simulated peak is the closed form's (`schedule_cost.memory_terms`) where the
    schedule reaches its steady state.
    """
    arrays, sigma = inputs.arrays, inputs.scale
    result = []
    for (start, stop, replicas, recompute), cost in zip(stages, stage_costs(inputs, list(stages), memo)):
        result.append(StageTimes(
            forward_s=cost.fwd_s, backward_s=cost.compute_s - cost.fwd_s - cost.weight_s, allreduce_s=cost.allreduce_s,
            activation_bytes=0.0 if stop == arrays.num_layers else sigma * arrays.cut_after(stop),
            base_bytes=cost.base_bytes, held_bytes=cost.held_bytes,
            rebuilt_bytes=cost.rebuilt_bytes + cost.deferred_bytes if recompute else cost.backward_top_bytes,
            step_s=cost.step_s, scratch_bytes=cost.scratch_bytes, accumulate_s=cost.accumulate_s,
            tied_s=cost.tied_s, weight_s=cost.weight_s, deferred_bytes=cost.deferred_bytes,
            weight_rebuilt_bytes=cost.rebuilt_bytes if start == 0 or recompute else cost.weight_top_bytes,
        ))
    return tuple(result)


def stage_ranks(inputs: CostInputs, stages: Sequence[Stage]) -> tuple[tuple[int, ...], ...]:
    """The ranks of each stage under the cost model's placement (`schedule_cost.first_ranks`)."""
    return tuple(tuple(range(first, first + replicas))
                 for first, replicas in zip(first_ranks(inputs, list(stages)), replicas_of(stages)))


class SimulationTooLongError(PlannerError):
    """A pipedream plan whose replica counts have a least common multiple too large to simulate."""

    def __init__(self, replicas: list[int], unit: int) -> None:
        self.replicas, self.unit = replicas, unit
        super().__init__(f"cannot simulate pipedream with replicas {replicas}: every replica's turn takes "
                         f"{unit} microbatches (the most simulated is {MAX_PIPEDREAM_ROUND}); the plan states the "
                         f"closed form for it")


MAX_PIPEDREAM_ROUND = 1024  # microbatches in one round of every replica, beyond which pipedream is not simulated


def simulated_pipedream_microbatches(stages: Sequence[Stage]) -> int:
    """Microbatches for a pipedream simulation: whole rounds of every replica (`pipedream_microbatches`),
    at least 32 and 4 x stages x the most replicas, to reach steady state; SimulationTooLongError
    when one round exceeds MAX_PIPEDREAM_ROUND."""
    replicas = replicas_of(stages)
    unit = math.lcm(*replicas)
    if unit > MAX_PIPEDREAM_ROUND:
        raise SimulationTooLongError(replicas, unit)
    return pipedream_microbatches(replicas, max(32, 4 * len(stages) * max(replicas)))


def simulate_stages(inputs: CostInputs, stages: Sequence[Stage], iterations: int = 1,
                    memo: StageMemo | None = None) -> Timeline:
    """Simulate a plan given as cost-model stages: `iterations` flushes, or for pipedream enough microbatches
    (`memo` as in `schedule_cost.stage_costs`)."""
    return simulate_schedule(_stage_schedule(inputs, stages, iterations), stage_times(inputs, stages, memo),
                             inputs.cluster, inputs.library_bytes)


def simulated_iteration_s(inputs: CostInputs, stages: Sequence[Stage], memo: StageMemo | None = None) -> float:
    """`simulate_stages(inputs, stages).iteration_s()` (seconds), without building the timeline for a flush
    schedule: its iteration is the end of the last op played (a search simulating many plans spent a fifth of
    its time making tables it only read that from); `memo` as in `schedule_cost.stage_costs`."""
    if inputs.schedule == "pipedream":
        return simulate_stages(inputs, stages, memo=memo).iteration_s()
    rows = _play(_stage_schedule(inputs, stages, 1), stage_times(inputs, stages, memo), inputs.cluster)
    return max((row[-1] for row in rows), default=0.0)


def _stage_schedule(inputs: CostInputs, stages: Sequence[Stage], iterations: int) -> Schedule:
    """The schedule `simulate_stages` plays: `iterations` flushes of the plan's microbatches, or for pipedream
    enough microbatches (`simulated_pipedream_microbatches`) in one."""
    if inputs.schedule == "pipedream":
        count, iterations = simulated_pipedream_microbatches(stages), 1
    else:
        count = inputs.microbatches
    return _built_schedule(inputs.schedule, tuple(replicas_of(stages)), count, iterations,
                           stage_ranks(inputs, stages), inputs.chunks)


# `build_schedule` remembered for the plans a search simulates, which share their stage and replica counts (a
# fifth of a simulation's time went to rebuilding the same schedule): a pure function of hashable arguments
# returning an immutable `Schedule`, so remembering it changes no result
_built_schedule = functools.lru_cache(maxsize=64)(build_schedule)
