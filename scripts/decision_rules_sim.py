"""How often the comparison's and the lever A/B's decision rules err when nothing differs,
and how often the A/B finds a lever that does pay: simulations with the project's own rules.

    python scripts/decision_rules_sim.py [--trials N]

1. The comparison's "all schemes (Holm)" column (roformer.study.stats.family_verdicts)
   with every true difference 0 and equivalence always shown: each comparison's difference
   test has a uniform p-value, its TOST p-value is 0. An error is a false "equivalent
   (nonzero)" that holds for the family. Beside it, the rule before 2026-11-29 (Holm over one
   p-value per comparison, its claim's).
2. `bench levers`' adoption (roformer.bench.levers.paid) of six levers with no effect, timed
   in 3 or 5 rounds against one baseline: each round has a drift shared by every variant (2 %)
   and independent noise on each time; then the paid set timed again in rounds of its own
   (the confirmation).
3. The same rule's power: one lever with a true gain, 3 rounds.
Results: docs/results/2026-11-29-decision-rules-cpu.md.
"""
from __future__ import annotations

import sys

import numpy as np

from roformer import cli
from roformer.study import stats as study_stats
from roformer.bench.common import ratio_stats
from roformer.bench.levers import paid

THRESHOLD = 1.005


def family_errors(m: int, trials: int, rng) -> tuple[float, float]:
    claims = {"equivalent": ("p_equivalence",), "equivalent (nonzero)": ("p_difference", "p_equivalence")}
    old = new = 0
    for p_difference in rng.uniform(size=(trials, m)):
        comparisons = [{"verdict": "equivalent (nonzero)" if p < 0.05 else "equivalent", "lo": 0.0,
                        "p_difference": p, "p_equivalence": 0.0} for p in p_difference]
        false = [c["verdict"] == "equivalent (nonzero)" for c in comparisons]
        before = study_stats.holm([max(c[k] for k in claims[c["verdict"]]) for c in comparisons])
        old += any(f and kept for f, kept in zip(false, before))
        new += any(f and v == "holds" for f, v in zip(false, study_stats.family_verdicts(comparisons)))
    return old / trials, new / trials


def timed_rows(rng, gains: list[float], sigma: float, rounds: int) -> list[dict]:
    """Rows of levers with these true gains, timed in the same rounds as one baseline."""
    drift = rng.normal(0, 0.02, rounds)
    base = np.exp(drift + rng.normal(0, sigma, rounds))
    rows = []
    for gain in gains:
        stats = ratio_stats(list(gain / np.exp(drift + rng.normal(0, sigma, rounds))), list(1 / base))
        rows.append({"x_tokens": stats["median"], "x_tokens_min": stats["min"]})
    return rows


def timed_row(rng, gain: float, sigma: float, rounds: int) -> dict:
    return timed_rows(rng, [gain], sigma, rounds)[0]


def null_adoption(sigma: float, rounds: int, trials: int, rng, levers: int = 6) -> tuple[float, float]:
    first = confirmed = 0
    for _ in range(trials):
        if any(paid(row, THRESHOLD) for row in timed_rows(rng, [1.0] * levers, sigma, rounds)):
            first += 1
            confirmed += paid(timed_row(rng, 1.0, sigma, rounds), THRESHOLD)
    return first / trials, confirmed / trials


def power(gain: float, sigma: float, trials: int, rng) -> tuple[float, float]:
    first = both = 0
    for _ in range(trials):
        if paid(timed_row(rng, gain, sigma, 3), THRESHOLD):
            first += 1
            both += paid(timed_row(rng, gain, sigma, 3), THRESHOLD)
    return first / trials, both / trials


@cli.entry_point
def main() -> None:
    command = cli.CommandFlags(__doc__.splitlines()[0])
    command.define("--trials", type=int, default=20_000)
    args, positional = command.parse(sys.argv[1:])
    if positional:
        raise cli.UsageError(f"unexpected arguments: {positional}")
    trials = args.trials
    rng = np.random.default_rng(0)
    print("| comparisons | family-wise error, before | now | no correction |\n|---|---|---|---|")
    for m in (3, 6):
        old, new = family_errors(m, trials, rng)
        print(f"| {m} | {old:.3f} | {new:.3f} | {1 - 0.95 ** m:.3f} |")
    print("\n| noise per time | rounds | a null lever adopted, first test | after the confirmation |\n|---|---|---|---|")
    for sigma in (0.005, 0.01, 0.02):
        for rounds in (3, 5):
            first, confirmed = null_adoption(sigma, rounds, trials, rng)
            print(f"| {sigma:.1%} | {rounds} | {first:.3f} | {confirmed:.3f} |")
    print("\n| true gain | noise per time | adopted, first test | with the confirmation |\n|---|---|---|---|")
    for gain in (1.01, 1.02, 1.03):
        for sigma in (0.005, 0.01):
            first, both = power(gain, sigma, trials, rng)
            print(f"| {gain:.2f}x | {sigma:.1%} | {first:.3f} | {both:.3f} |")


if __name__ == "__main__":
    main()
