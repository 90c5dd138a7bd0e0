"""How far this machine's speed moves on its own: a fixed CPU workload timed again and again, nothing else changed.

    python benchmarks/machine_drift.py [--seconds 90] [--threads 1]

Each sample is the median of 10 rounds of the same work (a 256 x 384 by 384 x 384 matrix product and an
element-wise chain over 1 MB, about 2 ms a round on the 2-core test machine), one sample every 0.2 s. Prints
the samples' spread (min, p10, median, p90, max) and p90 / p10: on a quiet machine the work's time should
hardly move, so the spread is the machine's (a virtual machine's neighbours, its clock). Measured/predicted
ratios from single runs of a few seconds (`measured_vs_predicted.py`) cannot be read more finely than it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

ROUNDS = 10
ROWS, WIDTH, ELEMENTS = 256, 384, 1 << 18


def workload_ms(rounds: int = ROUNDS) -> float:
    """Median milliseconds of one round of the fixed workload over `rounds` rounds (after one not timed)."""
    generator = torch.Generator().manual_seed(0)
    left, right = torch.randn(ROWS, WIDTH, generator=generator), torch.randn(WIDTH, WIDTH, generator=generator)
    values = torch.randn(ELEMENTS, generator=generator)
    times = []
    with torch.no_grad():
        for index in range(rounds + 1):
            began = time.perf_counter()
            product = left @ right
            chained = torch.tanh(values * 1.0001 + 0.5).mul_(values).sum()
            float(product[0, 0] + chained)  # both results used
            if index:
                times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    samples = []
    end = time.time() + args.seconds
    while time.time() < end:
        samples.append(workload_ms())
        time.sleep(0.2)
    samples.sort()

    def quantile(share: float) -> float:
        return samples[int(share * (len(samples) - 1))]

    print(f"{len(samples)} samples over {args.seconds:g} s, {args.threads} thread(s): min {samples[0]:.2f}, "
          f"p10 {quantile(0.1):.2f}, median {quantile(0.5):.2f}, p90 {quantile(0.9):.2f}, max {samples[-1]:.2f} ms; "
          f"p90 / p10 x{quantile(0.9) / quantile(0.1):.2f}")


if __name__ == "__main__":
    main()
