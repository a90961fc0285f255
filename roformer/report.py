"""Turn the runs of a position-scheme ablation into its report.

Pure reading, statistics and drawing: nothing here trains or evaluates. The inputs are
one row per (scheme, seed) run (final metrics, the held-out curve, length extrapolation,
GLUE) and one per context-extension run, which `roformer.ablate` collects; `summarize`
aggregates them over seeds (mean +/- sample std) and compares every scheme with the
reference scheme by paired differences over seeds (same seed = same data, masks and
shared initialisation), with a 95% t-interval. The outputs are `ablation.json`,
`ablation.md`, `loss_curves.png`, `extrapolation.png` and `extension.png`. The report
notebook calls the same functions.
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

from roformer.model import attention_stats

REPORT_JSON = "ablation.json"
REPORT_MD = "ablation.md"
LOSS_CURVES_PNG = "loss_curves.png"
EXTRAPOLATION_PNG = "extrapolation.png"
EXTENSION_PNG = "extension.png"
ATTENTION_PNG = "attention.png"

# Length-extrapolation variants: the plain model, and rotary with the length-extension
# scalings applied only at evaluation time.
EXTRAPOLATION_VARIANTS = {
    "plain": "",
    "linear": "+ position interpolation",
    "ntk": "+ NTK scaling",
    "yarn": "+ YaRN",
}
EXTENSION_LABELS = {"none": "plain extrapolation", "linear": "position interpolation", "ntk": "NTK scaling",
                    "yarn": "YaRN", "base": "larger base"}
# Final metrics aggregated over seeds; the first three are compared with the reference.
RUN_METRICS = ("eval_loss", "eval_mlm_accuracy", "eval_order_gap", "train_loss", "tokens_per_sec")
COMPARED = ("eval_loss", "eval_mlm_accuracy", "eval_order_gap")
# Per-evaluation curves aggregated over seeds (the last two from roformer.model.attention_stats).
CURVES = ("eval_loss", "eval_order_gap", "nearest_head_distance", "last_hidden_cosine")


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# --------------------------------------------------------------------------- one run


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


def eval_curve(rows: Iterable[Mapping], tokens_per_step: int) -> list[dict]:
    """The held-out evaluations of a run, one per step (the last row of a step wins):
    step, tokens seen, loss, accuracy and the word-order gap (shuffled - plain loss)."""
    by_step: dict[int, dict] = {}
    for row in rows:
        if isinstance(row.get("step"), int) and _finite(row.get("eval_loss")):
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
        "eval_shuffled_loss": _last(rows, "eval_shuffled_loss"),
        "eval_order_gap": _last(rows, "eval_order_gap"),
        "tokens_per_sec": statistics.median(throughput) if throughput else None,
    }


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


# --------------------------------------------------------------------------- statistics


def t_critical(df: int) -> float:
    """Two-sided 95% critical value of Student's t with `df` degrees of freedom."""
    from scipy import stats

    return float(stats.t.ppf(0.975, df))


def mean_std(values: Iterable[float | None]) -> dict | None:
    """Mean and sample standard deviation of the finite values (std None for one value)."""
    vals = [float(v) for v in values if _finite(v)]
    if not vals:
        return None
    return {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else None,
            "n": len(vals)}


def paired_difference(values: Mapping[int, float | None], reference: Mapping[int, float | None]) -> dict | None:
    """Mean of value - reference over the seeds both have, with its 95% t-interval (paired:
    each seed shares data order, masks and initialisation). `exceeds` is True when the
    interval excludes 0, i.e. the difference is larger than the seed-to-seed spread."""
    diffs = [float(values[s]) - float(reference[s]) for s in sorted(values)
             if s in reference and _finite(values[s]) and _finite(reference[s])]
    if not diffs:
        return None
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return {"diff": mean, "lo": None, "hi": None, "n": 1, "exceeds": None}
    half = t_critical(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return {"diff": mean, "lo": mean - half, "hi": mean + half, "n": len(diffs),
            "exceeds": bool(mean - half > 0 or mean + half < 0)}


def _curve_stats(curves: list[list[dict]], key: str) -> list[dict]:
    """Per evaluation step present in every curve: tokens and mean/std of `key` over curves."""
    if not curves:
        return []
    common = set.intersection(*({p["step"] for p in c if _finite(p.get(key))} for c in curves))
    out = []
    for step in sorted(common):
        points = [next(p for p in c if p["step"] == step) for c in curves]
        out.append({"step": step, "tokens": points[0]["tokens"], **mean_std(p[key] for p in points)})
    return out


def _interpolate_tokens(curve: list[dict], target: float) -> float | None:
    """Tokens at which a falling loss curve first reaches `target` (linear between evaluations)."""
    previous = None
    for point in curve:
        if point["eval_loss"] <= target:
            if previous is None:
                return float(point["tokens"])
            t0, l0 = previous["tokens"], previous["eval_loss"]
            return t0 + (point["tokens"] - t0) * (l0 - target) / (l0 - point["eval_loss"])
        previous = point
    return None


# --------------------------------------------------------------------------- aggregation


def summarize(setup: Mapping, runs: list[dict], extension: list[dict], *, reference: str,
              baseline: str = "", order_threshold: float = 0.1) -> dict:
    """The report dict: setup, the per-run rows, one aggregated row per scheme, the
    context-extension summary, the convergence comparison of `reference` with `baseline`
    (None without one) and the findings in words."""
    schemes: list[str] = []
    for r in runs:
        if r["scheme"] not in schemes:
            schemes.append(r["scheme"])
    ref_runs = {r["seed"]: r for r in runs if r["scheme"] == reference and r["status"] == "done"}
    rows = [_scheme_row(s, [r for r in runs if r["scheme"] == s], ref_runs, reference, order_threshold)
            for s in schemes]
    _add_relative_step_time(rows)
    result = {"setup": dict(setup), "reference": reference, "order_threshold": order_threshold,
              "schemes": rows, "runs": runs,
              "extension": summarize_extension(extension),
              "convergence": convergence(runs, reference, baseline)}
    result["findings"] = findings(result)
    return result


def _scheme_row(scheme: str, runs: list[dict], ref_runs: Mapping[int, dict], reference: str,
                order_threshold: float) -> dict:
    done = [r for r in runs if r["status"] == "done"]
    failed = [r for r in runs if r["status"] == "failed"]
    if failed:
        status = "failed"
    elif len(done) == len(runs):
        status = "done"
    else:
        status = f"{len(done)}/{len(runs)} seeds"
    row: dict[str, Any] = {
        "scheme": scheme, "status": status, "seeds": [r["seed"] for r in done],
        "params": next((r["params"] for r in done if r.get("params")), None),
        "errors": [f"seed {r['seed']} {r.get('failed_stage', '?')}: {r.get('error', '')}" for r in failed],
    }
    for key in RUN_METRICS:
        row[key] = mean_std(r.get(key) for r in done)
    row["vs_reference"] = {} if scheme == reference else {
        key: paired_difference({r["seed"]: r.get(key) for r in done},
                               {s: r.get(key) for s, r in ref_runs.items()}) for key in COMPARED}
    curves = [r.get("curve") or [] for r in done]
    row["curve"] = {key: _curve_stats(curves, key) for key in CURVES}
    onset = next((p for p in row["curve"]["eval_order_gap"] if p["mean"] >= order_threshold), None)
    row["order_onset_tokens"] = None if onset is None else onset["tokens"]
    row["extrapolation"] = _extrapolation_stats([r.get("extrapolation") for r in done])
    row["glue"] = _glue_stats([r.get("glue") for r in done])
    return row


def _extrapolation_stats(results: list[Mapping | None]) -> dict | None:
    results = [r for r in results if r and r.get("lengths")]
    if not results:
        return None
    lengths = results[0]["lengths"]
    loss = {}
    for variant in results[0]["loss"]:
        columns = [[r["loss"].get(variant, [None] * len(lengths))[i] for r in results] for i in range(len(lengths))]
        loss[variant] = [mean_std(c) for c in columns]
    return {"lengths": lengths, "loss": loss}


def _glue_stats(results: list[Mapping | None]) -> dict | None:
    results = [r for r in results if r]
    if not results:
        return None
    keys = list(dict.fromkeys(k for r in results for k in r.get("tasks", {})))
    scores = list(dict.fromkeys(k for r in results for k in r.get("scores", {})))
    return {"tasks": {k: mean_std(r["tasks"].get(k) for r in results) for k in keys},
            "scores": {k: mean_std(r["scores"].get(k) for r in results) for k in scores},
            "complete": {k: all(r.get("complete", {}).get(k, True) for r in results) for k in scores}}


def _add_relative_step_time(rows: list[dict]) -> None:
    """`step_time_rel`: mean step time / the fastest scheme's (same tokens per step)."""
    speeds = [r["tokens_per_sec"]["mean"] for r in rows if r.get("tokens_per_sec")]
    fastest = max(speeds) if speeds else None
    for r in rows:
        tps = r["tokens_per_sec"]["mean"] if r.get("tokens_per_sec") else None
        r["step_time_rel"] = fastest / tps if fastest and tps else None


def summarize_extension(runs: list[dict]) -> dict:
    """Per method: held-out loss at the extended length at every evaluated extension step
    (mean/std over seeds), and the final loss compared with plain extrapolation."""
    methods: list[str] = []
    for r in runs:
        if r["method"] not in methods:
            methods.append(r["method"])
    done = [r for r in runs if r["status"] == "done" and r.get("loss")]
    rows = []
    plain = {r["seed"]: r["loss"][-1] for r in done if r["method"] == "none"}
    for method in methods:
        mine = [r for r in done if r["method"] == method]
        steps = mine[0]["steps"] if mine else []
        row = {"method": method, "label": EXTENSION_LABELS.get(method, method), "seeds": [r["seed"] for r in mine],
               "status": "done" if mine and len(mine) == len([r for r in runs if r["method"] == method])
               else ("failed" if any(r["status"] == "failed" for r in runs if r["method"] == method)
                     else f"{len(mine)}/{len([r for r in runs if r['method'] == method])} seeds"),
               "steps": steps,
               "loss": [mean_std(r["loss"][i] for r in mine if len(r["loss"]) > i) for i in range(len(steps))],
               "vs_plain": None if method == "none" else paired_difference(
                   {r["seed"]: r["loss"][-1] for r in mine}, plain)}
        rows.append(row)
    length = next((r.get("length") for r in done), None)
    return {"length": length, "methods": rows, "runs": runs}


def convergence(runs: list[dict], reference: str, baseline: str) -> dict | None:
    """RoFormer's Fig. 3 claim (rope's MLM loss falls faster than BERT's learned absolute
    positions) on these curves: the paired difference baseline - reference at every
    evaluation, and the share of the budget the reference needs to reach the baseline's
    final held-out loss (per seed)."""
    ref = {r["seed"]: r for r in runs if r["scheme"] == reference and r["status"] == "done"}
    base = {r["seed"]: r for r in runs if r["scheme"] == baseline and r["status"] == "done"}
    seeds = sorted(set(ref) & set(base))
    if not seeds:
        return None
    steps = sorted(set.intersection(*({p["step"] for p in ref[s]["curve"]} & {p["step"] for p in base[s]["curve"]}
                                      for s in seeds)))
    at_step = []
    for step in steps:
        def loss(run):
            return next(p for p in run["curve"] if p["step"] == step)["eval_loss"]
        diff = paired_difference({s: loss(base[s]) for s in seeds}, {s: loss(ref[s]) for s in seeds})
        tokens = next(p for p in ref[seeds[0]]["curve"] if p["step"] == step)["tokens"]
        at_step.append({"step": step, "tokens": tokens, **diff})
    shares = []
    for s in seeds:
        final = base[s]["curve"][-1]
        reached = _interpolate_tokens(ref[s]["curve"], final["eval_loss"])
        shares.append(None if reached is None else reached / final["tokens"])
    return {"reference": reference, "baseline": baseline, "seeds": seeds, "at_step": at_step,
            "budget_share_to_baseline_final": mean_std(shares),
            "budget_share_values": shares}


# --------------------------------------------------------------------------- words


def _pm(stats: Mapping | None, digits: int = 3, scale: float = 1.0) -> str:
    if not stats:
        return "n/a"
    text = f"{scale * stats['mean']:.{digits}f}"
    return text + (f" ± {scale * stats['std']:.{digits}f}" if stats.get("std") is not None else "")


def _diff(d: Mapping | None, digits: int = 3, scale: float = 1.0) -> str:
    if not d:
        return "n/a"
    text = f"{scale * d['diff']:+.{digits}f}"
    if d.get("lo") is None:
        return text + " (one seed)"
    return text + f" [{scale * d['lo']:+.{digits}f}, {scale * d['hi']:+.{digits}f}]" + ("" if d["exceeds"] else " ~")


def _tokens(n: float | None) -> str:
    return "never" if n is None else f"{n / 1e6:.2f}M"


def findings(result: Mapping) -> list[str]:
    """The comparison in sentences: which differences exceed the seed spread, word-order
    use, convergence, extrapolation and context extension."""
    reference = result["reference"]
    rows = {r["scheme"]: r for r in result["schemes"]}
    ref = rows.get(reference)
    out = []
    if ref and ref.get("eval_loss"):
        better, worse, same, single = [], [], [], []
        n = ref["eval_loss"]["n"]
        for name, row in rows.items():
            d = (row.get("vs_reference") or {}).get("eval_loss")
            if name == reference or not d:
                continue
            # A scheme with fewer finished seeds than the reference is paired over fewer.
            seeds = "" if d["n"] == n else f", {d['n']} common seeds"
            if d.get("exceeds") is None:      # one common seed: no interval to judge by
                single.append(f"{name} ({_diff(d)})")
            elif d["exceeds"]:
                (worse if d["diff"] > 0 else better).append(f"{name} ({_diff(d)} nats{seeds})")
            else:
                same.append(f"{name} ({_diff(d)}{seeds})")
        if n < 2:
            out.append(f"Only one seed finished for {reference}: differences have no interval yet.")
        if worse:
            out.append(f"Held-out MLM loss higher than {reference} by more than the seed spread "
                       f"(95% interval of the paired difference excludes 0): {', '.join(worse)}.")
        if better:
            out.append(f"Held-out MLM loss lower than {reference} beyond the seed spread: {', '.join(better)}.")
        if same:
            out.append(f"Not distinguishable from {reference} at {n} seeds (interval includes 0): {', '.join(same)}.")
        if single:
            out.append(f"One seed in common with {reference} so far, no interval yet: {', '.join(single)}.")
    threshold = result.get("order_threshold", 0.1)
    uses, never = [], []
    for name, row in rows.items():
        gap = row.get("eval_order_gap")
        if not gap:
            continue
        if row.get("order_onset_tokens") is None:
            never.append(f"{name} (final gap {_pm(gap)} nats)")
        else:
            uses.append(f"{name} from {_tokens(row['order_onset_tokens'])} tokens (final gap {_pm(gap, 2)})")
    if uses:
        out.append(f"Word order (shuffling each document's tokens raises the held-out loss by >= {threshold} "
                   f"nats, mean over seeds): {'; '.join(uses)}.")
    if never:
        out.append(f"Ignore word order through the whole budget (gap < {threshold} nats at every evaluation): "
                   f"{'; '.join(never)}.")
    conv = result.get("convergence")
    if conv and conv["at_step"]:
        separated = [p for p in conv["at_step"] if p.get("exceeds") and p["diff"] > 0]
        first = separated[0]["tokens"] if separated else None
        stays = bool(separated) and all(p.get("exceeds") and p["diff"] > 0
                                        for p in conv["at_step"] if p["tokens"] >= first)
        share = conv.get("budget_share_to_baseline_final")
        text = (f"Convergence (RoFormer Fig. 3): {conv['reference']}'s held-out loss is below "
                f"{conv['baseline']}'s beyond the seed spread ")
        if first is None:
            text = (f"Convergence (RoFormer Fig. 3): at no evaluation is {conv['baseline']}'s held-out loss above "
                    f"{conv['reference']}'s beyond the seed spread, so the claim does not reproduce here")
        elif stays:
            text += f"at every evaluation from {_tokens(first)} tokens on, so the claim reproduces at this scale"
        else:
            text += f"at some evaluations only (first at {_tokens(first)} tokens), so the claim holds only in part"
        if share:
            text += (f"; {conv['reference']} reaches {conv['baseline']}'s final loss after "
                     f"{_pm(share, 2, 100)}% of the budget")
        out.append(text + ".")
    ext_rows = [(name, row["extrapolation"]) for name, row in rows.items() if row.get("extrapolation")]
    if ext_rows:
        lengths = ext_rows[0][1]["lengths"]
        last = len(lengths) - 1
        at_longest = {name: e["loss"]["plain"][last] for name, e in ext_rows if e["loss"]["plain"][last]}
        if at_longest and len(lengths) > 1:
            ranked = sorted(at_longest, key=lambda n: at_longest[n]["mean"])
            out.append(f"At {lengths[-1]} tokens ({lengths[-1] // lengths[0]}x the training length, no scaling) the "
                       "held-out loss ranks " + " < ".join(f"{n} {_pm(at_longest[n], 2)}" for n in ranked) + ".")
    ext = result.get("extension") or {}
    methods = [m for m in ext.get("methods", []) if m["loss"]]
    if methods:
        final = sorted(methods, key=lambda m: m["loss"][-1]["mean"])
        words = "; ".join(f"{m['label']} {_pm(m['loss'][0], 2)} -> {_pm(m['loss'][-1], 2)}"
                          + (f" (vs plain {_diff(m['vs_plain'], 2)})" if m.get("vs_plain") else "") for m in final)
        out.append(f"Context extension to {ext['length']} tokens, held-out loss there before -> after "
                   f"{final[0]['steps'][-1]} steps: {words}.")
    return out


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
        metrics += [k for k in glue.get("tasks", {}) if k not in metrics]
        scores += [k for k in glue.get("scores", {}) if k not in scores]
    return metrics, scores


def extrapolation_rows(schemes: list[Mapping]) -> tuple[list[int], list[tuple[str, list[dict | None]]]]:
    """Eval lengths and one (label, per-length stats) row per scheme and scaling variant."""
    lengths: list[int] = []
    rows: list[tuple[str, list[dict | None]]] = []
    for s in schemes:
        ext = s.get("extrapolation") or {}
        if not ext.get("lengths"):
            continue
        lengths = lengths or list(ext["lengths"])
        for variant, suffix in EXTRAPOLATION_VARIANTS.items():
            if variant in ext["loss"]:
                rows.append((f"{s['scheme']} {suffix}".strip(), ext["loss"][variant]))
    return lengths, rows


def to_markdown(result: Mapping) -> str:
    """The ablation report as markdown: setup, findings, and one table per question."""
    schemes = result["schemes"]
    reference = result.get("reference", "rope")
    setup = result.get("setup", {})
    lines = ["# Position-scheme ablation", ""]
    if setup:
        lines += [", ".join(f"{k}: {_fmt(v) if not isinstance(v, float) else f'{v:.3f}'}" for k, v in setup.items()),
                  ""]
    if result.get("findings"):
        lines += ["## Findings", ""] + [f"- {f}" for f in result["findings"]] + [""]

    lines += [f"## Pretraining (mean ± std over seeds; Δ = paired difference to {reference} "
              "with its 95% interval, ~ = interval includes 0)", ""]
    header = ["scheme", "status", "params", "tokens/s", "step time (rel)", "held-out loss", "held-out acc %",
              "order gap (nats)", "uses order from", f"Δ loss vs {reference}", "Δ acc (points)",
              "Δ order gap"]
    body = []
    for s in schemes:
        vs = s.get("vs_reference") or {}
        body.append([
            s["scheme"], s.get("status", "pending"), _fmt_params(s.get("params")),
            "n/a" if not s.get("tokens_per_sec") else f"{s['tokens_per_sec']['mean']:,.0f}",
            _fmt(s.get("step_time_rel"), 2), _pm(s.get("eval_loss")), _pm(s.get("eval_mlm_accuracy"), 1, 100),
            _pm(s.get("eval_order_gap")), _tokens(s.get("order_onset_tokens")) if s.get("eval_order_gap") else "n/a",
            "—" if s["scheme"] == reference else _diff(vs.get("eval_loss")),
            "—" if s["scheme"] == reference else _diff(vs.get("eval_mlm_accuracy"), 1, 100),
            "—" if s["scheme"] == reference else _diff(vs.get("eval_order_gap")),
        ])
    lines.append(_table(header, body))
    attention_rows = [[s["scheme"], _pm((s.get("curve") or {}).get("nearest_head_distance", [None])[-1], 2),
                       _pm((s.get("curve") or {}).get("last_hidden_cosine", [None])[-1], 3)]
                      for s in schemes if (s.get("curve") or {}).get("nearest_head_distance")]
    if attention_rows:
        lines += ["", "Attention at the last evaluation (roformer/model/attention_stats.py; over training in "
                  f"{ATTENTION_PNG}): the mean distance (tokens) the most local head looks, and the mean cosine "
                  "similarity of two positions' hidden states at the encoder's output (near 1: collapsed).", "",
                  _table(["scheme", "nearest head's distance", "hidden-state cosine"], attention_rows)]
    if result.get("position_signal"):
        lines += ["", "Position signal at initialisation (roformer/model/position_signal.py): RMS of the position "
                  "embeddings / RMS of the token embeddings they are added to (absolute schemes), and RMS of "
                  "the change the scheme makes to layer 0's attention logits / RMS of those logits without it.",
                  "", _table(["scheme", "input: position / token", "layer-0 logits: change / content"],
                             [[scheme, _fmt(r.get("input"), 2), _fmt(r.get("logits"), 2)]
                              for scheme, r in result["position_signal"].items()])]
    unigram = setup.get("unigram_loss")
    if unigram:
        lines += ["", f"Unigram loss of the vocabulary (a model that ignores context): {unigram:.3f} nats."]

    lengths, ext_rows = extrapolation_rows(schemes)
    if ext_rows:
        lines += ["", f"## Length extrapolation: held-out MLM loss by evaluation length (pretrained at "
                  f"{lengths[0]} tokens; n/a: beyond a learned position table)", ""]
        ext_header = ["scheme"] + [f"{n} ({n // lengths[0]}x)" for n in lengths]
        lines.append(_table(ext_header, [[label] + [_pm(v) for v in stats] for label, stats in ext_rows]))

    ext = result.get("extension") or {}
    methods = ext.get("methods") or []
    if methods and any(m["steps"] for m in methods):
        steps = max((m["steps"] for m in methods), key=len)
        lines += ["", f"## Context extension: held-out loss at {ext.get('length')} tokens vs extension steps "
                  f"({setup.get('extension', '')})", ""]
        header = ["method", "status"] + [f"step {s}" for s in steps] + ["Δ final vs plain"]
        body = [[m["label"], m["status"]] + [_pm(v) for v in m["loss"]] + [""] * (len(steps) - len(m["loss"]))
                + [_diff(m.get("vs_plain")) if m["method"] != "none" else "—"] for m in methods]
        lines.append(_table(header, body))

    conv = result.get("convergence")
    if conv and conv["at_step"]:
        lines += ["", f"## Convergence: {conv['baseline']} - {conv['reference']} held-out loss (paired over seeds "
                  f"{conv['seeds']})", ""]
        lines.append(_table(["tokens"] + [_tokens(p["tokens"]) for p in conv["at_step"]],
                            [["Δ loss"] + [_diff(p, 3) for p in conv["at_step"]]]))

    glue_metrics, glue_scores = glue_columns(schemes)
    if glue_metrics:
        lines += ["", "## GLUE dev (x100; median over fine-tuning seeds, then mean ± std over pretraining seeds)", ""]
        body = []
        for s in schemes:
            glue = s.get("glue") or {}
            body.append([s["scheme"]] + [_pm(glue.get("tasks", {}).get(k), 1) for k in glue_metrics]
                        + [_pm(glue.get("scores", {}).get(k), 1)
                           + ("" if glue.get("complete", {}).get(k, True) else "*") for k in glue_scores])
        lines.append(_table(["scheme"] + glue_metrics + glue_scores, body))
        if any(not all((s.get("glue") or {}).get("complete", {}).values()) for s in schemes if s.get("glue")):
            lines += ["", "\\* GLUE score over the tasks run only (not a full GLUE score)."]

    failed = [s for s in schemes if s.get("errors")] + [m for m in methods if m["status"] == "failed"]
    if failed:
        lines += ["", "Failed:"]
        for s in schemes:
            lines += [f"- {s['scheme']} {e}" for e in s.get("errors", [])]
        for r in ext.get("runs", []):
            if r["status"] == "failed":
                lines.append(f"- extension {r['method']} seed {r['seed']} {r.get('failed_stage', '?')}: "
                             f"{r.get('error', '')}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- plots


def _band(ax, points: list[dict], x_key: str, label: str, scale: float = 1e-6, **style):
    xs = [p[x_key] * scale for p in points]
    means = [p["mean"] for p in points]
    line = ax.plot(xs, means, label=label, **style)[0]
    if any(p.get("std") is not None for p in points):
        stds = [p.get("std") or 0.0 for p in points]
        ax.fill_between(xs, [m - s for m, s in zip(means, stds)], [m + s for m, s in zip(means, stds)],
                        color=line.get_color(), alpha=0.2, lw=0)


def _curve_panels(result: Mapping, panels: list[tuple[str, str, str]]):
    """A figure with one panel per (curve key, title, y label): that curve vs tokens, mean ±
    std over seeds, one band per scheme; returns (figure, axes)."""
    fig = Figure(figsize=(11, 4))
    axes = fig.subplots(1, len(panels))
    for ax, (key, title, ylabel) in zip(axes, panels):
        for s in result["schemes"]:
            points = (s.get("curve") or {}).get(key)
            if points:
                _band(ax, points, "tokens", s["scheme"], marker="o", ms=2)
        ax.set(title=title, xlabel="tokens (M)", ylabel=ylabel)
    return fig, axes


def _finish(fig, axes, out_path):
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    if out_path is not None:
        fig.savefig(out_path, dpi=120)
    return fig


def plot_loss_curves(result: Mapping, out_path: str | Path | None = None):
    """Held-out MLM loss and word-order gap vs tokens, mean ± std over seeds per scheme."""
    fig, (ax_loss, ax_gap) = _curve_panels(result, [
        ("eval_loss", "held-out MLM loss", "loss (nats)"),
        ("eval_order_gap", "word-order probe: shuffled - plain held-out loss", "nats")])
    unigram = result.get("setup", {}).get("unigram_loss")
    if unigram and ax_loss.lines:
        ax_loss.axhline(unigram, color="grey", lw=0.8, ls=":", label="unigram")
    return _finish(fig, (ax_loss, ax_gap), out_path)


def plot_extrapolation(result: Mapping, out_path: str | Path | None = None):
    """Held-out MLM loss vs evaluation length (mean ± std), and the final word-order gap."""
    fig = Figure(figsize=(11, 4))
    ax, ax_gap = fig.subplots(1, 2)
    lengths, rows = extrapolation_rows(result["schemes"])
    for label, stats in rows:
        pts = [{"length": n, **v} for n, v in zip(lengths, stats) if v]
        if pts:
            _band(ax, pts, "length", label, scale=1.0, marker="o", ls="--" if "+" in label else "-")
    if lengths:
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.axvline(lengths[0], color="grey", lw=0.8, ls=":")
    ax.set(title="length extrapolation", xlabel="evaluation sequence length", ylabel="held-out MLM loss")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)
    names = [s["scheme"] for s in result["schemes"] if s.get("eval_order_gap")]
    gaps = [s["eval_order_gap"] for s in result["schemes"] if s.get("eval_order_gap")]
    ax_gap.bar(range(len(names)), [g["mean"] for g in gaps], yerr=[g.get("std") or 0.0 for g in gaps], capsize=3)
    ax_gap.set_xticks(range(len(names)), names, rotation=20)
    ax_gap.set(title="word-order probe at the end (mean ± std)", ylabel="shuffled - plain loss (nats)")
    ax_gap.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    if out_path is not None:
        fig.savefig(out_path, dpi=120)
    return fig


def plot_extension(result: Mapping, out_path: str | Path | None = None):
    """Held-out loss at the extended length vs extension steps, per method (mean ± std)."""
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    ext = result.get("extension") or {}
    for m in ext.get("methods", []):
        pts = [{"step": s, **v} for s, v in zip(m["steps"], m["loss"]) if v]
        if pts:
            _band(ax, pts, "step", m["label"], scale=1.0, marker="o", ms=3)
    ax.set(title=f"context extension: held-out loss at {ext.get('length')} tokens", xlabel="extension step",
           ylabel="held-out MLM loss")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    if out_path is not None:
        fig.savefig(out_path, dpi=120)
    return fig


def plot_attention(result: Mapping, out_path: str | Path | None = None):
    """Over training, mean ± std over seeds per scheme: the mean distance the most local head
    looks, and the hidden states' cosine similarity across positions (roformer.model.attention_stats)."""
    fig, axes = _curve_panels(result, [
        ("nearest_head_distance", "most local head: mean attention distance", "tokens"),
        ("last_hidden_cosine", "hidden states: cosine similarity across positions", "cosine")])
    return _finish(fig, axes, out_path)


def write_report(result: Mapping, report_dir: str | Path) -> None:
    """Write ablation.json, ablation.md and the figures into report_dir."""
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    tmp = report_dir / (REPORT_JSON + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(report_dir / REPORT_JSON)  # never a half-written report
    (report_dir / REPORT_MD).write_text(to_markdown(result))
    plot_loss_curves(result, report_dir / LOSS_CURVES_PNG)
    plot_extrapolation(result, report_dir / EXTRAPOLATION_PNG)
    if (result.get("extension") or {}).get("methods"):
        plot_extension(result, report_dir / EXTENSION_PNG)
    if any((s.get("curve") or {}).get("nearest_head_distance") for s in result["schemes"]):
        plot_attention(result, report_dir / ATTENTION_PNG)


def load_report(report_dir: str | Path) -> dict:
    path = Path(report_dir) / REPORT_JSON
    if not path.exists():
        raise ValueError(f"no {REPORT_JSON} in {report_dir}; run `python -m roformer.ablate` first")
    return json.loads(path.read_text())
