"""How fast the `planner` command starts, against `python -c "import torch"`, side by side in one run.

    python benchmarks/cli_startup.py [--rounds 7]

Each round times, in fresh processes and in turn: `import torch`, `planner --help`, every
command's `--help` and `planner inspect profiles/gpt.json`. Printed: each median in seconds and
its ratio to the torch import (the target for every --help: at most 0.3).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLANNER = [sys.executable, "-m", "planner"]
SUBCOMMANDS = ("profile", "import-pipedream", "inspect", "partition", "show", "simulate", "compare",
               "calibrate", "export", "train")
COMMANDS = {
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    "planner --help": [*PLANNER, "--help"],
    **{f"planner {name} --help": [*PLANNER, name, "--help"] for name in SUBCOMMANDS},
    "planner inspect profiles/gpt.json": [*PLANNER, "inspect", "profiles/gpt.json"],
}


def seconds(command: list[str]) -> float:
    """Wall seconds of one run of `command` in the repository (its output discarded)."""
    start = time.perf_counter()
    subprocess.run(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    rounds = parser.parse_args().rounds
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(rounds):
        for name, command in COMMANDS.items():  # interleaved, so drifts in machine load hit every command alike
            times[name].append(seconds(command))
    torch_s = statistics.median(times["python -c 'import torch'"])
    print(f"{'command':<36} {'median s':>9} {'/ import torch':>15}")
    for name, measured in times.items():
        median = statistics.median(measured)
        print(f"{name:<36} {median:>9.3f} {median / torch_s:>15.2f}")


if __name__ == "__main__":
    main()
