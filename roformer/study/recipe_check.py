"""Whether the study's warmup and batch suit a scheme other than the one they were tuned with.

The study runs every scheme with one warmup and one batch size (`study.warmup_steps`,
`pretrain.train.batch_size`), those of the recipe sweep, whose baseline was rope. Inherited by
learned positions, they could favour rope. The check (`python -m roformer.study recipe
--config=configs/study.py:VARIANT --workdir=DIR`) trains `recipe_check.scheme` (learned) at
each warmup of `recipe_check.warmup_steps` (at the study's batch) and each batch of
`recipe_check.batch_sizes` at equal tokens (budgets, evaluations and warmup scaled to the same
token counts), every setting its own one-scheme study in DIR/recipe_check/<setting> over the
study's learning rates, on the tuning seeds only: no scored seed trains in it, and only the
validation split is read.

The rule, fixed in the config before the check runs (`recipe_check.margin` with its reason):
per setting, the scheme's validation loss at the last budget at the rate the tuning seeds
choose (their mean); the study's own setting is kept unless another is lower by more than the
margin, and then the lowest is the scheme's own. A chosen setting at an end of its grid is
said to be one. The result goes to DIR/recipe_check.json; the study's report in DIR reads it
and says which warmup and batch each scheme ran with and whether the check was made.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import time
from pathlib import Path

import ml_collections
import numpy as np

from roformer.config_files import fingerprint, split_list
from roformer.errors import ConfigError
from roformer.files import write_json_atomic
from roformer.study.preregistration import Preregistration
from roformer.study.records import RECIPE_CHECK

log = logging.getLogger("roformer.study")

RESULT = RECIPE_CHECK   # DIR/recipe_check.json: it travels with the records (roformer.study.records)
SUBDIR = "recipe_check"


@dataclasses.dataclass(frozen=True)
class Setting:
    warmup_steps: int   # at this setting's batch
    batch_size: int

    @property
    def name(self) -> str:
        return f"warmup{self.warmup_steps}_batch{self.batch_size}"


def _ints(section, key: str) -> list[int]:
    try:
        values = [int(v) for v in split_list(section[key])]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise ConfigError(f"recipe_check.{key}={section[key]!r}: a comma list of whole numbers > 0")
    return values


def settings(config) -> list[Setting]:
    """The study's own setting first, then each other warmup at the study's batch, then each
    other batch at equal tokens (its warmup the study's in tokens)."""
    section, base_warmup, base_batch = config.recipe_check, int(config.study.warmup_steps), \
        int(config.pretrain.train.batch_size)
    out = [Setting(base_warmup, base_batch)]
    out += [Setting(w, base_batch) for w in _ints(section, "warmup_steps") if w != base_warmup]
    for batch in _ints(section, "batch_sizes"):
        if batch != base_batch:
            out.append(Setting(_scaled(base_warmup, base_batch, batch, "study.warmup_steps"), batch))
    return out


def _scaled(steps: int, base_batch: int, batch: int, what: str) -> int:
    """`steps` at `base_batch` as steps at `batch`, the same tokens; ConfigError when not whole."""
    if (steps * base_batch) % batch:
        raise ConfigError(f"recipe_check.batch_sizes: batch {batch} cannot take {what}={steps} (at batch "
                          f"{base_batch}) at equal tokens in whole steps")
    return steps * base_batch // batch


def tuning_seeds(config) -> tuple[int, ...]:
    """The study's tuning seeds, which must be 0..k-1 with k >= 2: a setting's study trains
    seeds range(k), the first of which tunes it and the rest score it (its own registration,
    never read here), so no seed the study scores trains in the check."""
    seeds = Preregistration.from_config(config.study).tuning_seeds
    if sorted(seeds) != list(range(len(seeds))) or len(seeds) < 2:
        raise ConfigError(f"recipe check: study.tuning_seeds={config.study.tuning_seeds!r} must be 0..k-1 with k >= 2 "
                          "(each setting trains seeds 0..k-1, none the study scores)")
    return tuple(sorted(seeds))


def setting_config(config, setting: Setting) -> ml_collections.ConfigDict:
    """The one-scheme study of `setting`: the check's scheme alone, the tuning seeds only, the
    budgets, evaluations and warmup at the setting's batch in equal tokens."""
    seeds = tuning_seeds(config)
    sub = copy.deepcopy(config)
    st, base_batch = sub.study, int(config.pretrain.train.batch_size)
    scheme = config.recipe_check.scheme
    st.schemes = st.reference = scheme
    st.seeds = len(seeds)
    st.tuning_seeds, st.scored_seeds = str(seeds[0]), ",".join(map(str, seeds[1:]))
    st.warmup_steps = setting.warmup_steps
    if setting.batch_size != base_batch:
        st.budget_steps = ",".join(str(_scaled(int(b), base_batch, setting.batch_size, "study.budget_steps"))
                                   for b in split_list(config.study.budget_steps))
        st.eval_every = _scaled(int(config.study.eval_every), base_batch, setting.batch_size, "study.eval_every")
        sub.pretrain.train.batch_size = setting.batch_size
    return sub


def setting_key(sub) -> str:
    """What a setting's result depends on: its study's keys that change what a group computes and
    its pretraining settings, without where the data lie (a result travels between machines)."""
    from roformer.study.session import REPORT_ONLY_KEYS, portable_data

    pretrain = sub.pretrain.to_dict()
    pretrain["data"] = portable_data(pretrain["data"])
    return fingerprint({k: v for k, v in sub.study.to_dict().items() if k not in REPORT_ONLY_KEYS}, pretrain)


def planned(config) -> list[tuple[Setting, ml_collections.ConfigDict]]:
    """Every setting with its study's config, each validated: one ConfigError naming every
    setting that cannot run, before anything trains."""
    from roformer.study.plan import build_plan, validate

    if config.get("recipe_check") is None:
        raise ConfigError("the config has no recipe_check section (configs/study.py has one)")
    margin = config.recipe_check.margin
    if not (isinstance(margin, (int, float)) and margin > 0 and str(config.recipe_check.margin_reason).strip()):
        raise ConfigError(f"recipe_check.margin={margin!r}: a number > 0 with its reason (recipe_check.margin_reason)")
    out, problems = [], []
    for setting in settings(config):
        sub = setting_config(config, setting)
        try:
            validate(build_plan(sub))
        except ConfigError as error:
            problems.append(f"{setting.name}: {error}")
        out.append((setting, sub))
    if problems:
        raise ConfigError("recipe check: " + "; ".join(problems))
    return out


def setting_result(record: dict, tuning: tuple[int, ...]) -> dict:
    """The scheme's validation loss at the last budget at the rate the tuning seeds choose (their mean)."""
    from roformer.study.end_state_report import member_indices
    from roformer.study.report import choose_rate

    budget = record["budgets"][-1]
    rates = sorted({m["rate"] for m in record["members"]})
    r = choose_rate(record, budget, tuning)
    loss = float(np.mean(np.asarray(budget["validation_loss"], float)[member_indices(record, rates[r], tuning)]))
    return {"rate": rates[r], "rate_at_edge": len(rates) > 1 and r in (0, len(rates) - 1),
            "validation_loss": loss, "tokens": budget["tokens"]}


def choose(results: dict[str, dict], order: list[Setting], margin: float) -> dict:
    """The pre-registered rule over `results` (setting name -> its result; `order[0]` is the
    study's own setting): the study's own kept unless another is lower by more than `margin`,
    then the lowest; whether the choice is at an end of its grid."""
    base = order[0]
    finite = {s.name: results[s.name]["validation_loss"] for s in order
              if s.name in results and math.isfinite(results[s.name]["validation_loss"])}
    if base.name not in finite:
        return {"chosen": None, "kept": None, "at_edge": False}
    best = min(finite, key=finite.get)
    kept = finite[base.name] - finite[best] <= margin
    chosen = base if kept else next(s for s in order if s.name == best)
    warmups = sorted({s.warmup_steps for s in order if s.batch_size == base.batch_size})
    batches = sorted({s.batch_size for s in order})
    at_edge = (chosen.batch_size == base.batch_size and len(warmups) > 1 and chosen.warmup_steps in
               (warmups[0], warmups[-1])) or (len(batches) > 1 and chosen.batch_size in (batches[0], batches[-1]))
    return {"chosen": dataclasses.asdict(chosen), "chosen_name": chosen.name, "kept": kept, "at_edge": at_edge,
            "gain_over_study": finite[base.name] - finite[chosen.name]}


def run(config, workdir: str | Path) -> dict:
    """Train (or resume) every setting's study under DIR/recipe_check and write DIR/recipe_check.json;
    returns it. A setting whose result is in DIR/recipe_check.json under the same settings is
    not trained again. Stops before a setting once study.time_limit_s has passed (0: none)."""
    from roformer.study import report as study_report
    from roformer.study.session import run_study

    workdir = Path(workdir).resolve()
    jobs = planned(config)
    tuning = tuning_seeds(config)
    section = config.recipe_check
    previous = json.loads((workdir / RESULT).read_text()) if (workdir / RESULT).is_file() else {}
    keys = {s.name: setting_key(sub) for s, sub in jobs}
    results = {name: r for name, r in previous.get("settings", {}).items() if r.get("key") == keys.get(name)}
    start, limit = time.perf_counter(), float(config.study.time_limit_s)
    complete = True
    for setting, sub in jobs:
        if setting.name in results:
            log.info("recipe check: %s already checked", setting.name)
            continue
        left = limit - (time.perf_counter() - start)
        if limit and left <= 0:
            complete = False
            log.warning("recipe check: time limit reached before %s; the same command resumes there", setting.name)
            break
        sub.study.time_limit_s = max(left, 1.0) if limit else 0.0
        log.info("recipe check: %s (%s)", setting.name, section.scheme)
        if study_report.unfinished(sub, run_study(sub, workdir / SUBDIR / setting.name)):
            complete = False
            log.warning("recipe check: %s stopped by the time limit; the same command resumes it", setting.name)
            break
        record, _ = study_report.load_scheme(workdir / SUBDIR / setting.name, section.scheme)
        results[setting.name] = {**dataclasses.asdict(setting), **setting_result(record, tuning),
                                 "key": keys[setting.name]}
        _write(workdir, config, jobs, results, complete=False)
    return _write(workdir, config, jobs, results, complete=complete and len(results) == len(jobs))


def _write(workdir: Path, config, jobs, results: dict, *, complete: bool) -> dict:
    order = [s for s, _ in jobs]
    section = config.recipe_check
    out = {"scheme": section.scheme, "study_setting": dataclasses.asdict(order[0]), "margin": float(section.margin),
           "margin_reason": section.margin_reason, "inherited": section.inherited,
           "tuning_seeds": list(tuning_seeds(config)), "complete": complete,
           "settings": {s.name: results[s.name] for s in order if s.name in results},
           "choice": choose(results, order, float(section.margin)) if complete else None}
    write_json_atomic(workdir / RESULT, out)
    return out


def load_result(workdir: str | Path | None) -> dict | None:
    """DIR/recipe_check.json, or None (no workdir, or no check made in it)."""
    path = Path(workdir) / RESULT if workdir is not None else None
    return json.loads(path.read_text()) if path is not None and path.is_file() else None


def recipe_lines(config, check: dict | None) -> list[str]:
    """The study report's paragraph on the recipe: the warmup and batch every scheme ran with,
    where they come from, and the check's result for its scheme (`load_result`) when one was made."""
    st, train = config.study, config.pretrain.train
    section = config.get("recipe_check")
    inherited = f" ({section.inherited})" if section is not None else ""
    lines = ["## Warmup and batch", "",
             f"Every scheme ran with warmup {st.warmup_steps} steps and batch {train.batch_size} x {train.seq_len}"
             f"{inherited}."]
    if check is None:
        scheme = section.scheme if section is not None else "learned"
        return lines + [f"Not checked for {scheme} in this workdir (`python -m roformer.study recipe`; "
                        "docs/study-follow-ups.md).", ""]
    rows = [f"| {name} | {r['warmup_steps']} | {r['batch_size']} | {r['rate']:g}{' (edge)' if r['rate_at_edge'] else ''} "
            f"| {r['validation_loss']:.4f} |" for name, r in check["settings"].items()]
    lines += ["", f"Checked for {check['scheme']} on tuning seeds {', '.join(map(str, check['tuning_seeds']))} "
              f"(validation loss at the last budget, the rate the tuning seeds choose; rule: the study's setting kept "
              f"unless another is lower by more than {check['margin']:g} nats, {check['margin_reason']}):", "",
              "| setting | warmup (steps) | batch | rate | validation loss |", "|---|---|---|---|---|", *rows, ""]
    choice = check.get("choice")
    if not check["complete"] or not choice or choice["chosen"] is None:
        return lines + ["The check has not finished: the same command resumes it.", ""]
    if choice["kept"]:
        verdict = f"the study's setting holds for {check['scheme']}"
    else:
        verdict = (f"{check['scheme']} does better with {choice['chosen_name']} (by {choice['gain_over_study']:.4f} "
                   "nats): its comparison at the study's setting may favour the schemes the setting was tuned with")
    edge = " The chosen setting is at an end of its grid: a better one may lie beyond." if choice["at_edge"] else ""
    return lines + [f"Result: {verdict}.{edge}", ""]
