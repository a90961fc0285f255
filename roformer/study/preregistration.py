"""What the end-state comparison fixes before it is scored, and the report header that says so.

A verdict is only as good as the rule it was read with: a margin chosen after seeing the
differences, or rates tuned on the seeds that are then scored (the winner's curse: the rate
that won on those seeds' noise scores its own noise), can make any result. So the margins,
each with the reason it is the size it is, the seeds that tune and those that are scored
(disjoint), and the power the design aims for are written in the config and printed at the
top of the report, before any number the study measured.

`Preregistration.from_config` reads them from the study's config section (text or sequences,
as a command line or a config file gives them); `header_lines` renders them.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from roformer.errors import ConfigError
from roformer.study import end_state

FIELDS = ("equivalence_margin", "equivalence_reason", "slope_margin", "slope_reason", "tuning_seeds",
          "scored_seeds", "power_target", "planning_seed_sds", "planning_reason")


def _numbers(value: Any, kind: type, name: str) -> tuple:
    """A list setting as a tuple of `kind`: a sequence, or comma text ("100,101")."""
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    try:
        return tuple(kind(str(item).strip()) for item in items if str(item).strip())
    except ValueError:
        raise ConfigError(f"study.{name}={value!r}: expected {kind.__name__}s separated by commas") from None


@dataclasses.dataclass(frozen=True)
class Preregistration:
    """The end-state comparison's pre-registered settings.

    equivalence_margin  nats of mean test loss per prediction within which two schemes count as
                        equivalent (TOST); equivalence_reason says why that size (e.g. 0.05 nats
                        is about 5% in perplexity, below the differences papers report)
    slope_margin        nats per doubling of the tokens within which the gap's slope counts as
                        flat (roformer.study.end_state.is_flat); slope_reason says why
    tuning_seeds        the seeds whose validation loss chooses each scheme's rate
    scored_seeds        the seeds whose test loss is scored; none of them tunes
    power_target        the power the seed count is planned for (the power table's target)
    planning_seed_sds   paired seed sds (nats) the power table is computed at, before any is
                        measured; planning_reason says where they come from
    """

    equivalence_margin: float
    equivalence_reason: str
    slope_margin: float
    slope_reason: str
    tuning_seeds: tuple[int, ...]
    scored_seeds: tuple[int, ...]
    power_target: float = 0.8
    planning_seed_sds: tuple[float, ...] = ()
    planning_reason: str = ""

    def __post_init__(self):
        problems = []
        for name in ("equivalence_margin", "slope_margin"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                problems.append(f"{name}={value!r} must be a number > 0")
        for name in ("equivalence_reason", "slope_reason"):
            if not str(getattr(self, name)).strip():
                problems.append(f"{name} is empty: a margin is registered with the reason for its size")
        for name in ("tuning_seeds", "scored_seeds"):
            seeds = getattr(self, name)
            if not seeds:
                problems.append(f"{name} is empty")
            elif len(set(seeds)) != len(seeds):
                problems.append(f"{name} {list(seeds)} lists a seed twice")
        shared = sorted(set(self.tuning_seeds) & set(self.scored_seeds))
        if shared:
            problems.append(f"seeds {shared} both tune and are scored: tuning_seeds and scored_seeds must be disjoint "
                            "(a rate chosen on the scored seeds' noise biases their difference)")
        if not 0 < self.power_target < 1:
            problems.append(f"power_target={self.power_target!r} must be in (0, 1)")
        if any(not (math.isfinite(sd) and sd > 0) for sd in self.planning_seed_sds):
            problems.append(f"planning_seed_sds {list(self.planning_seed_sds)} must be > 0")
        if self.planning_seed_sds and not self.planning_reason.strip():
            problems.append("planning_reason is empty: say where the planning seed sds come from")
        if problems:
            raise ConfigError("pre-registration: " + "; ".join(problems))

    @classmethod
    def from_config(cls, section: Mapping | Any) -> Preregistration:
        """From a config section holding FIELDS (a ConfigDict or a mapping); seeds and sds as
        sequences or comma text."""
        get = section.get if isinstance(section, Mapping) else (lambda k, d=None: getattr(section, k, d))
        missing = [name for name in FIELDS[:6] if get(name) in (None, "")]
        if missing:
            raise ConfigError(f"pre-registration: study.{', study.'.join(missing)} not set")
        return cls(equivalence_margin=float(get("equivalence_margin")),
                   equivalence_reason=str(get("equivalence_reason")),
                   slope_margin=float(get("slope_margin")), slope_reason=str(get("slope_reason")),
                   tuning_seeds=_numbers(get("tuning_seeds"), int, "tuning_seeds"),
                   scored_seeds=_numbers(get("scored_seeds"), int, "scored_seeds"),
                   power_target=float(get("power_target", 0.8)),
                   planning_seed_sds=_numbers(get("planning_seed_sds", ()) or (), float, "planning_seed_sds"),
                   planning_reason=str(get("planning_reason", "") or ""))


def _seed_list(seeds: Sequence[int]) -> str:
    return ", ".join(str(s) for s in sorted(seeds))


def _needed(n: int | None, max_seeds: int) -> str:
    return f"> {max_seeds}" if n is None else str(n)


def header_lines(prereg: Preregistration, *, alpha: float = 0.05, max_seeds: int = 500) -> list[str]:
    """The report's header (markdown lines), printed before any number the study measured:
    the margins with their reasons, the verdict rules, the tuning and scored seeds, and the
    power table at the planning seed sds (seeds an equivalence and a difference verdict need
    for `power_target`, and the power the scored seeds give)."""
    n = len(prereg.scored_seeds)
    lines = [
        "## Pre-registered",
        "",
        "Fixed before any run was scored; every verdict below is read with these.",
        "",
        f"- Equivalence margin: +-{prereg.equivalence_margin:g} nats ({prereg.equivalence_reason}). Two schemes "
        f"are equivalent when the {100 - 200 * alpha:g}% interval of their paired difference lies within it "
        f"(two one-sided tests at {100 * alpha:g}%).",
        f"- Flat: the gap's slope against log2 tokens over the last {end_state.FLAT_WINDOW:.0%} of the budgets' "
        f"log-token range, its {100 - 200 * alpha:g}% interval within +-{prereg.slope_margin:g} nats per doubling "
        f"({prereg.slope_reason}).",
        "- Not decided: where a chosen rate is at its grid's edge, or the gap is not flat. Flagged: an "
        "\"equivalent\" where a scheme does not use word order.",
        f"- Rates chosen on tuning seeds {_seed_list(prereg.tuning_seeds)}; scored on seeds "
        f"{_seed_list(prereg.scored_seeds)} ({n}); no seed is both.",
    ]
    if prereg.planning_seed_sds:
        margin = prereg.equivalence_margin
        lines += ["", f"Power at margin {margin:g} nats, alpha {alpha:g}, target {100 * prereg.power_target:g}% "
                      f"(planning seed sds: {prereg.planning_reason}):", "",
                  f"| paired seed sd | seeds for equivalence (TOST, true difference 0) | seeds for a difference "
                  f"(two-sided t, true difference {margin:g}) | power with {n} seeds (equivalence / difference) |",
                  "|---|---|---|---|"]
        for row in end_state.power_table(prereg.planning_seed_sds, margin, power=prereg.power_target, alpha=alpha,
                                         max_seeds=max_seeds):
            eq = end_state.tost_power(n, row["sd"], margin, alpha=alpha)
            diff = end_state.difference_power(n, row["sd"], margin, alpha=alpha)
            lines.append(f"| {row['sd']:g} | {_needed(row['equivalence'], max_seeds)} | "
                         f"{_needed(row['difference'], max_seeds)} | {eq:.2f} / {diff:.2f} |")
    return lines
