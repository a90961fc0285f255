"""The downstream arm's verdict rules, fixed in the config before any member is fine-tuned, and
the pure arithmetic that reads them (roformer.study.downstream runs the fine-tunes).

A score is a task's headline dev metric (x100) of one kept member (a scheme at one pretraining
seed), averaged over its fine-tuning seeds. Schemes are compared paired by pretraining seed
(every scheme's seed k saw the same data order): the difference per seed, and a Student t
interval over the seeds (n - 1 degrees of freedom), so the pretraining seeds' spread is the
error, and the fine-tuning seeds' only through their mean.

- **The positive control.** A task counts only where the reference (rope) scores above the
  control (`none`, no position information): the interval of reference - control lies above
  0. A task whose control fails cannot show a position scheme's effect on word order, so its
  comparisons are shown but not judged.
- **Each scheme against the reference**, on a counted task: "equivalent" when the two one-sided
  tests put the difference within +-equivalence_margin ("(nonzero)" when it also excludes 0),
  else "higher" / "lower" when the interval excludes 0, else "undecided" (the study's rules,
  roformer.study.stats.verdict, in points instead of nats).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from roformer.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class DownstreamRules:
    reference: str
    control: str
    level: float
    equivalence_margin: float     # points of the headline metric
    equivalence_reason: str

    def __post_init__(self):
        problems = []
        if self.reference == self.control:
            problems.append(f"downstream.control={self.control!r} is the reference: the control is a scheme "
                            "without position information the reference must beat")
        if not 0.5 < self.level < 1:
            problems.append(f"downstream.level={self.level!r} must be in (0.5, 1)")
        if not (math.isfinite(self.equivalence_margin) and self.equivalence_margin > 0):
            problems.append(f"downstream.equivalence_margin={self.equivalence_margin!r} must be a number > 0")
        if not str(self.equivalence_reason).strip():
            problems.append("downstream.equivalence_reason is empty: a margin is registered with the reason for its size")
        if problems:
            raise ConfigError("downstream config: " + "; ".join(problems))

    def header_lines(self, tasks: Sequence[tuple[str, str]], finetune_seeds: int) -> list[str]:
        """The report's header (markdown lines), before any number: `tasks` as (task, its
        headline metric)."""
        pct, tost = f"{100 * self.level:g}%", f"{100 * (2 * self.level - 1):g}%"
        return [
            "## Pre-registered",
            "",
            "Fixed before any member was fine-tuned; every verdict below is read with these.",
            "",
            f"- Score: each task's headline dev metric x100 ({', '.join(f'{t} {m}' for t, m in tasks)}), "
            f"averaged over a member's {finetune_seeds} fine-tuning seed(s); one score per scheme and pretraining "
            "seed.",
            f"- Paired by pretraining seed; the {pct} interval is Student's t over the pretraining seeds (n - 1 "
            "degrees of freedom). Fewer than 2 common seeds: no interval, no verdict.",
            f"- Positive control: a task counts only where {self.reference} - {self.control} has its {pct} interval "
            f"above 0 ({self.control}: no position information). Failing it, the task's comparisons are shown, not "
            "judged.",
            f"- Each scheme - {self.reference}, on a counted task: \"equivalent\" when its {tost} interval lies "
            f"within +-{self.equivalence_margin:g} points ({self.equivalence_reason}); else \"higher\" or "
            f"\"lower\" when the {pct} interval excludes 0; else \"undecided\".",
        ]


@dataclasses.dataclass(frozen=True)
class Paired:
    """A paired difference over pretraining seeds: mean, its interval at the rules' level (and
    at the equivalence tests' 2 x level - 1), the seeds and their differences."""
    mean: float
    lo: float
    hi: float
    lo_tost: float
    hi_tost: float
    seeds: tuple[int, ...]
    differences: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.seeds)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def paired(scores: Mapping[int, float], reference: Mapping[int, float], level: float) -> Paired | None:
    """scores - reference over the pretraining seeds both have (a mean over each's fine-tuning
    seeds); None below 2 common seeds."""
    from scipy import stats

    seeds = tuple(sorted(set(scores) & set(reference)))
    if len(seeds) < 2:
        return None
    d = np.asarray([scores[s] - reference[s] for s in seeds], float)
    mean, se = float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d)))
    t, t_tost = (float(stats.t.ppf(q, len(d) - 1)) for q in (0.5 + level / 2, level))
    return Paired(mean, mean - t * se, mean + t * se, mean - t_tost * se, mean + t_tost * se, seeds,
                  tuple(float(x) for x in d))


def control_passes(control: Paired | None) -> bool:
    """Whether reference - control's interval lies above 0 (the reference is the better one)."""
    return control is not None and control.lo > 0


def verdict(difference: Paired | None, rules: DownstreamRules, counted: bool) -> str:
    """A scheme's verdict against the reference on a task (`counted`: it passed the control)."""
    if difference is None:
        return "no interval (fewer than 2 common pretraining seeds)"
    if not counted:
        return "not judged (the task fails the control)"
    from roformer.study.stats import verdict as study_verdict

    return study_verdict(difference.lo, difference.hi, difference.lo_tost, difference.hi_tost,
                         rules.equivalence_margin)
