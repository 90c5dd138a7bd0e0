"""Local search under the simulator: a plan's cuts moved (the one between nodes to where fewer bytes cross),
stages split and merged, replicas moved, while that shortens its simulated time (pure).

The final choice (`simulated_choice.best_simulated`) proves its plan the fastest only where its bounds are tight;
where it stops on its budget, plans it never reached can simulate much faster. The dynamic program's closed form
charges 1f1b a stage's whole forward and backward m - 1 times, where the simulator hides an early stage's
forwards behind the warm-up, so it keeps too few stages: vgg16 (PipeDream's profile) straight on 8 GPUs, 1f1b,
8 microbatches, is cut into 5 stages simulating 1930 ms, against 1610 ms for a cut into 8 found from it here.

`descend` is a first-improvement descent: the moves of the current plan in a fixed order, each simulated, the
first faster one taken (the next plan's moves tried from there on), until no move helps or the simulations
have played a budget of ops (`simulated_ops`).
A heuristic: nothing here proves a plan the fastest.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np

from planner.costs.schedule_cost import CostInputs, Stage, StageMemo, first_ranks, plan_fits, replicas_of
from planner.errors import InfeasiblePlanError
from planner.files.cluster import Cluster
from planner.planning.baselines import balanced_stages, baseline_plans
from planner.planning.optimizer import optimize
from planner.planning.simulated_choice import better, simulated_s
from planner.simulation.simulator import SimulationTooLongError, simulated_pipedream_microbatches

REFINE_OPS = 100_000  # simulated ops one start's descent may play: 0.1-0.2 s on the 2-core CPU machine
GROUP_SHARE = 4  # a start from `group_plans` descends on this fraction of the budget (1 / GROUP_SHARE), after `start`
CONTINUE_SHARE = 2  # then the best plan found from all starts descends again on 1 / CONTINUE_SHARE of the budget
CONTINUED = 2  # ... and so do the next best (CONTINUED in all)
GAINING_ROUNDS = 4  # then the best descends on that share again, at most this often, while each round gains MIN_GAIN
MIN_GAIN = 0.001  # (relative): a descent that stops where no move helps gains nothing the next round
SHIFTS = (1, -1, 2, -2, 4, -4, 8, -8)  # layers a cut moves by, nearest first
SHORT_RUN = 3  # stages at most in a run `window_moves` cuts again inside the plan (any length from either end)

Plan = tuple[Stage, ...]


def descend(start: Plan, start_s: float, moves: Callable[[Plan], Iterator[Plan]],
            judge: Callable[[Plan], float | None], budget_ops: int, ops: Callable[[Plan], int],
            resume: bool = True, wider: Callable[[Plan], Iterator[Plan]] | None = None) -> tuple[Plan, float]:
    """The plan reached from `start` (simulating `start_s` seconds) by taking, over and over, a move of
    `moves(plan)` that `judge` (seconds, None where it does not fit) finds `better` (faster by more than a relative
    TIE, or as fast on fewer devices, as the final choice breaks ties), until none is or the
    next trial would pass `budget_ops`, at `ops(plan)` each (`simulated_ops`). With `resume`, after a move is taken
    the next plan's moves are tried from the same position in their order on (wrapping round; a position only,
    when moves come and go with the stages), not from the first: the moves before it had just failed and mostly
    still do (resnet50 straight on 16 GPUs at 8 per node, 1f1b: x1.028 -> x1.057 faster on the same budget; for
    chunked plans the first-move order did better: gpt, interleaved-1f1b on 4 ranks, 32 microbatches, 2126.2
    against 2320.2 ms). Where a whole round of `moves` finds nothing better, the moves of `wider` (from their own
    position) are tried; one taken, `moves` again (a variable neighbourhood descent: on the same budget it reaches
    the plan the descent over `moves` alone stops at, then goes on). Never slower than `start` by more than a
    relative TIE a move (ties go to fewer devices); deterministic."""
    plan, plan_s = start, start_s
    families = [moves] + ([wider] if wider is not None else [])
    left, positions, level = budget_ops, [0] * len(families), 0
    while level < len(families):
        trials = list(families[level](plan))
        at = positions[level] % len(trials) if resume and trials else 0
        for step in range(len(trials)):
            trial = trials[(at + step) % len(trials)]
            cost = ops(trial)
            if cost > left:
                return plan, plan_s
            left -= cost
            trial_s = judge(trial)
            if trial_s is not None and better(trial, trial_s, plan, plan_s):
                plan, plan_s, positions[level], level = trial, trial_s, at + step, 0
                break
        else:
            level += 1  # a whole round of these moves without a better plan
    return plan, plan_s


def cut_moves(plan: Plan, shifts: Sequence[int] = SHIFTS) -> Iterator[Plan]:
    """`plan` with one cut moved by one of `shifts` layers, cut by cut (every stage keeps a layer)."""
    for at in range(len(plan) - 1):
        for shift in shifts:
            before, after = plan[at], plan[at + 1]
            cut = before.stop + shift
            if before.start < cut < after.stop:
                yield plan[:at] + (before._replace(stop=cut), after._replace(start=cut)) + plan[at + 2:]


Split = Callable[[int, int, int], tuple[tuple[int, int], ...]]  # (start, stop, parts) -> the parts' layer spans


def recut(split: Split, start: int, stop: int, parts: int) -> Plan:
    """Layers start..stop as `parts` one-device stages without recompute, cut where `split` cuts them."""
    return tuple(Stage(a, b, 1, False) for a, b in split(start, stop, parts))


def time_shares(inputs: CostInputs) -> Split:
    """`split(start, stop, parts)`: layers start..stop cut into `parts` non-empty spans where the forward + backward
    time reaches 1/parts, 2/parts, ... of theirs (each cut at the nearer layer boundary). Cheap (a few array
    lookups), where the balance of `baselines.balanced_stages` (the least largest span, by bisection) made the
    moves of a deep plan cost seconds to list; the cut moves then balance further."""
    prefix_s = np.asarray(inputs.arrays.compute_s, dtype=float)  # seconds before each layer boundary

    def split(start: int, stop: int, parts: int) -> tuple[tuple[int, int], ...]:
        targets = prefix_s[start] + (prefix_s[stop] - prefix_s[start]) * np.arange(1, parts) / parts
        above = np.clip(np.searchsorted(prefix_s, targets), 1, len(prefix_s) - 1)
        nearer = np.where(targets - prefix_s[above - 1] < prefix_s[above] - targets, above - 1, above)
        cuts = [start]
        for index, cut in enumerate(nearer.tolist(), start=1):
            cuts.append(min(max(cut, cuts[-1] + 1), stop - (parts - index)))
        cuts.append(stop)
        return tuple(zip(cuts, cuts[1:]))

    return split


def window_moves(plan: Plan, devices: int, split: Split) -> Iterator[Plan]:
    """`plan` with a run of k one-device stages cut again by `split` into k - 1 (k > 2; two into one is a merge of
    `plan_moves`) to k + (free devices) one-device stages without recompute, runs from the first stage on, shortest
    first; inside the plan (not touching either end) runs of at most SHORT_RUN stages. A jump no one move makes: a
    pipeline that fills one node gains on two only once several stages move at once (squeezenet1_0, PipeDream's
    profile, straight on 2 nodes of 8 GPUs, 1f1b, 8 microbatches: the 8 stages on one node no cut, split or
    merge improves simulate 584.8 ms; with these moves they reach 11 stages across both nodes and 540.7 ms)."""
    free = devices - sum(replicas_of(plan))
    seen = {plan}  # runs cut again can meet (the first stage into two, the first two into three)
    for first in range(len(plan)):
        for stop in range(first + 1, len(plan) + 1):
            if any(stage.replicas != 1 for stage in plan[first:stop]):
                break
            if first > 0 and stop < len(plan) and stop - first > SHORT_RUN:
                continue
            start, end, runs = plan[first].start, plan[stop - 1].stop, stop - first
            for parts in range(runs - 1 if runs > 2 else runs, min(runs + free, end - start) + 1):
                moved = plan[:first] + recut(split, start, end, parts) + plan[stop:]
                if moved not in seen:
                    seen.add(moved)
                    yield moved


def lower_crossings(cut_bytes: np.ndarray, at: int, low: int, high: int) -> list[int]:
    """Where a cut now before layer `at` could cross more cheaply, within layers `low`..`high`: walking outward
    from `at` on each side, every cut whose bytes (`cut_bytes[layer - 1]`) are a local minimum and fewer than
    at `at` and at every cut picked before it on that side (the steps down of a staircase); nearest first."""
    picks = []
    for side in (range(at + 1, high + 1), range(at - 1, low - 1, -1)):
        fewest = cut_bytes[at - 1]
        for layer in side:
            here = cut_bytes[layer - 1]
            if here < fewest and (layer == low or here <= cut_bytes[layer - 2]) and (
                    layer == high or here <= cut_bytes[layer]):
                fewest = here
                picks.append(layer)
    return sorted(picks, key=lambda layer: (abs(layer - at), layer))


def crossing_moves(plan: Plan, ranks: Sequence[int], group_sizes: Sequence[int], cut_bytes: np.ndarray,
                   split: Split) -> Iterator[Plan]:
    """`plan`, its stages starting on `ranks` (`schedule_cost.first_ranks`: right-aligned), with a cut where it
    crosses from one group of ranks to the next (a node to the next: each of `group_sizes`, the inner levels'
    groups) moved to one of its `lower_crossings`, the stages of the two groups either side (one device each, else
    the crossing is left alone) cut again by `split` into as many as before, without recompute. The cut over the
    slowest link decides more than any balance, and no move of a few layers reaches the next cheap one:
    densenet121 (PipeDream's profile) straight on 2 nodes of 8 GPUs at 100 and 10 GB/s, 1f1b, 8 microbatches,
    crossed after layer 119 (89.9 MB a microbatch) and simulated 507.6 ms; crossing after layer 138 (12.8 MB), both
    nodes cut again, 487.8 ms; refined from there with these moves, 462.8 ms, without them 491.2 ms.
    `refine_plan` tries these first: they are few (the steps down on each side, a dozen at most on that plan), and
    a deep plan's descent spends its budget before one round of `plan_moves` ends (that plan's round is about 135
    simulations of 768 ops, past the 100k of `REFINE_OPS`), so moves listed after them are not reached."""
    seen = {plan}
    for group in group_sizes:
        edges = [0] + [at for at in range(1, len(plan)) if ranks[at] % group == 0] + [len(plan)]
        for low, at, high in zip(edges, edges[1:], edges[2:]):
            if any(stage.replicas != 1 for stage in plan[low:high]):
                continue
            start, stop, left, right = plan[low].start, plan[high - 1].stop, at - low, high - at
            for cut in lower_crossings(cut_bytes, plan[at].start, start + left, stop - right):
                moved = plan[:low] + recut(split, start, cut, left) + recut(split, cut, stop, right) + plan[high:]
                if moved not in seen:
                    seen.add(moved)
                    yield moved


def plan_moves(plan: Plan, devices: int, straight: bool) -> Iterator[Plan]:
    """The moves of `refine_plan`, in order: a cut moved (`cut_moves`); a one-device stage split in two at the
    middle of its layers, where a device is free; two neighbours merged onto one device, or (replicas allowed)
    onto both's devices; one replica moved to a neighbour. `plan_fits` is left to the judge."""
    yield from cut_moves(plan)
    if sum(replicas_of(plan)) < devices:
        for at, stage in enumerate(plan):
            if stage.replicas == 1 and stage.stop - stage.start >= 2:
                middle = (stage.start + stage.stop) // 2
                yield plan[:at] + (stage._replace(stop=middle), stage._replace(start=middle)) + plan[at + 1:]
    for at in range(len(plan) - 1):
        before, after = plan[at], plan[at + 1]
        merged = before._replace(stop=after.stop, recompute=before.recompute or after.recompute)
        if before.replicas == after.replicas == 1:
            yield plan[:at] + (merged,) + plan[at + 2:]
        if not straight:
            yield plan[:at] + (merged._replace(replicas=before.replicas + after.replicas),) + plan[at + 2:]
    if not straight:
        for at in range(len(plan) - 1):
            before, after = plan[at], plan[at + 1]
            if before.replicas > 1:
                yield plan[:at] + (before._replace(replicas=before.replicas - 1),
                                   after._replace(replicas=after.replicas + 1)) + plan[at + 2:]
            if after.replicas > 1:
                yield plan[:at] + (before._replace(replicas=before.replicas + 1),
                                   after._replace(replicas=after.replicas - 1)) + plan[at + 2:]


class Refined(NamedTuple):
    """A refined plan, its simulated seconds and how many plans the refinement simulated."""

    stages: Plan
    seconds: float
    simulated: int


def refine_plan(inputs: CostInputs, start: Plan, start_s: float, straight: bool, allow_recompute: bool = True,
                budget_ops: int = REFINE_OPS) -> Refined:
    """A plan of one stage per rank block (not chunked) after `descend` over `crossing_moves` then `plan_moves`
    (straight, and `window_moves` where those find nothing better), judged by its simulated
    time (`simulated_s`) among plans that fit (`plan_fits`: placement and memory), from `start` on `budget_ops`, then
    from each of the `group_plans` and (straight) of the `straight_starts`, on a share of it each; the CONTINUED best
    by `better` (but `start` itself) descend again on 1 / CONTINUE_SHARE of the budget each (the
    descents mostly stop on their budget, not where no move helps: squeezenet1_0 straight on 2 nodes of 8 GPUs,
    1f1b, 8 microbatches, 574.5 -> 540.7 ms; the second best too: resnet101 straight on 8 GPUs, 1f1b, from the
    two-stage balanced start, 787.8 -> 774.2 ms), then the best on that share again while a round gains MIN_GAIN,
    GAINING_ROUNDS at most (inception_v3 straight on 8 GPUs, 1f1b: 1342.9 -> 1295.0 ms, for 0.1 s more); `start` as
    it is on a budget of 0. From all: the faster start does not
    always descend further (vgg16 on 2 nodes of 8 GPUs, zb-h1: from the one-node plan alone, x0.90 the speed), and
    halving the budget of `start` lost up to 5% on deep pipelines (squeezenet1_0 straight on 16 GPUs, 1f1b). The
    balanced starts lead to optima that moves from the optimizer's plan do not reach (PipeDream's squeezenet1_0
    straight on 8 GPUs, zb-h1, 8 microbatches: 509.0 ms from the optimizer's plan, 469.5 from a balanced one).
    Straight plans only: on PipeDream's profiles no replicated plan was faster for them."""
    simulated = 0
    memo: StageMemo = {}

    def judge(plan: Plan) -> float | None:
        nonlocal simulated
        if not plan_fits(inputs, list(plan), memo):
            return None
        simulated += 1
        value = simulated_s(inputs, list(plan), memo)
        return value if math.isfinite(value) else None

    if budget_ops <= 0:
        return Refined(start, start_s, 0)
    others = group_plans(inputs, straight, allow_recompute) + (straight_starts(inputs) if straight else [])
    starts = [(start, start_s)] + [(plan, plan_s) for plan in dict.fromkeys(others)
                                   if plan != start and (plan_s := judge(plan)) is not None]
    best = (start, start_s)
    devices, split = inputs.cluster.num_devices, time_shares(inputs)
    groups, cut_bytes = inputs.cluster.group_sizes()[:-1], inputs.arrays.cut_bytes

    def moves(plan: Plan) -> Iterator[Plan]:
        yield from crossing_moves(plan, first_ranks(inputs, list(plan)), groups, cut_bytes, split)
        yield from plan_moves(plan, devices, straight)

    def descent(plan: Plan, plan_s: float, budget: int) -> tuple[Plan, float]:
        return descend(plan, plan_s, moves, judge, budget, lambda trial: simulated_ops(inputs, trial),
                       wider=(lambda trial: window_moves(trial, devices, split)) if straight else None)

    shares = [budget_ops] + [budget_ops // GROUP_SHARE] * (len(starts) - 1)
    reached = []
    for (first, first_s), share in zip(starts, shares):
        found = descent(first, first_s, share)
        reached.append(found)
        if better(found[0], found[1], best[0], best[1]):
            best = found
    if len(starts) > 1:  # the best CONTINUED of them go on (a plan that is `start` itself: a replay)
        ranked = sorted(dict(reached).items(), key=lambda item: item[1])
        for plan, plan_s in [item for item in ranked if item[0] != start][:CONTINUED]:
            found = descent(plan, plan_s, budget_ops // CONTINUE_SHARE)
            if better(found[0], found[1], best[0], best[1]):
                best = found
    for _ in range(GAINING_ROUNDS if best[0] != start else 0):  # and the best goes on while that pays (`start`
        found = descent(*best, budget_ops // CONTINUE_SHARE)  # itself, no move made it faster: a replay)
        gained = best[1] / found[1] - 1.0 if found[1] > 0 else 0.0
        if better(found[0], found[1], best[0], best[1]):
            best = found
        if gained < MIN_GAIN:
            break
    return Refined(*best, simulated)


def group_plans(inputs: CostInputs, straight: bool, allow_recompute: bool) -> list[Plan]:
    """The optimizer's plan on one group of each inner level (one node of several): the closed form leaves out
    the transfers of fill and drain, which between nodes can outweigh what more devices save. resnet18 (PipeDream's
    profile) straight on 2 nodes of 8 GPUs, gpipe, 8 microbatches: 10 stages across the nodes simulate 673.1 ms,
    the 8-GPU plan 644.4 ms, refined 626.4 ms. Levels where nothing fits one group give no plan."""
    plans = []
    for inner in range(1, len(inputs.cluster.levels)):
        group = Cluster(inputs.cluster.levels[:inner], inputs.cluster.memory_bytes)
        try:
            found = optimize(dataclasses.replace(inputs, cluster=group), straight, allow_recompute)
        except InfeasiblePlanError:
            continue
        plans.append(tuple(found.stages))
    return plans


def balanced_plan(inputs: CostInputs, depth: int) -> Plan:
    """`depth` stages of one device each (at most one per layer) balanced by forward + backward time
    (`baselines.balanced_stages`, torchgpipe's balance by time), no recompute."""
    layer_s = [float(value) for value in np.diff(inputs.arrays.compute_s)]
    return tuple(Stage(start, stop, 1, False) for start, stop, _ in balanced_stages(layer_s, depth))


def straight_starts(inputs: CostInputs) -> list[Plan]:
    """The other starts of a straight plan's refinement: the pipelines of `baselines.baseline_plans` on every device
    (DeepSpeed's uniform and parameter-balanced partitions, torchgpipe's balance by time), so that the plan
    `planner partition --straight` chooses is never slower than the baselines it is compared with, and the plans
    balanced by time on half the devices and on two."""
    found = baseline_plans(inputs.arrays, inputs.cluster.num_devices)
    plans = [tuple(Stage(start, stop, 1, False) for start, stop, _ in stages) for name, stages in found.items()
             if name != "data-parallel"]
    devices = min(inputs.cluster.num_devices, inputs.arrays.num_layers)
    return plans + [balanced_plan(inputs, depth) for depth in sorted({max(2, devices // 2), 2}) if depth < devices]


def simulated_ops(inputs: CostInputs, plan: Plan) -> int:
    """About how many ops simulating `plan` plays: 6 x stages x microbatches (a forward, a backward or its B and W,
    and their messages per stage and microbatch); pipedream simulates `simulated_pipedream_microbatches`, 0 where
    it cannot simulate at all."""
    if inputs.schedule != "pipedream":
        return 6 * len(plan) * inputs.microbatches
    try:
        return 6 * len(plan) * simulated_pipedream_microbatches(plan)
    except SimulationTooLongError:
        return 0
