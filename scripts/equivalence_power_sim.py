"""How often the study's own comparison declares two schemes equivalent when they do not differ:
a simulation with `roformer.study.stats.compare` (seed x item bootstrap, TOST), beside the exact
power of the paired t TOST (`roformer.study.end_state.tost_power`).

    python scripts/equivalence_power_sim.py [--trials N]

Each cell: `trials` comparisons of a scheme with the reference whose per-seed paired difference
is N(0, sd^2), at the study's registered margin and scored seeds (configs/study.py: 0.05 nats,
seeds 2-7, so 6) and, for comparison, the margin and seed count before the pre-registration
(0.02 nats, 8 seeds). "Equivalent" counts both "equivalent" and "equivalent (nonzero)".
Results: docs/results/2026-12-07-equivalence-power-cpu.md.
"""
from __future__ import annotations

import sys
import time

from roformer import cli

from roformer.study.end_state import simulated_verdicts, tost_power

SDS = (0.03, 0.05, 0.07)
SETTINGS = ((0.05, 6, "registered: margin 0.05, 6 scored seeds"), (0.02, 8, "before: margin 0.02, 8 seeds"))


def equivalent_rate(verdicts: dict[str, float]) -> float:
    return sum(share for verdict, share in verdicts.items() if verdict.startswith("equivalent"))


@cli.entry_point
def main() -> None:
    command = cli.CommandFlags(__doc__.splitlines()[0])
    command.define("--trials", type=int, default=4000)
    args, positional = command.parse(sys.argv[1:])
    if positional:
        raise cli.UsageError(f"unexpected arguments: {positional}")
    trials = args.trials
    start = time.perf_counter()
    print("| setting | paired seed sd | P(equivalent), simulated with compare | exact paired-t TOST | "
          "P(higher or lower), simulated |")
    print("|---|---|---|---|---|")
    for margin, seeds, name in SETTINGS:
        for sd in SDS:
            verdicts = simulated_verdicts(seeds, sd, margin, trials=trials)
            false_difference = verdicts.get("higher", 0.0) + verdicts.get("lower", 0.0)
            print(f"| {name} | {sd:g} | {equivalent_rate(verdicts):.3f} | {tost_power(seeds, sd, margin):.3f} | "
                  f"{false_difference:.3f} |", flush=True)
    print(f"\n{trials} trials per cell, {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
