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
from planner.planning.local_search import refine_plan
from planner.planning.simulated_choice import best_simulated
from planner.simulation.simulator import SimulationTooLongError, simulate_stages

REPO = Path(__file__).resolve().parents[1]
CLUSTERS = ((4, None), (8, None), (16, 8))
# one stage per rank: the chunked schedules' plans come from planner.planning.chunked, another search
UNCHUNKED = tuple(schedule for schedule in SCHEDULES if schedule not in CHUNKED_SCHEDULES)


def main() -> None:
    """Print one line per case and a summary per schedule."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", type=Path, default=REPO.parent / "shared" / "pipedream-profiles")
    args = parser.parse_args()
    profiles = {path.stem: load_profile(path) for path in sorted((REPO / "profiles").glob("*.json"))}
    profiles |= {path.stem: import_pipedream(path) for path in sorted(args.profiles.glob("*.txt"))}
    print(f"# {datetime.date.today()}: simulated / closed-form iteration time of the closed form's optimum (1.000 = agreement), and the final choice under the simulator")
    ratios: dict[str, list[tuple[float, str]]] = {schedule: [] for schedule in UNCHUNKED}
    gains: dict[str, list[tuple[float, bool, float, float]]] = {schedule: [] for schedule in UNCHUNKED}
    refining: dict[str, list[float]] = {schedule: [] for schedule in UNCHUNKED}  # how much faster local search made it
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
                    chosen_s, gap = choice.simulated_s, choice.gap
                    if not choice.exhaustive:  # as `planner partition` does (its `_refined`)
                        chosen_s = refine_plan(inputs, choice.stages, choice.simulated_s, straight, True).seconds
                        gap = chosen_s / choice.lower_bound_s if choice.lower_bound_s > 0 else math.inf
                    seconds = time.perf_counter() - started
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
                          f"in {seconds:.2f} s  {case}", flush=True)
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

if __name__ == "__main__":
    main()
