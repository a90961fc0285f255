"""Turn per-scheme run directories into the ablation report.

Pure reading and drawing: nothing here trains or evaluates. The inputs are
ordinary pretrain workdirs (their `metrics.jsonl`), the GLUE summaries and the
length-extrapolation results that `roformer.ablate` collects into one report
dict; the outputs are `ablation.json`, `ablation.md`, `loss_curves.png` and
`extrapolation.png`. The report notebook calls the same functions.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Iterable, Mapping

# Figures are built without pyplot, so writing them needs no GUI backend and
# leaves a notebook's backend alone.
from matplotlib.figure import Figure
from roformer.train.metrics import read_metrics

REPORT_JSON = "ablation.json"
REPORT_MD = "ablation.md"
LOSS_CURVES_PNG = "loss_curves.png"
EXTRAPOLATION_PNG = "extrapolation.png"

# Length-extrapolation variants: the plain model, and rotary with the two
# length-extension scalings applied only at evaluation time.
EXTRAPOLATION_VARIANTS = {
    "plain": "",
    "linear": "+ position interpolation",
    "ntk": "+ NTK scaling",
}


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


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
        if _finite(row.get("loss")):
            train[step] = float(row["loss"])
        if _finite(row.get("eval_loss")):
            heldout[step] = float(row["eval_loss"])
    return {"train": sorted(train.items()), "eval": sorted(heldout.items())}


def _last(rows: list[Mapping], key: str) -> float | None:
    for row in reversed(rows):
        if _finite(row.get(key)):
            return float(row[key])
    return None


def pretrain_summary(rows: list[Mapping]) -> dict[str, float | int | None]:
    """Final losses/accuracies and median throughput of one pretraining run.

    The first logged throughput includes compilation, so it is left out of
    the median whenever there is more than one row.
    """
    throughput = [float(r["tokens_per_sec"]) for r in rows if _finite(r.get("tokens_per_sec"))]
    if len(throughput) > 1:
        throughput = throughput[1:]
    steps = [r["step"] for r in rows if isinstance(r.get("step"), int)]
    return {
        "steps": max(steps) if steps else None,
        "train_loss": _last(rows, "loss"),
        "train_mlm_accuracy": _last(rows, "mlm_accuracy"),
        "eval_loss": _last(rows, "eval_loss"),
        "eval_mlm_accuracy": _last(rows, "eval_mlm_accuracy"),
        "tokens_per_sec": statistics.median(throughput) if throughput else None,
    }


def add_relative_step_time(schemes: list[dict]) -> None:
    """Set `step_time_rel` = step time / the fastest scheme's step time.

    Every scheme trains on the same number of tokens per step, so the ratio of
    throughputs is the ratio of step times.
    """
    speeds = [s["tokens_per_sec"] for s in schemes if _finite(s.get("tokens_per_sec"))]
    fastest = max(speeds) if speeds else None
    for s in schemes:
        tps = s.get("tokens_per_sec")
        s["step_time_rel"] = fastest / tps if fastest and _finite(tps) and tps > 0 else None


def glue_summary(results: Mapping) -> dict:
    """Per-task median metrics and GLUE scores (x100) from a `glue_results.json` dict.

    Task columns are "<task> <metric>" (plus the split when a task reports several,
    e.g. MNLI matched/mismatched); a score over only some tasks is kept with
    `complete: false` so the table can mark it partial.
    """
    from roformer.glue.tasks import TASKS

    tasks: dict[str, float] = {}
    for name, task_result in results.get("tasks", {}).items():
        display = TASKS[name].display if name in TASKS else name
        medians = task_result.get("median", {})
        for split, metrics in medians.items():
            prefix = display if len(medians) == 1 else f"{display} {split}"
            for metric, value in metrics.items():
                tasks[f"{prefix} {metric}"] = None if value is None else 100.0 * float(value)
    scores = {key: s.get("score") for key, s in results.get("glue", {}).items()}
    complete = {key: bool(s.get("complete")) for key, s in results.get("glue", {}).items()}
    return {"tasks": tasks, "scores": scores, "complete": complete}


# --------------------------------------------------------------------------- markdown


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, str):
        return x
    if isinstance(x, int) and not isinstance(x, bool):
        return f"{x:,}"
    if _finite(x):
        return f"{x:.{digits}f}"
    return "n/a"


def _fmt_params(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 1e6:.2f}M"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def glue_columns(schemes: list[Mapping]) -> tuple[list[str], list[str]]:
    """(task metric keys, score keys) present in any scheme's GLUE results, in a stable order."""
    metrics: list[str] = []
    scores: list[str] = []
    for s in schemes:
        glue = s.get("glue") or {}
        for key in glue.get("tasks", {}):
            if key not in metrics:
                metrics.append(key)
        for key in glue.get("scores", {}):
            if key not in scores:
                scores.append(key)
    return metrics, scores


def extrapolation_rows(schemes: list[Mapping]) -> tuple[list[int], list[tuple[str, list[float | None]]]]:
    """Eval lengths and one (label, losses) row per scheme and scaling variant."""
    lengths: list[int] = []
    rows: list[tuple[str, list[float | None]]] = []
    for s in schemes:
        ext = s.get("extrapolation") or {}
        if not ext.get("lengths"):
            continue
        lengths = lengths or list(ext["lengths"])
        for variant, suffix in EXTRAPOLATION_VARIANTS.items():
            losses = ext.get("loss", {}).get(variant)
            if losses is not None:
                rows.append((f"{s['scheme']} {suffix}".strip(), list(losses)))
    return lengths, rows


def winners(schemes: list[Mapping]) -> dict[str, str]:
    """Which scheme is best on each headline number (lower loss, higher GLUE score)."""
    done = [s for s in schemes if s.get("status") == "done"]
    best: dict[str, str] = {}

    def pick(label, value_of, lower_is_better):
        digits = 3 if lower_is_better else 1   # as the tables print them
        scored = {s["scheme"]: round(value_of(s), digits) for s in done if _finite(value_of(s))}
        if len(scored) < 2:
            return
        value = (min if lower_is_better else max)(scored.values())
        leaders = [scheme for scheme, v in scored.items() if v == value]
        if len(leaders) == len(scored):
            best[label] = f"all tied ({value:.{digits}f})"
        else:
            best[label] = f"{' = '.join(leaders)} ({value:.{digits}f})"

    pick("held-out MLM loss", lambda s: s.get("eval_loss"), True)
    for key in glue_columns(schemes)[1]:
        pick(key, lambda s: (s.get("glue") or {}).get("scores", {}).get(key), False)
    lengths, _ = extrapolation_rows(schemes)
    if len(lengths) > 1:
        longest = len(lengths) - 1

        def loss_at_longest(s):
            losses = (s.get("extrapolation") or {}).get("loss", {}).get("plain") or []
            return losses[longest] if len(losses) > longest else None

        pick(f"MLM loss at {lengths[-1]} tokens (no scaling)", loss_at_longest, True)
    return best


def to_markdown(report: Mapping) -> str:
    """The ablation report as markdown: setup line, main table, extrapolation table."""
    schemes = report["schemes"]
    setup = report.get("setup", {})
    lines = ["# Position-scheme ablation", ""]
    if setup:
        lines.append(", ".join(f"{k}: {v}" for k, v in setup.items()))
        lines.append("")

    glue_metrics, glue_scores = glue_columns(schemes)
    header = ["scheme", "status", "params", "tokens/s", "step time (rel)",
              "train loss", "held-out loss", "held-out acc"]
    header += glue_metrics + glue_scores
    body = []
    for s in schemes:
        glue = s.get("glue") or {}
        row = [
            s["scheme"],
            s.get("status", "pending"),
            _fmt_params(s.get("params")),
            _fmt(None if s.get("tokens_per_sec") is None else round(s["tokens_per_sec"])),
            _fmt(s.get("step_time_rel"), 2),
            _fmt(s.get("train_loss")),
            _fmt(s.get("eval_loss")),
            _fmt(s.get("eval_mlm_accuracy")),
        ]
        row += [_fmt(glue.get("tasks", {}).get(k), 1) for k in glue_metrics]
        row += [_fmt(glue.get("scores", {}).get(k), 1)
                + ("" if glue.get("complete", {}).get(k, True) else "*") for k in glue_scores]
        body.append(row)
    lines.append(_table(header, body))
    if any(not all(s.get("glue", {}).get("complete", {}).values()) for s in schemes if s.get("glue")):
        lines += ["", "\\* GLUE score over the tasks run only (not a full GLUE score)."]

    lengths, ext_rows = extrapolation_rows(schemes)
    if ext_rows:
        lines += ["", "Held-out MLM loss by evaluation length (pretrained at "
                  f"{lengths[0]} tokens; n/a: beyond a learned position table):", ""]
        ext_header = ["scheme"] + [f"{n} ({n // lengths[0]}x)" for n in lengths]
        lines.append(_table(ext_header, [[label] + [_fmt(v) for v in losses] for label, losses in ext_rows]))

    best = winners(schemes)
    if best:
        lines += ["", "Best: " + "; ".join(f"{label}: {who}" for label, who in best.items()) + "."]

    failed = [s for s in schemes if s.get("status") == "failed"]
    if failed:
        lines += ["", "Failed:"]
        lines += [f"- {s['scheme']} ({s.get('failed_stage', '?')}): {s.get('error', '')}" for s in failed]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- plots


def plot_loss_curves(curves: Mapping[str, Mapping[str, list]], out_path: str | Path | None = None):
    """Train and held-out MLM loss vs step, one line per scheme. Returns the figure."""
    fig = Figure(figsize=(11, 4))
    ax_train, ax_eval = fig.subplots(1, 2)  # own y-axes: held-out differences are small
    for scheme, c in curves.items():
        if c.get("train"):
            ax_train.plot(*zip(*c["train"]), label=scheme, lw=1.2)
        if c.get("eval"):
            ax_eval.plot(*zip(*c["eval"]), marker="o", ms=3, label=scheme)
    ax_train.set(title="MLM train loss", xlabel="step", ylabel="loss")
    ax_eval.set(title="MLM held-out loss", xlabel="step", ylabel="loss")
    for ax in (ax_train, ax_eval):
        ax.grid(alpha=0.3)
    if ax_eval.lines or ax_train.lines:
        (ax_eval if ax_eval.lines else ax_train).legend()
    fig.tight_layout()
    if out_path is not None:
        fig.savefig(out_path, dpi=120)
    return fig


def plot_extrapolation(schemes: list[Mapping], out_path: str | Path | None = None):
    """Held-out MLM loss vs evaluation length, one line per scheme/variant. Returns the figure."""
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    lengths, rows = extrapolation_rows(schemes)
    for label, losses in rows:
        pts = [(n, v) for n, v in zip(lengths, losses) if v is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label, ls="--" if "+" in label else "-")
    if lengths:
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.axvline(lengths[0], color="grey", lw=0.8, ls=":")
    ax.set(title="Length extrapolation", xlabel="evaluation sequence length",
           ylabel="held-out MLM loss")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    if out_path is not None:
        fig.savefig(out_path, dpi=120)
    return fig


def collect_curves(report: Mapping, report_dir: str | Path) -> dict[str, dict]:
    """Loss curves of every scheme, read from its pretrain workdir's metrics.jsonl."""
    report_dir = Path(report_dir)
    curves = {}
    for s in report["schemes"]:
        workdir = s.get("pretrain_workdir")
        if workdir:
            curves[s["scheme"]] = loss_curves(read_metrics(report_dir / workdir / "metrics.jsonl"))
    return curves


def write_report(report: Mapping, report_dir: str | Path) -> None:
    """Write ablation.json, ablation.md, loss_curves.png and extrapolation.png into report_dir."""
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    tmp = report_dir / (REPORT_JSON + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(report_dir / REPORT_JSON)  # never a half-written report
    (report_dir / REPORT_MD).write_text(to_markdown(report))
    plot_loss_curves(collect_curves(report, report_dir), report_dir / LOSS_CURVES_PNG)
    plot_extrapolation(report["schemes"], report_dir / EXTRAPOLATION_PNG)


def load_report(report_dir: str | Path) -> dict:
    path = Path(report_dir) / REPORT_JSON
    if not path.exists():
        raise ValueError(f"no {REPORT_JSON} in {report_dir}; run `python -m roformer.ablate` first")
    return json.loads(path.read_text())
