"""The ablation's record of its stages (`DIR/ablation_state.json`) and the one rule that
turns records into a status.

Per run and stage the file holds {"status": "done" | "failed", "fingerprint", "wall_s",
"result"} (done) or {"status", "fingerprint", "error"} (failed); a stage without a record
is pending. A run's status and a scheme's over its seeds both come from `combined_status`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence

from roformer.files import write_json_atomic

STATE_FILE = "ablation_state.json"
PINNED_TOKENIZER = "tokenizer.json"   # the vocabulary every run reads (roformer.ablation.runner pins it)


def is_main_process() -> bool:
    """Whether this process writes the ablation's files (every process keeps the same state)."""
    # jax only when asked: a run's process must take its cores before jax starts (ablation/job.py).
    import jax

    return jax.process_index() == 0


class AblationState:
    """`DIR/ablation_state.json`: per run and stage, status, fingerprint, result."""

    def __init__(self, workdir: Path, path: Path | None = None):
        self.path = path or workdir / STATE_FILE
        self.data: dict[str, dict[str, dict]] = (
            json.loads(self.path.read_text()) if self.path.exists() else {})

    def get(self, run: str, stage: str) -> dict:
        return self.data.get(run, {}).get(stage, {})

    def is_done(self, run: str, stage: str, fp: str) -> bool:
        record = self.get(run, stage)
        return record.get("status") == "done" and record.get("fingerprint") == fp

    def set(self, run: str, stage: str, record: dict) -> None:
        self.data.setdefault(run, {})[stage] = record
        if not is_main_process():  # every process keeps the same state; one writes it
            return
        write_json_atomic(self.path, self.data)


def combined_status(statuses: Sequence[str | None], partial: str = "pending") -> str:
    """The status of a whole from its parts' (a run from its stages, a scheme or an extension
    method from its seeds' runs): failed when any part failed, done when every part is,
    else `partial` (e.g. "pending", "2/3 seeds")."""
    if "failed" in statuses:
        return "failed"
    if all(s == "done" for s in statuses):
        return "done"
    return partial


def run_status(records: Mapping[str, Mapping], stages: Sequence[str]) -> dict:
    """A run's status from its stages' records, with the first failed stage and its error."""
    status = combined_status([records[s].get("status") for s in stages])
    if status != "failed":
        return {"status": status}
    failed = next(s for s in stages if records[s].get("status") == "failed")
    return {"status": "failed", "failed_stage": failed, "error": records[failed].get("error")}
