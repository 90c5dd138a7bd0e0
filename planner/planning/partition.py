"""partition(): from a profile and a cluster to a Plan, with its predictions (pure, no I/O; long memory-limited solves
may run in worker processes: `solve_ahead`)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from planner.planning.baselines import baseline_plans
from planner.files.cluster import Cluster, ClusterError
from planner.costs.layer_arrays import (
    ASSUMED_WEIGHT_SHARE, OPTIMIZER_STATE_COPIES, LayerArrays, batch_scaling_note, optimizer_terms,
)
from planner.costs.pipedream_cost import (
    pipedream_bottleneck_s, pipedream_stage_memory_bytes, pipedream_time_from_units, pipedream_unit_terms,
)
from planner.errors import InfeasiblePlanError, PlannerError
from planner.planning.optimizer import Solution, optimize
from planner.planning.pipedream_optimizer import optimize_pipedream
from planner.planning.chunked import ChunkedChoice, best_chunked, chunk_choices, chunked_counts, refine_chunked
from planner.planning.local_search import refine_plan
from planner.planning.simulated_choice import best_simulated
from planner.planning.solve_ahead import SolvesAhead
from planner.profiling.conditions import cores
from planner.files.plan import COST_MODELS, Plan, Prediction, ProfileRef, StagePlan, profile_digest
from planner.files.profile import Profile
from planner.simulation.plan_simulation import plan_cost_inputs
from planner.simulation.simulator import SimulationTooLongError, simulate_stages, simulated_iteration_s
from planner.units import plural, significant
from planner.costs.schedule_cost import (
    CostInputs,
    Stage,
    StageCost,
    first_ranks,
    objective_s,
    plan_fits,
    samples_per_s,
    stage_costs,
)
from planner.schedules.schedule import (
    CHUNKED_SCHEDULES, FIXED_CHUNKS, FLUSH_SCHEDULES, SCHEDULES, SPLIT_BACKWARD_SCHEDULES,
)

AUTO = "auto"
MICROBATCH_CHOICES = tuple(2**k for k in range(8))  # 1 .. 128 tried by --microbatches auto
MAX_AUTO_MICROBATCHES = MICROBATCH_CHOICES[-1]  # with --global-batch-size: its divisors up to this
# Moving a chunked plan's cuts (`_refined`) sped it up by at most 8.0% in 122 cases (PipeDream's profiles, the shipped
# ones and gpt2-medium profiled on an H200, 2-16 GPUs, both chunked schedules, 2 microbatches per GPU), and by 21% in
# a review's sweep (vgg16, zbv on 2 GPUs, 2 microbatches): observed, not proven. A chunked plan further than this
# behind the fastest candidate is not refined (up to a second each): a heuristic that may miss a plan.
REFINE_GAIN_CAP = 1.25
CHUNKED_MARGIN = 1.10  # a chunked plan auto chose by less than this over one of one stage per GPU: `_auto_note` warns
AUTO_MICROBATCH_SHARE = 0.95  # auto takes the fewest microbatches within 5% of the best throughput
# a memory-limited solve that took this long hands the search's other solves to worker processes (`solve_ahead`):
# starting them costs about half a second each. (At 1 s, once the recompute search took one pass, densenet121 at 8
# GB on 2 cores planned in 0.94x the time of one process; nasnetalarge, 3.6-6.6 s a solve, in 1.2x less.)
SOLVE_AHEAD_AFTER_S = 3.0
# a plan whose simulated peak exceeds the memory limit is searched again within a lower limit at most this many times
# (`_within_limit`), and a peak within this relative share of the limit fits it (float sums in another order)
MEMORY_REFITS = 3
MEMORY_TOLERANCE = 1e-9
# on equal throughput: least memory first
SCHEDULE_PREFERENCE = ("1f1b", "zb-h1", "zbv", "gpipe", "interleaved-1f1b", "pipedream")
# never pipedream (stale weights change what training computes); the chunked ones (their cut a heuristic) at the
# microbatch count the best plan of one stage per rank chose
AUTO_SCHEDULES = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zbv")
# schedules whose objectives are one without a memory limit, so that they share their best plan without it
SAME_UNLIMITED = ("gpipe", "1f1b")


def partition(
    profile: Profile, cluster: Cluster, cost_model: str = "planner", straight: bool = False,
    optimizer: str = "adam", profile_path: str = "", schedule: str = AUTO, microbatches: int | str = AUTO,
    microbatch_size: int | None = None, recompute: bool = True, global_batch_size: int | None = None,
    progress: Callable[[str], None] | None = None, workers: int | None = None,
) -> Plan:
    """The best plan for `profile` on `cluster` under `cost_model` (see `schedule_cost`, `pipedream_optimizer`).

    `straight` forbids replication; `recompute` lets the optimizer recompute activations per stage.
    With `cluster.memory_bytes`, every device's memory must fit, its simulated peak included (`_within_limit`;
    `optimizer` says how many optimizer state copies weights have). `schedule` and `microbatches` may be "auto":
    the synchronous schedule (`AUTO_SCHEDULES`; the zero-bubble ones only if the profile measured its split
    backward's cost; pipedream only when named) with the highest throughput, and the fewest microbatches (a power
    of two up to 128) within 5% of the best throughput; the chunked schedules at the count nearest the best one-stage-per-GPU plan's.
    The plan may use fewer devices than the cluster has; its notes then say so.

    `global_batch_size` B fixes the samples per optimizer step of a synchronous schedule: every plan
    considered trains B = microbatch size x microbatches (replicas share the microbatches), so plans are
    compared at the batch the user trains with. With neither --microbatches nor --microbatch-size the
    counts are B's divisors up to 128, each with microbatches of B / count samples (times scaled linearly
    from the profiled batch, or interpolated between its measured sizes: `LayerArrays.at_batch_size`); a fixed
    count or size fixes the other. Without it the microbatch size is
    `microbatch_size` (default: the profiled batch) and the plan's global batch is what it implies.

    `progress(what)` is told each step of the search as it starts (a schedule at a microbatch count, its final
    choice simulating plans, a local search), for a status line: a memory-limited search can take many seconds.
    Once one of its solves took SOLVE_AHEAD_AFTER_S, the others run ahead in `workers` processes (default: the
    CPUs this process may use; 1: none), which changes the wall time, not the plan.
    """
    if cost_model not in COST_MODELS:
        raise PlannerError(f"unknown cost model {cost_model!r}; available: {', '.join(COST_MODELS)}")
    if optimizer not in OPTIMIZER_STATE_COPIES:
        raise PlannerError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZER_STATE_COPIES)}")
    if cost_model == "pipedream":
        return _partition_pipedream(profile, cluster, straight, optimizer, profile_path)
    if schedule != AUTO and schedule not in SCHEDULES:
        raise PlannerError(f"unknown schedule {schedule!r}; use auto or one of {', '.join(SCHEDULES)}")
    if microbatches != AUTO and (isinstance(microbatches, bool) or not isinstance(microbatches, int)
                                 or microbatches < 1):
        raise PlannerError(f"--microbatches must be auto or a whole number of at least 1, got {microbatches!r}")
    if microbatch_size is not None and microbatch_size < 1:
        raise PlannerError(f"--microbatch-size must be at least 1, got {microbatch_size}")
    profiled = profile.batch_size or 1
    failed_sizes = frozenset(int(size) for size in profile.settings.get("batch_sizes_not_timed") or {})
    counts, size_of = _batch_shapes(schedule, microbatches, microbatch_size or profiled,
                                    microbatch_size is not None, global_batch_size, failed_sizes)
    base = CostInputs(
        LayerArrays.from_profile(profile), cluster, "1f1b", 1, 1.0, float(profile.input_bytes),
        OPTIMIZER_STATE_COPIES[optimizer], None if cluster.memory_bytes is None else float(cluster.memory_bytes),
        library_bytes=float(profile.library_bytes), **optimizer_terms(profile, optimizer),
    )
    schedules = AUTO_SCHEDULES if schedule == AUTO else (schedule,)
    unmeasured = schedule == AUTO and profile.split_backward_ratio is None
    if unmeasured:  # a zero-bubble plan's gain could be all the split's unknown cost: not chosen blind
        schedules = tuple(name for name in schedules if name not in SPLIT_BACKWARD_SCHEDULES)

    def choose(limit: float | None) -> _Candidate:
        return _choose(replace(base, memory_bytes=limit), schedules, counts, straight, recompute, size_of, profiled,
                       microbatches == AUTO and global_batch_size is None,
                       (lambda size: LayerArrays.at_batch_size(profile, size)) if profile.size_times else None,
                       progress or (lambda what: None), cores() if workers is None else workers)

    chosen, peaks, refit = _within_limit(choose, base.memory_bytes,
                                         lambda found: _one_stage_plans(found, straight, recompute))
    plan = _planner_plan(profile, chosen, peaks, straight, recompute, optimizer, profile_path)
    if refit is not None:
        plan = plan.with_notes(refit)
    if microbatches == AUTO and global_batch_size is None and plan.global_batch_size is not None:
        plan = plan.with_notes(_global_batch_note(plan))
    if schedule == AUTO and chosen.others:
        plan = plan.with_notes(_auto_note(chosen))
    if schedule == AUTO and chosen.inputs.chunks > 1 and len(counts) > 1:
        tried = ", ".join(name for name in schedules if name in CHUNKED_SCHEDULES)
        plan = plan.with_notes(f"--schedule auto tried {tried} at one microbatch count, the nearest the best plan "
                               "of one stage per GPU chose; name the schedule to search its counts")
    if schedule in SPLIT_BACKWARD_SCHEDULES and profile.split_backward_ratio is None:
        plan = plan.with_notes(f"the profile did not measure what splitting a backward costs (split_backward_ratio): "
                               f"{schedule}'s backwards are priced as whole ones; if the model checkpoints layers "
                               "with use_reentrant=True, training refuses the schedule")
    left_out = (sorted(size_of(count) for count in _divisors(global_batch_size) if count not in counts)
                if microbatches == AUTO and microbatch_size is None and global_batch_size is not None else [])
    if left_out:
        plan = plan.with_notes(f"microbatches of {', '.join(map(str, left_out))} sample"
                               f"{'s' if left_out != [1] else ''} left out: the profile could not run the model at "
                               "that size (its notes say why)")
    if unmeasured:
        plan = plan.with_notes(f"--schedule auto left out {', '.join(SPLIT_BACKWARD_SCHEDULES)}: the profile did not "
                                "measure what splitting a backward costs (split_backward_ratio: made before it did, "
                                "imported, or a model that checkpoints layers with use_reentrant=True, which they "
                                "cannot train); profile again, or name the schedule")
    return plan


def _auto_note(chosen: _Candidate) -> str:
    """What `--schedule auto` weighed: each other schedule's best plan, in simulated samples/s against the chosen
    one's; where a chunked plan won by less than CHUNKED_MARGIN over the best of one stage per GPU, that its v times
    the ops per microbatch carry fixed costs the simulation leaves out."""
    others = sorted(chosen.others, key=lambda other: -other[1])
    compared = ", ".join(f"{name} {1 - rate / chosen.samples_per_s:.1%} slower" for name, rate in others)
    note = (f"--schedule auto chose {chosen.inputs.schedule} ({significant(chosen.samples_per_s, 4)} samples/s simulated); "
            f"the best plan of each other schedule: {compared}")
    single = [(name, rate) for name, rate in others if name not in CHUNKED_SCHEDULES]
    if chosen.inputs.chunks > 1 and single and single[0][1] * CHUNKED_MARGIN > chosen.samples_per_s:
        note += (f". {chosen.inputs.schedule} runs {chosen.inputs.chunks} times the forwards and backwards of "
                 f"{single[0][0]} per microbatch, each smaller; what an op costs beyond its layers' profiled time (a "
                 "rank's wake-up, its caches refilled after a wait) is not simulated, and on small models it can "
                 "outweigh a gain this small (benchmarks/models/vit.py, 4 layers of width 128, on 2 CPU processes: "
                 "interleaved-1f1b simulated 2.6% faster than 1f1b and trained at 0.66-0.85x its samples/s): train "
                 "both, or name the schedule")
    return note


def _global_batch_note(plan: Plan) -> str:
    """The note of a plan whose microbatch count the search chose: its global batch may change with the cluster."""
    count = plural(plan.microbatches or 1, "microbatch", "microbatches")
    return (f"global batch {plan.global_batch_size} = {count} (chosen for this cluster) x {plan.microbatch_size} "
            "samples: it may change with --gpus or --memory; --global-batch-size fixes it")


def _batch_shapes(
    schedule: str, microbatches: int | str, size: int, size_given: bool, global_batch_size: int | None,
    failed_sizes: frozenset[int],
) -> tuple[tuple[int, ...], Callable[[int], int]]:
    """The microbatch counts to consider and each one's microbatch size, samples (`partition` docstring);
    PlannerError for a global batch that the given count or size does not divide, or pipedream's. Where the
    planner chooses the count for a global batch, counts whose microbatches have a size in `failed_sizes` (the
    profile could not run the model at it: `batch_sizes_not_timed`) are left out, unless every count would be."""
    fixed = (microbatches,) if microbatches != AUTO else MICROBATCH_CHOICES
    if global_batch_size is None:
        return fixed, lambda count: size
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise PlannerError(f"--global-batch-size must be a whole number of samples of at least 1, got "
                           f"{global_batch_size!r}")
    if schedule == "pipedream":
        raise PlannerError("--global-batch-size fixes the samples per optimizer step of a synchronous schedule, but "
                           "pipedream updates the weights after every microbatch; leave it out, or use --schedule auto, "
                           f"{', '.join(FLUSH_SCHEDULES)}")
    batch = global_batch_size
    if size_given and batch % size:
        raise PlannerError(f"--global-batch-size {batch} is not a whole number of microbatches of {size} samples "
                           f"(--microbatch-size); give a multiple of {size}, or leave --microbatch-size out")
    if microbatches != AUTO:
        count = int(microbatches)
        if batch % count or (size_given and batch != count * size):
            wanted = f"{count} x {size} = {count * size}" if size_given else f"a multiple of {count}"
            raise PlannerError(f"--global-batch-size {batch} is not {count} microbatches (--microbatches) of whole "
                               f"samples; give {wanted}, or leave --microbatches out")
        return (count,), lambda count: batch // count
    if size_given:
        return (batch // size,), lambda count: size
    divisors = _divisors(batch)
    runnable = tuple(count for count in divisors if batch // count not in failed_sizes)
    return runnable or divisors, lambda count: batch // count


def _divisors(batch: int) -> tuple[int, ...]:
    """The microbatch counts a global batch of `batch` samples splits into, up to MAX_AUTO_MICROBATCHES."""
    return tuple(count for count in range(1, min(batch, MAX_AUTO_MICROBATCHES) + 1) if batch % count == 0)


@dataclass(frozen=True)
class _Candidate:
    inputs: CostInputs
    solution: Solution
    iteration_s: float  # simulated (`predicted_iteration_s`)
    samples_per_s: float
    data_parallel_s: float  # one stage on every device, simulated the same way
    data_parallel_fits: bool
    microbatch_size: int = 1  # samples
    peak_bytes: tuple[float, ...] = ()  # chunked plans: per stage, the simulated peak of the device holding it
    exhaustive: bool = True  # the final choice proved no plan simulates faster (`simulated_choice`)
    simulated: int = 1  # plans the final choice simulated
    lower_bound_s: float = 0.0  # no plan simulates faster (`SimulatedChoice.lower_bound_s`; 0: nothing proven)
    refined: bool | None = None  # whether the local search (`_refined`) found a faster plan; None: not run
    refine_simulated: int = 0  # plans the local search simulated
    others: tuple[tuple[str, float], ...] = ()  # of several schedules tried: each other one's best, (name, samples/s)


def _choose(
    base: CostInputs, schedules: tuple[str, ...], counts: tuple[int, ...], straight: bool, recompute: bool,
    size_of: Callable[[int], int], profiled: int, auto_counts: bool = False,
    arrays_at: Callable[[int], LayerArrays] | None = None, progress: Callable[[str], None] = lambda what: None,
    workers: int = 1,
) -> _Candidate:
    """The fastest (schedule, microbatch count among `counts`, `size_of(count)` samples each, the profile's
    times scaled by size / `profiled`) and its optimal plan; InfeasiblePlanError if none fits. `arrays_at(size)`:
    the layers' arrays whose times, so scaled, are those at `size` (`LayerArrays.at_batch_size`: a profile of
    several batch sizes); None: `base.arrays` at every size. `progress` and `workers` as `partition`'s."""
    results: list[_Candidate] = []
    failures: list[InfeasiblePlanError] = []
    solved: dict[tuple[str, int], _Candidate | None] = {}
    ahead: list[SolvesAhead] = []  # started once a memory-limited solve was slow
    sized: dict[int, LayerArrays] = {}  # arrays_at per microbatch size, made once
    unlimited_at: dict[int, Solution] = {}  # per count, gpipe's and 1f1b's best plan without the memory limit

    def inputs_for(schedule: str, count: int) -> CostInputs:
        size = size_of(count)
        if size not in sized:
            sized[size] = base.arrays if arrays_at is None else arrays_at(size)
        return replace(base, schedule=schedule, microbatches=count, scale=size / profiled,
                       arrays=sized[size].for_schedule(schedule))

    def run(schedule: str, count: int) -> _Candidate | None:
        key = (schedule, count)
        if key not in solved:
            progress(f"{schedule}, {_microbatches_text(count)}")
            inputs = inputs_for(schedule, count)
            twin = solved.get(("1f1b", count)) if schedule in ("gpipe", "zb-h1") else None
            # without a memory limit gpipe and 1f1b have the same objective and the same best plan; zb-h1 starts
            # from 1f1b's plan where it fits (the final choice then searches zb-h1's plans under the simulator:
            # its own dynamic program doubled the time of `--schedule auto` for nothing it found better)
            if twin is not None and (schedule == "zb-h1" or base.memory_bytes is None) and \
                    plan_fits(inputs, list(twin.solution.stages)):
                for solves in ahead:  # (not needed after all)
                    solves.forget(key)
                solution = Solution(twin.solution.stages, objective_s(inputs, list(twin.solution.stages)))
                solved[key] = _simulated_candidate(inputs, solution, straight, size_of(count))
                return solved[key]
            try:
                solution = ahead[0].result(key) if ahead and key in ahead[0] else None
                if solution is None:  # not solved ahead, or no plan fits (its error comes from solving it here)
                    started = time.perf_counter()
                    solution = optimize(inputs, straight, recompute, unlimited_plan(schedule, count, inputs))
                    if time.perf_counter() - started >= SOLVE_AHEAD_AFTER_S:
                        solve_ahead(key)
            except InfeasiblePlanError as exc:
                failures.append(exc)
                solved[key] = None
            else:
                solved[key] = _simulated_candidate(inputs, solution, straight, size_of(count))
        return solved[key]

    def unlimited_plan(schedule: str, count: int, inputs: CostInputs) -> Solution | None:
        """Under a memory limit, gpipe's and 1f1b's best plan without it at `count`, found once for both (3 s of
        each memory-limited solve of nasnetalarge on 16 GPUs); None otherwise (`optimize` finds its own)."""
        if base.memory_bytes is None or schedule not in SAME_UNLIMITED:
            return None
        if count not in unlimited_at:
            unlimited_at[count] = optimize(replace(inputs, memory_bytes=None), straight, recompute)
        return unlimited_at[count]

    def solve_ahead(current: tuple[str, int]) -> None:
        """Once: the memory-limited solves `run` may come to after `current`, in worker processes, in about the
        order it would: schedule by schedule (zb-h1's last: it mostly takes 1f1b's plan), the highest throughput
        ceiling first."""
        if ahead or base.memory_bytes is None or workers <= 1:
            return
        keys = [(schedule, count) for schedule in sorted(ordered, key=lambda name: name == "zb-h1")
                for count in sorted(counts, key=lambda count: (-throughput_ceiling(inputs_for(schedule, count),
                                                                                   size_of(count)), count))
                if (schedule, count) not in solved and (schedule, count) != current]
        if keys:
            ahead.append(SolvesAhead(min(workers, len(keys))))  # (and this process, on what none has begun)
            for schedule, count in keys:
                ahead[0].submit((schedule, count), inputs_for(schedule, count), straight, recompute)

    def run_chunked(schedule: str, count: int) -> _Candidate | None:
        key = (schedule, count)
        if key not in solved:
            progress(f"{schedule}, {_microbatches_text(count)}")
            solved[key] = _chunked_candidate(inputs_for(schedule, count), size_of(count))
        return solved[key]

    # chunked schedules last: beside plans of one stage per rank, they are tried at the count the best of those chose
    in_turn = sorted(schedules, key=lambda name: (name in CHUNKED_SCHEDULES, SCHEDULE_PREFERENCE.index(name)))
    ordered = [name for name in in_turn if name not in CHUNKED_SCHEDULES and name != "pipedream"]  # `run` solves them
    try:
        for schedule in in_turn:
            if schedule == "pipedream":
                found = run(schedule, 1)
            elif schedule in CHUNKED_SCHEDULES:
                ranks = base.cluster.num_devices
                allowed = chunked_counts(schedule, counts, ranks, auto_counts)
                if results and len(allowed) > 1:
                    leader = max(results, key=lambda r: r.samples_per_s)
                    allowed = (_nearest_count(allowed, leader.inputs.microbatches),)
                found = _auto_microbatches(
                    allowed, lambda count: run_chunked(schedule, count),
                    lambda count: throughput_ceiling(inputs_for(schedule, count), size_of(count)))
                if found is not None:  # refined below, before the comparison, where that could make it the fastest
                    results.append(found)
                elif len(schedules) == 1:
                    raise PlannerError(_no_chunked_plan(schedule, chunked_counts(schedule, counts, ranks, auto_counts),
                                                        ranks, base))
                continue
            else:
                found = _auto_microbatches(
                    counts, lambda count: run(schedule, count),
                    lambda count: throughput_ceiling(inputs_for(schedule, count), size_of(count)))
                for solves in ahead:  # the counts it ruled out, left to the other schedules' solves
                    for count in counts:
                        solves.forget((schedule, count))
            if found is not None:
                progress(f"{schedule}, {_microbatches_text(found.inputs.microbatches)}: simulating")
                results.append(_final_choice(found, straight, recompute))
    finally:  # every solve is done
        for solves in ahead:
            solves.close()
    if not results:
        raise _least_memory_failure(failures)
    unproven = sorted((index for index, result in enumerate(results) if not result.exhaustive),
                      key=lambda index: -results[index].samples_per_s)
    for index in unproven:
        if results[index].samples_per_s * REFINE_GAIN_CAP >= max(result.samples_per_s for result in results):
            progress(f"{results[index].inputs.schedule}: local search")
            results[index] = _refined(results[index], straight, recompute)
    best = max(result.samples_per_s for result in results)
    fastest = [result for result in results if result.samples_per_s >= best * (1.0 - 1e-9)]
    winner = min(fastest, key=lambda result: SCHEDULE_PREFERENCE.index(result.inputs.schedule))
    return replace(winner, others=tuple((result.inputs.schedule, result.samples_per_s) for result in results
                                        if result is not winner))


def _microbatches_text(count: int) -> str:
    """"1 microbatch", "8 microbatches": for progress lines."""
    return f"{count} microbatch{'' if count == 1 else 'es'}"


def _refined(found: _Candidate, straight: bool, recompute: bool) -> _Candidate:
    """A plan the final choice did not prove fastest, after a local search under the simulator (REFINE_OPS of
    simulated ops from its plan, a quarter of that from each other start: half a second to about two on the 2-core
    CPU machine):
    a chunked plan's cuts moved (`refine_chunked`), another's cuts moved, stages split and merged and replicas
    moved (`local_search.refine_plan`; on several nodes also from the optimizer's plan on one); each schedule's
    plan within REFINE_GAIN_CAP of the fastest, before they are compared (compared unrefined, `--schedule auto`
    chose an interleaved-1f1b plan of 266.0 ms over a zbv plan of 270.3 ms that refines to 262.7 ms: gpt2-medium
    on 4 GPUs)."""
    if found.inputs.chunks == 1:
        start = tuple(found.solution.stages)
        stages, iteration, simulated = refine_plan(found.inputs, start, found.iteration_s, straight, recompute)
        if stages == start:
            return replace(found, refine_simulated=simulated, refined=False)
        return replace(found, solution=Solution(stages, objective_s(found.inputs, list(stages))), iteration_s=iteration,
                       samples_per_s=samples_per_s(found.inputs, iteration, found.microbatch_size),
                       refine_simulated=simulated, refined=True)
    start = ChunkedChoice(found.inputs, tuple(found.solution.stages), found.iteration_s, found.peak_bytes)
    choice = refine_chunked(start)
    if choice is start:
        return found
    return replace(found, solution=Solution(choice.stages, objective_s(choice.inputs, list(choice.stages))),
                   iteration_s=choice.iteration_s, peak_bytes=choice.peak_bytes,
                   samples_per_s=samples_per_s(choice.inputs, choice.iteration_s, found.microbatch_size))


def _nearest_count(allowed: tuple[int, ...], count: int) -> int:
    """The count of `allowed` nearest `count` (on a tie the larger: more microbatches, a smaller bubble)."""
    return min(allowed, key=lambda option: (abs(option - count), -option))


def _simulated_candidate(inputs: CostInputs, solution: Solution, straight: bool, size: int) -> _Candidate:
    """The optimizer's plan judged by simulation; data parallelism (one stage on every device)
    instead when it fits and simulates faster (the closed form can rank the two the other way)."""
    iteration = predicted_iteration_s(inputs, list(solution.stages))
    everywhere = [Stage(0, inputs.arrays.num_layers, inputs.cluster.num_devices, False)]
    fits = plan_fits(inputs, everywhere)
    split = inputs.schedule in SPLIT_BACKWARD_SCHEDULES
    whole = _one_stage_inputs(inputs)
    data_parallel = (iteration if list(solution.stages) == everywhere and not split
                     else predicted_iteration_s(whole, everywhere))
    if not straight and not split and fits and data_parallel < iteration:
        solution, iteration = Solution(tuple(everywhere), objective_s(inputs, everywhere)), data_parallel
    return _Candidate(inputs, solution, iteration, samples_per_s(inputs, iteration, size), data_parallel, fits, size)


def _one_stage_inputs(inputs: CostInputs) -> CostInputs:
    """The inputs that judge a one-stage plan (data parallelism): one stage splits no backward and has no
    chunks, so under a zero-bubble or chunked schedule it runs as 1f1b does, whole backwards; the same
    inputs under the other schedules."""
    if inputs.schedule not in SPLIT_BACKWARD_SCHEDULES + CHUNKED_SCHEDULES:
        return inputs
    return _under(inputs, "1f1b")


def _under(inputs: CostInputs, schedule: str) -> CostInputs:
    """`inputs` for `schedule`, with one stage per rank: its arrays (`LayerArrays.for_schedule`) and no chunks."""
    return replace(inputs, schedule=schedule, arrays=inputs.arrays.for_schedule(schedule), chunks=1)


UNCHUNKED = {"interleaved-1f1b": "1f1b", "zbv": "zb-h1"}  # each chunked schedule's order with one stage per rank


def _one_stage_per_rank_inputs(inputs: CostInputs) -> CostInputs:
    """The inputs that judge plans of one stage per rank (the baselines) beside a chunked plan: its schedule with one
    chunk per rank (UNCHUNKED: interleaved-1f1b's is 1f1b, zbv's zb-h1, B and W apart); the same inputs otherwise."""
    return _under(inputs, UNCHUNKED[inputs.schedule]) if inputs.schedule in CHUNKED_SCHEDULES else inputs


def _chunked_candidate(inputs: CostInputs, size: int) -> _Candidate | None:
    """The fastest chunked plan of `inputs` on every device of the cluster (`chunked.best_chunked`), with
    data parallelism simulated beside it for the speedup; None where none fits."""
    choice = best_chunked(inputs, inputs.cluster.num_devices)
    if choice is None:
        return None
    everywhere = [Stage(0, inputs.arrays.num_layers, inputs.cluster.num_devices, False)]
    whole = _one_stage_inputs(inputs)
    solution = Solution(choice.stages, objective_s(choice.inputs, list(choice.stages)))
    return _Candidate(choice.inputs, solution, choice.iteration_s,
                      samples_per_s(choice.inputs, choice.iteration_s, size),
                      predicted_iteration_s(whole, everywhere), plan_fits(whole, everywhere), size,
                      exhaustive=False, simulated=len(chunk_choices(inputs.schedule)), peak_bytes=choice.peak_bytes)


def _no_chunked_plan(schedule: str, counts: tuple[int, ...], ranks: int, base: CostInputs) -> str:
    """Why no plan of a chunked schedule was found at `counts` (those it may run): none, too few layers, or
    memory."""
    if not counts:  # `chunked_counts` left none
        return (f"{schedule} runs microbatches in groups of one per rank: no microbatch count allowed here is a "
                f"multiple of the {ranks} ranks; give --microbatches a multiple of {ranks}")
    if base.arrays.num_layers < 2 * ranks:
        return (f"{schedule} needs at least 2 chunks per rank: {base.arrays.num_layers} layers cannot make "
                f"{2 * ranks} chunks on {plural(ranks, 'GPU')}; use --schedule 1f1b, or fewer GPUs")
    return (f"no {schedule} plan with {', '.join(map(str, chunk_choices(schedule)))} chunks per rank fits in "
            f"{base.memory_bytes / 1e9:.4g} GB per GPU; use --schedule 1f1b (it may recompute), or more memory")


def _final_choice(found: _Candidate, straight: bool, recompute: bool) -> _Candidate:
    """The plan the simulator finds fastest for the candidate's schedule and microbatches
    (`simulated_choice.best_simulated`), seeded with the candidate's plan and data parallelism when it fits."""
    inputs = found.inputs
    everywhere = [Stage(0, inputs.arrays.num_layers, inputs.cluster.num_devices, False)]
    seeds = [list(found.solution.stages)] + ([everywhere] if not straight and found.data_parallel_fits else [])
    choice = best_simulated(inputs, seeds, straight, recompute)
    chosen = Solution(choice.stages, objective_s(inputs, list(choice.stages)))
    # the search simulated the chosen plan already; inf only where no pipedream simulation was possible
    iteration = choice.simulated_s if math.isfinite(choice.simulated_s) else chosen.objective_s
    return replace(found, solution=chosen, iteration_s=iteration,
                   samples_per_s=samples_per_s(inputs, iteration, found.microbatch_size),
                   exhaustive=choice.exhaustive, simulated=choice.simulated, lower_bound_s=choice.lower_bound_s)


def _least_memory_failure(failures: list[InfeasiblePlanError]) -> InfeasiblePlanError:
    """One failure for all of `failures` (each of the same limit, none with a `detail`): its smallest memory is
    the least of theirs, found when first read (the message included), so a caller that only needs "nothing
    fits" (`scaling_table`, `_within_limit`'s searches below the limit) pays for no search. Found as: the first
    failure's own bisection, then each later one asked only whether it needs less than the least so far
    (`smallest_memory_below`), which one solve answers where it does not. (Every failure's own bisection took
    3.8 of the 4.3 s that 1 and 2 GPUs of the gpt example at 100 MB spent in `partition` to say that nothing
    fits.)"""

    def least_below(bound: float) -> float:
        least = math.inf
        for failure in failures:
            least = min(least, failure.smallest_memory_below(min(bound, least)))
        return least

    return InfeasiblePlanError(failures[0].memory_bytes, lambda: least_below(math.inf), smallest_below=least_below)


def _auto_microbatches(
    counts: tuple[int, ...], run: Callable[[int], _Candidate | None], upper: Callable[[int], float],
) -> _Candidate | None:
    """The fewest of `counts` (ascending) within AUTO_MICROBATCH_SHARE of the best throughput among them.

    `run(count)` plans one count (None: nothing fits); `upper(count)` bounds its throughput from above
    (`throughput_ceiling`). The answer is the one that planning every count would give, found by
    planning only the counts the bounds cannot settle: with `found` the best throughput planned so far
    and `best` the most any count can reach (max of `found` and the unplanned counts' ceilings), a count
    is ruled out when its throughput (or ceiling) is below SHARE x `found`, and chosen when it is the
    first not ruled out and its throughput is at least SHARE x `best`. Otherwise the unplanned count
    of highest ceiling is planned next (it settles `best`), or the undecided count itself.
    """
    planned: dict[int, _Candidate | None] = {}
    ceiling = {count: upper(count) for count in counts}
    while True:
        reached = [c.samples_per_s for c in planned.values() if c is not None]
        found = max(reached, default=0.0)
        unplanned = [count for count in counts if count not in planned]
        best = max([found] + [ceiling[count] for count in unplanned])
        if not unplanned and not reached:
            return None
        undecided = None
        for count in counts:
            if count in planned:
                candidate = planned[count]
                if candidate is None or candidate.samples_per_s < AUTO_MICROBATCH_SHARE * found:
                    continue
                if candidate.samples_per_s >= AUTO_MICROBATCH_SHARE * best:
                    return candidate
            elif ceiling[count] < AUTO_MICROBATCH_SHARE * found:
                continue
            undecided = count
            break
        if undecided is None:  # every count ruled out: only when none fits
            return None
        if undecided in planned or not reached:  # settle `best` first: plan the highest ceiling
            undecided = max(unplanned, key=lambda count: (ceiling[count], -count))
        planned[undecided] = run(undecided)


def throughput_ceiling(inputs: CostInputs, microbatch_size: int) -> float:
    """An upper bound of the samples/s any plan of `inputs` (a flush schedule) simulates, from
    iteration >= sigma max(m T / D, path): every microbatch passes every layer once on one device
    (T: forward + whole backward of all layers, as 1f1b runs them; a split backward only takes
    longer), so some device of the D is busy m T / D, and one microbatch's forward and backward
    run one after another (path = T; under a zero-bubble schedule only its forwards are sure to, as
    W's leave the path). inf where some layer's time is negative (no bound)."""
    arrays = inputs.arrays.for_schedule("1f1b")
    if np.any(np.diff(arrays.compute_s) < 0) or np.any(np.diff(arrays.fwd_s) < 0):
        return math.inf
    total = float(arrays.compute_s[-1])
    path = float(arrays.fwd_s[-1]) if inputs.schedule in SPLIT_BACKWARD_SCHEDULES else total
    lowest = inputs.scale * max(inputs.microbatches * total / inputs.cluster.num_devices, path)
    return samples_per_s(inputs, lowest, microbatch_size)


def _within_limit(
    choose: Callable[[float | None], _Candidate], limit: float | None,
    one_stage: Callable[[_Candidate], list[_Candidate]],
) -> tuple[_Candidate, list[float], str | None]:
    """`choose(limit)`'s plan, its stated memory per stage (`_stated_peaks`, bytes) and a note, every stage within
    `limit` (bytes; None: no limit, no note).

    The search fits each stage's closed form to the limit; a stage's simulated peak can be higher (messages
    waiting in receive buffers: `_simulated_peaks`). Then the search runs again within a lower limit, at most
    MEMORY_REFITS times, keeping the plans that fit the real one. A search limit L gives one of three answers: a
    plan over the limit (L too high), a plan within it, or none at all (L too low). The first L is the limit less
    the excess E = peak - limit; while every answer was over, the next is the last L less the last plan's excess;
    once some L was too low or gave a plan within the limit, the next L halves the gap between the highest such L
    and the least L found too high (a higher L admits faster plans). So a first L too low no longer ends the
    search: PipeDream's vgg16 on 4 GPUs under gpipe at 8.448 GB peaked 0.72 GB over, nothing fitted within
    7.724 GB, and partition refused it, while a plan peaking at 8.119 GB fitted (it came within 8.786 GB).
    A lower limit leaves out plans that fit the real one, so the plans of one stage (`one_stage(found)`: on one
    device, or on all; no message waits on them) that fit it in simulation are candidates too: the fastest of
    those and the searches' plans that fit is the answer, and the note says so. InfeasiblePlanError where none
    fits."""
    chosen = choose(limit)
    peaks = _stated_peaks(chosen)
    if limit is None or max(peaks) <= limit * (1 + MEMORY_TOLERANCE):
        return chosen, peaks, None
    first_peak = max(peaks)
    too_high, too_low_or_fits = limit, None  # the least search limit whose plan is over; the highest not
    search_limit, tried = limit - (first_peak - limit), []
    found: list[tuple[_Candidate, list[float], float]] = []  # (plan, its stated peaks, the search limit it came from)
    for _ in range(MEMORY_REFITS):
        tried.append(search_limit)
        try:
            chosen = choose(search_limit)
        except InfeasiblePlanError:
            too_low_or_fits = search_limit
        else:
            peaks = _stated_peaks(chosen)
            if max(peaks) <= limit * (1 + MEMORY_TOLERANCE):
                found.append((chosen, peaks, search_limit))
                too_low_or_fits = search_limit
            else:
                too_high = search_limit
        if too_low_or_fits is None:
            search_limit -= max(peaks) - limit
        else:
            search_limit = (too_low_or_fits + too_high) / 2
    found += [(candidate, _stated_peaks(candidate), limit) for candidate in one_stage(chosen)]
    fitting = [entry for entry in found if max(entry[1]) <= limit * (1 + MEMORY_TOLERANCE)]
    if not fitting:
        raise InfeasiblePlanError(limit, first_peak, detail=(
            f"once the messages waiting in receive buffers are counted: the fastest plan whose stages fit it in the "
            f"closed form peaks at {first_peak / 1e9:.4g} GB in simulation, and searching again within "
            f"{_limits_text(tried)} found no plan that stays within {limit / 1e9:.4g} GB, nor does any plan "
            "of one stage"))
    best, peaks, within = max(fitting, key=lambda entry: entry[0].samples_per_s)  # (on a tie, the first found)
    inputs = replace(best.inputs, memory_bytes=limit)  # judged at the real limit from here on (the peaks are not)
    everywhere = [Stage(0, inputs.arrays.num_layers, inputs.cluster.num_devices, False)]
    how = (f"the search's plan within {within / 1e9:.4g} GB" if within < limit else
           "a plan of one stage, simulated alone (the notes on the search concern that plan, not the search's)")
    chosen = replace(best, inputs=inputs, data_parallel_fits=plan_fits(_one_stage_inputs(inputs), everywhere))
    return chosen, peaks, (
        f"memory: the fastest plan whose stages fit {limit / 1e9:.4g} GB in the closed form peaked at "
        f"{first_peak / 1e9:.4g} GB in simulation (received messages waiting in buffers); the search ran again within "
        f"{_limits_text(tried)}, and this plan, the fastest found that stays within {limit / 1e9:.4g} GB (not "
        f"proven the fastest that does), is {how}: it peaks at {max(peaks) / 1e9:.4g} GB")


def _limits_text(limits: Sequence[float]) -> str:
    """'7.724 GB' or '7.724, 8.086 and 8.267 GB': the search limits a refit tried, in order, with as many digits
    (4 to 9) as tell them apart (GPT-2 within 137.7 MB tried 0.13756, 0.13763 and 0.13766 GB)."""
    digits = next((count for count in range(4, 10) if len({f"{value / 1e9:.{count}g}" for value in limits}) ==
                   len(set(limits))), 9)
    shown = [f"{value / 1e9:.{digits}g}" for value in limits]
    return (shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} and {shown[-1]}") + " GB"


def _one_stage_plans(found: _Candidate, straight: bool, recompute: bool) -> list[_Candidate]:
    """The plans of one stage for `found`'s schedule and microbatches at its cluster's memory limit that fit it in
    the closed form: on one device, and unless `straight` on every device (data parallelism), recomputing too where
    `recompute` allows (no message waits on one stage, so its closed form is its simulated peak; `_within_limit`
    checks); each judged as `_simulated_candidate` judges data parallelism."""
    inputs = replace(found.inputs, memory_bytes=found.inputs.cluster.memory_bytes)
    layers, devices = inputs.arrays.num_layers, inputs.cluster.num_devices
    found_plans = []
    for replicas in sorted({1} if straight else {1, devices}):
        for flag in (False, True) if recompute else (False,):
            stages = [Stage(0, layers, replicas, flag)]
            if plan_fits(inputs, stages):
                iteration = predicted_iteration_s(_one_stage_inputs(inputs), stages)
                found_plans.append(replace(
                    found, inputs=inputs, solution=Solution(tuple(stages), objective_s(inputs, stages)),
                    iteration_s=iteration, samples_per_s=samples_per_s(inputs, iteration, found.microbatch_size),
                    exhaustive=False, simulated=1, lower_bound_s=0.0, refined=None, refine_simulated=0))
    return found_plans


def _stated_peaks(chosen: _Candidate) -> list[float]:
    """The memory a plan states per stage, bytes: a chunked plan's simulated peaks per device, otherwise
    `_simulated_peaks`."""
    if chosen.peak_bytes:
        return list(chosen.peak_bytes)
    stages = list(chosen.solution.stages)
    return _simulated_peaks(chosen.inputs, stages, [cost.memory_bytes for cost in stage_costs(chosen.inputs, stages)])


def _planner_plan(
    profile: Profile, chosen: _Candidate, peaks: Sequence[float], straight: bool, recompute: bool, optimizer: str,
    profile_path: str,
) -> Plan:
    """A Plan with the planner cost model's per-stage terms and predictions; `peaks`: its stated memory per stage,
    bytes (`_stated_peaks`)."""
    inputs, solution, size = chosen.inputs, chosen.solution, chosen.microbatch_size
    stages_list = list(solution.stages)
    costs = stage_costs(inputs, stages_list)
    ranks = first_ranks(inputs, stages_list)
    stages = tuple(
        StagePlan(
            start=start, stop=stop, first_layer=profile.layers[start].name, last_layer=profile.layers[stop - 1].name,
            replicas=replicas, ranks=tuple(range(rank, rank + replicas)), recompute=flag,
            compute_ms=cost.compute_s * 1000.0, comm_ms=max(cost.comm_in_s, cost.comm_out_s) * 1000.0,
            allreduce_ms=cost.allreduce_s * 1000.0, period_ms=cost.period_s * 1000.0,
            memory_bytes=int(peak), step_ms=cost.step_s * 1000.0,
            accumulate_ms=cost.accumulate_s * 1000.0, tied_allreduce_ms=cost.tied_s * 1000.0,
        )
        for (start, stop, replicas, flag), cost, rank, peak in zip(stages_list, costs, ranks, peaks)
    )
    used = len(stages_list) // inputs.chunks if inputs.chunks > 1 else solution.devices  # chunks share devices
    objective, closed_form = chosen.iteration_s, solution.objective_s
    flush = inputs.schedule in FLUSH_SCHEDULES
    per_iteration = inputs.microbatches if flush else 1
    single_s = per_iteration * inputs.scale * float(inputs.arrays.for_schedule("1f1b").compute_s[-1])  # whole backwards
    devices = inputs.cluster.num_devices
    data_parallel = chosen.data_parallel_s
    predicted = Prediction(
        bottleneck_s=max(cost.bound_s for cost in costs),
        iteration_ms=objective * 1000.0,
        samples_per_s=samples_per_s(inputs, objective, size),
        bubble_fraction=_idle_fraction(inputs, stages_list, costs, used, objective),
        speedup_vs_single_device=single_s / objective if objective > 0 else 1.0,
        speedup_vs_data_parallel=data_parallel / objective if objective > 0 else 1.0,
        devices_used=used,
        peak_memory_bytes=max(stage.memory_bytes for stage in stages),
        objective_ms=closed_form * 1000.0,
    )
    notes = _common_notes(profile, inputs.cluster, used, optimizer)
    if not chosen.peak_bytes:
        above = _memory_note(peaks, [cost.memory_bytes for cost in costs])
        notes += [above] if above else []
    if not chosen.data_parallel_fits:
        notes.append(f"data parallelism on {plural(devices, 'GPU')} does not fit in memory: the speedup over it "
                     "compares with a plan you could not run")
    unit = "samples" if profile.batch_size else "profiled mini-batches"
    if flush:
        count = plural(inputs.microbatches, "microbatch", "microbatches")
        notes.append(f"{inputs.schedule}: {count} of {size} {unit} per iteration (a global batch of "
                     f"{inputs.microbatches * size} per optimizer step); iteration_ms is one flushed iteration")
    if inputs.chunks > 1:
        where = (f"stage s on rank s mod {used}" if inputs.schedule == "interleaved-1f1b"
                 else f"in a V: rank r holds stages r and {2 * used - 1} - r")
        tried = "2 chunks per rank" if inputs.schedule in FIXED_CHUNKS else \
            f"the fastest of {', '.join(map(str, chunk_choices(inputs.schedule)))} chunks per rank"
        notes.append(f"{inputs.schedule}: {inputs.chunks} chunks per rank on {used} ranks ({where}), "
                     "cut to balance forward + backward time, then cuts moved one layer at a time while the "
                     "simulated iteration shortens within memory; "
                     f"iteration_ms is simulated, {tried} "
                     f"(the closed form says {significant(closed_form * 1000, 4)} ms); a heuristic: no bound proves another cut "
                     "slower. memory/GPU is each device's simulated peak, all its chunks together")
    else:
        proof = ("no other plan simulates faster" if chosen.exhaustive else
                 "for pipedream the search is a heuristic (its bounds hold for the steady state, which the simulated "
                 "run may not reach)" if not flush else
                 "the search stopped at its cap before proving that no other plan simulates faster"
                 + (f" (none simulates faster than {significant(chosen.lower_bound_s * 1000, 4)} ms)" if chosen.lower_bound_s > 0
                    else ""))
        moves = "cuts moved and stages split and merged" + ("" if straight else ", replicas moved")
        if chosen.refined is not None:
            proof += (f"; then a local search ({moves}: {chosen.refine_simulated} more plans simulated) "
                      + ("found this faster plan" if chosen.refined else "found no faster plan"))
        if not chosen.exhaustive and chosen.lower_bound_s > 0:
            proof += f": this plan is at most x{chosen.iteration_s / chosen.lower_bound_s:.3f} from the fastest"
        notes.append(f"iteration_ms is simulated ({inputs.schedule} schedule, op times from the cost model); the "
                     f"closed form says {significant(closed_form * 1000, 4)} ms. The plan is the fastest of {chosen.simulated} "
                     f"simulated, searched in order of a lower bound on their time: {proof}")
    if not flush:
        notes.append(f"pipedream: asynchronous 1F1B with weight stashing, microbatches of {size} {unit}; "
                     "iteration_ms is the steady-state time per microbatch. Weights update after every "
                     "microbatch and backwards use stale weights: training differs from synchronous SGD/Adam")
    if inputs.schedule in SPLIT_BACKWARD_SCHEDULES:
        notes.append(f"{inputs.schedule}: each backward split into B (input gradients, sent back at once) and W (weight "
                     "gradients, deferred into the bubbles); a microbatch's activations live until its W")
        if not inputs.arrays.weight_measured:
            notes.append("the profile did not measure input-gradient times (bwd_input_ms; made before it did, or "
                         f"imported): W is assumed {ASSUMED_WEIGHT_SHARE:.0%} of each backward; profile again to measure it")
        if not inputs.arrays.deferred_measured:
            notes.append("the profile did not measure what a split backward keeps from B to W (deferred_bytes; made "
                         "before it did, or imported): each layer is assumed to keep its output's size; profile again "
                         "to measure it")
        elif inputs.arrays.input_workspace_bytes is None:
            notes.append("the profile did not measure what a split backward's B holds per layer "
                         "(input_workspace_bytes; made before 2026-11-28): memory counts every kept gradient under the "
                         "largest workspace, the most it can be; profile again to measure it")
    if size != (profile.batch_size or 1):
        notes.append(batch_scaling_note(profile, size))
    if any(stage.recompute for stage in stages):
        notes.append("stages marked recompute keep only their inputs and redo the forward during backward")
    if profile.batch_coupling is not None:
        notes += profile.batch_coupling.notes(size, inputs.microbatches if flush else None)
    if inputs.step_s_per_byte <= 0 and inputs.step_s_per_tensor <= 0:
        notes.append(f"the profile did not time the {optimizer} optimizer step (made before it did, or imported): "
                     "iteration_ms leaves it out; profile again to count it")
    return Plan(
        profile=ProfileRef(profile.model_name, profile_path, profile_digest(profile)),
        cluster=inputs.cluster, cost_model="planner", schedule=inputs.schedule,
        microbatches=inputs.microbatches if flush else None, microbatch_size=size, straight=straight,
        stages=stages, predicted=predicted, notes=tuple(notes), optimizer=optimizer, chunks=inputs.chunks,
    )


def _idle_fraction(inputs: CostInputs, stages: list[Stage], costs: Sequence[StageCost], used: int,
                   iteration_s: float) -> float:
    """The plan's idle share of device time (`Prediction.bubble_fraction`): under a flush schedule the simulated
    iteration's (`Timeline.idle_fraction`, the figure `simulate`, `show` and `compare` state for the plan); under
    pipedream the steady state's, 1 - the stages' compute and optimizer step per microbatch / (`used` devices x
    `iteration_s`), as the simulation counts busy time (its all-reduces overlap compute)."""
    if inputs.schedule in FLUSH_SCHEDULES:
        return simulate_stages(inputs, stages).idle_fraction()
    busy_s = sum(cost.compute_s + cost.step_s for cost in costs)
    return max(0.0, 1.0 - busy_s / (used * iteration_s)) if iteration_s > 0 else 0.0


def _simulated_peaks(inputs: CostInputs, stages: list[Stage], closed_form: list[float]) -> list[float]:
    """Per stage, the larger of its closed-form memory and its simulated peak (`Timeline.peak_memory`): the
    simulation plays each receiver thread, where messages from several replicas or from a faster neighbour
    wait in buffers the closed form (`schedule_cost.ahead_terms`) does not count. Flush schedules only (pipedream's
    simulation runs many microbatches and may refuse: its closed form stands)."""
    if inputs.schedule not in FLUSH_SCHEDULES:
        return closed_form
    peaks = simulate_stages(inputs, stages).peak_memory()
    return [max(bound, float(peaks[index])) for index, bound in enumerate(closed_form)]


def _memory_note(peaks: Sequence[float], closed_form: Sequence[float]) -> str | None:
    """The note of a plan whose stated memory (`_simulated_peaks`) is above the closed form on some stage, bytes.
    None: every stage states its closed form."""
    above = [index for index, (peak, bound) in enumerate(zip(peaks, closed_form))
             if peak > bound * (1 + MEMORY_TOLERANCE)]
    if not above:
        return None
    worst = max(above, key=lambda index: peaks[index] - closed_form[index])
    return (f"memory/GPU of stage{'s' if len(above) > 1 else ''} {', '.join(map(str, above))} is the simulated peak, "
            f"above the closed form the search fits to the limit (stage {worst}: {peaks[worst] / 1e6:.4g} MB against "
            f"{closed_form[worst] / 1e6:.4g}): received messages wait there, each receiver thread posting two "
            "receives ahead, from replicas or a faster neighbour")


def _common_notes(profile: Profile, cluster: Cluster, used: int, optimizer: str) -> list[str]:
    notes = []
    if used < cluster.num_devices:
        notes.append(f"uses {used} of {cluster.num_devices} GPUs: more would not make it faster")
    if profile.batch_size is None:
        notes.append("the profile does not say its batch size: samples/s counts profiled mini-batches")
    notes.append(
        f"each device's memory fits {cluster.memory_bytes / 1e9:.4g} GB ({optimizer} optimizer state)"
        if cluster.memory_bytes is not None else
        f"memory is reported ({optimizer} optimizer state) but not constrained (give --memory)"
    )
    return notes


def _partition_pipedream(
    profile: Profile, cluster: Cluster, straight: bool, optimizer: str, profile_path: str
) -> Plan:
    """The plan minimising PipeDream's published objective (flat cluster; see `pipedream_cost`)."""
    bandwidth = _flat_bandwidth(cluster)
    arrays = LayerArrays.from_profile(profile)
    library = profile.library_bytes  # every device's, beside its stage (`Profile.library_bytes`)
    limit = None if cluster.memory_bytes is None else cluster.memory_bytes - library
    try:
        solution = optimize_pipedream(arrays, cluster.num_devices, bandwidth, straight, limit, optimizer)
    except InfeasiblePlanError as exc:
        failure = exc  # (the clause unbinds `exc`; its smallest memory, a search, is read when the message is)
        raise InfeasiblePlanError(cluster.memory_bytes or 0, lambda: failure.smallest_memory_bytes + library) from None
    stages = []
    next_rank = 0
    busy_s = 0.0
    for index, (start, stop, replicas) in enumerate(solution.stages):
        compute_s = float(arrays.compute_s[stop] - arrays.compute_s[start])
        params = float(arrays.param_bytes[stop] - arrays.param_bytes[start])
        allreduce_unit, comm_unit = pipedream_unit_terms(params, arrays.cut_before(start), arrays.cut_after(stop),
                                                         bandwidth)
        comm_s = float(comm_unit) / replicas
        stage_time_s = float(pipedream_time_from_units(compute_s, allreduce_unit, replicas))
        busy_s += replicas * stage_time_s
        stages.append(StagePlan(
            start=start, stop=stop, first_layer=profile.layers[start].name, last_layer=profile.layers[stop - 1].name,
            replicas=replicas, ranks=tuple(range(next_rank, next_rank + replicas)), recompute=False,
            compute_ms=compute_s * 1000.0, comm_ms=comm_s * 1000.0,
            allreduce_ms=allreduce_unit * (replicas - 1.0) / replicas * 1000.0,
            period_ms=max(stage_time_s, comm_s) * 1000.0,
            memory_bytes=library + _stage_memory_bytes(arrays, list(solution.stages), index, optimizer),
        ))
        next_rank += replicas
    bottleneck_s = solution.objective_s
    total_s = float(arrays.compute_s[-1])
    devices = cluster.num_devices
    data_parallel_s = pipedream_bottleneck_s(arrays, [(0, arrays.num_layers, devices)], bandwidth)
    per_batch = profile.batch_size or 1
    predicted = Prediction(
        bottleneck_s=bottleneck_s,
        iteration_ms=bottleneck_s * 1000.0,
        samples_per_s=per_batch / bottleneck_s if bottleneck_s > 0 else 0.0,
        bubble_fraction=1.0 - busy_s / (solution.devices * bottleneck_s) if bottleneck_s > 0 else 0.0,
        speedup_vs_single_device=total_s / bottleneck_s if bottleneck_s > 0 else 1.0,
        speedup_vs_data_parallel=data_parallel_s / bottleneck_s if bottleneck_s > 0 else 1.0,
        devices_used=solution.devices,
        peak_memory_bytes=max(stage.memory_bytes for stage in stages),
        objective_ms=bottleneck_s * 1000.0,
    )
    notes = _common_notes(profile, cluster, solution.devices, optimizer)
    notes.append(
        "pipedream cost model: asynchronous 1F1B with weight stashing in steady state, one profiled mini-batch "
        "per replica; iteration_ms is the time per mini-batch"
    )
    return Plan(
        profile=ProfileRef(profile.model_name, profile_path, profile_digest(profile)),
        cluster=cluster, cost_model="pipedream", schedule="pipedream", microbatches=None,
        microbatch_size=profile.batch_size, straight=straight, stages=tuple(stages), predicted=predicted,
        notes=tuple(notes), optimizer=optimizer,
    )


@dataclass(frozen=True)
class BaselineResult:
    """A baseline plan's stages and its time under the plan's cost model (`iteration_s`: what the
    plan's `iteration_ms` measures, so the two compare directly); `chunks`: stages per device, as a plan's."""

    name: str
    stages: tuple[tuple[int, int, int], ...]
    iteration_s: float
    peak_memory_bytes: int
    chunks: int = 1

    @property
    def devices(self) -> int:
        """Devices the baseline uses: the sum of its replicas, over its chunks (a chunked plan's stages share them)."""
        return sum(replicas for _, _, replicas in self.stages) // self.chunks


def compare_baselines(profile: Profile, plan: Plan, optimizer: str | None = None) -> list[BaselineResult]:
    """The baselines of `baselines.baseline_plans`, evaluated under the plan's cost model, schedule,
    microbatches, cluster and optimizer (`optimizer` overrides the plan's); beside a chunked plan, under its
    schedule with one stage per rank (`_one_stage_per_rank_inputs`: the baselines have no chunks)."""
    optimizer = optimizer or plan.optimizer
    arrays = LayerArrays.from_profile(profile)
    cluster = plan.cluster
    found = baseline_plans(arrays, cluster.num_devices)
    if plan.cost_model == "pipedream":
        bandwidth = _flat_bandwidth(cluster)
        return [
            BaselineResult(name, tuple(stages), pipedream_bottleneck_s(arrays, stages, bandwidth),
                           profile.library_bytes + max(_stage_memory_bytes(arrays, stages, index, optimizer)
                                                       for index in range(len(stages))))
            for name, stages in found.items()
        ]
    inputs = _one_stage_per_rank_inputs(plan_cost_inputs(profile, plan, optimizer))
    whole = _one_stage_inputs(inputs)
    results = []
    for name, stages in found.items():
        flagged = [(start, stop, replicas, False) for start, stop, replicas in stages]
        judged = whole if len(flagged) == 1 else inputs
        peak = max(cost.memory_bytes for cost in stage_costs(judged, flagged))
        results.append(BaselineResult(name, tuple(stages), predicted_iteration_s(judged, flagged), int(peak)))
    return results


def compare_schedules(profile: Profile, plan: Plan, recompute: bool = True) -> list[BaselineResult]:
    """The best plan of each other synchronous schedule for the plan's profile, cluster, microbatches,
    microbatch size, straightness and optimizer (`partition` with that schedule), named "best <schedule>";
    a schedule with no plan that fits is left out. Empty for pipedream and the pipedream cost model."""
    if plan.cost_model != "planner" or plan.schedule not in FLUSH_SCHEDULES:
        return []
    found = []
    for schedule in FLUSH_SCHEDULES:
        if schedule == plan.schedule:
            continue
        try:
            other = partition(profile, plan.cluster, straight=plan.straight, optimizer=plan.optimizer,
                              schedule=schedule, microbatches=plan.microbatches or 1,
                              microbatch_size=plan.microbatch_size, recompute=recompute)
        except PlannerError:  # nothing fits, or a count interleaved-1f1b cannot run
            continue
        found.append(BaselineResult(f"best {schedule}", tuple((s.start, s.stop, s.replicas) for s in other.stages),
                                    other.predicted.iteration_ms / 1000.0, other.predicted.peak_memory_bytes,
                                    other.chunks))
    return found


def predicted_iteration_s(inputs: CostInputs, stages: list[Stage]) -> float:
    """What a plan's `iteration_ms` states (seconds): the simulated iteration (flush schedules) or
    steady-state time per microbatch (pipedream) of `stages`; the closed form `objective_s` when
    the replica counts make a pipedream simulation too long (`simulator.SimulationTooLongError`)."""
    try:
        return simulated_iteration_s(inputs, stages)
    except SimulationTooLongError:
        return objective_s(inputs, stages)


def _stage_memory_bytes(arrays: LayerArrays, stages: list[tuple[int, int, int]], index: int, optimizer: str) -> int:
    """Memory per device of stage `index` of a plan (`pipedream_cost.pipedream_stage_memory_bytes`), less the
    device's library bytes."""
    start, stop, replicas = stages[index]
    downstream = sum(r for _, _, r in stages[index + 1:])
    return int(pipedream_stage_memory_bytes(
        arrays.stage_weight_bytes(start, stop), arrays.stage_saved_bytes(start, stop), replicas, downstream,
        OPTIMIZER_STATE_COPIES[optimizer],
    ))


def _flat_bandwidth(cluster: Cluster) -> float:
    """The single bandwidth of a flat cluster (PipeDream's objective knows no hierarchy)."""
    if len(cluster.levels) != 1:
        raise ClusterError(
            f"the pipedream cost model assumes a flat cluster of one level and one bandwidth, got "
            f"{len(cluster.levels)} levels; omit --gpus-per-node, or give one level in the cluster file"
        )
    return cluster.levels[0].bandwidth_Bps
