"""The ablation's comparison in sentences (the report's findings): which differences to the
reference exceed the seed spread, which schemes use word order and from when, whether the
gap to the reference is still closing, RoFormer's convergence claim, extrapolation and
context extension. Reads the dict roformer.ablation.summary builds.
"""
from __future__ import annotations

from typing import Mapping

from roformer.ablation import onset
from roformer.ablation.formats import diff, mtokens, pm, tokens


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
            single.append(f"{name} ({diff(d)})")
        elif d["exceeds"]:
            (worse if d["diff"] > 0 else better).append(f"{name} ({diff(d)} nats{seeds})")
        else:
            same.append(f"{name} ({diff(d)}{seeds})")
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
    """Which schemes use word order (and from when: per run, then the median over runs),
    which started in fewer than half their runs, and which never did in any run."""
    out = []
    uses, some, never = [], [], []
    for name, row in rows.items():
        gap = row.get("eval_order_gap")
        if not gap:
            continue
        runs = row.get("order_onset_runs") or {"started": 0, "observed": 0, "first": None}
        seeds = f"{runs['started']} of {runs['observed']} seeds started"
        if row.get("order_onset_tokens") is not None:
            uses.append(f"{name}: median onset {tokens(row['order_onset_tokens'])} tokens ({seeds}; final gap "
                        f"{pm(gap, 2)})")
        elif runs["started"]:
            some.append(f"{name} ({seeds}, the first at {tokens(runs['first'])} tokens; final gap {pm(gap, 2)})")
        else:
            never.append(f"{name} (final gap {pm(gap)} nats)")
    if uses:
        out.append(f"Word order (shuffling each document's tokens raises a run's held-out loss by >= {threshold} "
                   f"nats; the median onset over seeds, censored runs counted): {'; '.join(uses)}.")
    if some:
        out.append(f"Word order in fewer than half the seeds by the budget's end (gap >= {threshold} nats): "
                   f"{'; '.join(some)}.")
    if never:
        out.append(f"Ignore word order through the whole budget (gap < {threshold} nats at every evaluation "
                   f"of every seed): {'; '.join(never)}.")
    return out


def _gap_trend_findings(trends: list[Mapping], reference: str) -> list[str]:
    """Whether the budget decided the comparison: which schemes' gap to the reference is still
    closing at its end (roformer.ablation.onset.gap_trend)."""
    judged = [t for t in trends if t["trend"]]
    if not judged:
        return []
    window = f"{mtokens(judged[0]['from_tokens'])}-{mtokens(judged[0]['to_tokens'])} tokens"
    parts = []
    for trend in ("closing", "parallel", "widening", "unclear"):
        names = []
        for t in (t for t in judged if t["trend"] == trend):
            text = f"{t['scheme']} ({diff(t['slope'])}"
            if t["closes_in_tokens"] is not None:
                text += f"; a straight line reaches 0 after {mtokens(t['closes_in_tokens'])} more tokens"
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
    reached = [v for v in conv.get("budget_share_values", []) if v is not None]
    text = (f"Convergence (RoFormer Fig. 3): {conv['reference']}'s held-out loss is below "
            f"{conv['baseline']}'s beyond the seed spread ")
    if len(conv["seeds"]) < 2:   # no interval from one pair, so nothing is "beyond the spread"
        last = conv["at_step"][-1]
        text = (f"Convergence (RoFormer Fig. 3): one seed in common, no interval yet; {conv['baseline']} - "
                f"{conv['reference']} held-out loss is {last['diff']:+.3f} at {tokens(last['tokens'])} tokens")
    elif first is None:
        text = (f"Convergence (RoFormer Fig. 3): at no evaluation is {conv['baseline']}'s held-out loss above "
                f"{conv['reference']}'s beyond the seed spread, so the claim does not reproduce here")
    elif stays:
        text += f"at every evaluation from {tokens(first)} tokens on, so the claim reproduces at this scale"
    else:
        text += f"at some evaluations only (first at {tokens(first)} tokens), so the claim holds only in part"
    if share:
        # the share is over the seeds that reach it; the others are named, not averaged away
        of = len(conv.get("budget_share_values", []))
        seeds = f" in {len(reached)} of {of} seeds" if len(reached) < of else ""
        text += (f"; {conv['reference']} reaches {conv['baseline']}'s final loss{seeds} after "
                 f"{pm(share, 2, 100)}% of the budget")
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
            "held-out loss ranks " + " < ".join(f"{n} {pm(at_longest[n], 2)}" for n in ranked) + "."]


def _extension_findings(ext: Mapping) -> list[str]:
    """The context-extension methods ranked by their final loss at the extended length."""
    methods = [m for m in ext.get("methods", []) if m["loss"]]
    if not methods:
        return []
    final = sorted(methods, key=lambda m: m["loss"][-1]["mean"])
    words = "; ".join(f"{m['label']} {pm(m['loss'][0], 2)} -> {pm(m['loss'][-1], 2)}"
                      + (f" (vs plain {diff(m['vs_plain'], 2)})" if m.get("vs_plain") else "") for m in final)
    return [f"Context extension to {ext['length']} tokens, held-out loss there before -> after "
            f"{final[0]['steps'][-1]} steps: {words}."]
