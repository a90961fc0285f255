"""The statistics of a position-scheme ablation's report: the runs aggregated over seeds.

The inputs are one row per (scheme, seed) run (final metrics, the held-out curve, length
extrapolation, GLUE) and one per context-extension run, which roformer.ablation.collect
reads; `summarize` aggregates them over seeds (mean +/- sample std) and compares every
scheme with the reference scheme by paired differences over seeds (same seed = same data,
masks and shared initialisation), with a 95% t-interval, and adds the convergence
comparison, the onset of word-order use (roformer.ablation.onset) and the findings
(roformer.ablation.findings). `extrapolation_rows` and `glue_columns` read the result the
way the markdown and the figures show it.
"""
from __future__ import annotations

from typing import Any, Mapping

from roformer.ablation import onset
from roformer.ablation.findings import findings
from roformer.ablation.state import combined_status
from roformer.ablation.stats import finite, mean_std, paired_difference

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
    # When the scheme starts using order: per run (its first evaluation at the threshold), then
    # the Kaplan-Meier median over its runs, with how many started; the mean gap crossing the
    # threshold can be one seed's jump.
    onsets = onset.scheme_onsets(done, order_threshold)
    started = onsets[0] if onsets else {"median_onset": None, "started": 0, "observed": 0, "onsets": []}
    row["order_onset_tokens"] = started["median_onset"]
    row["order_onset_runs"] = {"started": started["started"], "observed": started["observed"],
                               "first": started["onsets"][0] if started["onsets"] else None}
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
        def loss(run, step=step):
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


# --------------------------------------------------------------------------- the result as rows


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
