"""The study report's end state: the scored seeds' curves at each budget's chosen rate, each
scheme's compute multiplier M(T) against the reference, the flat test on the gap's slope, the
end-state verdicts (roformer.study.end_state), and their lines in study.md, which lead the
report after the pre-registered header (roformer.study.preregistration)."""
from __future__ import annotations

import functools
import math
from collections.abc import Collection

import numpy as np

from roformer import config_files as plan
from roformer.study import end_state
from roformer.study.preregistration import Preregistration, header_lines


def member_indices(record: dict, rate: float, seeds: Collection[int] | None = None) -> list[int]:
    """The members at `rate` of `seeds` (None: every seed), by seed."""
    return sorted((i for i, m in enumerate(record["members"]) if m["rate"] == rate
                   and (seeds is None or m["seed"] in seeds)), key=lambda i: record["members"][i]["seed"])


def scored_curve(scheme: str, runs: dict, result: dict, scored: Collection[int]) -> np.ndarray:
    """A scheme's test loss [budgets, scored seeds, items] at each budget's chosen rate."""
    record, arrays = runs[scheme]
    return np.stack([arrays[f"budget{b['steps']}"][member_indices(record, b["rows"][scheme]["rate"], scored)]
                     for b in result["budgets"]]).astype(np.float64)


def uses_order(config, info: dict) -> bool:
    """The scheme uses word order at the end: the median loss increase under the widest
    shuffle window at the last evaluation reaches study.order_threshold (its spectrum's)."""
    widest = f"shuffle{max(int(w) for w in plan.split_list(config.study.windows))}"
    return bool(info["spectrum"][widest]["median"][-1] >= float(config.study.order_threshold))


def end_state_summary(config, prereg: Preregistration, runs: dict, result: dict) -> dict:
    """Per scheme against the reference, on the scored seeds at each budget's chosen rate: M(T)
    (`end_state.multiplier_curve`), the gap's slope over the last quarter of the budgets and
    whether it is flat, and the end-state verdict at the last budget."""
    st, reference = config.study, config.study.reference
    out = {"tuning_seeds": list(prereg.tuning_seeds), "scored_seeds": list(prereg.scored_seeds),
           "multiplier": {}, "slope": {}, "verdicts": {}, "uses_order": {}, "edge_schemes": []}
    schemes = result["schemes"]
    out["uses_order"] = {s: uses_order(config, result["schemes_info"][s]) for s in schemes}
    out["edge_schemes"] = [s for s in schemes if any(b["rows"][s]["rate_at_edge"] for b in result["budgets"])]
    if reference not in schemes:
        return out
    tokens = [b["tokens"] for b in result["budgets"]]
    weight = runs[reference][1]["test_weight"].astype(np.float64)
    ref_loss = scored_curve(reference, runs, result, prereg.scored_seeds)
    samples = int(st.bootstrap)
    for scheme in schemes:
        if scheme == reference:
            continue
        loss = scored_curve(scheme, runs, result, prereg.scored_seeds)
        out["multiplier"][scheme] = end_state.multiplier_curve(tokens, loss, tokens, ref_loss, weight,
                                                               samples=samples, seed=0)
        slope = end_state.gap_slope(tokens, loss, ref_loss, weight, samples=samples, seed=0)
        slope["flat"] = end_state.is_flat(slope, prereg.slope_margin)
        out["slope"][scheme] = slope
        out["verdicts"][scheme] = end_state.end_state_verdict(
            result["budgets"][-1]["rows"][scheme]["vs_reference"], scheme=scheme, reference=reference,
            flat=slope["flat"], edge_schemes=out["edge_schemes"], uses_order=out["uses_order"])
    return out


def format_tokens(t: float) -> str:
    """A token count as the report writes it: 4.10M, or 2.6k below 100k."""
    return f"{t / 1e6:.2f}M" if t >= 1e5 else f"{t / 1e3:.1f}k"


@functools.lru_cache(maxsize=4)
def header(prereg: Preregistration) -> tuple[str, ...]:
    """The pre-registration's header: its power table takes seconds, and the study writes the
    report after every group with the same registration."""
    return tuple(header_lines(prereg))


def multiplier_cell(row: dict, first: float, last: float) -> str:
    """One M(T) cell: M [interval] or why there is none."""
    t = row["tokens"]
    if row["status"] == end_state.BEFORE:
        return f"<= {first / t:.2f} (reached before the first budget)"
    if row["status"] == end_state.NEVER:
        return f"> {last / t:.2f} (not reached within the budgets)"
    if row["status"] != end_state.REACHED:
        return row["status"]
    interval = f"[{row['lo']:.2f}, {row['hi']:.2f}]" if math.isfinite(row["lo"]) else \
        f"(no interval: {row['censored']} replicates crossed outside the budgets)"
    return f"{row['multiplier']:.2f} {interval}"


def end_state_lines(result: dict) -> list[str]:
    """The report's lead: the M(T) table (scheme x budget), then the flat test on each gap's
    slope and the end-state verdicts."""
    end, reference = result["end_state"], result["reference"]
    tokens = [b["tokens"] for b in result["budgets"]]
    seeds = (f"scored seeds {', '.join(map(str, end['scored_seeds']))}; rates chosen on tuning seeds "
             f"{', '.join(map(str, end['tuning_seeds']))} only")
    lines = [f"## Compute multiplier M(T) against {reference}", "",
             f"The tokens each scheme needs to reach {reference}'s mean test loss at budget T, over T (95% interval, "
             f"seed x item bootstrap; {seeds}). Near 1: {reference}'s lead is an onset transient; steadily above 1: "
             "a lasting efficiency gain; below 1: the scheme is ahead.", ""]
    if not end["multiplier"]:
        return lines + [f"Not measured: {reference} has not finished.", ""]
    lines += ["| scheme | " + " | ".join(format_tokens(t) for t in tokens) + " |", "|---|" + "---|" * len(tokens)]
    for scheme, rows in end["multiplier"].items():
        lines.append(f"| {scheme} | " + " | ".join(multiplier_cell(r, tokens[0], tokens[-1]) for r in rows) + " |")
    prereg = result["preregistration"]
    lines += ["", f"## End state against {reference}", "",
              f"The gap (scheme - {reference}, nats) against log2 tokens over the last quarter of the budgets' "
              f"log-token range: flat when its 90% interval lies within +-{prereg['slope_margin']:g} nats per doubling.",
              ""]
    for scheme, slope in end["slope"].items():
        budgets = ", ".join(format_tokens(t) for t in slope["budgets"])
        lines.append(f"- {scheme}: slope {slope['slope']:+.4f} nats per doubling, 95% [{slope['lo']:+.4f}, "
                     f"{slope['hi']:+.4f}], 90% [{slope['lo90']:+.4f}, {slope['hi90']:+.4f}] over {budgets}: "
                     f"{'flat' if slope['flat'] else 'not flat'}")
    lines += ["", f"End-state verdicts at the last budget ({format_tokens(tokens[-1])} tokens; equivalence margin "
              f"+-{prereg['equivalence_margin']:g} nats):", ""]
    for scheme, verdict in end["verdicts"].items():
        why = f" ({'; '.join(verdict['reasons'])})" if verdict["reasons"] else ""
        flag = f". Flag: {verdict['flag']}" if verdict["flag"] else ""
        lines.append(f"- {scheme} vs {reference}: {verdict['verdict']}{why}{flag}")
    return lines + [""]
