"""What kind of run a workdir holds: one workdir, one kind of run.

Pretraining, GLUE, the ablation, the study and the capability check each write files of the
same names into their workdir (config.json, metrics.jsonl, tensorboard/): a run of one kind
started on another's workdir would replace them, and a resumed pretraining would read GLUE's
loss rows as its own. So each driver `claim`s its workdir under the lock
(roformer.workdir_lock), before it writes anything, and a workdir that holds another kind of
run is refused in one line (`WorkdirOfAnotherKind`); the driver `record`s its kind in
`DIR/run_kind.json` with the first files it writes. A workdir written before that record
existed is recognised by the files its kind writes (`MARKERS`) and gets the record at its
next run. The workdir lock only keeps two runs from using one workdir at the same time; this
keeps them apart across time too.
"""
from __future__ import annotations

import json
from pathlib import Path

import jax

from roformer.files import write_json_atomic
from roformer.workdir_lock import WorkdirError

RECORD = "run_kind.json"
PRETRAINING, GLUE, ABLATION, STUDY, CAPABILITY = "pretraining", "GLUE", "ablation", "study", "capability"
KINDS = (PRETRAINING, GLUE, ABLATION, STUDY, CAPABILITY)

# The files and folders only one kind writes at the top of its workdir, for workdirs written
# before RECORD existed (the first that matches decides). config.json is shared by name, so
# pretraining's is told by the key only it writes.
MARKERS: dict[str, tuple[str, ...]] = {
    PRETRAINING: ("checkpoints/", "corrupt_checkpoints/"),
    GLUE: ("glue_results.json", "models/", "submission.zip"),
    ABLATION: ("ablation_config.json", "ablation_state.json"),
    STUDY: ("study_config.json", "schemes/"),
    CAPABILITY: ("capability.json", "capability.md"),
}


class WorkdirOfAnotherKind(WorkdirError):
    """The workdir holds another kind of run than the one started on it."""


def recorded_kind(workdir: str | Path) -> tuple[str | None, str]:
    """(kind of run `workdir` holds, how that is known); (None, "") for a workdir that holds
    none (new, empty, or only files no run of this project writes)."""
    workdir = Path(workdir)
    record = workdir / RECORD
    if record.is_file():
        try:
            kind = json.loads(record.read_text()).get("kind")
        except (OSError, ValueError, AttributeError):
            kind = None
        if kind in KINDS:
            return kind, f"recorded in {RECORD}"
    for kind, markers in MARKERS.items():
        for marker in markers:
            path = workdir / marker.rstrip("/")
            if path.is_dir() if marker.endswith("/") else path.is_file():
                return kind, f"it has {marker}"
    config = workdir / "config.json"
    if config.is_file():
        try:
            keys = json.loads(config.read_text())
        except (OSError, ValueError):
            keys = {}
        if isinstance(keys, dict) and "resolved_model" in keys:
            return PRETRAINING, "its config.json is a pretraining run's"
        if isinstance(keys, dict) and ("eval_only" in keys or {"init", "vocab"} <= set(keys)):
            return GLUE, "its config.json is a GLUE run's"
    return None, ""


def claim(workdir: str | Path, kind: str) -> None:
    """Refuse `workdir` for a run of `kind` when it holds another kind of run (one line, before
    the run writes anything); a workdir of the same kind or of none passes, and one of the same
    kind written before the record existed gets it now."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: one of {KINDS}")
    held, how = recorded_kind(workdir)
    if held is not None and held != kind:
        raise WorkdirOfAnotherKind(
            f"{workdir} holds a {held} run ({how}); a {kind} run there would replace its files "
            f"(config.json, metrics.jsonl, ...): give the {kind} run a workdir of its own")
    if held == kind and not how.startswith("recorded") and jax.process_index() == 0:
        record(workdir, kind)


def record(workdir: str | Path, kind: str) -> None:
    """Record that `workdir` holds a run of `kind` (once; call it with the run's first files)."""
    workdir = Path(workdir)
    held, how = recorded_kind(workdir)
    if held == kind and how.startswith("recorded"):
        return
    write_json_atomic(workdir / RECORD, {"kind": kind})
