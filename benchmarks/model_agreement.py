"""Closed form against simulation, and what the final choice under the simulator changes.

    python benchmarks/model_agreement.py [--profiles ../shared/pipedream-profiles]

For the shipped example profiles and every PipeDream profile, on 4 and 8 GPUs (flat, 100 GB/s)
and 16 GPUs (8 per node, 100 GB/s within and 10 GB/s between nodes), with and without
replication, each schedule's optimal plan under the closed form (8 microbatches for flush
schedules) is simulated op by op, then the final choice (`simulated_choice.best_simulated`, then
where it proved nothing `local_search.refine_plan`, as `planner partition` runs them) searches for a
plan that simulates faster. Prints per case the
simulated / closed-form iteration time of the dynamic program's plan, how much faster the chosen
plan simulates, and whether the search proved it the fastest; per schedule, the share of cases
within 2%, the gains and the share proven. Plans state the simulated value of the chosen plan
(`Prediction.iteration_ms`) and keep its closed form as `objective_ms`.

`--reference` also searches, for every flush case the bounds leave more than 2% open, far longer than
`planner partition` does (`reference_search`: the final choice on REFERENCE_FACTOR times its caps, then the
local search from the chosen plan and from plans balanced by time on 2, 3, 4, 6, 8, 12 and 16 devices, each on
a REFERENCE_FACTOR times larger budget), and prints the chosen plan's time over the best any of them found:
whether an open case is a weak bound or a plan left behind. Not a proof either (minutes more).
"""

from __future__ import annotations

import argparse
import datetime
import math
import time
from pathlib import Path

from planner.files.cluster import make_cluster
from planner.costs.layer_arrays import LayerArrays
from planner.planning.optimizer import optimize
from planner.files.pipedream import import_pipedream
from planner.files.profile import load_profile
from planner.schedules.schedule import CHUNKED_SCHEDULES, SCHEDULES
from planner.costs.schedule_cost import CostInputs, Stage, plan_fits
from planner.planning.local_search import REFINE_OPS, balanced_plan, refine_plan
from planner.planning.simulated_choice import MAX_EXPANSIONS, MAX_SIMULATIONS, best_simulated, simulated_s
from planner.simulation.simulator import SimulationTooLongError, simulate_stages

REPO = Path(__file__).resolve().parents[1]
CLUSTERS = ((4, None), (8, None), (16, 8))
# one stage per rank: the chunked schedules' plans come from planner.planning.chunked, another search
UNCHUNKED = tuple(schedule for schedule in SCHEDULES if schedule not in CHUNKED_SCHEDULES)
REFERENCE_FACTOR = 8  # how much longer `reference_search` searches than `planner partition`
REFERENCE_DEPTHS = (2, 3, 4, 6, 8, 12, 16)  # stages of the time-balanced starts of `reference_search`


def reference_search(inputs: CostInputs, chosen: tuple[Stage, ...], chosen_s: float, straight: bool) -> tuple[float, float]:
    """(seconds of the fastest plan found, a lower bound on every plan's) by the module docstring's long search."""
    seeds = [list(chosen)]
    choice = best_simulated(inputs, seeds, straight, True, MAX_SIMULATIONS * REFERENCE_FACTOR,
                            MAX_EXPANSIONS * REFERENCE_FACTOR)
    best_s = min(chosen_s, choice.simulated_s)
    if choice.exhaustive:
        return best_s, best_s
    devices = min(inputs.cluster.num_devices, inputs.arrays.num_layers)
    starts = [choice.stages] + [balanced_plan(inputs, depth) for depth in REFERENCE_DEPTHS if depth <= devices]
    for start in starts:
        start_s = simulated_s(inputs, list(start)) if plan_fits(inputs, list(start)) else math.inf
        if math.isfinite(start_s):
            found = refine_plan(inputs, start, start_s, straight, True, REFINE_OPS * REFERENCE_FACTOR)
            best_s = min(best_s, found.seconds)
    return best_s, choice.lower_bound_s


def main() -> None:
    """Print one line per case and a summary per schedule."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", type=Path, default=REPO.parent / "shared" / "pipedream-profiles")
    parser.add_argument("--reference", action="store_true",
                        help="search far longer where the bounds leave more than 2%% open (the module docstring)")
    parser.add_argument("--names", nargs="*", help="only these profiles (file stems, e.g. vgg16 gpt)")
    args = parser.parse_args()
    profiles = {path.stem: load_profile(path) for path in sorted((REPO / "profiles").glob("*.json"))}
    profiles |= {path.stem: import_pipedream(path) for path in sorted(args.profiles.glob("*.txt"))}
    profiles = {name: profile for name, profile in profiles.items() if not args.names or name in args.names}
    print(f"# {datetime.date.today()}: simulated / closed-form iteration time of the closed form's optimum (1.000 = agreement), and the final choice under the simulator")
    ratios: dict[str, list[tuple[float, str]]] = {schedule: [] for schedule in UNCHUNKED}
    gains: dict[str, list[tuple[float, bool, float, float]]] = {schedule: [] for schedule in UNCHUNKED}
    refining: dict[str, list[float]] = {schedule: [] for schedule in UNCHUNKED}  # how much faster local search made it
    # per open case: chosen / the best the long search found, and chosen / the best lower bound known
    behind: dict[str, list[tuple[float, float]]] = {schedule: [] for schedule in UNCHUNKED}
    for name, profile in profiles.items():
        arrays = LayerArrays.from_profile(profile)
        for gpus, per_node in CLUSTERS:
            cluster = make_cluster(gpus, per_node, ["100GB/s", "10GB/s"])
            for schedule in UNCHUNKED:
                for straight in (False, True):
                    inputs = CostInputs(arrays, cluster, schedule, 8)
                    solution = optimize(inputs, straight)
                    try:
                        simulated = simulate_stages(inputs, list(solution.stages)).iteration_s()
                    except SimulationTooLongError:
                        continue
                    everywhere = [Stage(0, arrays.num_layers, gpus, False)]
                    seeds = [list(solution.stages)] + ([everywhere] if not straight and plan_fits(inputs, everywhere)
                                                       else [])
                    started = time.perf_counter()
                    choice = best_simulated(inputs, seeds, straight, True)
                    chosen_s, gap, chosen = choice.simulated_s, choice.gap, choice.stages
                    if not choice.exhaustive:  # as `planner partition` does (its `_refined`)
                        refined_plan = refine_plan(inputs, choice.stages, choice.simulated_s, straight, True)
                        chosen_s, chosen = refined_plan.seconds, refined_plan.stages
                        gap = chosen_s / choice.lower_bound_s if choice.lower_bound_s > 0 else math.inf
                    seconds = time.perf_counter() - started
                    reference = ""
                    if args.reference and gap > 1.02 and schedule != "pipedream":
                        best_s, bound_s = reference_search(inputs, chosen, chosen_s, straight)
                        bound_s = max(bound_s, choice.lower_bound_s)
                        behind[schedule].append((chosen_s / best_s, chosen_s / bound_s))
                        reference = f"; long search: chosen x{chosen_s / best_s:.3f} the best found, at most x{chosen_s / bound_s:.3f}"
                    ratio = simulated / solution.objective_s
                    gain = simulated / chosen_s
                    refined = choice.simulated_s / chosen_s
                    replicas = [stage[2] for stage in solution.stages]
                    case = f"{name} {gpus} GPUs{'' if per_node is None else f' ({per_node}/node)'} " \
                           f"{schedule}{' straight' if straight else ''} replicas {replicas}"
                    ratios[schedule].append((ratio, case))
                    gains[schedule].append((gain, choice.exhaustive, seconds, gap))
                    refining[schedule].append(refined)
                    print(f"{ratio:7.3f}  final choice x{gain:.3f} faster{' (proven)' if choice.exhaustive else f' (local search x{refined:.3f}; at most x{gap:.3f} from the best)'} "
                          f"in {seconds:.2f} s  {case}{reference}", flush=True)
    print()
    for schedule, found in ratios.items():
        within = sum(abs(ratio - 1.0) <= 0.02 for ratio, _ in found)
        worst = max(found, key=lambda item: abs(item[0] - 1.0))
        faster = [gain for gain, _, _, _ in gains[schedule] if gain > 1.001]
        proven = sum(exhaustive for _, exhaustive, _, _ in gains[schedule])
        slowest = max(seconds for _, _, seconds, _ in gains[schedule])
        certified = sum(gap <= 1.02 for _, _, _, gap in gains[schedule])
        print(f"{schedule:9s}: chosen plan proven within 2% of the simulator's best in {certified}/{len(found)}"
              + (" (pipedream: a heuristic search, nothing proven)" if schedule == "pipedream" else ""))
        print(f"{schedule:9s}: closed form within 2% in {within}/{len(found)} cases, worst {worst[0]:.3f} ({worst[1]}); "
              f"final choice faster in {len(faster)} (up to x{max(faster, default=1.0):.3f}), proven fastest in "
              f"{proven}/{len(found)}, at most {slowest:.2f} s; local search faster in "
              f"{sum(gain > 1.001 for gain in refining[schedule])} (up to x{max(refining[schedule], default=1.0):.3f})")
        if args.reference and schedule != "pipedream":
            open_cases = behind[schedule]
            near = sum(ratio <= 1.02 for ratio, _ in open_cases)
            proven_now = sum(bound <= 1.02 for _, bound in open_cases)
            print(f"{schedule:9s}: of {len(open_cases)} open, the chosen plan is within 2% of the best the long search "
                  f"found in {near} (worst x{max((r for r, _ in open_cases), default=1.0):.3f}); its longer final "
                  f"choice proves {proven_now} within 2%")

if __name__ == "__main__":
    main()
