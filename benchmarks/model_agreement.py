"""Closed form against simulation: how far the optimizer's objective is from the simulated schedule.

    python benchmarks/model_agreement.py [--profiles ../shared/pipedream-profiles]

For the shipped example profiles and every PipeDream profile, on 4 and 8 GPUs (flat, 100 GB/s)
and 16 GPUs (8 per node, 100 GB/s within and 10 GB/s between nodes), with and without
replication, each schedule's optimal plan (8 microbatches for flush schedules) is simulated op
by op. Prints simulated / closed-form iteration time per case and, per schedule, the share of
cases within 2% and the worst case. Plans state the simulated value (`Prediction.iteration_ms`)
and keep the closed form as `objective_ms`.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

from planner.files.cluster import make_cluster
from planner.costs.layer_arrays import LayerArrays
from planner.planning.optimizer import optimize
from planner.files.pipedream import import_pipedream
from planner.files.profile import load_profile
from planner.schedules.schedule import SCHEDULES
from planner.costs.schedule_cost import CostInputs
from planner.simulation.simulator import SimulationTooLongError, simulate_stages

REPO = Path(__file__).resolve().parents[1]
CLUSTERS = ((4, None), (8, None), (16, 8))


def main() -> None:
    """Print one line per case and a summary per schedule."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", type=Path, default=REPO.parent / "shared" / "pipedream-profiles")
    args = parser.parse_args()
    profiles = {path.stem: load_profile(path) for path in sorted((REPO / "profiles").glob("*.json"))}
    profiles |= {path.stem: import_pipedream(path) for path in sorted(args.profiles.glob("*.txt"))}
    print(f"# {datetime.date.today()}: simulated / closed-form iteration time (1.000 = agreement)")
    ratios: dict[str, list[tuple[float, str]]] = {schedule: [] for schedule in SCHEDULES}
    for name, profile in profiles.items():
        arrays = LayerArrays.from_profile(profile)
        for gpus, per_node in CLUSTERS:
            cluster = make_cluster(gpus, per_node, ["100GB/s", "10GB/s"])
            for schedule in SCHEDULES:
                for straight in (False, True):
                    inputs = CostInputs(arrays, cluster, schedule, 8)
                    solution = optimize(inputs, straight)
                    try:
                        simulated = simulate_stages(inputs, list(solution.stages)).iteration_s()
                    except SimulationTooLongError:
                        continue
                    ratio = simulated / solution.objective_s
                    replicas = [stage[2] for stage in solution.stages]
                    case = f"{name} {gpus} GPUs{'' if per_node is None else f' ({per_node}/node)'} " \
                           f"{schedule}{' straight' if straight else ''} replicas {replicas}"
                    ratios[schedule].append((ratio, case))
                    print(f"{ratio:7.3f}  {case}", flush=True)
    print()
    for schedule, found in ratios.items():
        within = sum(abs(ratio - 1.0) <= 0.02 for ratio, _ in found)
        worst = max(found, key=lambda item: abs(item[0] - 1.0))
        print(f"{schedule:9s}: {within}/{len(found)} cases within 2%; worst {worst[0]:.3f} ({worst[1]})")


if __name__ == "__main__":
    main()
