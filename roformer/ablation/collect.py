"""The ablation's results, read back into the rows of `ablation.json`.

One row per (scheme, seed) run, from its stage records (status, extrapolation), its
`metrics.jsonl` (final metrics, the held-out curve) and its GLUE workdir's
`glue_results.json`; one row per context-extension run; and the setup they share. The
statistics over seeds and the words are roformer.ablation.summary's (`summarize`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
from pathlib import Path
from typing import Any, Iterable, Mapping

from roformer.model import attention_stats
from roformer.ablation import summary
from roformer.ablation.plan import Plan, PlannedRun, fingerprint
from roformer.ablation.stats import finite
from roformer.ablation.state import PINNED_TOKENIZER, AblationState, is_main_process, run_status
from roformer.files import write_json_atomic
from roformer.glue.tasks import TASKS
from roformer.machine import describe_cpu, machine_info
from roformer.train.metrics import read_metrics


# --------------------------------------------------------------------------- one run's metrics


def loss_curves(rows: Iterable[Mapping]) -> dict[str, list[tuple[int, float]]]:
    """(step, loss) pairs for the train and the held-out MLM loss.

    A resumed run logs some steps twice; the later row (from the resumed run) wins.
    """
    train: dict[int, float] = {}
    heldout: dict[int, float] = {}
    for row in rows:
        step = row.get("step")
        if not isinstance(step, int):
            continue
        if finite(row.get("loss")):
            train[step] = float(row["loss"])
        if finite(row.get("eval_loss")):
            heldout[step] = float(row["eval_loss"])
    return {"train": sorted(train.items()), "eval": sorted(heldout.items())}


def eval_curve(rows: Iterable[Mapping], tokens_per_step: int) -> list[dict]:
    """The held-out evaluations of a run, one per step (the last row of a step wins):
    step, tokens seen, loss, accuracy and the word-order gap (shuffled - plain loss)."""
    by_step: dict[int, dict] = {}
    for row in rows:
        if isinstance(row.get("step"), int) and finite(row.get("eval_loss")):
            point = by_step[row["step"]] = {
                "step": row["step"], "tokens": row["step"] * tokens_per_step, "eval_loss": row["eval_loss"],
                "eval_mlm_accuracy": row.get("eval_mlm_accuracy"), "eval_order_gap": row.get("eval_order_gap")}
            stats = attention_stats.from_metrics(row)
            if stats is not None:
                point.update(stats)
                # One number each for the curves: how close the most local head looks, and
                # how alike the positions are at the encoder's output.
                point["nearest_head_distance"] = min(min(heads) for heads in stats["attention_distance"])
                point["last_hidden_cosine"] = stats["hidden_cosine"][-1]
    return [by_step[s] for s in sorted(by_step)]


def _last(rows: list[Mapping], key: str) -> float | None:
    for row in reversed(rows):
        if finite(row.get(key)):
            return float(row[key])
    return None


def pretrain_summary(rows: list[Mapping]) -> dict[str, float | int | None]:
    """Final losses/accuracies and median throughput of one pretraining run.

    The first logged throughput includes compilation, so it is left out of
    the median whenever there is more than one row.
    """
    throughput = [float(r["tokens_per_sec"]) for r in rows if finite(r.get("tokens_per_sec"))]
    if len(throughput) > 1:
        throughput = throughput[1:]
    steps = [r["step"] for r in rows if isinstance(r.get("step"), int)]
    return {
        "steps": max(steps) if steps else None,
        "train_loss": _last(rows, "loss"),
        "train_mlm_accuracy": _last(rows, "mlm_accuracy"),
        "eval_loss": _last(rows, "eval_loss"),
        "eval_mlm_accuracy": _last(rows, "eval_mlm_accuracy"),
        "eval_shuffled_loss": _last(rows, "eval_shuffled_loss"),
        "eval_order_gap": _last(rows, "eval_order_gap"),
        "tokens_per_sec": statistics.median(throughput) if throughput else None,
    }


def glue_summary(results: Mapping, display: Mapping[str, str] | None = None) -> dict:
    """Per-task median metrics and GLUE scores (x100) from a `glue_results.json` dict.

    Task columns are "<task> <metric>" (plus the split when a task reports several,
    e.g. MNLI matched/mismatched), the task under its `display` name (default: the GLUE
    registry's); a score over only some tasks is kept with `complete: false` so the table
    can mark it partial.
    """
    display = {name: spec.display for name, spec in TASKS.items()} if display is None else display
    tasks: dict[str, float] = {}
    for name, task_result in results.get("tasks", {}).items():
        medians = task_result.get("median", {})
        for split, metrics in medians.items():
            prefix = display.get(name, name) if len(medians) == 1 else f"{display.get(name, name)} {split}"
            for metric, value in metrics.items():
                tasks[f"{prefix} {metric}"] = None if value is None else 100.0 * float(value)
    scores = {key: s.get("score") for key, s in results.get("glue", {}).items()}
    complete = {key: bool(s.get("complete")) for key, s in results.get("glue", {}).items()}
    return {"tasks": tasks, "scores": scores, "complete": complete}


# --------------------------------------------------------------------------- the report's rows


def build_report(plan: Plan, state: AblationState) -> dict:
    """The report dict (ablation.json) from the state file and the run directories."""
    config = plan.config
    setup = _setup(plan)
    runs = [_run_row(plan, state, run) for run in plan.scheme_runs]
    extension = [_extension_row(state, run) for run in plan.extension_runs]
    if plan.extension_runs:
        ext, seeds = config.extension, plan.extension_seeds
        setup["extension"] = (f"{ext.scheme} at {ext.factor}x the length, {ext.steps} steps, lr {ext.learning_rate}, "
                              f"pretraining seed{'s' if seeds > 1 else ''} {', '.join(map(str, range(seeds)))}")
    result = summary.summarize(setup, runs, extension, reference=config.reference, baseline=config.baseline,
                              order_threshold=config.order_threshold)
    result["position_signal"] = _position_signals(plan)
    return result


def _setup(plan: Plan) -> dict[str, Any]:
    """What every run shares, in words and numbers (the report's first line)."""
    config, pre, steps = plan.config, plan.config.pretrain, plan.steps
    setup = {
        "size": pre.model.size,
        "data": pre.data.files if pre.data.source == "files" else pre.data.source,
        "vocab": pre.data.vocab or f"WordPiece {pre.data.vocab_size} trained on the corpus",
        "seq_len": pre.train.seq_len,
        "batch_size": pre.train.batch_size,
        "steps": steps,
        "tokens": steps * pre.train.batch_size * pre.train.seq_len,
        "seeds": _seeds_text(plan),
        "glue": (f"{config.glue.task} (median of {config.glue.seeds} fine-tuning seed"
                 f"{'s' if config.glue.seeds > 1 else ''} per pretrained model)"
                 if plan.glue_tasks else "skipped"),
        "machine": _machine(),
    }
    unigram = _unigram_loss(plan)
    if unigram is not None:
        setup["unigram_loss"] = unigram
    return setup


def _run_row(plan: Plan, state: AblationState, run: PlannedRun) -> dict[str, Any]:
    """One (scheme, seed) run: status, final metrics, curve, extrapolation and GLUE."""
    name, workdir, train = run.name, plan.workdir, run.train_config.train
    stages = [stage.name for stage in run.stages]
    records = {s: state.get(name, s) for s in stages}
    row: dict[str, Any] = {"scheme": run.key, "seed": run.seed, **run_status(records, stages),
                           "pretrain_workdir": f"pretrain/{name}", "glue_workdir": None,
                           "learning_rate": train.learning_rate}
    row["wall_s"] = round(sum(r.get("wall_s", 0.0) for r in records.values()), 1)
    metrics = read_metrics(run.workdir / "metrics.jsonl")
    row.update(pretrain_summary(metrics))
    row["curve"] = eval_curve(metrics, train.batch_size * train.seq_len)
    ext = records.get("extrapolation", {}).get("result") or {}
    row["params"] = ext.get("params")
    row["extrapolation"] = ext.get("extrapolation")
    if records.get("glue", {}).get("status") == "done":
        row["glue_workdir"] = f"glue/{name}"
        results = workdir / row["glue_workdir"] / "glue_results.json"
        row["glue"] = glue_summary(json.loads(results.read_text())) if results.exists() else None
    return row


def _extension_row(state: AblationState, run: PlannedRun) -> dict[str, Any]:
    """One context-extension run: status and its held-out loss at every evaluated step."""
    stages = [stage.name for stage in run.stages]
    records = {s: state.get(run.name, s) for s in stages}
    row = {"method": run.key, "seed": run.seed, **run_status(records, stages), "workdir": run.name,
           "wall_s": round(sum(r.get("wall_s", 0.0) for r in records.values()), 1)}
    row.update(records["extension_eval"].get("result") or {})
    return row


def _seeds_text(plan: Plan) -> int | str:
    """config.seeds, or per scheme when config.scheme_seeds makes them differ."""
    if len(set(plan.seeds.values())) <= 1:
        return plan.config.seeds
    return " / ".join(f"{scheme} {n}" for scheme, n in plan.seeds.items())


def _machine() -> str:
    """One line saying what ran it; the load average matters on a shared machine."""
    m = machine_info()
    desc = f"{m['device_count']} x {m['device_kind']} ({m['platform']}), {m['cpu_count']} CPU cores"
    if m["cpu"]:
        desc += f" ({describe_cpu(m['cpu'])})"
    if hasattr(os, "getloadavg"):
        desc += ", load average {:.1f}".format(os.getloadavg()[1])  # 5-minute
    return desc


def position_signal_fingerprint(plan: Plan) -> str:
    """What the position signals depend on: every scheme's model and the vocabulary's size."""
    models = {run.key: run.pretrain_config.model.to_dict() for run in plan.scheme_runs if run.seed == 0}
    return fingerprint(models, plan.config.pretrain.data.vocab_size)


def _position_signals(plan: Plan) -> dict[str, dict]:
    """Per scheme, the position / token signal ratios at initialisation
    (roformer.model.position_signal), at the pretraining length, cached in the workdir."""
    config = plan.config
    cache = plan.workdir / "position_signal.json"
    configs = {run.key: run.pretrain_config for run in plan.scheme_runs if run.seed == 0}
    fp = position_signal_fingerprint(plan)
    if cache.exists():
        saved = json.loads(cache.read_text())
        if saved.get("fingerprint") == fp:
            return saved["ratios"]
    # flax and the model: only when the cache is stale.
    from roformer.model.position_signal import position_signals
    from roformer.train.config import build_model_config

    # The ratios do not depend on which ids the vocabulary holds, only on the parameters.
    models = {s: build_model_config(c.model, vocab_size=config.pretrain.data.vocab_size) for s, c in configs.items()}
    ratios = position_signals(models, seed=0, length=config.pretrain.train.seq_len)
    if is_main_process():
        write_json_atomic(cache, {"fingerprint": fp, "ratios": ratios}, indent=None)
    return ratios


def _unigram_loss(plan: Plan) -> float | None:
    """The corpus's context-free MLM loss under the runs' (pinned) vocabulary, cached in the
    workdir."""
    workdir, config = plan.workdir, plan.config
    cache = workdir / "unigram_loss.json"
    fp = fingerprint(config.pretrain.data)
    if cache.exists():
        saved = json.loads(cache.read_text())
        if saved.get("fingerprint") == fp:
            return saved["unigram_loss"]
    vocab = Path(config.pretrain.data.vocab or workdir / PINNED_TOKENIZER)
    if not vocab.exists():
        return None
    from roformer.data import DataConfig, make_pretrain_data   # the data pipeline: only when the cache is stale

    data_cfg = dataclasses.replace(DataConfig.from_mapping(config.pretrain.data), vocab=str(vocab))
    data = make_pretrain_data(data_cfg, seq_len=config.pretrain.train.seq_len, batch_size=1, seed=0,
                              show_progress=False)
    value = data.unigram_loss()
    if is_main_process():
        write_json_atomic(cache, {"fingerprint": fp, "unigram_loss": value}, indent=None)
    return value
