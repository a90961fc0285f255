"""Turn the runs of a position-scheme ablation into its report.

Pure reading, statistics and drawing: nothing here trains or evaluates. The inputs are
one row per (scheme, seed) run (final metrics, the held-out curve, length extrapolation,
GLUE) and one per context-extension run, which roformer.ablation.collect reads; `summarize`
aggregates them over seeds (mean +/- sample std) and compares every scheme with the
reference scheme by paired differences over seeds (same seed = same data, masks and
shared initialisation), with a 95% t-interval. The outputs are `ablation.json`,
`ablation.md`, `loss_curves.png`, `extrapolation.png`, `extension.png`, `attention.png` and
`onset.png` (roformer.ablation.onset: when each seed starts to use word order). The report
notebook calls the same functions.
"""
from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Mapping

# Figures are built without pyplot, so writing them needs no GUI backend and
# leaves a notebook's backend alone.
from matplotlib.figure import Figure

from roformer.ablation import onset
from roformer.ablation.state import combined_status
from roformer.ablation.stats import finite, mean_std, paired_difference
from roformer.errors import ConfigError
from roformer.files import write_bytes_atomic, write_json_atomic, write_text_atomic

REPORT_JSON = "ablation.json"
REPORT_MD = "ablation.md"
LOSS_CURVES_PNG = "loss_curves.png"
EXTRAPOLATION_PNG = "extrapolation.png"
EXTENSION_PNG = "extension.png"
ATTENTION_PNG = "attention.png"
ONSET_PNG = "onset.png"

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


# --------------------------------------------------------------------------- curves


def _curve_stats(curves: list[list[dict]], key: str) -> list[dict]:
    """Per evaluation step present in every curve: tokens and mean/std of `key` over curves."""
    if not curves:
        return []
    common = set.intersection(*({p["step"] for p in c if finite(p.get(key))} for c in curves))
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
              "convergence": convergence(runs, reference, baseline),
              "onset": onset.summarize_onset(runs, reference=reference, threshold=order_threshold)}
    result["findings"] = findings(result)
    return result


def short_of_unigram(result: Mapping) -> bool:
    """Whether no scheme's held-out loss is below the unigram loss (a smoke run): such models
    have not learned from context yet, and their differences say nothing about the schemes,
    so the markdown report states no findings (ablation.json keeps them)."""
    unigram = result.get("setup", {}).get("unigram_loss")
    losses = [s["eval_loss"]["mean"] for s in result["schemes"] if s.get("eval_loss")]
    return bool(unigram and losses and min(losses) >= unigram)


def _scheme_row(scheme: str, runs: list[dict], ref_runs: Mapping[int, dict], reference: str,
                order_threshold: float) -> dict:
    done = [r for r in runs if r["status"] == "done"]
    failed = [r for r in runs if r["status"] == "failed"]
    row: dict[str, Any] = {
        "scheme": scheme, "status": combined_status([r["status"] for r in runs], f"{len(done)}/{len(runs)} seeds"),
        "seeds": [r["seed"] for r in done],
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
        # A run counts as done once its losses are in (a done run without them is still pending).
        statuses = [r["status"] if r["status"] != "done" or r in mine else "pending"
                    for r in runs if r["method"] == method]
        steps = mine[0]["steps"] if mine else []
        row = {"method": method, "label": EXTENSION_LABELS.get(method, method), "seeds": [r["seed"] for r in mine],
               "status": combined_status(statuses, f"{len(mine)}/{len(statuses)} seeds"),
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
    rows = {r["scheme"]: r for r in result["schemes"]}
    out = _reference_findings(rows, result["reference"])
    out += _word_order_findings(rows, result.get("order_threshold", 0.1))
    out += _gap_trend_findings((result.get("onset") or {}).get("gap_trend") or [], result["reference"])
    conv = result.get("convergence")
    if conv and conv["at_step"]:
        out.append(_convergence_finding(conv))
    out += _extrapolation_findings(rows)
    out += _extension_findings(result.get("extension") or {})
    return out


def _reference_findings(rows: Mapping[str, Mapping], reference: str) -> list[str]:
    """Which schemes' held-out loss differs from the reference's beyond the seed spread."""
    ref = rows.get(reference)
    if not (ref and ref.get("eval_loss")):
        return []
    out = []
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
        out.append(f"Not distinguishable from {reference} (interval includes 0; paired over {n} seeds unless "
                   f"noted): {', '.join(same)}.")
    if single:
        out.append(f"One seed in common with {reference} so far, no interval yet: {', '.join(single)}.")
    return out


def _word_order_findings(rows: Mapping[str, Mapping], threshold: float) -> list[str]:
    """Which schemes use word order (and from when), and which never do."""
    out = []
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
    return out


def _gap_trend_findings(trends: list[Mapping], reference: str) -> list[str]:
    """Whether the budget decided the comparison: which schemes' gap to the reference is still
    closing at its end (roformer.ablation.onset.gap_trend)."""
    judged = [t for t in trends if t["trend"]]
    if not judged:
        return []
    window = f"{_mtokens(judged[0]['from_tokens'])}-{_mtokens(judged[0]['to_tokens'])} tokens"
    parts = []
    for trend in ("closing", "parallel", "widening", "unclear"):
        names = []
        for t in (t for t in judged if t["trend"] == trend):
            text = f"{t['scheme']} ({_diff(t['slope'])}"
            if t["closes_in_tokens"] is not None:
                text += f"; a straight line reaches 0 after {_mtokens(t['closes_in_tokens'])} more tokens"
            names.append(text + ")")
        if names:
            parts.append(f"{trend}: {', '.join(names)}")
    return [f"Gap to {reference} at the end of the budget (slope of the paired loss difference over "
            f"{window}, nats per {onset.TREND_TOKENS / 1e6:.0f}M tokens, 95% interval over seeds): "
            + "; ".join(parts) + f". A closing gap means the budget has not decided that comparison; parallel: "
            f"the interval lies within +-{onset.PARALLEL_SLOPE:g}; unclear: it includes 0 but is wider than that."]


def _convergence_finding(conv: Mapping) -> str:
    """Whether the reference's loss stays below the baseline's (RoFormer's Fig. 3 claim)."""
    separated = [p for p in conv["at_step"] if p.get("exceeds") and p["diff"] > 0]
    first = separated[0]["tokens"] if separated else None
    stays = bool(separated) and all(p.get("exceeds") and p["diff"] > 0
                                    for p in conv["at_step"] if p["tokens"] >= first)
    share = conv.get("budget_share_to_baseline_final")
    text = (f"Convergence (RoFormer Fig. 3): {conv['reference']}'s held-out loss is below "
            f"{conv['baseline']}'s beyond the seed spread ")
    if len(conv["seeds"]) < 2:   # no interval from one pair, so nothing is "beyond the spread"
        last = conv["at_step"][-1]
        text = (f"Convergence (RoFormer Fig. 3): one seed in common, no interval yet; {conv['baseline']} - "
                f"{conv['reference']} held-out loss is {last['diff']:+.3f} at {_tokens(last['tokens'])} tokens")
    elif first is None:
        text = (f"Convergence (RoFormer Fig. 3): at no evaluation is {conv['baseline']}'s held-out loss above "
                f"{conv['reference']}'s beyond the seed spread, so the claim does not reproduce here")
    elif stays:
        text += f"at every evaluation from {_tokens(first)} tokens on, so the claim reproduces at this scale"
    else:
        text += f"at some evaluations only (first at {_tokens(first)} tokens), so the claim holds only in part"
    if share:
        text += (f"; {conv['reference']} reaches {conv['baseline']}'s final loss after "
                 f"{_pm(share, 2, 100)}% of the budget")
    return text + "."


def _extrapolation_findings(rows: Mapping[str, Mapping]) -> list[str]:
    """The schemes ranked by held-out loss at the longest evaluated length."""
    ext_rows = [(name, row["extrapolation"]) for name, row in rows.items() if row.get("extrapolation")]
    if not ext_rows:
        return []
    lengths = ext_rows[0][1]["lengths"]
    last = len(lengths) - 1
    at_longest = {name: e["loss"]["plain"][last] for name, e in ext_rows if e["loss"]["plain"][last]}
    if not (at_longest and len(lengths) > 1):
        return []
    ranked = sorted(at_longest, key=lambda n: at_longest[n]["mean"])
    return [f"At {lengths[-1]} tokens ({lengths[-1] // lengths[0]}x the training length, no scaling) the "
            "held-out loss ranks " + " < ".join(f"{n} {_pm(at_longest[n], 2)}" for n in ranked) + "."]


def _extension_findings(ext: Mapping) -> list[str]:
    """The context-extension methods ranked by their final loss at the extended length."""
    methods = [m for m in ext.get("methods", []) if m["loss"]]
    if not methods:
        return []
    final = sorted(methods, key=lambda m: m["loss"][-1]["mean"])
    words = "; ".join(f"{m['label']} {_pm(m['loss'][0], 2)} -> {_pm(m['loss'][-1], 2)}"
                      + (f" (vs plain {_diff(m['vs_plain'], 2)})" if m.get("vs_plain") else "") for m in final)
    return [f"Context extension to {ext['length']} tokens, held-out loss there before -> after "
            f"{final[0]['steps'][-1]} steps: {words}."]


# --------------------------------------------------------------------------- markdown


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, str):
        return x
    if isinstance(x, int) and not isinstance(x, bool):
        return f"{x:,}"
    if finite(x):
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
    if short_of_unigram(result):
        lines += [f"> **No findings: a pipeline check.** No scheme's held-out loss is below the unigram loss "
                  f"({setup['unigram_loss']:.3f} nats): the models have not learned from context yet, so the "
                  "tables show that every stage ran, not which scheme is better.", ""]
    elif result.get("findings"):
        lines += ["## Findings", ""] + [f"- {f}" for f in result["findings"]] + [""]
    lines += _pretraining_md(schemes, reference)
    lines += _attention_md(schemes)
    lines += _position_signal_md(result.get("position_signal"))
    unigram = setup.get("unigram_loss")
    if unigram:
        lines += ["", f"Unigram loss of the vocabulary (a model that ignores context): {unigram:.3f} nats."]
    lines += _extrapolation_md(schemes)
    ext = result.get("extension") or {}
    lines += _extension_md(ext, setup)
    lines += _onset_md(result.get("onset"))
    lines += _convergence_md(result.get("convergence"))
    lines += _glue_md(schemes)
    lines += _failed_md(schemes, ext)
    return "\n".join(lines) + "\n"


def _pretraining_md(schemes: list[Mapping], reference: str) -> list[str]:
    """The main table: throughput, final held-out metrics and their differences to the reference."""
    lines = [f"## Pretraining (mean ± std over seeds; Δ = paired difference to {reference} "
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
    return lines + [_table(header, body)]


def _attention_md(schemes: list[Mapping]) -> list[str]:
    attention_rows = [[s["scheme"], _pm((s.get("curve") or {}).get("nearest_head_distance", [None])[-1], 2),
                       _pm((s.get("curve") or {}).get("last_hidden_cosine", [None])[-1], 3)]
                      for s in schemes if (s.get("curve") or {}).get("nearest_head_distance")]
    if not attention_rows:
        return []
    return ["", "Attention at the last evaluation (roformer/model/attention_stats.py; over training in "
            f"{ATTENTION_PNG}): the mean distance (tokens) the most local head looks, and the mean cosine "
            "similarity of two positions' hidden states at the encoder's output (near 1: collapsed).", "",
            _table(["scheme", "nearest head's distance", "hidden-state cosine"], attention_rows)]


def _position_signal_md(position_signal: Mapping | None) -> list[str]:
    if not position_signal:
        return []
    return ["", "Position signal at initialisation (roformer/model/position_signal.py): RMS of the position "
            "embeddings / RMS of the token embeddings they are added to (absolute schemes), and RMS of "
            "the change the scheme makes to layer 0's attention logits / RMS of those logits without it.",
            "", _table(["scheme", "input: position / token", "layer-0 logits: change / content"],
                       [[scheme, _fmt(r.get("input"), 2), _fmt(r.get("logits"), 2)]
                        for scheme, r in position_signal.items()])]


def _extrapolation_md(schemes: list[Mapping]) -> list[str]:
    lengths, ext_rows = extrapolation_rows(schemes)
    if not ext_rows:
        return []
    ext_header = ["scheme"] + [f"{n} ({n // lengths[0]}x)" for n in lengths]
    return ["", f"## Length extrapolation: held-out MLM loss by evaluation length (pretrained at "
            f"{lengths[0]} tokens; n/a: beyond a learned position table)", "",
            _table(ext_header, [[label] + [_pm(v) for v in stats] for label, stats in ext_rows])]


def _extension_md(ext: Mapping, setup: Mapping) -> list[str]:
    methods = ext.get("methods") or []
    if not (methods and any(m["steps"] for m in methods)):
        return []
    steps = max((m["steps"] for m in methods), key=len)
    header = ["method", "status"] + [f"step {s}" for s in steps] + ["Δ final vs plain"]
    body = [[m["label"], m["status"]] + [_pm(v) for v in m["loss"]] + [""] * (len(steps) - len(m["loss"]))
            + [_diff(m.get("vs_plain")) if m["method"] != "none" else "—"] for m in methods]
    return ["", f"## Context extension: held-out loss at {ext.get('length')} tokens vs extension steps "
            f"({setup.get('extension', '')})", "", _table(header, body)]


def _mtokens(n: float | None) -> str:
    if n is None:
        return "—"
    # thousands below 0.05M, so a short run's columns do not all read 0.0M
    return f"{n / 1e6:.1f}M" if n >= 5e4 else f"{n / 1e3:.0f}k" if n >= 1e3 else f"{n:.0f}"


def _onset_md(onset_result: Mapping | None) -> list[str]:
    """When each scheme's seeds start to use word order (roformer.ablation.onset), and the
    held-out loss at matched tokens with differences to the reference."""
    if not onset_result or not onset_result.get("schemes"):
        return []
    header = ["scheme", "seeds started / observed", "median onset", "onsets (tokens)", "not started by",
              "fell back", f"held-out loss spikes (>= {onset.SPIKE_NATS:g} nats above the best so far)"]
    body = []
    for s in onset_result["schemes"]:
        spikes = ", ".join(f"seed {x['seed']} at {_mtokens(x['tokens'])} (+{x['rise']:.2f}"
                           f"{', recovered' if x['recovered'] else ', not recovered'})" for x in s.get("loss_spikes", []))
        body.append([s["scheme"], f"{s['started']} / {s['observed']}", _mtokens(s["median_onset"]),
                     ", ".join(_mtokens(t) for t in s["onsets"]) or "—",
                     ", ".join(_mtokens(t) for t in s["censored"]) or "—",
                     ", ".join(f"seed {x}" for x in s["fell_back"]) or "—", spikes or "—"])
    lines = ["", "## Onset of word-order use (per seed)", "",
             f"A run uses word order from its first evaluation with an order gap >= {onset_result['threshold']:g} "
             "nats. `fraction started` is the Kaplan-Meier estimate (runs not started yet are censored at their "
             "last evaluation).", "", _table(header, body)]
    rows = onset_result["loss_at_matched_tokens"]
    if rows and rows[0]["cells"]:
        lines += ["", f"Held-out MLM loss at matched tokens (mean over seeds; in brackets the paired difference "
                  f"to {onset_result['reference']} with its 95% interval):", "",
                  _table(["scheme"] + [_mtokens(c["tokens"]) for c in rows[0]["cells"]],
                         [[row["scheme"]] + [_matched_cell(c) for c in row["cells"]] for row in rows])]
    trends = onset_result.get("gap_trend") or []
    if trends:
        t0 = trends[0]
        lines += ["", f"Is the gap to {onset_result['reference']} still closing? The slope of each seed's loss "
                  f"difference to {onset_result['reference']} over the last evaluations "
                  f"({_mtokens(t0['from_tokens'])}-{_mtokens(t0['to_tokens'])} tokens), in nats per "
                  f"{onset.TREND_TOKENS / 1e6:.0f}M tokens, mean over seeds with its 95% interval; the straight "
                  "line to 0 extends the mean gap at the mean slope (an extrapolation, not a forecast):", "",
                  _table(["scheme", "seeds", "gap at the end", "slope", "trend", "straight line to 0"],
                         [[t["scheme"], str(len(t["seeds"])), f"{t['gap']:+.3f}", _diff(t["slope"]),
                           t["trend"] or "—",
                           f"{_mtokens(t['closes_in_tokens'])} more tokens" if t["closes_in_tokens"] else "—"]
                          for t in trends])]
    return lines


def _matched_cell(cell: Mapping) -> str:
    text = "—" if cell["mean"] is None else f"{cell['mean']:.3f}"
    d = cell["vs_reference"]
    if d is not None and d["lo"] is not None:
        text += f" ({d['diff']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}])"
    elif d is not None:
        text += f" ({d['diff']:+.3f}, n=1)"
    return text


CONVERGENCE_COLUMNS = 12   # evaluations shown in the convergence table (all of them are in the JSON)


def _convergence_points(points: list[Mapping], columns: int = CONVERGENCE_COLUMNS) -> list[Mapping]:
    """At most `columns` evaluations, evenly spaced from the first to the last, plus the first
    whose difference exceeds the seed spread (where the finding's words point)."""
    if len(points) <= columns:
        return list(points)
    chosen = {round(i * (len(points) - 1) / (columns - 1)) for i in range(columns)}
    chosen |= {next((i for i, p in enumerate(points) if p.get("exceeds")), 0)}
    return [points[i] for i in sorted(chosen)]


def _convergence_md(conv: Mapping | None) -> list[str]:
    if not (conv and conv["at_step"]):
        return []
    shown = _convergence_points(conv["at_step"])
    thinned = "" if len(shown) == len(conv["at_step"]) else (
        f"; {len(shown)} of {len(conv['at_step'])} evaluations, all of them in ablation.json")
    return ["", f"## Convergence: {conv['baseline']} - {conv['reference']} held-out loss (paired over seeds "
            f"{conv['seeds']}{thinned})", "",
            _table(["tokens"] + [_tokens(p["tokens"]) for p in shown], [["Δ loss"] + [_diff(p, 3) for p in shown]])]


def _glue_md(schemes: list[Mapping]) -> list[str]:
    glue_metrics, glue_scores = glue_columns(schemes)
    if not glue_metrics:
        return []
    body = []
    for s in schemes:
        glue = s.get("glue") or {}
        body.append([s["scheme"]] + [_pm(glue.get("tasks", {}).get(k), 1) for k in glue_metrics]
                    + [_pm(glue.get("scores", {}).get(k), 1)
                       + ("" if glue.get("complete", {}).get(k, True) else "*") for k in glue_scores])
    lines = ["", "## GLUE dev (x100; median over fine-tuning seeds, then mean ± std over pretraining seeds)", "",
             _table(["scheme"] + glue_metrics + glue_scores, body)]
    if any(not all((s.get("glue") or {}).get("complete", {}).values()) for s in schemes if s.get("glue")):
        lines += ["", "\\* GLUE score over the tasks run only (not a full GLUE score)."]
    return lines


def _failed_md(schemes: list[Mapping], ext: Mapping) -> list[str]:
    methods = ext.get("methods") or []
    failed = [s for s in schemes if s.get("errors")] + [m for m in methods if m["status"] == "failed"]
    if not failed:
        return []
    lines = ["", "Failed:"]
    for s in schemes:
        lines += [f"- {s['scheme']} {e}" for e in s.get("errors", [])]
    for r in ext.get("runs", []):
        if r["status"] == "failed":
            lines.append(f"- extension {r['method']} seed {r['seed']} {r.get('failed_stage', '?')}: "
                         f"{r.get('error', '')}")
    return lines


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
        _save(fig, out_path)
    return fig


def _save(fig, out_path: str | Path) -> None:
    """The figure at `out_path` (its suffix names the format), replaced atomically: a reader
    never sees half an image."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format=Path(out_path).suffix.lstrip(".") or "png", dpi=120)
    write_bytes_atomic(out_path, buffer.getvalue())


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
        _save(fig, out_path)
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
    return _finish(fig, (ax,), out_path)


def plot_attention(result: Mapping, out_path: str | Path | None = None):
    """Over training, mean ± std over seeds per scheme: the mean distance the most local head
    looks, and the hidden states' cosine similarity across positions (roformer.model.attention_stats)."""
    fig, axes = _curve_panels(result, [
        ("nearest_head_distance", "most local head: mean attention distance", "tokens"),
        ("last_hidden_cosine", "hidden states: cosine similarity across positions", "cosine")])
    return _finish(fig, axes, out_path)


def plot_onset(result: Mapping, out_path: str | Path | None = None):
    """Step curves of the estimated fraction of each scheme's seeds using word order against
    tokens (roformer.ablation.onset)."""
    onset_result = result["onset"]
    fig = Figure(figsize=(6.5, 4))
    ax = fig.subplots()
    for s in onset_result["schemes"]:
        xs, ys = [0.0], [0.0]
        for p in s["fraction_started"]:
            xs += [p["tokens"], p["tokens"]]
            ys += [ys[-1], p["fraction"]]
        xs.append(max([r["last_tokens"] for r in s["runs"]] + [xs[-1]]))
        ys.append(ys[-1])
        ax.plot([x / 1e6 for x in xs], ys, label=f"{s['scheme']} ({s['started']}/{s['observed']})")
    ax.set(xlabel="tokens (M)", ylabel="fraction of seeds using word order", ylim=(-0.03, 1.03),
           title=f"onset of word-order use (order gap >= {onset_result['threshold']:g} nats)")
    return _finish(fig, (ax,), out_path)


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
    if any(s["started"] for s in (result.get("onset") or {}).get("schemes", [])):
        plot_onset(result, report_dir / ONSET_PNG)
    if any((s.get("curve") or {}).get("nearest_head_distance") for s in result["schemes"]):
        plot_attention(result, report_dir / ATTENTION_PNG)


def load_report(report_dir: str | Path) -> dict:
    path = Path(report_dir) / REPORT_JSON
    if not path.exists():
        raise ConfigError(f"no {REPORT_JSON} in {report_dir}; run `python -m roformer.ablate` first")
    return json.loads(path.read_text())
