"""The schedule optimizer against brute force over every plan on small random inputs."""

from __future__ import annotations

import copy
from unittest import mock
from dataclasses import dataclass, replace
from typing import Iterator

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from planner.files.cluster import Cluster, make_cluster
from tests.planner.layer_strategies import layer_arrays
from planner.costs.layer_arrays import LayerArrays
from planner.errors import InfeasiblePlanError
from planner.costs.stage_sums import Pairs
from planner.planning import optimizer as optimizer_module
from planner.planning.bound_search import PROBES
from planner.planning.optimizer import Solution, _Evaluator, _StageGrid, optimize, recompute_options
from planner.schedules.schedule import CHUNKED_SCHEDULES, SCHEDULES, SPLIT_BACKWARD_SCHEDULES
from planner.costs.schedule_cost import (
    CostInputs, Stage, StageCost, StageMemo, objective_s, plan_fits, stage_costs,
)

CONTIGUOUS = tuple(name for name in SCHEDULES if name not in CHUNKED_SCHEDULES)  # one stage per rank

TIE = 1e-9  # objectives within this relative distance of the optimum count as optimal


@dataclass(frozen=True)
class Scored:
    """One plan that obeys the placement rule, with its objective and peak memory per device."""

    stages: tuple[Stage, ...]
    objective_s: float
    peak_bytes: float

    @property
    def devices(self) -> int:
        """Devices the plan uses."""
        return sum(stage[2] for stage in self.stages)


def every_plan(num_layers: int, devices: int, straight: bool, allow_recompute: bool) -> list[tuple[Stage, ...]]:
    """Every contiguous partition, replica assignment (total <= devices) and recompute choice."""
    plans: list[tuple[Stage, ...]] = []
    flags = (False, True) if allow_recompute else (False,)

    def extend(start: int, left: int, stages: tuple[Stage, ...]) -> None:
        if start == num_layers:
            plans.append(stages)
            return
        for stop in range(start + 1, num_layers + 1):
            for replicas in range(1, (1 if straight else left) + 1):
                if replicas <= left:
                    for recompute in flags:
                        extend(stop, left - replicas, stages + ((start, stop, replicas, recompute),))

    extend(0, devices, ())
    return plans


def score_plans(inputs: CostInputs, straight: bool, allow_recompute: bool) -> list[Scored]:
    """Every plan that obeys the placement rule (memory ignored), scored by the cost model (recompute where the
    schedule allows it: not under zb-h1)."""
    unlimited = replace(inputs, memory_bytes=None)
    recompute = allow_recompute and inputs.schedule not in SPLIT_BACKWARD_SCHEDULES
    return [Scored(stages, objective_s(unlimited, list(stages), costs), max(cost.memory_bytes for cost in costs))
            for stages, costs in priced_plans(unlimited, straight, recompute)]


def priced_plans(inputs: CostInputs, straight: bool, recompute: bool) -> Iterator[tuple[tuple[Stage, ...], list[StageCost]]]:
    """Every plan that obeys the placement rule with its stage costs, memory limit ignored; each stage's terms
    computed once (`StageMemo`: the plans share most of their stages)."""
    unlimited = replace(inputs, memory_bytes=None)
    memo: StageMemo = {}
    for stages in every_plan(inputs.arrays.num_layers, inputs.cluster.num_devices, straight, recompute):
        if plan_fits(unlimited, list(stages)):
            yield stages, stage_costs(unlimited, list(stages), memo)


def peaks_and_largest_terms(inputs: CostInputs, straight: bool, recompute: bool) -> list[tuple[float, float]]:
    """(peak bytes, max Q(s)) of every plan that obeys the placement rule (memory limit ignored)."""
    return [(max(cost.memory_bytes for cost in costs), max(cost.bound_s for cost in costs))
            for _, costs in priced_plans(inputs, straight, recompute)]


def feasible(scored: list[Scored], memory_bytes: float | None) -> list[Scored]:
    """The plans whose every device fits the memory limit (all of them without a limit)."""
    return [plan for plan in scored if memory_bytes is None or plan.peak_bytes <= memory_bytes]


def optimal(plans: list[Scored]) -> tuple[float, int]:
    """(least objective, fewest devices among plans within TIE of it)."""
    best = min(plan.objective_s for plan in plans)
    return best, min(plan.devices for plan in plans if plan.objective_s <= best * (1 + TIE))


def check_solution(inputs: CostInputs, solution: Solution, straight: bool, allow_recompute: bool) -> None:
    """The solution is a well-formed plan within the limits whose claimed objective is its own."""
    stages = list(solution.stages)
    assert stages[0][0] == 0 and stages[-1][1] == inputs.arrays.num_layers
    assert all(stop == next_start for (_, stop, _, _), (next_start, _, _, _) in zip(stages, stages[1:]))
    assert all(start < stop and replicas >= 1 for start, stop, replicas, _ in stages)
    assert solution.devices == sum(stage[2] for stage in stages) <= inputs.cluster.num_devices
    assert not straight or all(stage[2] == 1 for stage in stages)
    assert allow_recompute or not any(stage[3] for stage in stages)
    assert plan_fits(inputs, stages)
    assert solution.objective_s == objective_s(inputs, stages)


BANDWIDTHS = [1e9, 1e10, 1e11]
LATENCIES = [1e-5, 1e-3, 0.03125]  # per message, seconds: against layer times of 1 us to 0.1 s


@st.composite
def clusters(draw: st.DrawFn) -> Cluster:
    """Flat clusters of 1-4 devices, or 2 nodes of 2 or 3 devices with any two bandwidths; half of
    them with per-message latencies (any per level), half without; a third with measured all-reduce
    terms per level unlike the links' (`with_allreduce_terms`)."""
    with_latency = draw(st.booleans())

    def latency() -> float:
        return draw(st.sampled_from(LATENCIES)) if with_latency else 0.0

    if draw(st.booleans()):
        cluster = make_cluster(draw(st.integers(1, 4)), None, [draw(st.sampled_from(BANDWIDTHS))],
                               latencies=[latency()])
    else:
        per_node = draw(st.sampled_from([2, 3]))
        inner, outer = draw(st.sampled_from(BANDWIDTHS)), draw(st.sampled_from(BANDWIDTHS))
        cluster = make_cluster(2 * per_node, per_node, [inner, outer], latencies=[latency(), latency()])
    return with_allreduce_terms(cluster, draw) if draw(st.integers(0, 2)) == 0 else cluster


def with_allreduce_terms(cluster: Cluster, draw: st.DrawFn) -> Cluster:
    """`cluster` with each level's all-reduce priced apart from its link, as `planner cluster` measures
    it: a third of the link's bandwidth up to three times it, any latency (or the link's)."""
    return replace(cluster, levels=tuple(
        replace(level, allreduce_bandwidth_Bps=level.bandwidth_Bps * draw(st.sampled_from([1 / 3, 0.5, 3.0])),
                allreduce_latency_s=draw(st.sampled_from([None, 0.0, *LATENCIES])))
        for level in cluster.levels))


def memory_limit(data: st.DataObject, scored: list[Scored]) -> float | None:
    """None, exactly some plan's peak, between two peaks, below every peak or above all of them."""
    peaks = sorted({plan.peak_bytes for plan in scored})
    kind = data.draw(st.sampled_from(["none", "at", "between", "below", "above"]))
    if kind == "none":
        return None
    if kind == "below":
        return data.draw(st.sampled_from([0.0, peaks[0] * 0.5, peaks[0] * (1 - 1e-6)]))
    if kind == "above":
        return peaks[-1] * 1.5 + 1e6
    index = data.draw(st.integers(0, len(peaks) - 1))
    if kind == "at" or index == len(peaks) - 1:
        return peaks[index]
    return (peaks[index] + peaks[index + 1]) / 2


@pytest.mark.slow
@settings(max_examples=400, deadline=None)  # 1,500 took 70-90 s of a 5-minute suite on 2 cores; each run draws anew
@given(
    arrays=layer_arrays(), cluster=clusters(), schedule=st.sampled_from(CONTIGUOUS),
    microbatches=st.integers(1, 6), scale=st.sampled_from([0.5, 1.0, 2.0]) | st.floats(0.5, 2.0),
    input_bytes=st.sampled_from([0.0, 1e6, 1e8]), optimizer_copies=st.sampled_from([1, 2]),
    step_s_per_byte=st.sampled_from([0.0, 0.0, 1e-11, 2.5e-10]),  # an optimizer step of 0 to 0.1 s per 4e8 bytes
    scratch_per_byte=st.sampled_from([0.0, 0.0, 1.0, 3.0]),  # the step's scratch memory per weight byte
    scratch_per_largest=st.sampled_from([0.0, 0.0, 2.0]),  # ... and per byte of the stage's largest weight
    accumulate_s_per_byte=st.sampled_from([0.0, 0.0, 1e-11, 1e-10]),  # gradient accumulation per weight byte
    step_s_per_tensor=st.sampled_from([0.0, 0.0, 1e-5, 0.01]),  # the optimizer step's cost per parameter tensor
    step_s_per_call=st.sampled_from([0.0, 0.0, 4e-4, 0.02]),  # and per call, once per stage with a tensor to step
    library_bytes=st.sampled_from([0.0, 0.0, 0.0, 5e7]),  # CUDA libraries' workspaces, once per device
    straight=st.booleans(), allow_recompute=st.booleans(), data=st.data(),
)
def test_optimum_matches_brute_force(
    arrays: LayerArrays, cluster: Cluster, schedule: str, microbatches: int, scale: float, input_bytes: float,
    optimizer_copies: int, step_s_per_byte: float, scratch_per_byte: float, scratch_per_largest: float,
    accumulate_s_per_byte: float, step_s_per_tensor: float, step_s_per_call: float, library_bytes: float,
    straight: bool, allow_recompute: bool, data: st.DataObject,
) -> None:
    inputs = CostInputs(arrays, cluster, schedule, microbatches, scale, input_bytes, optimizer_copies,
                        step_s_per_byte=step_s_per_byte, scratch_per_byte=scratch_per_byte,
                        scratch_per_largest=scratch_per_largest,
                        accumulate_s_per_byte=accumulate_s_per_byte, step_s_per_tensor=step_s_per_tensor,
                        step_s_per_call=step_s_per_call, library_bytes=library_bytes)
    scored = score_plans(inputs, straight, allow_recompute)
    inputs = replace(inputs, memory_bytes=memory_limit(data, scored))
    plans = feasible(scored, inputs.memory_bytes)
    if not plans:
        with pytest.raises(InfeasiblePlanError) as caught:
            optimize(inputs, straight, allow_recompute)
        enough = caught.value.smallest_memory_bytes
        assert enough > inputs.memory_bytes
        # the named memory admits a plan; it is the least that does, up to rounding to whole MB
        assert min(plan.peak_bytes for plan in scored) <= enough < min(plan.peak_bytes for plan in scored) + 2e6
        # asked whether it needs less than a bound (as `partition` asks of its other failures), the same value
        # below the bound and inf at or above it
        bound = data.draw(st.sampled_from([enough, enough + 5e5, enough + 1e6, enough + 3e6]))
        fresh = optimizer_module._infeasible(inputs, straight, recompute_options(inputs, allow_recompute))
        assert fresh.smallest_memory_below(bound) == (enough if enough < bound else np.inf)
        inputs = replace(inputs, memory_bytes=enough)
        plans = feasible(scored, enough)
    best, fewest = optimal(plans)
    # whole outer groups scanned one count at a time, or by `_Evaluator.fewest_outer`'s closed forms (which the
    # dynamic program takes on clusters of more outer groups than these)
    with mock.patch.object(optimizer_module, "_SCANNED", data.draw(st.sampled_from([0, optimizer_module._SCANNED]))):
        solution = optimize(inputs, straight, allow_recompute)
    check_solution(inputs, solution, straight, allow_recompute)
    assert solution.objective_s == pytest.approx(best, rel=TIE, abs=0.0)
    assert solution.devices == fewest  # no plan within TIE of the optimum uses fewer devices


def test_a_memory_limited_search_starts_no_higher_than_any_plan_within_the_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A review's case: 2 layers of 1 s and 1 GB each on 2 devices, 1f1b, one microbatch, an optimizer step of 1e-18
    s per byte. Without a limit the optimizer keeps one stage (largest term 2e-9 s, the objective within TIE of the
    two-stage plan's, whose terms are 1e-9 s): the tie goes to fewer devices. The memory-limited search starts its
    bisection (where `_least_bound` cannot run: many outer groups) at that plan's term, less TIE x its objective,
    which no plan within the limit beats; at the term itself it would have started above the two-stage plan, which
    fits."""
    arrays = LayerArrays(compute_s=np.array([0.0, 1.0, 2.0]), param_bytes=np.array([0.0, 1e9, 2e9]),
                         cut_bytes=np.zeros(2), saved_bytes=np.zeros(3), fwd_s=np.array([0.0, 0.3, 0.6]),
                         workspace_bytes=np.zeros(2), param_tensors=np.zeros(3), weight_s=np.zeros(3),
                         deferred_bytes=np.zeros(3))
    inputs = CostInputs(arrays, make_cluster(2, None, [1e10]), "1f1b", 1, step_s_per_byte=1e-18)
    one, two = [Stage(0, 2, 1, False)], [Stage(0, 1, 1, False), Stage(1, 2, 1, False)]
    assert list(optimize(inputs, straight=True).stages) == one
    limited = replace(inputs, memory_bytes=max(cost.memory_bytes for cost in stage_costs(inputs, two)) + 1.0)
    assert plan_fits(limited, two) and not plan_fits(limited, one)  # the limit binds: the search runs
    lows: list[float] = []
    search = optimizer_module.smallest_bound
    monkeypatch.setattr(optimizer_module, "_least_bound", lambda *args: None)  # the bisection, as on many outer groups
    monkeypatch.setattr(optimizer_module, "smallest_bound",
                        lambda solve, value, best, low, *probes: lows.append(low) or search(solve, value, best, low,
                                                                                          *probes))
    solution = optimize(limited, straight=True)
    assert lows and all(low <= max(cost.bound_s for cost in stage_costs(limited, two)) for low in lows)
    assert solution.objective_s == pytest.approx(objective_s(limited, two), rel=1e-9)


@pytest.mark.parametrize("one_pass", [True, False])
def test_a_binding_memory_limit_is_searched_in_one_pass_or_bisected_without_probes(
        monkeypatch: pytest.MonkeyPatch, one_pass: bool) -> None:
    """2 layers of 1 s and 1 GB each on 2 devices, one microbatch: without a limit one stage is best. Where it fits the
    limit it is the answer, with no memory-limited search (the bound search runs once, without the limit, with its
    probes); where it does not, `_least_bound` finds the least max Q within the limit in one pass, and no bisection
    runs but the one without the limit. Where that pass cannot run (the closed forms of many outer groups), the
    optimum lies above the unlimited one and probes just above it would all fail, so the memory-limited bisection
    starts at once (no probe)."""
    arrays = LayerArrays(compute_s=np.array([0.0, 1.0, 2.0]), param_bytes=np.array([0.0, 1e9, 2e9]),
                         cut_bytes=np.zeros(2), saved_bytes=np.zeros(3), fwd_s=np.array([0.0, 0.3, 0.6]))
    inputs = CostInputs(arrays, make_cluster(2, None, [1e10]), "1f1b", 1)
    one, two = [Stage(0, 2, 1, False)], [Stage(0, 1, 1, False), Stage(1, 2, 1, False)]
    assert list(optimize(inputs, straight=True).stages) == one
    between = max(cost.memory_bytes for cost in stage_costs(inputs, two)) + 1.0  # two stages fit, one does not
    probes: list[int] = []
    search = optimizer_module.smallest_bound
    monkeypatch.setattr(optimizer_module, "smallest_bound",
                        lambda solve, value, best, low, count: probes.append(count) or search(solve, value, best,
                                                                                               low, count))
    if not one_pass:
        monkeypatch.setattr(optimizer_module, "_least_bound", lambda *args: None)
    for memory, plan, counts in ((1e15, one, [PROBES]), (between, two, [PROBES] if one_pass else [PROBES, 0])):
        limited = replace(inputs, memory_bytes=memory)
        assert plan_fits(limited, plan) and (plan == one or not plan_fits(limited, one))
        probes.clear()
        assert list(optimize(limited, straight=True).stages) == plan
        assert probes == counts


@settings(max_examples=200, deadline=None)
@given(arrays=layer_arrays(), cluster=clusters(), schedule=st.sampled_from(CONTIGUOUS), microbatches=st.integers(1, 6),
       straight=st.booleans(), allow_recompute=st.booleans(), data=st.data())
def test_least_bound_is_the_least_largest_term_of_a_plan_within_memory(
    arrays: LayerArrays, cluster: Cluster, schedule: str, microbatches: int, straight: bool, allow_recompute: bool,
    data: st.DataObject,
) -> None:
    """`_least_bound` (one pass of the dynamic program) against brute force: the least max Q(s) over every plan that
    fits the limit (some plan's peak, or between two), given the max Q of any one of them as its upper bound, and a
    plan within the limit that has it."""
    inputs = CostInputs(arrays, cluster, schedule, microbatches, 1.0, 1e6, 2, step_s_per_byte=1e-11,
                        scratch_per_byte=1.0, accumulate_s_per_byte=1e-11)
    recompute = allow_recompute and schedule not in SPLIT_BACKWARD_SCHEDULES
    scored = peaks_and_largest_terms(inputs, straight, recompute)
    peaks = sorted({peak for peak, _ in scored})
    index = data.draw(st.integers(0, len(peaks) - 1))
    limit = peaks[index] if index == len(peaks) - 1 or data.draw(st.booleans()) else (peaks[index] + peaks[index + 1]) / 2
    largest = [bound for peak, bound in scored if peak <= limit]
    limited = replace(inputs, memory_bytes=limit)
    options = recompute_options(limited, allow_recompute)
    upper = data.draw(st.sampled_from(largest))
    value, plan = optimizer_module._least_bound(_Evaluator(limited, Pairs(limited)), straight, options,
                                                upper * (1 + TIE))
    assert value == pytest.approx(min(largest), rel=TIE, abs=0.0)
    assert plan_fits(limited, plan) and plan[0][0] == 0 and plan[-1][1] == arrays.num_layers  # a plan that has it
    assert max(cost.bound_s for cost in stage_costs(limited, plan)) == pytest.approx(value, rel=TIE, abs=0.0)
    assert not straight or all(stage[2] == 1 for stage in plan)


@settings(max_examples=300, deadline=None)
@given(entries=st.lists(st.tuples(st.integers(0, 7), st.sampled_from([0.5, 1.0, 2.0, 3.0]),
                                  st.sampled_from([0.0, 0.25, 1.0])), min_size=1, max_size=40),
       group=st.sampled_from([1, 2, 4]), exact_devices=st.booleans())
def test_undominated_keeps_what_no_entry_of_its_residue_beats_in_devices_largest_q_and_cost(
        entries: list[tuple[int, float, float]], group: int, exact_devices: bool) -> None:
    """`_undominated` against the definition: an entry goes where another of its residue has at most its devices
    (the same count where `exact_devices`), at most its largest Q and at most its cost, and is not the same entry
    seen later (of equal entries the first stays)."""
    devices = np.array([d for d, _, _ in entries])
    largest, cost = np.array([v for _, v, _ in entries]), np.array([c for _, _, c in entries])
    kept = optimizer_module._undominated(devices % group, devices, largest, cost, exact_devices)

    def beats(i: int, j: int) -> bool:
        same = devices[i] == devices[j] if exact_devices else devices[i] % group == devices[j] % group
        no_worse = devices[i] <= devices[j] and largest[i] <= largest[j] and cost[i] <= cost[j]
        equal = (devices[i], largest[i], cost[i]) == (devices[j], largest[j], cost[j])
        return same and no_worse and (not equal or i < j)

    expected = {j for j in range(len(entries)) if not any(beats(i, j) for i in range(len(entries)) if i != j)}
    assert sorted(kept.tolist()) == sorted(expected)


@settings(max_examples=150, deadline=None)
@given(arrays=layer_arrays(), cluster=clusters(), schedule=st.sampled_from(["gpipe", "1f1b"]),
       microbatches=st.integers(1, 6), straight=st.booleans(), data=st.data())
def test_one_pass_over_recompute_costs_finds_the_optimum_of_a_binding_limit(
    arrays: LayerArrays, cluster: Cluster, schedule: str, microbatches: int, straight: bool, data: st.DataObject,
) -> None:
    """Where a memory limit binds and stages may recompute, the plans that can win come from one pass of the dynamic
    program over (devices, largest Q, recompute cost) (`_least_objectives`): against brute force, the least
    objective and, within a tie of it, the fewest devices, at limits between two plans' peaks or at one."""
    inputs = CostInputs(arrays, cluster, schedule, microbatches, 1.0, 1e6, 2, step_s_per_byte=1e-11,
                        scratch_per_byte=1.0, accumulate_s_per_byte=1e-11)
    scored = score_plans(inputs, straight, True)
    peaks = sorted({plan.peak_bytes for plan in scored})
    index = data.draw(st.integers(0, len(peaks) - 1))
    limit = peaks[index] if index == len(peaks) - 1 or data.draw(st.booleans()) else (peaks[index] + peaks[index + 1]) / 2
    limited = replace(inputs, memory_bytes=limit)
    passes = []
    one_pass = optimizer_module._least_objectives
    with mock.patch.object(optimizer_module, "_least_objectives", lambda *args: passes.append(1) or one_pass(*args)):
        solution = optimize(limited, straight, True)
    check_solution(limited, solution, straight, True)
    best, fewest = optimal(feasible(scored, limit))
    assert solution.objective_s == pytest.approx(best, rel=TIE, abs=0.0)
    assert solution.devices == fewest
    unlimited = optimize(inputs, straight, True)
    assert passes == ([] if plan_fits(limited, list(unlimited.stages)) else [1])  # the pass ran where the limit binds


def test_a_replicated_zero_bubble_stage_can_hold_more_microbatches_on_fewer_devices_after_it() -> None:
    """A review's case: 2 layers on 4 devices at 1 GB/s, zb-h1, 6 microbatches, 3.5 GB, nothing deferred from B to W.
    Layer 0 on 2 replicas holds min(3, ceil(D / 2) + ceil((4 - D) / 2)) microbatches' activations: 2 with layer 1
    on 2 devices after it (D = 4), 3 with layer 1 on one (D = 3), 4.2 GB. The search kept only the fewest devices
    after layer 0 of each residue, the 1-device entry, and returned [(0, 1) x 3, (1, 2) x 1] at 0.51 s; brute force
    finds [(0, 1) x 2, (1, 2) x 2] at 0.46 s."""
    arrays = LayerArrays(compute_s=np.array([0.0, 0.05, 0.06]), param_bytes=np.array([0.0, 3e8, 3.5e8]),
                         cut_bytes=np.zeros(2), saved_bytes=np.array([0.0, 1e9, 1e9]),
                         fwd_s=np.array([0.0, 0.02, 0.024]), weight_s=np.zeros(3), deferred_bytes=np.zeros(3))
    inputs = CostInputs(arrays, make_cluster(4, None, [1e9]), "zb-h1", 6, memory_bytes=3.5e9)
    best, fewest = optimal(feasible(score_plans(inputs, False, False), inputs.memory_bytes))
    solution = optimize(inputs, False, False)
    check_solution(inputs, solution, False, False)
    assert solution.objective_s == pytest.approx(best, rel=TIE, abs=0.0) == pytest.approx(0.46)
    assert solution.devices == fewest == 4


def test_a_zero_bubble_suffix_on_more_devices_can_let_a_stage_before_it_fit() -> None:
    """A review fuzzer's case (6 layers, 6 GPUs at 10 GB/s, zb-h1, 7 microbatches, 4 GB): the stage of layer 2 alone
    keeps min(d + 1, 7) microbatches' deferred gradients (400 MB each), d = 6 - D with D the devices from it on:
    4.601 GB with D = 2 (the rest of the model on one device), 4.201 with D = 3, 3.801 with D = 4 (layers 3, 4
    and 5 on one device each). The DP kept the fewest devices per state and refused, naming 4.601 GB; brute
    force finds two plans that fit, and the optimizer now returns the better."""
    arrays = LayerArrays(
        compute_s=np.array([0.0, 0.1, 0.113114, 0.143114, 0.243114, 0.253114, 0.31031]),
        param_bytes=np.array([0.0, 1e6, 2e6, 5.2e7, 5.2e7, 1.02e8, 1.02e8]),
        cut_bytes=np.array([0.0, 1e7, 0.0, 1e7, 1e5, 0.0]),
        saved_bytes=np.array([0.0, 4e8, 4e8, 8e8, 8e8, 8e8, 8e8]),
        fwd_s=np.array([0.0, 0.0, 0.003278, 0.010778, 0.010778, 0.020778, 0.020778]),
        workspace_bytes=np.array([0.0, 1e6, 1e6, 4e8, 1e6, 1e8]),
        param_tensors=np.array([0.0, 1.0, 3.0, 3.0, 5.0, 7.0, 8.0]),
        weight_s=np.array([0.0, 0.05, 0.054918, 0.060543, 0.160543, 0.160543, 0.174842]),
        deferred_bytes=np.array([0.0, 0.0, 1e8, 5e8, 6e8, 6.01e8, 1.001e9]))
    inputs = CostInputs(arrays, make_cluster(6, None, ["10GB/s"]), "zb-h1", 7, memory_bytes=4e9)
    scored = score_plans(inputs, True, False)
    fitting = feasible(scored, inputs.memory_bytes)
    assert len(fitting) == 2
    best, fewest = optimal(fitting)
    solution = optimize(inputs, True, False)
    check_solution(inputs, solution, True, False)
    assert solution.objective_s == pytest.approx(best, rel=TIE, abs=0.0) and solution.devices == fewest


def test_zero_bubble_replicas_that_fit_are_the_fewest_a_scan_finds() -> None:
    # hypothesis's case: zb-h1 keeps ceil(D / r) + ceil((P - D) / r) microbatches in flight, which the old
    # closed form ceil(P / flights) put up to two groups low (it said no count fits; 6 replicas do)
    arrays = LayerArrays(compute_s=np.zeros(2), param_bytes=np.array([0.0, 1e6]), cut_bytes=np.zeros(1),
                         saved_bytes=np.array([0.0, 4e8]))  # one layer of 1 MB weights keeping 400 MB
    inputs = CostInputs(arrays, make_cluster(8, None, [1e10]), "zb-h1", 11, memory_bytes=1e9)
    evaluator = _Evaluator(inputs, Pairs(inputs))
    pair, end = np.zeros(7, dtype=np.int64), np.arange(2, 9)
    flags, downstream = np.zeros(7, dtype=bool), 8 - end
    counts = np.arange(2, 9)
    fits = np.array([[evaluator.memory(pair[:1], np.array([r]), flags[:1], downstream[i:i + 1])[0] <= 1e9
                      for r in counts] for i in range(7)])
    assert fits.any()
    expected = np.where(fits.any(axis=1), counts[np.argmax(fits, axis=1)], np.inf)
    assert np.array_equal(evaluator._fewest_fitting(pair, flags, downstream), expected)
    assert np.array_equal(evaluator.fewest_outer(pair, end, flags, downstream, 1.0),
                          evaluator._fewest_outer_scan(pair, end, flags, downstream, 1.0))


@st.composite
def measured_clusters(draw: st.DrawFn) -> Cluster:
    """`clusters` of 2 or more devices, every one with all-reduce terms of its own (`with_allreduce_terms`)."""
    cluster = draw(clusters())
    assume(cluster.num_devices >= 2)
    return with_allreduce_terms(cluster, draw)


@settings(max_examples=200, deadline=None)
@given(arrays=layer_arrays(), cluster=measured_clusters(), schedule=st.sampled_from(CONTIGUOUS) | st.just("pipedream"),
       microbatches=st.integers(1, 6), memory=st.sampled_from([None, None, 4e9]), data=st.data())
def test_replicated_stages_are_priced_at_the_measured_all_reduce(
    arrays: LayerArrays, cluster: Cluster, schedule: str, microbatches: int, memory: float | None,
    data: st.DataObject,
) -> None:
    # the dynamic programs' own all-reduce terms (per combination, on outer groups, in the closed forms)
    # against the brute force, which prices each stage with `stage_cost`, on clusters whose all-reduce is
    # not the links' ring (the general test draws these a third of the time, and mostly straight); pipedream
    # half the time: only it replicates a stage over whole outer groups in the unlimited program
    inputs = CostInputs(arrays, cluster, schedule, microbatches, memory_bytes=memory)
    plans = feasible(score_plans(inputs, False, False), memory)
    assume(plans)
    best, fewest = optimal(plans)
    solution = optimize(inputs, False, False)
    check_solution(inputs, solution, False, False)
    assert solution.objective_s == pytest.approx(best, rel=TIE, abs=0.0)
    assert solution.devices == fewest


@settings(max_examples=100, deadline=None)
@given(arrays=layer_arrays(), cluster=clusters(), schedule=st.sampled_from(CONTIGUOUS),
       microbatches=st.integers(1, 6), memory=st.sampled_from([None, 2e9, 4e9]),
       straight=st.booleans(), allow_recompute=st.booleans())
def test_optimize_is_deterministic(
    arrays: LayerArrays, cluster: Cluster, schedule: str, microbatches: int, memory: float | None,
    straight: bool, allow_recompute: bool,
) -> None:
    inputs = CostInputs(arrays, cluster, schedule, microbatches, memory_bytes=memory)
    twin = CostInputs(copy.deepcopy(arrays), cluster, schedule, microbatches, memory_bytes=memory)
    try:
        first = optimize(inputs, straight, allow_recompute)
    except InfeasiblePlanError as error:
        with pytest.raises(InfeasiblePlanError) as again:
            optimize(twin, straight, allow_recompute)
        assert again.value.smallest_memory_bytes == error.smallest_memory_bytes
        return
    second = optimize(twin, straight, allow_recompute)
    assert second.stages == first.stages and second.objective_s == first.objective_s


@settings(max_examples=100, deadline=None)
@given(arrays=layer_arrays(), cluster=clusters(), microbatches=st.integers(1, 6), straight=st.booleans(),
       allow_recompute=st.booleans(), fraction=st.sampled_from([0.4, 0.7, 0.9, 1.0]))
def test_gpipe_searches_a_binding_limit_from_1f1bs_best_plan_without_it_as_from_its_own(
    arrays: LayerArrays, cluster: Cluster, microbatches: int, straight: bool, allow_recompute: bool, fraction: float,
) -> None:
    """Without a memory limit gpipe's and 1f1b's objectives are one, and so are their best plans: `partition` finds
    it once and passes it to both searches within a limit, which then find what each finds alone."""
    gpipe = CostInputs(arrays, cluster, "gpipe", microbatches, 1.0, 1e6, 2, step_s_per_byte=1e-11,
                       scratch_per_byte=1.0, accumulate_s_per_byte=1e-11)
    shared = optimize(replace(gpipe, schedule="1f1b"), straight, allow_recompute)
    own = optimize(gpipe, straight, allow_recompute)
    assert own.stages == shared.stages and own.objective_s == shared.objective_s
    peak = max(cost.memory_bytes for cost in stage_costs(gpipe, list(own.stages)))
    limited = replace(gpipe, memory_bytes=fraction * peak)
    try:
        alone = optimize(limited, straight, allow_recompute)
    except InfeasiblePlanError:
        with pytest.raises(InfeasiblePlanError):
            optimize(limited, straight, allow_recompute, shared)
        return
    assert optimize(limited, straight, allow_recompute, shared) == alone


def test_unhelpful_devices_are_left_unused() -> None:
    # one layer with 4 GB of weights: replicating it costs more in all-reduce than it saves
    arrays = LayerArrays(np.array([0.0, 0.001]), np.array([0.0, 4e9]), np.array([0.0]), fwd_s=np.array([0.0, 0.0005]))
    for schedule in CONTIGUOUS:
        solution = optimize(CostInputs(arrays, make_cluster(8, None, [1e9]), schedule, 4))
        assert solution.stages == ((0, 1, 1, False),) and solution.devices == 1


def test_recompute_only_when_memory_requires_it() -> None:
    # two layers with large activations: without a limit nothing recomputes; a tight limit forces it
    arrays = LayerArrays(
        compute_s=np.array([0.0, 0.01, 0.02]), param_bytes=np.array([0.0, 1e6, 2e6]),
        cut_bytes=np.array([1e6, 0.0]), saved_bytes=np.array([0.0, 1e9, 2e9]), fwd_s=np.array([0.0, 0.004, 0.008]),
    )
    free = optimize(CostInputs(arrays, make_cluster(1, None, [1e10]), "gpipe", 4, input_bytes=1e6))
    assert not any(stage[3] for stage in free.stages)
    tight = CostInputs(arrays, make_cluster(1, None, [1e10]), "gpipe", 4, input_bytes=1e6, memory_bytes=3e9)
    solution = optimize(tight)
    assert any(stage[3] for stage in solution.stages)
    assert plan_fits(tight, list(solution.stages))
    with pytest.raises(InfeasiblePlanError):
        optimize(tight, allow_recompute=False)


def test_tie_with_less_recompute_goes_to_fewer_devices() -> None:
    # found by the brute-force test: one stage on one device, 1f1b, m = 2, sigma = 0.5, costs
    # 0.0625 + 0.0625 = 0.125 s; two stages with the first recomputing cost 0.078125 + 0.046875 =
    # 0.125 s too, on two devices. The tie goes to the single device.
    arrays = LayerArrays(
        compute_s=np.array([0.0, 0.0625, 0.125]), param_bytes=np.zeros(3), cut_bytes=np.zeros(2),
        saved_bytes=np.array([0.0, 1e8, 1.01e8]), fwd_s=np.array([0.0, 0.03125, 0.03125]),
    )
    inputs = CostInputs(arrays, make_cluster(4, 2, [1e9, 1e9]), "1f1b", 2, scale=0.5, memory_bytes=5.05e7)
    assert objective_s(inputs, [(0, 2, 1, False)]) == objective_s(inputs, [(0, 1, 1, True), (1, 2, 1, False)])
    solution = optimize(inputs, straight=True)
    assert solution.objective_s == 0.125
    assert solution.stages == ((0, 2, 1, False),)


# clusters beyond `clusters`: more nodes, more outer groups than `_solve_front` scans (the closed forms of
# `_Evaluator.fewest_outer`), latencies on some
LARGER_CLUSTERS = [
    make_cluster(8, None, [1e10]), make_cluster(16, 8, [3e11, 2.5e10]), make_cluster(8, 2, [1e11, 1e9]),
    make_cluster(12, 2, [1e11, 1e10], latencies=[1e-5, 1e-3]), make_cluster(6, 3, [1e9, 1e11], latencies=[0.0, 1e-3]),
    replace(make_cluster(16, 2, [1e11, 1e10]), levels=(  # all-reduces priced apart from the links (`planner
        replace(make_cluster(16, 2, [1e11, 1e10]).levels[0], allreduce_bandwidth_Bps=4e10),  # cluster`), over
        replace(make_cluster(16, 2, [1e11, 1e10]).levels[1], allreduce_bandwidth_Bps=5e9))),  # 7 outer counts
]


@settings(max_examples=300, deadline=None)
@given(arrays=layer_arrays(), cluster=clusters() | st.sampled_from(LARGER_CLUSTERS),
       schedule=st.sampled_from(CONTIGUOUS), microbatches=st.integers(1, 16), straight=st.booleans(),
       allow_recompute=st.booleans(), step_s_per_byte=st.sampled_from([0.0, 1e-11]),
       accumulate_s_per_byte=st.sampled_from([0.0, 1e-10]), samples=st.lists(st.integers(0, 10**9), max_size=20))
def test_stage_grid_matches_the_evaluator(
    arrays: LayerArrays, cluster: Cluster, schedule: str, microbatches: int, straight: bool, allow_recompute: bool,
    step_s_per_byte: float, accumulate_s_per_byte: float, samples: list[int],
) -> None:
    # the dynamic program's tables give every candidate stage the placement, Q and memory of the evaluator,
    # bit for bit, their memory ceilings the same test against a limit, and their floors rule out no
    # candidate at its own Q and memory
    inputs = CostInputs(arrays, cluster, schedule, microbatches, step_s_per_byte=step_s_per_byte,
                        accumulate_s_per_byte=accumulate_s_per_byte, memory_bytes=4e9)
    evaluator = _Evaluator(inputs, Pairs(inputs))
    grid = _StageGrid(evaluator, straight, recompute_options(inputs, allow_recompute))
    total = cluster.num_devices
    pair, downstream, combo = (axis.ravel() for axis in np.meshgrid(
        np.arange(len(evaluator.pairs.starts)), np.arange(total + 1), np.arange(grid.combos), indexing="ij"))
    replicas = grid.replicas[combo]
    first = total - downstream - replicas
    valid = evaluator.placement_ok(first, replicas)
    assert np.array_equal(grid.valid[downstream, combo], valid)
    pair, downstream, combo, replicas, first = (x[valid] for x in (pair, downstream, combo, replicas, first))
    bound, memory = evaluator.terms(pair, replicas, first, grid.flags[combo], downstream)
    assert np.array_equal(grid.bound(pair, downstream, combo), bound)
    assert np.array_equal(grid.memory(pair, downstream, combo), memory)
    for limit in np.concatenate([memory[:3], [1e9, 4e9]]):
        assert np.array_equal(grid.fits(pair, downstream, combo, float(limit)), memory <= limit)
    for sample in samples if len(pair) else []:
        at = sample % len(pair)
        entries, combos = grid.live(pair[at:at + 1], downstream[at:at + 1], float(bound[at]), float(memory[at]))
        assert combo[at] in combos[entries == 0]


@settings(max_examples=200, deadline=None)
@given(arrays=layer_arrays(),
       cluster=st.sampled_from(LARGER_CLUSTERS[:3] + LARGER_CLUSTERS[5:] + [make_cluster(4, None, [1e9])]),
       schedule=st.sampled_from(CONTIGUOUS), microbatches=st.integers(1, 32),
       memory=st.sampled_from([None, 1e9, 4e9, 1.6e10]), recompute=st.booleans(), data=st.data())
def test_fewest_outer_closed_forms_match_the_scan(
    arrays: LayerArrays, cluster: Cluster, schedule: str, microbatches: int, memory: float | None, recompute: bool,
    data: st.DataObject,
) -> None:
    # the closed forms for whole outer groups find the fewest that work, as trying every count does, at bounds
    # near a candidate's Q but no candidate's own (there they may round the other way: exact ties only with
    # these round numbers); `_solve_front` uses them on clusters with many outer groups
    inputs = CostInputs(arrays, cluster, schedule, microbatches, memory_bytes=memory)
    evaluator = _Evaluator(inputs, Pairs(inputs))
    assume(np.all(evaluator.pairs.replicated >= 0))  # (a tied weight no layer's parameters hold: not a profile)
    total, group = cluster.num_devices, inputs.class_size
    pair, end = (axis.ravel() for axis in np.meshgrid(
        np.arange(len(evaluator.pairs.starts)), np.arange(2 * group, total + 1, group), indexing="ij"))
    flags, downstream = np.full(len(pair), recompute), total - end
    counts = np.arange(2 * group, total + 1, group)
    at = data.draw(st.integers(0, len(pair) - 1))
    count = counts[data.draw(st.integers(0, len(counts) - 1))]
    exact = float(evaluator.terms(pair[at:at + 1], np.array([count]), end[at:at + 1] - count, flags[:1],
                                  downstream[at:at + 1])[0][0])
    assume(exact > 0)  # a model of zero times: every bound below is then the candidate's own Q, 0
    for bound in (exact * (1 - 1e-9), exact * (1 + 1e-9), exact * 0.5 * (1 + 3e-9), exact * 2.0 * (1 - 3e-9)):
        assert np.array_equal(evaluator.fewest_outer(pair, end, flags, downstream, bound),
                              evaluator._fewest_outer_scan(pair, end, flags, downstream, bound))

