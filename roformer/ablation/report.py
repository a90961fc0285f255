"""Turn the runs of a position-scheme ablation into its report: the files in the report
directory, written and read back.

Pure reading, statistics and drawing: nothing here trains or evaluates. The rows of the runs
(roformer.ablation.collect) are aggregated by roformer.ablation.summary (with the words of
roformer.ablation.findings), written as `ablation.json`, as markdown by
roformer.ablation.report_md (`ablation.md`) and drawn by roformer.ablation.figures
(`loss_curves.png`, `extrapolation.png`, `extension.png`, `attention.png` and `onset.png`).
The report notebook calls the same functions.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

from roformer.ablation.figures import (ATTENTION_PNG, EXTENSION_PNG, EXTRAPOLATION_PNG, LOSS_CURVES_PNG, ONSET_PNG,
                                       plot_attention, plot_extension, plot_extrapolation, plot_loss_curves,
                                       plot_onset)
from roformer.ablation.report_md import to_markdown
from roformer.errors import ConfigError
from roformer.files import write_json_atomic, write_text_atomic

REPORT_JSON = "ablation.json"
REPORT_MD = "ablation.md"


def write_report(result: Mapping, report_dir: str | Path) -> None:
    """Write ablation.json, ablation.md and the figures into report_dir."""
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(report_dir / REPORT_JSON, result)   # never a half-written report
    write_text_atomic(report_dir / REPORT_MD, to_markdown(result))
    plot_loss_curves(result, report_dir / LOSS_CURVES_PNG)
    plot_extrapolation(result, report_dir / EXTRAPOLATION_PNG)
    if (result.get("extension") or {}).get("methods"):
        plot_extension(result, report_dir / EXTENSION_PNG)
    if has_onsets(result):
        plot_onset(result, report_dir / ONSET_PNG)
    if has_attention_stats(result):
        plot_attention(result, report_dir / ATTENTION_PNG)


def has_onsets(result: dict) -> bool:
    """Whether any run started using word order (the onset figure has a curve to draw)."""
    return any(s["started"] for s in (result.get("onset") or {}).get("schemes", []))


def has_attention_stats(result: dict) -> bool:
    """Whether the runs recorded attention statistics over training (softmax attention)."""
    return any((s.get("curve") or {}).get("nearest_head_distance") for s in result["schemes"])


def load_report(report_dir: str | Path) -> dict:
    path = Path(report_dir) / REPORT_JSON
    if not path.exists():
        raise ConfigError(f"no {REPORT_JSON} in {report_dir}; run `python -m roformer.ablate` first")
    return json.loads(path.read_text())
