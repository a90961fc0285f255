"""The ablation report as markdown (ablation.md): setup, findings, and one table per
question, from the dict roformer.ablation.summary builds.
"""
from __future__ import annotations

from typing import Mapping

from roformer.ablation import onset
from roformer.ablation.figures import ATTENTION_PNG
from roformer.ablation.formats import diff, fmt, fmt_params, mtokens, pm, table, tokens
from roformer.ablation.summary import extrapolation_rows, glue_columns, short_of_unigram


def to_markdown(result: Mapping) -> str:
    """The ablation report as markdown: setup, findings, and one table per question."""
    schemes = result["schemes"]
    reference = result.get("reference", "rope")
    setup = result.get("setup", {})
    lines = ["# Position-scheme ablation", ""]
    if setup:
        lines += [", ".join(f"{k}: {fmt(v) if not isinstance(v, float) else f'{v:.3f}'}" for k, v in setup.items()),
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


def _onset_cell(row: Mapping) -> str:
    """The median onset over seeds and how many started ("none (0/3)" when none did)."""
    if not row.get("eval_order_gap"):
        return "n/a"
    runs = row.get("order_onset_runs")
    counts = f" ({runs['started']}/{runs['observed']})" if runs else ""
    return (tokens(row["order_onset_tokens"]) if row.get("order_onset_tokens") is not None else "none") + counts


def _pretraining_md(schemes: list[Mapping], reference: str) -> list[str]:
    """The main table: throughput, final held-out metrics and their differences to the reference."""
    lines = [f"## Pretraining (mean ± std over seeds; Δ = paired difference to {reference} "
             "with its 95% interval, ~ = interval includes 0)", ""]
    header = ["scheme", "status", "params", "tokens/s", "step time (rel)", "held-out loss", "held-out acc %",
              "order gap (nats)", "median onset (seeds started)", f"Δ loss vs {reference}", "Δ acc (points)",
              "Δ order gap"]
    body = []
    for s in schemes:
        vs = s.get("vs_reference") or {}
        body.append([
            s["scheme"], s.get("status", "pending"), fmt_params(s.get("params")),
            "n/a" if not s.get("tokens_per_sec") else f"{s['tokens_per_sec']['mean']:,.0f}",
            fmt(s.get("step_time_rel"), 2), pm(s.get("eval_loss")), pm(s.get("eval_mlm_accuracy"), 1, 100),
            pm(s.get("eval_order_gap")), _onset_cell(s),
            "—" if s["scheme"] == reference else diff(vs.get("eval_loss")),
            "—" if s["scheme"] == reference else diff(vs.get("eval_mlm_accuracy"), 1, 100),
            "—" if s["scheme"] == reference else diff(vs.get("eval_order_gap")),
        ])
    return lines + [table(header, body)]


def _attention_md(schemes: list[Mapping]) -> list[str]:
    attention_rows = [[s["scheme"], pm((s.get("curve") or {}).get("nearest_head_distance", [None])[-1], 2),
                       pm((s.get("curve") or {}).get("last_hidden_cosine", [None])[-1], 3)]
                      for s in schemes if (s.get("curve") or {}).get("nearest_head_distance")]
    if not attention_rows:
        return []
    return ["", "Attention at the last evaluation (roformer/model/attention_stats.py; over training in "
            f"{ATTENTION_PNG}): the mean distance (tokens) the most local head looks, and the mean cosine "
            "similarity of two positions' hidden states at the encoder's output (near 1: collapsed).", "",
            table(["scheme", "nearest head's distance", "hidden-state cosine"], attention_rows)]


def _position_signal_md(position_signal: Mapping | None) -> list[str]:
    if not position_signal:
        return []
    return ["", "Position signal at initialisation (roformer/model/position_signal.py): RMS of the position "
            "embeddings / RMS of the token embeddings they are added to (absolute schemes), and RMS of "
            "the change the scheme makes to layer 0's attention logits / RMS of those logits without it.",
            "", table(["scheme", "input: position / token", "layer-0 logits: change / content"],
                       [[scheme, fmt(r.get("input"), 2), fmt(r.get("logits"), 2)]
                        for scheme, r in position_signal.items()])]


def _extrapolation_md(schemes: list[Mapping]) -> list[str]:
    lengths, ext_rows = extrapolation_rows(schemes)
    if not ext_rows:
        return []
    ext_header = ["scheme"] + [f"{n} ({n // lengths[0]}x)" for n in lengths]
    return ["", f"## Length extrapolation: held-out MLM loss by evaluation length (pretrained at "
            f"{lengths[0]} tokens; n/a: beyond a learned position table)", "",
            table(ext_header, [[label] + [pm(v) for v in stats] for label, stats in ext_rows])]


def _extension_md(ext: Mapping, setup: Mapping) -> list[str]:
    methods = ext.get("methods") or []
    if not (methods and any(m["steps"] for m in methods)):
        return []
    steps = max((m["steps"] for m in methods), key=len)
    header = ["method", "status"] + [f"step {s}" for s in steps] + ["Δ final vs plain"]
    body = [[m["label"], m["status"]] + [pm(v) for v in m["loss"]] + [""] * (len(steps) - len(m["loss"]))
            + [diff(m.get("vs_plain")) if m["method"] != "none" else "—"] for m in methods]
    return ["", f"## Context extension: held-out loss at {ext.get('length')} tokens vs extension steps "
            f"({setup.get('extension', '')})", "", table(header, body)]


def _onset_md(onset_result: Mapping | None) -> list[str]:
    """When each scheme's seeds start to use word order (roformer.ablation.onset), and the
    held-out loss at matched tokens with differences to the reference."""
    if not onset_result or not onset_result.get("schemes"):
        return []
    header = ["scheme", "seeds started / observed", "median onset", "onsets (tokens)", "not started by",
              "fell back", f"held-out loss spikes (>= {onset.SPIKE_NATS:g} nats above the best so far)"]
    body = []
    for s in onset_result["schemes"]:
        spikes = ", ".join(f"seed {x['seed']} at {mtokens(x['tokens'])} (+{x['rise']:.2f}"
                           f"{', recovered' if x['recovered'] else ', not recovered'})" for x in s.get("loss_spikes", []))
        body.append([s["scheme"], f"{s['started']} / {s['observed']}", mtokens(s["median_onset"]),
                     ", ".join(mtokens(t) for t in s["onsets"]) or "—",
                     ", ".join(mtokens(t) for t in s["censored"]) or "—",
                     ", ".join(f"seed {x}" for x in s["fell_back"]) or "—", spikes or "—"])
    lines = ["", "## Onset of word-order use (per seed)", "",
             f"A run uses word order from its first evaluation with an order gap >= {onset_result['threshold']:g} "
             "nats. `fraction started` is the Kaplan-Meier estimate (runs not started yet are censored at their "
             "last evaluation).", "", table(header, body)]
    rows = onset_result["loss_at_matched_tokens"]
    if rows and rows[0]["cells"]:
        lines += ["", f"Held-out MLM loss at matched tokens (mean over seeds; in brackets the paired difference "
                  f"to {onset_result['reference']} with its 95% interval):", "",
                  table(["scheme"] + [mtokens(c["tokens"]) for c in rows[0]["cells"]],
                         [[row["scheme"]] + [_matched_cell(c) for c in row["cells"]] for row in rows])]
    trends = onset_result.get("gap_trend") or []
    if trends:
        t0 = trends[0]
        lines += ["", f"Is the gap to {onset_result['reference']} still closing? The slope of each seed's loss "
                  f"difference to {onset_result['reference']} over the last evaluations "
                  f"({mtokens(t0['from_tokens'])}-{mtokens(t0['to_tokens'])} tokens), in nats per "
                  f"{onset.TREND_TOKENS / 1e6:.0f}M tokens, mean over seeds with its 95% interval; the straight "
                  "line to 0 extends the mean gap at the mean slope (an extrapolation, not a forecast):", "",
                  table(["scheme", "seeds", "gap at the end", "slope", "trend", "straight line to 0"],
                         [[t["scheme"], str(len(t["seeds"])), f"{t['gap']:+.3f}", diff(t["slope"]),
                           t["trend"] or "—",
                           f"{mtokens(t['closes_in_tokens'])} more tokens" if t["closes_in_tokens"] else "—"]
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
            table(["tokens"] + [tokens(p["tokens"]) for p in shown], [["Δ loss"] + [diff(p, 3) for p in shown]])]


def _glue_md(schemes: list[Mapping]) -> list[str]:
    glue_metrics, glue_scores = glue_columns(schemes)
    if not glue_metrics:
        return []
    body = []
    for s in schemes:
        glue = s.get("glue") or {}
        body.append([s["scheme"]] + [pm(glue.get("tasks", {}).get(k), 1) for k in glue_metrics]
                    + [pm(glue.get("scores", {}).get(k), 1)
                       + ("" if glue.get("complete", {}).get(k, True) else "*") for k in glue_scores])
    lines = ["", "## GLUE dev (x100; median over fine-tuning seeds, then mean ± std over pretraining seeds)", "",
             table(["scheme"] + glue_metrics + glue_scores, body)]
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
