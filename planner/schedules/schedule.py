"""Schedules as data: per rank, the ordered actions of gpipe, 1f1b, zb-h1, interleaved-1f1b, zbv and pipedream (pure).

One representation serves the simulator, the plots and the runtime. A `Schedule` holds one
`RankProgram` per rank: the rank's stage, replica and its `Action`s in the order the rank
performs them. Stage s with r replicas gives microbatch i to replica i mod r (round-robin).

Actions: `forward` / `backward` of a microbatch on the rank's stage; `send_activation` /
`recv_activation` (after / before a forward, between stage s and s + 1); `send_gradient` /
`recv_gradient` (after / before a backward, between stage s + 1 and s); `allreduce` of the
stage's gradients among its replicas (a collective: every replica takes part); `step` (the
optimizer update); `weight`: the weight-gradient part of a backward that a zero-bubble schedule
runs later (there `backward` computes only the gradients of the stage's inputs). Sends never
block; receives wait for their send; an all-reduce waits for every replica of its stage.

- `gpipe`, per iteration: every forward, then every backward (same order), all-reduce, step.
- `1f1b`, per iteration: n - 1 forwards, then one forward and one backward in turn, then the
  remaining backwards, all-reduce, step; n = min(own microbatches, ceil(D / r)) in flight, D the
  devices of this stage and every later one (`in_flight`).
- `zb-h1` (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1f1b's order of forwards
  and backwards, the backward split into B (`backward`: the inputs' gradients, sent at once) and
  W (`weight`: the weights' gradients). Replicas of later stages defer their W's more: stage s
  (one device each) runs W of its k-th microbatch after B of its (k + s)-th and the s W's left
  after its last B, where the earlier stages wait for their gradients (`weight_deferral`). With
  equal F, B and W that is the paper's bubble (p - 1)(F + B - W), a third of 1f1b's. Memory: a
  microbatch is held from its forward to its W (autograd keeps the graph until then): 1f1b's n
  plus the d deferred, which is p on every stage (1f1b's first stage's).
- `interleaved-1f1b` (Narayanan et al., SC 2021; Megatron-LM's virtual pipeline): the model cut into
  p v stages, v chunks per rank placed round-robin (stage s on rank s mod p, so rank r holds stages
  r, r + p, ..., r + (v - 1) p), one device per stage. Rank r runs its m v forwards and backwards in
  1f1b fashion over "virtual microbatches": the k-th forward is microbatch (k div p v) p + k mod p of
  chunk (k div p) mod v, the k-th backward the same microbatch of chunk v - 1 - (k div p) mod v;
  (p - r - 1) 2 + (v - 1) p forwards run before the first backward. m must be a multiple of p. The
  bubble is 1f1b's divided by v: (p - 1)(F + B) / v for a whole model's F and B per microbatch on
  each of the p ranks, at the price of v times the messages; rank 0 holds (v - 1) p + 2 (p - 1) + 1
  chunk-microbatches at its peak.
- `zbv` (Qi et al. 2024, section 6; torch's ScheduleZBVZeroBubble): 2 p stages in a V on p ranks, rank r
  holding stages r (down) and 2p - 1 - r (up; `stage_placement`), so the first and last stage share rank 0
  and the turn (stage p - 1 to p) is a message of rank p - 1 to itself; backwards split into B and W as in
  zb-h1, in the phases of `_v_shape`, any m. With equal F = B = W = f per chunk and m >= 2p - 1 the
  iteration is 6 m f + (p - 1) f: only the first forward's way down idles; every rank holds 2p
  chunk-microbatches at its peak (p of a whole stage's size, 1f1b's first stage's). Neighbouring ranks
  exchange both legs' messages, so a rank may receive in another order than its neighbour sends:
  `receive_order` gives the sender's order, which a first-in, first-out channel delivers.
- `pipedream`: the 1f1b order over every iteration's microbatches without a flush, with an
  all-reduce (replicated stages) and a step after every backward (weight stashing keeps each
  backward on its forward's weights); the microbatches must divide evenly among each stage's
  replicas, whose k-th backwards all-reduce together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence, Union

from planner.errors import PlannerError

if TYPE_CHECKING:
    import numpy as np

SCHEDULES = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zbv", "pipedream")
FLUSH_SCHEDULES = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zbv")  # an all-reduce and step once per iteration
CHUNKED_SCHEDULES = ("interleaved-1f1b", "zbv")  # several stages (chunks) per rank (`stage_placement`)
SPLIT_BACKWARD_SCHEDULES = ("zb-h1", "zbv")  # `backward` is B (input gradients) and `weight` W (weight gradients)
FIXED_CHUNKS = {"zbv": 2}  # chunked schedules whose chunks per rank are set by their shape
ArrayOrInt = Union[int, "np.ndarray"]

FORWARD, BACKWARD = "forward", "backward"
SEND_ACTIVATION, RECV_ACTIVATION = "send_activation", "recv_activation"
SEND_GRADIENT, RECV_GRADIENT = "send_gradient", "recv_gradient"
ALLREDUCE, STEP = "allreduce", "step"
WEIGHT = "weight"
OPS = (FORWARD, BACKWARD, WEIGHT, SEND_ACTIVATION, RECV_ACTIVATION, SEND_GRADIENT, RECV_GRADIENT, ALLREDUCE, STEP)
SENDS = (SEND_ACTIVATION, SEND_GRADIENT)
RECEIVES = (RECV_ACTIVATION, RECV_GRADIENT)
_SHORT = {FORWARD: "F", BACKWARD: "B", WEIGHT: "W", SEND_ACTIVATION: "sa", RECV_ACTIVATION: "ra", SEND_GRADIENT: "sg",
          RECV_GRADIENT: "rg", ALLREDUCE: "AR", STEP: "S"}


class ScheduleError(PlannerError):
    """A schedule breaks a rule; `step` is the first bad action's index on `rank` and `grid` shows it."""

    def __init__(self, problem: str, rank: int, step: int, grid: str) -> None:
        self.problem, self.rank, self.step, self.grid = problem, rank, step, grid
        super().__init__(f"rank {rank}, action {step}: {problem}\n{grid}")


def in_flight(schedule: str, microbatches: int, replicas: ArrayOrInt, devices_from_here: ArrayOrInt,
              devices_total: ArrayOrInt | None = None) -> ArrayOrInt:
    """Microbatches in flight per replica of a stage with `replicas` replicas and `devices_from_here` devices in it
    and every later stage: gpipe ceil(m / r), 1f1b n = min(ceil(m / r), ceil(D / r)), pipedream ceil(D / r),
    interleaved-1f1b m per chunk (an upper bound: its rank's peak over all its chunks is the simulator's),
    zb-h1 min(ceil(m / r), n + `weight_deferral`) (held from forward to W); `devices_total`: the devices
    of every stage (zb-h1 only; None: D); element-wise on arrays."""
    per_replica = -(-microbatches // replicas)
    through = -(-devices_from_here // replicas)
    if schedule == "gpipe" or schedule in CHUNKED_SCHEDULES:  # chunked: a chunk holds at most its m (its rank's
        return per_replica  # peak over all its chunks is min(2 (p - r - 1) + (v - 1) p + 1, m v): the simulator's)
    if schedule in ("1f1b", "zb-h1"):
        import numpy as np  # only for the optimizer's arrays: schedules of plans need no numpy

        n = np.minimum(per_replica, through)
        if schedule == "1f1b":
            return n
        total = devices_from_here if devices_total is None else devices_total
        return np.minimum(per_replica, n + weight_deferral(replicas, devices_from_here, total))
    return through


def weight_deferral(replicas: ArrayOrInt, devices_from_here: ArrayOrInt, devices_total: ArrayOrInt) -> ArrayOrInt:
    """zb-h1: how many microbatches a replica's W's trail its B's, d = ceil((P - D) / r) with P the devices of
    every stage and D those of this stage and the later ones (unreplicated: the stage's index s), so that
    every stage holds about as many microbatches as 1f1b's first stage (n + d = P for one device per stage)."""
    return -(-(devices_total - devices_from_here) // replicas)


def pipedream_microbatches(replicas: Sequence[int], at_least: int) -> int:
    """The fewest microbatches, at least `at_least` (and 1), that every stage's replica count divides:
    pipedream deals microbatches to a stage's replicas in turn, so a run of it ends on whole rounds."""
    unit = math.lcm(*replicas)
    return unit * max(1, -(-at_least // unit))


@dataclass(frozen=True)
class Action:
    """One thing a rank does: `op` on `microbatch` of `stage` (-1 for all-reduce and step); `peer`
    is the rank sent to or received from (-1 otherwise); `iteration` counts flushes."""

    op: str
    stage: int
    microbatch: int = -1
    peer: int = -1
    iteration: int = 0

    def short(self) -> str:
        """A few characters for grids: F3, B3, sa3 (send activation), rg3 (receive gradient), AR, S."""
        return _SHORT[self.op] + (str(self.microbatch) if self.microbatch >= 0 else "")


@dataclass(frozen=True)
class RankProgram:
    """What one rank does, in order: `stage` is its (first) stage; `stages` every stage it runs, lowest
    first ((stage,) but under a chunked schedule)."""

    rank: int
    stage: int
    replica: int
    actions: tuple[Action, ...]
    stages: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.stages:
            object.__setattr__(self, "stages", (self.stage,))


@dataclass(frozen=True)
class Schedule:
    """Every rank's program; `microbatches` per iteration, `iterations` run back to back."""

    name: str
    microbatches: int
    iterations: int
    stage_ranks: tuple[tuple[int, ...], ...]  # ranks of each stage, replica k at index k
    programs: tuple[RankProgram, ...]

    @property
    def num_stages(self) -> int:
        """Stages of the pipeline."""
        return len(self.stage_ranks)

    def owner(self, stage: int, microbatch: int) -> int:
        """The rank of `stage` that handles `microbatch` (round-robin over the replicas)."""
        ranks = self.stage_ranks[stage]
        return ranks[microbatch % len(ranks)]

    def grid(self, marks: dict[int, int] | None = None, width: int = 16) -> str:
        """The programs as text, one row per rank; `marks` {rank: action index} brackets actions."""
        marks = marks or {}
        lines = []
        for program in self.programs:
            at = marks.get(program.rank)
            first = 0 if at is None else max(0, at - width // 2)
            cells = [f"[{a.short()}]" if at == first + k else a.short()
                     for k, a in enumerate(program.actions[first:first + width])]
            more = " ..." if first + width < len(program.actions) else ""
            lead = "... " if first > 0 else ""
            lines.append(f"rank {program.rank:3d} (stage {program.stage}): {lead}{' '.join(cells)}{more}")
        return "\n".join(lines)


def build_schedule(
    name: str, stage_replicas: Sequence[int], microbatches: int, iterations: int = 1,
    stage_ranks: Sequence[Sequence[int]] | None = None, chunks: int = 1,
) -> Schedule:
    """The schedule `name` for stages with these replica counts (ranks contiguous from 0 by default);
    `chunks`: stages per rank of a chunked schedule (`interleaved-1f1b`), whose stages lie round-robin on
    len(stage_replicas) / chunks ranks, one device each."""
    if name not in SCHEDULES:
        raise PlannerError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}")
    if microbatches < 1 or iterations < 1 or not stage_replicas or min(stage_replicas) < 1:
        raise PlannerError(f"a schedule needs microbatches >= 1, iterations >= 1 and stages with replicas >= 1; "
                           f"got {microbatches}, {iterations}, {list(stage_replicas)}")
    uneven = [r for r in stage_replicas if (microbatches * iterations) % r]
    if name == "pipedream" and uneven:
        raise PlannerError(f"pipedream all-reduces after every backward, so every replica needs as many "
                           f"microbatches: {microbatches * iterations} microbatches do not divide among "
                           f"{uneven[0]} replicas; use a multiple of {uneven[0]}")
    if name in CHUNKED_SCHEDULES:
        return _chunked_schedule(name, len(stage_replicas), chunks, microbatches, iterations, stage_replicas)
    if chunks != 1:
        raise PlannerError(f"{name} runs one stage per rank, got chunks={chunks}; chunks are for "
                           f"{', '.join(CHUNKED_SCHEDULES)}")
    if stage_ranks is None:
        firsts = [sum(stage_replicas[:s]) for s in range(len(stage_replicas))]
        stage_ranks = [tuple(range(first, first + r)) for first, r in zip(firsts, stage_replicas)]
    ranks = tuple(tuple(int(rank) for rank in group) for group in stage_ranks)
    if [len(group) for group in ranks] != list(stage_replicas):
        raise PlannerError(f"stage ranks {ranks} do not match replicas {list(stage_replicas)}")
    every = [rank for group in ranks for rank in group]
    if len(set(every)) != len(every) or min(every) < 0:
        raise PlannerError(f"stage ranks {ranks} must be distinct and not negative: one program per rank")
    skeleton = Schedule(name, microbatches, iterations, ranks, ())
    programs = []
    for stage, group in enumerate(ranks):
        downstream = sum(len(later) for later in ranks[stage:])
        deferral = int(weight_deferral(len(group), downstream, len(every)))
        for replica, rank in enumerate(group):
            actions = _program(skeleton, stage, replica, downstream, deferral)
            programs.append(RankProgram(rank, stage, replica, tuple(actions)))
    programs.sort(key=lambda program: program.rank)
    return Schedule(name, microbatches, iterations, ranks, tuple(programs))


def stage_placement(name: str, num_stages: int, chunks: int) -> tuple[int, ...]:
    """The rank of each of `num_stages` stages of a chunked schedule on num_stages / chunks = p ranks:
    interleaved-1f1b round-robin (stage s on rank s mod p), zbv in a V (stage s on rank s for s < p, on
    rank 2p - 1 - s after: rank r holds stages r and 2p - 1 - r, so the model goes down the ranks and
    back up, and the first and last stages share rank 0)."""
    if chunks < 1 or num_stages % chunks:
        raise PlannerError(f"{name}: {num_stages} stages are not a whole number of chunks={chunks} per rank")
    ranks = num_stages // chunks
    if name == "zbv":
        return tuple(stage if stage < ranks else 2 * ranks - 1 - stage for stage in range(num_stages))
    return tuple(stage % ranks for stage in range(num_stages))


def _chunked_schedule(
    name: str, num_stages: int, chunks: int, microbatches: int, iterations: int, stage_replicas: Sequence[int],
) -> Schedule:
    """A chunked schedule: `num_stages` = p x chunks stages placed by `stage_placement` (module docstring)."""
    if chunks < 1 or num_stages % chunks or any(r != 1 for r in stage_replicas):
        raise PlannerError(f"{name} needs stages of one device each, a whole number of chunks per rank: got "
                           f"{num_stages} stages, chunks={chunks}, replicas {list(stage_replicas)}")
    if name in FIXED_CHUNKS and chunks != FIXED_CHUNKS[name]:
        raise PlannerError(f"{name} runs exactly {FIXED_CHUNKS[name]} chunks per rank, got chunks={chunks}")
    ranks = num_stages // chunks
    if name == "interleaved-1f1b" and microbatches % ranks:
        raise PlannerError(f"{name} runs microbatches in groups of one per rank: {microbatches} microbatches do not "
                           f"divide among {ranks} ranks; use a multiple of {ranks}")
    placement = stage_placement(name, num_stages, chunks)
    stage_ranks = tuple((rank,) for rank in placement)
    skeleton = Schedule(name, microbatches, iterations, stage_ranks, ())
    programs = []
    for rank in range(ranks):
        own = tuple(stage for stage in range(num_stages) if placement[stage] == rank)
        actions: list[Action] = []
        for iteration in range(iterations):
            actions += (_interleaved(skeleton, rank, ranks, chunks, iteration) if name == "interleaved-1f1b"
                        else _v_shape(skeleton, rank, ranks, iteration))
            for stage in own:
                actions += _update(stage, 1, iteration)
        programs.append(RankProgram(rank, rank, 0, tuple(actions), own))
    return Schedule(name, microbatches, iterations, stage_ranks, tuple(programs))


def _v_shape(schedule: Schedule, rank: int, ranks: int, iteration: int) -> list[Action]:
    """One iteration of rank `rank` under zbv, its down stage d = rank and up stage u = 2p - 1 - rank, each
    op only where it can run (a forward not beyond m, a B after its forward, a W after its B), in phases:
    2 (p - rank) - 1 forwards of d (the first microbatches must reach the turn of the V); rank times F of u
    then F of d; p - rank times F, B and W of u (the up leg starts its backwards at once); then, while
    forwards are left, F of d, B and W of d, F, B and W of u; then rank times B of d and B of u, p - rank times
    B and W of d, and the W's left, u's then d's. Each op's microbatch is the next one in order for it."""
    down, up = rank, 2 * ranks - 1 - rank
    m = schedule.microbatches
    done = {(op, stage): 0 for op in (FORWARD, BACKWARD, WEIGHT) for stage in (down, up)}
    actions: list[Action] = []

    def run(op: str, stage: int) -> None:
        count = done[(op, stage)]
        ready = {FORWARD: m, BACKWARD: done[(FORWARD, stage)], WEIGHT: done[(BACKWARD, stage)]}[op]
        if count >= ready:
            return
        done[(op, stage)] = count + 1
        if op == FORWARD:
            actions.extend(_forward_steps(schedule, stage, count, iteration))
        elif op == BACKWARD:
            actions.extend(_backward_steps(schedule, stage, count, iteration))
        else:
            actions.append(Action(WEIGHT, stage, count, -1, iteration))

    for _ in range(2 * (ranks - rank) - 1):
        run(FORWARD, down)
    for _ in range(rank):
        run(FORWARD, up)
        run(FORWARD, down)
    for _ in range(ranks - rank):
        for op in (FORWARD, BACKWARD, WEIGHT):
            run(op, up)
    while done[(FORWARD, up)] < m:
        for stage in (down, up):
            for op in (FORWARD, BACKWARD, WEIGHT):
                run(op, stage)
    for _ in range(rank):
        run(BACKWARD, down)
        run(BACKWARD, up)
    for _ in range(ranks - rank):
        run(BACKWARD, down)
        run(WEIGHT, down)
    for stage in (up, down):
        while done[(BACKWARD, stage)] < m:
            run(BACKWARD, stage)
        while done[(WEIGHT, stage)] < m:
            run(WEIGHT, stage)
    return actions


def _interleaved(schedule: Schedule, rank: int, ranks: int, chunks: int, iteration: int) -> list[Action]:
    """One iteration of rank `rank` under interleaved 1F1B: warm-up forwards, then one forward and one
    backward in turn, then the remaining backwards, over its m x chunks virtual microbatches."""
    total = schedule.microbatches * chunks

    def unit(k: int, forward: bool) -> tuple[int, int]:  # (stage, microbatch) of the k-th forward or backward
        chunk = (k // ranks) % chunks
        microbatch = (k // (ranks * chunks)) * ranks + k % ranks
        return (chunk if forward else chunks - 1 - chunk) * ranks + rank, microbatch

    def forward(k: int) -> list[Action]:
        return _forward_steps(schedule, *unit(k, True), iteration)

    def backward(k: int) -> list[Action]:
        return _backward_steps(schedule, *unit(k, False), iteration)

    warmup = min((ranks - rank - 1) * 2 + (chunks - 1) * ranks, total)
    actions = [a for k in range(warmup) for a in forward(k)]
    for k in range(warmup, total):
        actions += forward(k) + backward(k - warmup)
    return actions + [a for k in range(total - warmup, total) for a in backward(k)]


def _forward_steps(schedule: Schedule, stage: int, microbatch: int, iteration: int) -> list[Action]:
    """Receive the activation (but on the first stage), forward, send it on (but from the last stage)."""
    steps = [] if stage == 0 else [Action(RECV_ACTIVATION, stage, microbatch, schedule.owner(stage - 1, microbatch),
                                          iteration)]
    steps.append(Action(FORWARD, stage, microbatch, -1, iteration))
    if stage < schedule.num_stages - 1:
        steps.append(Action(SEND_ACTIVATION, stage, microbatch, schedule.owner(stage + 1, microbatch), iteration))
    return steps


def _backward_steps(schedule: Schedule, stage: int, microbatch: int, iteration: int) -> list[Action]:
    """Receive the gradient (but on the last stage), backward, send the input gradient (but from the first)."""
    steps = [] if stage == schedule.num_stages - 1 else [
        Action(RECV_GRADIENT, stage, microbatch, schedule.owner(stage + 1, microbatch), iteration)]
    steps.append(Action(BACKWARD, stage, microbatch, -1, iteration))
    if stage > 0:
        steps.append(Action(SEND_GRADIENT, stage, microbatch, schedule.owner(stage - 1, microbatch), iteration))
    return steps


def _program(schedule: Schedule, stage: int, replica: int, devices_from_here: int, deferral: int) -> list[Action]:
    """The ordered actions of one replica of one stage."""
    replicas, m = len(schedule.stage_ranks[stage]), schedule.microbatches

    def forward(i: int, iteration: int) -> list[Action]:
        return _forward_steps(schedule, stage, i, iteration)

    def weight(i: int, iteration: int) -> list[Action]:
        return [Action(WEIGHT, stage, i, -1, iteration)]

    def backward(i: int, iteration: int) -> list[Action]:
        steps = _backward_steps(schedule, stage, i, iteration)
        if schedule.name == "pipedream":
            steps += _update(stage, replicas, iteration)
        return steps

    if schedule.name == "pipedream":
        mine = [(i, i // m) for i in range(replica, m * schedule.iterations, replicas)]
        return _one_f_one_b(mine, int(in_flight("pipedream", m, replicas, devices_from_here)), forward, backward)
    actions: list[Action] = []
    for iteration in range(schedule.iterations):
        mine = [(i, iteration) for i in range(replica, m, replicas)]
        flights = int(in_flight("1f1b", m, replicas, devices_from_here))
        if schedule.name == "gpipe":
            actions += [a for i, it in mine for a in forward(i, it)] + [a for i, it in mine for a in backward(i, it)]
        elif schedule.name == "zb-h1":
            actions += _zero_bubble_h1(mine, flights, deferral, forward, backward, weight)
        else:
            actions += _one_f_one_b(mine, flights, forward, backward)
        actions += _update(stage, replicas, iteration)
    return actions


def _one_f_one_b(mine: list[tuple[int, int]], flights: int, forward, backward) -> list[Action]:
    """n - 1 forwards, then forward and backward in turn, then the remaining backwards."""
    warmup = max(min(flights, len(mine)) - 1, 0)
    actions = [a for i, it in mine[:warmup] for a in forward(i, it)]
    for k in range(warmup, len(mine)):
        actions += forward(*mine[k]) + backward(*mine[k - warmup])
    for i, it in mine[len(mine) - warmup:]:
        actions += backward(i, it)
    return actions


def _zero_bubble_h1(mine: list[tuple[int, int]], flights: int, deferral: int, forward, backward,
                    weight) -> list[Action]:
    """1f1b's order of forwards and backwards (B), each W `deferral` microbatches after its B: W of the k-th
    right after B of the (k + deferral)-th (and its gradient's send), the last `deferral` W's after the last B."""
    deferral = min(deferral, len(mine))
    done = 0

    def backward_then_weight(i: int, iteration: int) -> list[Action]:
        nonlocal done
        done += 1
        return backward(i, iteration) + (weight(*mine[done - 1 - deferral]) if done > deferral else [])

    actions = _one_f_one_b(mine, flights, forward, backward_then_weight)
    return actions + [a for i, it in mine[len(mine) - deferral:] for a in weight(i, it)]


def _update(stage: int, replicas: int, iteration: int) -> list[Action]:
    """All-reduce among the stage's replicas (if several), then the optimizer step."""
    steps = [Action(ALLREDUCE, stage, -1, -1, iteration)] if replicas > 1 else []
    return steps + [Action(STEP, stage, -1, -1, iteration)]


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError at the first broken rule: every microbatch of every stage forward then
    backward exactly once per iteration on its owner (and, in zero-bubble schedules, W once after its
    backward and before the iteration's all-reduce and step; W nowhere else), every receive matched by a send, and the
    programs run to the end (sends buffered, receives and all-reduces wait) without deadlock."""
    for program in schedule.programs:
        _check_program(schedule, program)
    _check_runs(schedule)


def receive_order(schedule: Schedule, rank: int) -> dict[int, list[Action]]:
    """Per peer, the receive actions of `rank` from that peer in the order the peer sends them (sends to
    itself left out): the order one first-in, first-out channel per pair of ranks delivers, which can
    differ from the order `rank`'s program consumes them (zbv's two legs cross between neighbours)."""
    return receive_orders(schedule).get(rank, {})


def receive_orders(schedule: Schedule) -> dict[int, dict[int, list[Action]]]:
    """`receive_order` of every rank that receives from another: rank -> peer -> its receive actions."""
    wanted = {(program.rank, a.op, a.iteration, a.stage, a.microbatch, a.peer): a
              for program in schedule.programs for a in program.actions if a.op in RECEIVES}
    order: dict[int, dict[int, list[Action]]] = {}
    for program in schedule.programs:
        for action in program.actions:
            if action.op in SENDS and action.peer != program.rank:
                op, stage = ((RECV_ACTIVATION, action.stage + 1) if action.op == SEND_ACTIVATION
                             else (RECV_GRADIENT, action.stage - 1))
                order.setdefault(action.peer, {}).setdefault(program.rank, []).append(
                    wanted[(action.peer, op, action.iteration, stage, action.microbatch, program.rank)])
    return order


def _check_program(schedule: Schedule, program: RankProgram) -> None:
    seen_forward: set[tuple[int, int, int]] = set()  # (stage, iteration, microbatch)
    seen_backward: set[tuple[int, int, int]] = set()
    seen_weight: set[tuple[int, int, int]] = set()
    split = schedule.name in SPLIT_BACKWARD_SCHEDULES

    def fail(problem: str, index: int) -> None:
        raise ScheduleError(problem, program.rank, index, schedule.grid({program.rank: index}))

    for index, action in enumerate(program.actions):
        key = (action.stage, action.iteration, action.microbatch)
        if action.op in (FORWARD, BACKWARD, WEIGHT, SEND_ACTIVATION, RECV_ACTIVATION, SEND_GRADIENT, RECV_GRADIENT):
            if action.stage not in program.stages or schedule.owner(action.stage, action.microbatch) != program.rank:
                fail(f"{action.short()} of stage {action.stage} does not belong to this rank", index)
        if action.op == FORWARD:
            if key in seen_forward:
                fail(f"forward of microbatch {action.microbatch} runs twice", index)
            seen_forward.add(key)
        elif action.op == BACKWARD:
            if key not in seen_forward:
                fail(f"backward of microbatch {action.microbatch} before its forward", index)
            if key in seen_backward:
                fail(f"backward of microbatch {action.microbatch} runs twice", index)
            seen_backward.add(key)
        elif action.op == WEIGHT:
            if not split:
                fail(f"{schedule.name} runs whole backwards: W of microbatch {action.microbatch} has no place in it",
                     index)
            if key not in seen_backward:
                fail(f"W of microbatch {action.microbatch} before its backward (B)", index)
            if key in seen_weight:
                fail(f"W of microbatch {action.microbatch} runs twice", index)
            seen_weight.add(key)
        elif action.op in (ALLREDUCE, STEP) and split and seen_backward - seen_weight:
            pending = sorted(seen_backward - seen_weight)[0]
            fail(f"{action.short()} before W of microbatch {pending[2]}: the weights' gradients are not complete",
                 index)
    expected = {(stage, i // schedule.microbatches if schedule.name == "pipedream" else it, i)
                for stage in program.stages for it in range(schedule.iterations)
                for i in _owned(schedule, stage, program.replica, it)}
    extra = sorted(seen_forward - expected)
    if extra:
        index = next(k for k, a in enumerate(program.actions)
                     if a.op == FORWARD and (a.stage, a.iteration, a.microbatch) == extra[0])
        fail(f"microbatch {extra[0][2]} (iteration {extra[0][1]}) of stage {extra[0][0]} is not this rank's to run",
             index)
    missing = sorted(expected - seen_backward)
    if missing:
        fail(f"microbatch {missing[0][2]} (iteration {missing[0][1]}) of stage {missing[0][0]} never runs its "
             "backward", len(program.actions) - 1)
    missing = sorted(expected - seen_weight) if split else []
    if missing:
        fail(f"microbatch {missing[0][2]} (iteration {missing[0][1]}) of stage {missing[0][0]} never runs its W",
             len(program.actions) - 1)


def _owned(schedule: Schedule, stage: int, replica: int, iteration: int) -> list[int]:
    """Microbatches replica `replica` of `stage` must run in `iteration` (pipedream numbers them across iterations)."""
    replicas = len(schedule.stage_ranks[stage])
    m = schedule.microbatches
    offset = iteration * m if schedule.name == "pipedream" else 0
    return [i for i in range(offset, offset + m) if i % replicas == replica]


def _check_runs(schedule: Schedule) -> None:
    """Run every program with buffered sends; a receive needs its send, an all-reduce every replica, and every
    send its receive."""
    position = {program.rank: 0 for program in schedule.programs}
    sent: set[tuple[str, int, int, int, int]] = set()  # (kind, from stage, microbatch, iteration, to rank)
    received: set[tuple[str, int, int, int, int]] = set()
    arrived: dict[tuple[int, int], set[int]] = {}  # (stage, n-th all-reduce) -> ranks that reached it
    reductions = dict.fromkeys(position, 0)
    progress = True
    while progress:
        progress = False
        for program in schedule.programs:
            rank = program.rank
            while position[rank] < len(program.actions):
                action = program.actions[position[rank]]
                if action.op in SENDS:
                    sent.add((action.op, action.stage, action.microbatch, action.iteration, action.peer))
                elif action.op in RECEIVES:
                    kind, source = ((SEND_ACTIVATION, action.stage - 1) if action.op == RECV_ACTIVATION
                                    else (SEND_GRADIENT, action.stage + 1))
                    if schedule.owner(source, action.microbatch) != action.peer:
                        raise ScheduleError(
                            f"{action.short()} expects rank {action.peer}, but stage {source} runs microbatch "
                            f"{action.microbatch} on rank {schedule.owner(source, action.microbatch)}",
                            rank, position[rank], schedule.grid({rank: position[rank]}))
                    if (kind, source, action.microbatch, action.iteration, rank) not in sent:
                        break
                    received.add((kind, source, action.microbatch, action.iteration, rank))
                elif action.op == ALLREDUCE:
                    group = arrived.setdefault((action.stage, reductions[rank]), set())
                    group.add(rank)
                    if len(group) < len(schedule.stage_ranks[action.stage]):
                        break
                    reductions[rank] += 1
                position[rank] += 1
                progress = True
    stuck = {p.rank: position[p.rank] for p in schedule.programs if position[p.rank] < len(p.actions)}
    if stuck:
        rank = min(stuck)
        raise ScheduleError(f"deadlock: {len(stuck)} ranks wait forever (bracketed: where each waits)",
                            rank, stuck[rank], schedule.grid(stuck))
    orphans = sorted(sent - received)
    if orphans:
        kind, stage, microbatch, iteration, peer = orphans[0]
        sender = schedule.owner(stage, microbatch)
        program = next(p for p in schedule.programs if p.rank == sender)
        step = next(k for k, a in enumerate(program.actions)
                    if (a.op, a.stage, a.microbatch, a.iteration, a.peer) == orphans[0])
        raise ScheduleError(f"{kind} of stage {stage}, microbatch {microbatch} (iteration {iteration}) to rank {peer} "
                            "is never received", sender, step, schedule.grid({sender: step}))
