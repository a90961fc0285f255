"""The downstream arm: the members a study kept (roformer.study.kept), fine-tuned on GLUE tasks
on the CPU and compared by scheme.

    python -m roformer.study downstream --config=configs/study.py:VARIANT DIR SOURCE...

For each kept member (a scheme at one scored pretraining seed, at the rate the study chose)
and each task of `downstream.tasks`, `roformer.glue.run_glue` fine-tunes it with
`downstream.glue`'s protocol for each of its fine-tuning seeds (`downstream.glue.seeds`), in
DIR/finetunes/<scheme>/seed<k>/<task> (a GLUE workdir: its metrics.jsonl and
glue_results.json). Once a run is whole its dev scores go in scores.json beside it, with the
fingerprint of its settings and member, so the same command resumes where it stopped and a
run of other settings is done again. After each run the report is rewritten:
DIR/downstream.md and downstream.json, the pre-registered rules first
(roformer.study.downstream_rules), then per task the positive control (reference - control)
and each scheme's paired difference to the reference with its interval and verdict.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import ml_collections

from roformer.config_files import fingerprint, split_list
from roformer.errors import ConfigError
from roformer.files import write_json_atomic, write_text_atomic
from roformer.study import kept
from roformer.study.downstream_rules import DownstreamRules, control_passes, paired, verdict

log = logging.getLogger("roformer.study")

REPORT_MD, REPORT_JSON = "downstream.md", "downstream.json"
CONFIG_RECORD = "downstream_config.json"
FINETUNES_DIR = "finetunes"
SOURCES_DIR = "sources"          # kept-members archives unpacked
SCORES_FILE = "scores.json"      # a whole run's dev scores, beside its GLUE outputs
CACHE_DIR = "xla_cache"          # compiled GLUE programs, shared by every run of DIR
# Set per run by the stage, or where the data lie: not part of a run's fingerprint.
RUN_KEYS = ("task", "init", "compilation_cache_dir", "progress_bar", "data_dir", "hf_cache_dir", "tfds_data_dir")


@dataclasses.dataclass(frozen=True)
class DownstreamPlan:
    """What the arm fine-tunes and how it judges, from a study config's `downstream` section."""
    tasks: tuple[str, ...]
    schemes: tuple[str, ...]       # the study's, for the report's order
    rules: DownstreamRules
    glue: ml_collections.ConfigDict

    @classmethod
    def from_config(cls, config) -> DownstreamPlan:
        """The plan, or one ConfigError naming every problem, before anything is read."""
        from roformer.glue.settings import check_config
        from roformer.glue.tasks import TASKS

        section = config.get("downstream")
        if section is None or "glue" not in section:
            raise ConfigError("the config has no downstream section: give --config=configs/study.py:VARIANT")
        problems = []
        tasks = tuple(split_list(section.tasks))
        unknown = [t for t in tasks if t not in TASKS or t == "ax"]
        if not tasks or unknown or len(set(tasks)) != len(tasks):
            problems.append(f"downstream.tasks={section.tasks!r}: GLUE tasks with training data, each once "
                            f"(one of {', '.join(t for t in TASKS if t != 'ax')})")
        try:
            check_config(section.glue, prefix="downstream.glue.")
        except ConfigError as error:
            problems.append(str(error))
        try:
            rules = DownstreamRules(reference=str(config.study.reference), control=str(section.control),
                                    level=float(section.level), equivalence_margin=float(section.equivalence_margin),
                                    equivalence_reason=str(section.equivalence_reason))
        except ConfigError as error:
            problems.append(str(error).removeprefix("downstream config: "))
            rules = None
        if problems:
            raise ConfigError("downstream config: " + "; ".join(problems))
        return cls(tasks, tuple(split_list(config.study.schemes)), rules, section.glue)

    @property
    def finetune_seeds(self) -> int:
        return int(self.glue.seeds)

    @staticmethod
    def headline(task: str) -> tuple[str, str]:
        """(the dev split, the metric) a task is scored by: its first of each."""
        from roformer.glue.tasks import TASKS

        spec = TASKS[task]
        return spec.eval_splits[0], spec.metrics[0]

    def glue_config(self, member: kept.KeptMember, task: str, cache_dir: Path) -> ml_collections.ConfigDict:
        """The GLUE config of one run: the protocol, this member as the encoder, this task."""
        glue = ml_collections.ConfigDict(self.glue.to_dict())
        glue.task, glue.init = task, str(member.path)
        glue.compilation_cache_dir, glue.progress_bar = str(cache_dir), False
        return glue

    def run_key(self, member: kept.KeptMember, task: str) -> str:
        """What a run's scores depend on: the protocol, the task and the member (its record's
        fingerprint, seed, rate and budget), not where the member lies."""
        protocol = {k: v for k, v in self.glue.to_dict().items() if k not in RUN_KEYS}
        return fingerprint(protocol, task, {k: v for k, v in member.meta.items() if k != "path"})


def order_schemes(plan: DownstreamPlan, schemes) -> list[str]:
    """Reference, control, then the study's order, then any other."""
    listed = [plan.rules.reference, plan.rules.control, *plan.schemes, *sorted(schemes)]
    return [s for s in dict.fromkeys(listed) if s in schemes]


def run_dir(workdir: Path, scheme: str, seed: int, task: str) -> Path:
    return Path(workdir) / FINETUNES_DIR / scheme / f"seed{seed}" / task


def finished_scores(path: Path, key: str) -> dict | None:
    """A run's scores when it finished under `key`'s settings, else None."""
    try:
        done = json.loads((path / SCORES_FILE).read_text())
    except (OSError, ValueError):
        return None
    return done if done.get("key") == key else None


def run_downstream(config, workdir: str | Path, sources) -> dict:
    """Fine-tune every kept member of `sources` on every task (resuming: whole runs of these
    settings are kept), rewriting the report after each; returns the report's content."""
    from roformer.glue import run_glue

    plan = DownstreamPlan.from_config(config)
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    members = kept.gather(sources, workdir / SOURCES_DIR)
    schemes = order_schemes(plan, {scheme for scheme, _ in members})
    absent = [s for s in (plan.rules.reference, plan.rules.control) if s not in schemes]
    if absent:
        raise ConfigError(f"no kept members of {' or '.join(absent)} in {', '.join(map(str, sources))}: the "
                          "reference and the control are what every task is judged by")
    write_text_atomic(workdir / CONFIG_RECORD, config.to_json_best_effort(indent=2) + "\n")
    log.info("%s", "\n".join(plan.rules.header_lines([(t, plan.headline(t)[1]) for t in plan.tasks],
                                                     plan.finetune_seeds)))
    todo = [(members[(scheme, seed)], task) for scheme in schemes for seed in sorted(s for sc, s in members if sc == scheme)
            for task in plan.tasks]
    for n, (member, task) in enumerate(todo, 1):
        path, key = run_dir(workdir, member.scheme, member.seed, task), plan.run_key(member, task)
        if finished_scores(path, key) is not None:
            continue
        log.info("downstream %d/%d: %s seed %d (rate %g), %s", n, len(todo), member.scheme, member.seed,
                 member.meta.get("rate", float("nan")), task)
        results = run_glue(plan.glue_config(member, task, workdir / CACHE_DIR), path)
        split, metric = plan.headline(task)
        seeds = results["tasks"][task]["seeds"]
        write_json_atomic(path / SCORES_FILE, {
            "key": key, "scheme": member.scheme, "seed": member.seed, "task": task, "split": split, "metric": metric,
            "member": member.meta, "scores": {s: 100 * float(r[split][metric]) for s, r in seeds.items()},
            "eval_cut_from": results["tasks"][task].get("eval_cut_from", {})})
        write_report(plan, workdir, members)
    return write_report(plan, workdir, members)


# --------------------------------------------------------------------------- the report


def collect(plan: DownstreamPlan, workdir: Path, members: dict) -> dict[str, dict[str, dict[int, float]]]:
    """task -> scheme -> pretraining seed -> its score (the mean over its fine-tuning seeds),
    of the runs finished under these settings."""
    table: dict[str, dict[str, dict[int, float]]] = {task: {} for task in plan.tasks}
    for (scheme, seed), member in members.items():
        for task in plan.tasks:
            done = finished_scores(run_dir(workdir, scheme, seed, task), plan.run_key(member, task))
            if done is not None and done["scores"]:
                values = list(done["scores"].values())
                table[task].setdefault(scheme, {})[seed] = sum(values) / len(values)
    return table


def summarize(plan: DownstreamPlan, table: dict[str, dict[str, dict[int, float]]]) -> dict:
    """Per task: the control's paired difference and whether it passes, each scheme's mean
    score and per-seed scores, and each scheme's paired difference to the reference with its
    verdict."""
    rules = plan.rules
    out = {"rules": dataclasses.asdict(rules), "tasks": {}}
    for task, by_scheme in table.items():
        reference = by_scheme.get(rules.reference, {})
        control = paired(reference, by_scheme[rules.control], rules.level) if rules.control in by_scheme else None
        counted = control_passes(control)
        rows = {}
        for scheme in order_schemes(plan, by_scheme):
            scores = by_scheme[scheme]
            row = {"mean": sum(scores.values()) / len(scores), "per_seed": {str(s): v for s, v in sorted(scores.items())}}
            if scheme != rules.reference:
                difference = paired(scores, reference, rules.level)
                row["vs_reference"] = difference.to_dict() if difference else None
                row["verdict"] = verdict(difference, rules, counted)
            rows[scheme] = row
        out["tasks"][task] = {"metric": plan.headline(task)[1], "control": control.to_dict() if control else None,
                              "counted": counted, "schemes": rows}
    out["counted"] = [task for task, result in out["tasks"].items() if result["counted"]]
    return out


def _interval(p: dict | None) -> str:
    return "n/a" if p is None else f"{p['mean']:+.2f} [{p['lo']:+.2f}, {p['hi']:+.2f}] (n={len(p['seeds'])})"


def markdown(plan: DownstreamPlan, summary: dict, members: dict, missing: list[str]) -> str:
    rules = plan.rules
    lines = ["# The downstream arm", ""]
    lines += rules.header_lines([(t, plan.headline(t)[1]) for t in plan.tasks], plan.finetune_seeds)
    lines += ["", "## Which tasks count", "",
              f"| task | metric | {rules.reference} - {rules.control} ({100 * rules.level:g}% interval) | counts |",
              "|---|---|---|---|"]
    for task, result in summary["tasks"].items():
        lines.append(f"| {task} | {result['metric']} | {_interval(result['control'])} | "
                     f"{'yes' if result['counted'] else 'no'} |")
    for task, result in summary["tasks"].items():
        lines += ["", f"## {task} ({result['metric']} x100, dev)", "",
                  f"| scheme | mean | per pretraining seed | - {rules.reference} ({100 * rules.level:g}% interval) | "
                  "verdict |", "|---|---|---|---|---|"]
        for scheme, row in result["schemes"].items():
            seeds = ", ".join(f"{s}: {v:.1f}" for s, v in row["per_seed"].items())
            vs = "reference" if scheme == rules.reference else _interval(row["vs_reference"])
            lines.append(f"| {scheme} | {row['mean']:.2f} | {seeds} | {vs} | {row.get('verdict', '')} |")
    rates = {}
    for (scheme, _), member in members.items():
        rates.setdefault(scheme, set()).add(member.meta.get("rate"))
    lines += ["", "## Members", "",
              "Kept at the study's last budget, at the rate its tuning seeds chose: " + "; ".join(
                  f"{scheme} {len([1 for s, _ in members if s == scheme])} seed(s) at rate "
                  f"{', '.join(f'{r:g}' for r in sorted(rates[scheme]))}" for scheme in sorted(rates)) + "."]
    if missing:
        lines += ["", "Not fine-tuned yet (the same command resumes with them): " + ", ".join(missing) + "."]
    return "\n".join(lines) + "\n"


def write_report(plan: DownstreamPlan, workdir: Path, members: dict) -> dict:
    """downstream.md and downstream.json from the finished runs of `workdir`."""
    table = collect(plan, workdir, members)
    summary = summarize(plan, table)
    missing = [f"{scheme} seed {seed} {task}" for (scheme, seed) in members for task in plan.tasks
               if seed not in table[task].get(scheme, {})]
    summary["missing"] = missing
    write_json_atomic(workdir / REPORT_JSON, summary, indent=2)
    write_text_atomic(workdir / REPORT_MD, markdown(plan, summary, members, missing))
    return summary
