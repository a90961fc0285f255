"""The study report's equal wall-clock view (roformer.study.wall_clock): each scheme's measured
training throughput, its loss at the reference's time to each budget, and the time multiplier,
set in study.md beside the equal-token M(T) table."""
from __future__ import annotations

import math

import numpy as np

from roformer.study import end_state, wall_clock
from roformer.study.end_state_report import format_tokens, scored_curve


def wall_clock_summary(config, runs: dict, result: dict) -> dict:
    """Per scheme its throughput and device; against the reference (when every reported scheme
    ran on one device kind) the equal-time rows and the time multiplier per budget. `result`
    is the report's summary with its end state (scored seeds, M(T))."""
    st, reference = config.study, config.study.reference
    schemes = result["schemes"]
    out = {"throughput": {}, "devices": [], "rows": {}, "time_multiplier": {}, "not_compared": ""}
    for scheme in schemes:
        record = runs[scheme][0]
        out["throughput"][scheme] = {"device": record.get("device", "?"),
                                     "member_tokens_per_s": wall_clock.member_throughput(record)}
    out["devices"] = sorted({t["device"] for t in out["throughput"].values()})
    if reference not in schemes:
        out["not_compared"] = f"{reference} has not finished"
        return out
    if len(out["devices"]) > 1:
        out["not_compared"] = (f"the records were trained on different devices ({', '.join(out['devices'])}): "
                               "throughputs are compared on one device only")
        return out
    reference_rate = out["throughput"][reference]["member_tokens_per_s"]
    if not reference_rate:
        out["not_compared"] = f"{reference}'s record holds no throughput"
        return out
    tokens = [b["tokens"] for b in result["budgets"]]
    scored = result["end_state"]["scored_seeds"]
    weight = runs[reference][1]["test_weight"].astype(np.float64)
    ref_loss = scored_curve(reference, runs, result, scored)
    for scheme in schemes:
        rate = out["throughput"][scheme]["member_tokens_per_s"]
        if scheme == reference or not rate:
            continue
        ratio = rate / reference_rate
        out["throughput"][scheme]["ratio"] = ratio
        out["rows"][scheme] = wall_clock.equal_time_rows(tokens, scored_curve(scheme, runs, result, scored), tokens,
                                                         ref_loss, weight, ratio, samples=int(st.bootstrap), seed=0)
        out["time_multiplier"][scheme] = [
            {**row, **{k: row[k] / ratio for k in ("multiplier", "lo", "hi")}}
            for row in result["end_state"]["multiplier"].get(scheme, [])]
    out["throughput"][reference]["ratio"] = 1.0
    return out


def _difference_cell(row: dict) -> str:
    if not math.isfinite(row["diff"]):
        return f"— ({format_tokens(row['scheme_tokens'])} tokens: outside its budgets)"
    bounds = f" [{row['lo']:+.3f}, {row['hi']:+.3f}]" if math.isfinite(row["lo"]) else ""
    return f"{row['diff']:+.3f}{bounds} at {format_tokens(row['scheme_tokens'])}"


def _time_cell(row: dict, ratio: float, first: float, last: float) -> str:
    t = row["tokens"]
    if row["status"] == end_state.BEFORE:
        return f"<= {first / t / ratio:.2f}"
    if row["status"] == end_state.NEVER:
        return f"> {last / t / ratio:.2f}"
    if row["status"] != end_state.REACHED:
        return row["status"]
    bounds = f" [{row['lo']:.2f}, {row['hi']:.2f}]" if math.isfinite(row["lo"]) else ""
    return f"{row['multiplier']:.2f}{bounds}"


def wall_clock_lines(result: dict) -> list[str]:
    """study.md's equal wall-clock section: throughputs, then the loss difference at equal time
    and the time multiplier per reference budget."""
    clock, reference = result.get("wall_clock"), result["reference"]
    if not clock or not result["schemes"]:
        return []
    lines = [f"## At equal wall-clock time against {reference}", "",
             "Training throughput per member: tokens/s over every training chunk after the first (which compiled the "
             "program), all members of the scheme's group in one vmapped program, over the members.", "",
             f"| scheme | device | tokens/s per member | x {reference} |", "|---|---|---|---|"]
    for scheme, t in clock["throughput"].items():
        rate = f"{t['member_tokens_per_s']:,.0f}" if t["member_tokens_per_s"] else "—"
        ratio = f"{t['ratio']:.2f}" if "ratio" in t else "—"
        lines.append(f"| {scheme} | {t['device']} | {rate} | {ratio} |")
    if clock["not_compared"]:
        return lines + ["", f"Not read at equal time: {clock['not_compared']}.", ""]
    tokens = [b["tokens"] for b in result["budgets"]]
    header = "| scheme | " + " | ".join(format_tokens(t) for t in tokens) + " |"
    lines += ["", f"Loss after {reference}'s time to each budget T minus {reference}'s at T (nats; 95% interval, seed x "
              "item bootstrap, the throughputs taken as fixed), at the tokens the scheme reads in that time (T x its "
              "throughput ratio; its loss there interpolated in log tokens and log loss between its budgets, not "
              "extrapolated):", "", header, "|---|" + "---|" * len(tokens)]
    for scheme, rows in clock["rows"].items():
        lines.append(f"| {scheme} | " + " | ".join(_difference_cell(r) for r in rows) + " |")
    lines += ["", f"Time multiplier: the time each scheme needs to reach {reference}'s loss at T over {reference}'s "
              f"time to T (M(T) over the throughput ratio; 95% interval):", "", header, "|---|" + "---|" * len(tokens)]
    for scheme, rows in clock["time_multiplier"].items():
        ratio = clock["throughput"][scheme]["ratio"]
        lines.append(f"| {scheme} | " + " | ".join(_time_cell(r, ratio, tokens[0], tokens[-1]) for r in rows) + " |")
    return lines + [""]
