"""Position-scheme ablation in one command, resumable, with a report.

    python -m roformer.ablate --config=configs/ablation.py --workdir=DIR

For every scheme in `config.schemes`: MLM pretraining (an ordinary pretrain workdir),
length-extrapolation evaluation of the pretrained model, then GLUE fine-tuning (an
ordinary GLUE workdir). Layout of DIR:

    pretrain/<scheme>/         `tensorboard --logdir DIR/pretrain` shows them side by side
    glue/<scheme>/
    ablation_state.json        per scheme and stage: done/failed, config fingerprint, results
    errors/<scheme>.<stage>.txt  traceback of a failed stage
    ablation.json, ablation.md, loss_curves.png, extrapolation.png

Every scheme gets the same `config.pretrain` (data, data order, seed, optimiser,
budget); only the model keys of the scheme's config file are applied on top.
Re-running skips stages that finished with the same config, resumes interrupted
pretraining from its checkpoints, and retries failed stages. A failing scheme is
recorded (with its traceback in DIR/errors/) and the others still run.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import ml_collections

from roformer import report

log = logging.getLogger("roformer.ablate")

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
# Short scheme names -> pretraining config files in configs/.
SCHEME_CONFIG_FILES = {
    "learned": "absolute", "sinusoidal": "sinusoidal", "shaw": "relative", "t5": "t5",
    "alibi": "alibi", "rope": "rotary", "rope_linear": "rotary_linear", "none": "none",
}
STAGES = ("pretrain", "extrapolation", "glue")
STATE_FILE = "ablation_state.json"


class Preempted(Exception):
    """Pretraining saved a checkpoint on SIGTERM: stop the ablation, resume it next run."""


# --------------------------------------------------------------------------- configs


def _split_list(value: str) -> list[str]:
    return [item.strip() for item in str(value).split(",") if item.strip()]


def load_config_file(name: str, arg: str | None = None) -> ml_collections.ConfigDict:
    """`get_config(arg)` of configs/<name>.py (the repo root goes on sys.path for files
    such as configs/ablation.py that import `configs.base`)."""
    path = CONFIG_DIR / f"{name}.py"
    if not path.exists():
        known = sorted(SCHEME_CONFIG_FILES) + sorted(p.stem for p in CONFIG_DIR.glob("*.py"))
        raise ValueError(f"unknown scheme {name!r}: no {path}; choose one of {known}")
    if str(CONFIG_DIR.parent) not in sys.path:
        sys.path.insert(0, str(CONFIG_DIR.parent))
    spec = importlib.util.spec_from_file_location(f"configs.{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def scheme_model_keys(scheme: str) -> dict[str, Any]:
    """The model keys a scheme's config file sets differently from configs/base.py."""
    base_model = load_config_file("base").model.to_dict()
    scheme_model = load_config_file(SCHEME_CONFIG_FILES.get(scheme, scheme)).model.to_dict()
    return {k: v for k, v in scheme_model.items() if k != "size" and base_model.get(k) != v}


def pretrain_steps(config: ml_collections.ConfigDict) -> int:
    """The shared budget in optimizer steps (budget_tokens wins when > 0)."""
    train = config.pretrain.train
    if config.budget_tokens > 0:
        return math.ceil(config.budget_tokens / (train.batch_size * train.seq_len))
    return int(train.steps)


def scheme_pretrain_config(config: ml_collections.ConfigDict, scheme: str) -> ml_collections.ConfigDict:
    """config.pretrain with the scheme's model keys and the shared step budget."""
    cfg = ml_collections.ConfigDict(config.pretrain.to_dict())
    for key, value in scheme_model_keys(scheme).items():
        cfg.model[key] = value
    cfg.train.steps = pretrain_steps(config)
    if cfg.model.get("max_position_embeddings") is None:
        # Size the learned table to the pretraining length, so "beyond the table"
        # is exactly "beyond what was trained" in the extrapolation evaluation.
        cfg.model.max_position_embeddings = cfg.train.seq_len
    return cfg


def scheme_glue_config(config: ml_collections.ConfigDict, pretrain_workdir: Path) -> ml_collections.ConfigDict:
    cfg = ml_collections.ConfigDict(config.glue.to_dict())
    cfg.init = str(pretrain_workdir)
    return cfg


def fingerprint(*parts: Any) -> str:
    """Stable hash of JSON-able parts: a stage reruns when its inputs change."""
    text = json.dumps([p.to_dict() if isinstance(p, ml_collections.ConfigDict) else p for p in parts],
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- state


class AblationState:
    """`DIR/ablation_state.json`: per scheme and stage, status, fingerprint, result."""

    def __init__(self, workdir: Path):
        self.path = workdir / STATE_FILE
        self.data: dict[str, dict[str, dict]] = (
            json.loads(self.path.read_text()) if self.path.exists() else {})

    def get(self, scheme: str, stage: str) -> dict:
        return self.data.get(scheme, {}).get(stage, {})

    def is_done(self, scheme: str, stage: str, fp: str) -> bool:
        record = self.get(scheme, stage)
        return record.get("status") == "done" and record.get("fingerprint") == fp

    def set(self, scheme: str, stage: str, record: dict) -> None:
        self.data.setdefault(scheme, {})[stage] = record
        if not _is_main_process():  # every process keeps the same state; one writes it
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2) + "\n")
        tmp.replace(self.path)


# --------------------------------------------------------------------------- stages


def _run_pretrain(cfg: ml_collections.ConfigDict, workdir: Path) -> dict:
    from roformer.train import train_and_evaluate

    summary = train_and_evaluate(cfg, workdir)
    if summary["preempted"]:
        raise Preempted(f"{workdir} preempted at step {summary['final_step']}")
    if summary["final_step"] < cfg.train.steps:
        raise RuntimeError(f"pretraining stopped at step {summary['final_step']} of {cfg.train.steps}")
    return {"steps": summary["final_step"]}


def _run_glue(cfg: ml_collections.ConfigDict, workdir: Path) -> dict:
    from roformer.glue import run_glue

    run_glue(cfg, str(workdir))
    return {}


def _run_extrapolation(config: ml_collections.ConfigDict, pretrain_cfg: ml_collections.ConfigDict,
                       pretrain_workdir: Path) -> dict:
    from roformer import extrapolation

    ext = config.extrapolation
    return extrapolation.evaluate_workdir(
        pretrain_workdir, pretrain_cfg.data, seq_len=pretrain_cfg.train.seq_len,
        factors=[int(f) for f in _split_list(ext.factors)], scalings=_split_list(ext.scalings),
        num_docs=ext.num_docs, batch_size=ext.batch_size, seed=pretrain_cfg.train.seed)


# Stage runners are looked up here at call time, so tests can swap in fast fakes.
STAGE_RUNNERS: dict[str, Callable] = {
    "pretrain": _run_pretrain, "extrapolation": _run_extrapolation, "glue": _run_glue,
}


def _is_main_process() -> bool:
    import jax

    return jax.process_index() == 0


def run_ablation(config: ml_collections.ConfigDict, workdir: str | Path) -> dict:
    """Run (or resume) the whole ablation in `workdir` and write the report; returns it."""
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    schemes = _split_list(config.schemes)
    if not schemes:
        raise ValueError("config.schemes is empty; list at least one scheme")
    if len(set(schemes)) != len(schemes):
        raise ValueError(f"config.schemes lists a scheme twice: {config.schemes!r}")
    state = AblationState(workdir)
    if _is_main_process():
        (workdir / "ablation_config.json").write_text(config.to_json_best_effort(indent=2) + "\n")

    for scheme in schemes:
        try:
            _run_scheme(config, workdir, state, scheme)
        except Preempted as error:
            log.warning("%s; stopping the ablation (re-run the command to resume)", error)
            break
        finally:  # the report so far: readable while the next scheme trains
            result = build_report(config, workdir, state)
            if _is_main_process():
                report.write_report(result, workdir)
    return result


def _run_scheme(config: ml_collections.ConfigDict, workdir: Path, state: AblationState, scheme: str) -> None:
    """Run the stages of one scheme that are not done yet; failures are recorded, not raised."""
    try:
        pretrain_cfg = scheme_pretrain_config(config, scheme)
    except Exception as error:  # noqa: BLE001 - a bad scheme is reported, the rest run
        _record_failure(state, workdir, scheme, "pretrain", "", error)
        return
    pretrain_dir = workdir / "pretrain" / scheme
    fps = {"pretrain": fingerprint(pretrain_cfg)}
    fps["extrapolation"] = fingerprint(fps["pretrain"], config.extrapolation)
    fps["glue"] = fingerprint(fps["pretrain"], config.glue)
    stage_calls = {
        "pretrain": lambda: STAGE_RUNNERS["pretrain"](pretrain_cfg, pretrain_dir),
        "extrapolation": lambda: STAGE_RUNNERS["extrapolation"](config, pretrain_cfg, pretrain_dir),
        "glue": lambda: STAGE_RUNNERS["glue"](scheme_glue_config(config, pretrain_dir), workdir / "glue" / scheme),
    }
    for stage in STAGES:
        if stage == "glue" and not _split_list(config.glue.task):
            continue
        if state.is_done(scheme, stage, fps[stage]):
            log.info("%s: %s already done, skipping", scheme, stage)
            continue
        log.info("%s: %s starting", scheme, stage)
        start = time.time()
        try:
            result = stage_calls[stage]()
        except Preempted:
            raise
        except Exception as error:  # noqa: BLE001 - recorded; the other stages and schemes still run
            _record_failure(state, workdir, scheme, stage, fps[stage], error)
            if stage == "pretrain":
                return  # evaluation and fine-tuning need the pretrained model
            continue
        state.set(scheme, stage, {"status": "done", "fingerprint": fps[stage],
                                  "wall_s": round(time.time() - start, 1), "result": result})
        if _is_main_process():
            (workdir / "errors" / f"{scheme}.{stage}.txt").unlink(missing_ok=True)  # an earlier failure


def _record_failure(state: AblationState, workdir: Path, scheme: str, stage: str, fp: str,
                    error: Exception) -> None:
    log.error("%s: %s failed: %s: %s", scheme, stage, type(error).__name__, error)
    if _is_main_process():
        errors = workdir / "errors"
        errors.mkdir(exist_ok=True)
        (errors / f"{scheme}.{stage}.txt").write_text(
            "".join(traceback.format_exception(type(error), error, error.__traceback__)))
    first_line = str(error).splitlines()[0] if str(error) else ""
    state.set(scheme, stage, {"status": "failed", "fingerprint": fp, "error": f"{type(error).__name__}: {first_line}"})


# --------------------------------------------------------------------------- report


def _machine() -> str:
    """One line saying what ran it; the load average matters on a shared machine."""
    from roformer.bench.common import machine_info

    m = machine_info()
    desc = f"{m['device_count']} x {m['device_kind']} ({m['platform']}), {m['cpu_count']} CPU cores"
    if hasattr(os, "getloadavg"):
        desc += ", load average {:.1f}".format(os.getloadavg()[1])  # 5-minute
    return desc


def build_report(config: ml_collections.ConfigDict, workdir: Path, state: AblationState) -> dict:
    """The report dict (ablation.json) from the state file and the run directories."""
    schemes = _split_list(config.schemes)
    pre = config.pretrain
    steps = pretrain_steps(config)
    seeds = config.glue.seeds
    setup = {
        "size": pre.model.size,
        "data": pre.data.files if pre.data.source == "files" else pre.data.source,
        "seq_len": pre.train.seq_len,
        "batch_size": pre.train.batch_size,
        "steps": steps,
        "tokens": steps * pre.train.batch_size * pre.train.seq_len,
        "glue": (f"{config.glue.task} (median of {seeds} seed{'s' if seeds > 1 else ''})"
                 if _split_list(config.glue.task) else "skipped"),
        "machine": _machine(),
    }
    rows = []
    for scheme in schemes:
        row: dict[str, Any] = {"scheme": scheme, "status": "pending",
                               "pretrain_workdir": f"pretrain/{scheme}", "glue_workdir": None}
        stages = [s for s in STAGES if s != "glue" or _split_list(config.glue.task)]
        records = {s: state.get(scheme, s) for s in stages}
        failed = [s for s in stages if records[s].get("status") == "failed"]
        if failed:
            row.update(status="failed", failed_stage=failed[0], error=records[failed[0]].get("error"))
        elif all(records[s].get("status") == "done" for s in stages):
            row["status"] = "done"
        row["wall_s"] = round(sum(r.get("wall_s", 0.0) for r in records.values()), 1)
        metrics = report.read_metrics(workdir / row["pretrain_workdir"] / "metrics.jsonl")
        row.update(report.pretrain_summary(metrics))
        ext = records["extrapolation"].get("result") or {}
        row["params"] = ext.get("params")
        row["extrapolation"] = ext.get("extrapolation")
        if records.get("glue", {}).get("status") == "done":
            row["glue_workdir"] = f"glue/{scheme}"
            results = workdir / row["glue_workdir"] / "glue_results.json"
            row["glue"] = report.glue_summary(json.loads(results.read_text())) if results.exists() else None
        rows.append(row)
    report.add_relative_step_time(rows)
    return {"setup": setup, "schemes": rows}


# --------------------------------------------------------------------------- CLI


def main(argv):
    from absl import flags
    from absl import logging as absl_logging

    if len(argv) > 1:
        raise ValueError(f"unexpected arguments: {argv[1:]}")
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax's per-save INFO lines drown the progress
    logging.getLogger("roformer").setLevel(logging.INFO)
    result = run_ablation(flags.FLAGS.config, flags.FLAGS.workdir)
    if _is_main_process():
        print((Path(flags.FLAGS.workdir) / report.REPORT_MD).read_text())
    if any(s["status"] == "failed" for s in result["schemes"]):
        sys.exit(1)


if __name__ == "__main__":
    # Flags are defined only when run as a program: the library function must stay
    # importable next to roformer.pretrain, which defines its own --config.
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "ablation config file (configs/ablation.py[:smoke])")
    flags.DEFINE_string("workdir", None, "directory for all runs and the report")
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(main)
