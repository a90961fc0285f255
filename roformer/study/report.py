"""The GPU comparison's report: DIR/study.md, DIR/study.json and figures, from the schemes'
records (roformer.study), the statistics of roformer.study.stats and the
figures of roformer.study.figures.

First the pre-registration (roformer.study.preregistration: margins, seeds, power), before
any measured number; then the end state (roformer.study.end_state): each scheme's compute
multiplier M(T) against the reference, the flat test on the gap's slope and the end-state
verdicts. Then per budget and scheme: the learning rate chosen on the validation split by
the tuning seeds only (lowest mean over them; a rate with a diverged member only when every
rate has one), the test loss of the scored seeds at that rate with its seed x item interval,
the paired difference to the reference with its verdict (the pre-registered TOST margin), and
diverged members by name. Then onsets (Kaplan-Meier, censoring shown), the order-horizon
spectrum and the position signal over training.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Collection
from pathlib import Path

import numpy as np

from roformer import config_files as plan
from roformer.study import figures as study_figures, recipe_check, stats as study_stats
from roformer.study.end_state_report import (end_state_lines, end_state_summary, format_tokens, header,
                                             member_indices)
from roformer.study.preregistration import Preregistration
from roformer.study.wall_clock_report import wall_clock_lines, wall_clock_summary
from roformer.files import write_json_atomic, write_text_atomic

REPORT_MD, REPORT_JSON = "study.md", "study.json"


def load_scheme(workdir: Path, scheme: str) -> tuple[dict, dict[str, np.ndarray]]:
    """A finished scheme's record and its test sums."""
    path = workdir / "schemes" / f"{scheme}.json"
    arrays = np.load(path.with_suffix(".npz"))
    return json.loads(path.read_text()), {k: arrays[k] for k in arrays.files}


def load(workdir: Path) -> dict[str, tuple[dict, dict]]:
    return {path.stem: load_scheme(workdir, path.stem) for path in sorted((workdir / "schemes").glob("*.json"))}


def choose_rate(record: dict, budget: dict, seeds: Collection[int] | None = None) -> int:
    """Index of the rate with the lowest mean validation loss over its members of `seeds` (the
    tuning seeds; None: every seed) at `budget`; a rate with such a member diverged by then only
    if every rate has one (then the lowest median). No other seed's loss is read."""
    members = record["members"]
    rates = sorted({m["rate"] for m in members})
    val = np.asarray(budget["validation_loss"], float)
    diverged = [d is not None for d in budget_divergence(record, budget)]
    scores, fallback = [], []
    for rate in rates:
        pick = [i for i, m in enumerate(members) if m["rate"] == rate and (seeds is None or m["seed"] in seeds)]
        bad = any(diverged[i] for i in pick) or not np.all(np.isfinite(val[pick]))
        scores.append(math.inf if bad else float(val[pick].mean()))
        finite = val[pick][np.isfinite(val[pick])]
        fallback.append(float(np.median(finite)) if len(finite) else math.inf)
    best = int(np.argmin(scores)) if min(scores) < math.inf else int(np.argmin(fallback))
    return best


def budget_divergence(record: dict, budget: dict) -> list[int | None]:
    """Per member, the step at which the model of `budget` diverged (None: it did not): its
    trunk up to the budget's cooldown, then its own branch. Records written before budgets kept
    their own have only the trunk's (`diverged_at`), read as diverged by the budget's end."""
    if "diverged_at" in budget:
        return budget["diverged_at"]
    return [d if d is not None and d <= budget["steps"] else None for d in record["diverged_at"]]


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def summarize(config, workdir: Path, runs: dict[str, tuple[dict, dict]] | None = None) -> dict:
    """The report's content from the finished schemes' records (`runs`, as `load` gives them;
    read from `workdir` when not given)."""
    st = config.study
    prereg = Preregistration.from_config(st)
    tuning, scored = set(prereg.tuning_seeds), set(prereg.scored_seeds)
    margin = prereg.equivalence_margin
    runs = load(workdir) if runs is None else runs
    order = [s for s in plan.split_list(st.schemes) if s in runs]
    result = {"schemes": order, "reference": st.reference, "margin": margin,
              "preregistration": dataclasses.asdict(prereg), "budgets": [], "schemes_info": {}}
    if not order:
        return result
    budget_steps = [b["steps"] for b in runs[order[0]][0]["budgets"]]
    for b_index, steps in enumerate(budget_steps):
        rows = {}
        chosen_loss = {}
        for scheme in order:
            record, arrays = runs[scheme]
            budget = record["budgets"][b_index]
            rates = sorted({m["rate"] for m in record["members"]})
            r = choose_rate(record, budget, tuning)
            pick = member_indices(record, rates[r], scored)
            loss, weight = arrays[f"budget{steps}"][pick].astype(np.float64), arrays["test_weight"]
            seeds = [record["members"][i]["seed"] for i in pick]
            chosen_loss[scheme] = (loss, weight, seeds)
            replicates = study_stats.bootstrap_means(loss, weight, samples=int(st.bootstrap), seed=b_index)
            lo, hi = study_stats.interval(study_stats.mean_loss(loss, weight), replicates, len(seeds))
            val = np.asarray(budget["validation_loss"], float)
            rows[scheme] = {
                "rate": rates[r], "rate_at_edge": len(rates) > 1 and r in (0, len(rates) - 1),
                "validation_by_rate": {str(rate): float(np.mean(val[member_indices(record, rate, tuning)]))
                                       for rate in rates},
                "test_loss": study_stats.mean_loss(loss, weight), "lo": lo, "hi": hi,
                "test_loss_per_seed": (loss.sum(1) / weight.sum()).tolist(),
                "diverged": [{"seed": m["seed"], "rate": m["rate"], "step": d}
                             for m, d in zip(record["members"], budget_divergence(record, budget)) if d is not None],
            }
        if st.reference in chosen_loss:
            ref_loss, weight, ref_seeds = chosen_loss[st.reference]
            for scheme in order:
                if scheme == st.reference:
                    continue
                loss, _, seeds = chosen_loss[scheme]
                common = [s for s in seeds if s in ref_seeds]
                a = loss[[seeds.index(s) for s in common]]
                b = ref_loss[[ref_seeds.index(s) for s in common]]
                rows[scheme]["vs_reference"] = study_stats.compare(a, b, weight, margin=margin,
                                                                   samples=int(st.bootstrap), seed=b_index)
            compared = [rows[s]["vs_reference"] for s in order if s != st.reference]
            for vs, family in zip(compared, study_stats.family_verdicts(compared)):
                vs["family"] = family
        first = runs[order[0]][0]
        result["budgets"].append({"steps": steps, "tokens": steps * first["tokens_per_step"], "rows": rows})
    for scheme in order:
        result["schemes_info"][scheme] = _over_training(config, *runs[scheme], result["budgets"][-1]["rows"][scheme]["rate"])
    result["end_state"] = end_state_summary(config, prereg, runs, result)
    result["wall_clock"] = wall_clock_summary(config, runs, result)
    result["recipe_check"] = recipe_check.load_result(workdir)
    return result


def _over_training(config, record: dict, arrays: dict, rate: float) -> dict:
    """Onsets, validation curves (their band, and each seed's), spectrum and position signal of
    the members at `rate`."""
    st = config.study
    pick = member_indices(record, rate)
    evals = record["evals"]
    tokens = [e["tokens"] for e in evals]
    widest = f"shuffle{max(int(w) for w in plan.split_list(st.windows))}"
    onsets = [study_stats.onset(tokens, [e["gaps"][widest][i] for e in evals], float(st.order_threshold)) for i in pick]
    grid = np.asarray(tokens, float)
    curve = study_stats.onset_curve([o["tokens"] for o in onsets], [o["started"] for o in onsets], grid)
    val = np.asarray([[e["validation_loss"][i] for e in evals] for i in pick], float)
    names = list(evals[0]["gaps"])
    spectrum = {name: study_stats.percentile_band(np.asarray([[e["gaps"][name][i] for e in evals] for i in pick], float))
                for name in names}
    spectrum_onset = {}
    for name in names:
        median = np.asarray(spectrum[name]["median"])
        hit = np.flatnonzero((median >= float(st.order_threshold)) & (grid > 0))
        spectrum_onset[name] = float(grid[hit[0]]) if len(hit) else None
    signal = {key: study_stats.percentile_band(np.asarray([[e["signal"][key][i] for e in evals] for i in pick], float))
              for key in evals[0]["signal"]}
    edges = record.get("edges", {})
    return {"rate": rate, "tokens": tokens, "onsets": onsets, "onset_curve": curve,
            "validation": study_stats.percentile_band(val), "validation_per_seed": val.tolist(),
            "spectrum": spectrum, "spectrum_onset": spectrum_onset,
            "signal": signal, "timing": record["timing"], "device": record["device"],
            "parameters": record["parameters"], "memory_estimate_gib": record.get("memory_estimate_bytes", 0) / 2**30,
            "members": len(record["members"]) - edges.get("members", 0), "edge_rates": edges.get("rates", []),
            "edge_members": edges.get("members", 0), "edge_timing": edges.get("timing")}


# --------------------------------------------------------------------------- writing


def _extended_note(result: dict) -> str:
    extended = [s for s in result["schemes"] if result["schemes_info"][s].get("edge_rates")]
    return f" (and the rates beyond the grid for {', '.join(extended)})" if extended else ""


def missing_schemes(config, result: dict) -> list[str]:
    return [s for s in plan.split_list(config.study.schemes) if s not in result["schemes"]]


def edges_waiting(config, result: dict) -> list[str]:
    """The schemes whose chosen rate is at the edge of their grid at some budget and whose rates
    beyond it have not trained (with study.extend_edges; they train once every grid is whole)."""
    if not config.study.extend_edges or missing_schemes(config, result):
        return []
    info = result["schemes_info"]
    return [s for s in result["schemes"] if not info[s]["edge_rates"]
            and any(b["rows"][s]["rate_at_edge"] for b in result["budgets"])]


def unfinished(config, result: dict) -> list[str]:
    """What the study's command has still to train, in words (empty when the study is whole)."""
    missing, waiting = missing_schemes(config, result), edges_waiting(config, result)
    return ([f"the schemes {', '.join(missing)}"] if missing else []) + \
        ([f"the rates beyond the grid of {', '.join(waiting)}"] if waiting else [])


def limits(config, result: dict, manifest: dict) -> list[str]:
    """The report's "what this does and does not show" paragraph, from what the runs did: the
    claims a reader might take from the tables that these runs cannot support."""
    st = config.study
    last = result["budgets"][-1]
    rows = last["rows"]
    info = result["schemes_info"]
    passes = last["steps"] * int(config.pretrain.train.batch_size) / max(manifest.get("train_rows", 0), 1)
    shows = (f"It shows the masked-LM test loss of {len(result['schemes'])} position schemes at "
             f"{', '.join(format_tokens(b['tokens']) for b in result['budgets'])} tokens per member, each scheme at the "
             f"best of {len(plan.split_list(st.learning_rates))} learning rates"
             f"{_extended_note(result)} chosen on a validation split that shares no document with the test split, with "
             f"{_count(st.seeds, 'seed')} per rate, and when each starts to use word order.")
    parameters = next(iter(info.values()))["parameters"]
    nots = [f"It does not show what happens past {format_tokens(last['tokens'])} tokens, at another model size than "
            f"this one ({parameters:,} parameters), on another corpus, or on any downstream task: every measure here "
            "is an MLM loss (plain, or with the order disturbed)."]
    if passes > 1:
        nots.append(f"Each member reads the training split {passes:.1f} times by the last budget: repeated text can be "
                    "memorised, which lowers the later budgets' losses and favours the schemes that memorise fastest.")
    else:
        nots.append(f"By the last budget each member has read {passes:.2f} of the training split's rows, each at "
                    "most once: repetition plays no part.")
    edge = [s for s in result["schemes"] if rows[s]["rate_at_edge"]]
    if edge:
        nots.append(f"The chosen rate is at the edge of the grid for {', '.join(edge)} at the last budget: the best "
                    "rate may lie outside it, so those losses bound the tuned loss from above.")
    waiting = edges_waiting(config, result)
    if waiting:
        nots.append(f"The rates beyond the grid of {', '.join(waiting)} have not trained yet; the same command "
                    "trains them.")
    undecided = [s for s in result["schemes"] if rows[s].get("vs_reference", {}).get("verdict") == "undecided"]
    if undecided:
        nots.append(f"'undecided' ({', '.join(undecided)}) is not a tie: neither a difference nor equivalence within "
                    f"+-{st.equivalence_margin:g} nats was shown.")
    uncorrected = [s for s in result["schemes"] if (rows[s].get("vs_reference", {}).get("family") or "").startswith("not under Holm")]
    if uncorrected:
        nots.append(f"At the last budget the verdicts of {', '.join(uncorrected)} hold as single comparisons but not with "
                    "all of the budget's comparisons corrected together (Holm): read them one at a time, not as a "
                    "ranking of every scheme at once.")
    diverged = sum(len(rows[s]["diverged"]) for s in result["schemes"])
    unstable = [s for s in result["schemes"] if any(d["rate"] == rows[s].get("rate") for d in rows[s]["diverged"])]
    if diverged and not unstable:
        nots.append(f"{diverged} member(s) diverged (listed in the tables): a rate with a diverged member is not "
                    "chosen unless every rate has one, so those schemes are compared at a rate that trained stably.")
    elif diverged:
        nots.append(f"{diverged} member(s) diverged (listed in the tables). Every rate of {', '.join(unstable)} had a "
                    "diverged member at the last budget: its rate is the one with the lowest median, and its loss and "
                    "comparison include the diverged members (so no interval, no verdict).")
    censored = [s for s in result["schemes"] if any(o["left_censored"] for o in info[s]["onsets"])]
    if censored:
        nots.append(f"Onsets marked <= ({', '.join(censored)}) happened at or before the first evaluation; when is "
                    "not known.")
    missing = missing_schemes(config, result)
    if missing:
        nots.append(f"Not finished, so not compared: {', '.join(missing)}.")
    return [shows, "", " ".join(nots)]


def markdown(config, result: dict, manifest: dict) -> str:
    prereg = Preregistration.from_config(config.study)
    # The pre-registration first: every number below is read with it.
    lines = ["# Position schemes compared (`configs/study.py`)", "", *header(prereg), ""]
    if not result["schemes"]:
        return "\n".join(lines + ["No scheme has finished yet."]) + "\n"
    lines += end_state_lines(result) + wall_clock_lines(result)
    lines += _setup_lines(config, result, manifest)
    lines += recipe_check.recipe_lines(config, result.get("recipe_check"))
    lines += _budget_tables(result)
    lines += _rate_lines(result)
    lines += _order_lines(config.study, result)
    lines += _signal_lines(result)
    lines += ["", "## What this does and does not show", "", *limits(config, result, manifest)]
    lines += _time_lines(result)
    return "\n".join(lines) + "\n"


def _setup_lines(config, result: dict, manifest: dict) -> list[str]:
    """What every scheme shared (model, batch, rates, schedule, budgets, splits) and how the
    intervals and verdicts are read."""
    st, train = config.study, config.pretrain.train
    any_info = next(iter(result["schemes_info"].values()))
    train_tokens = manifest.get("train_tokens", 0)
    last_tokens = result["budgets"][-1]["tokens"]
    return [
        f"device: {any_info['device']}, model: {config.pretrain.model.size} "
        f"({config.pretrain.model.get('num_heads') or 'preset'} heads), batch {train.batch_size} x {train.seq_len}, "
        f"{_count(st.seeds, 'seed')} x rates {st.learning_rates} per scheme ({any_info['members']} members in one vmapped "
        f"program), warmup-stable-decay (warmup {st.warmup_steps} steps, cooldown {st.cooldown_fraction:.0%} of each "
        f"budget), budgets {', '.join(format_tokens(b['tokens']) for b in result['budgets'])} tokens per member; "
        f"training split {format_tokens(train_tokens)} tokens, so the last budget is "
        f"{last_tokens / max(train_tokens, 1):.2f} passes; test split {manifest.get('test_predictions', 0):,} masked "
        f"predictions ({manifest.get('test_rows', 0):,} rows x {manifest.get('test_mask_draws', 1)} mask draws, "
        f"{_count(manifest.get('test_items', manifest.get('test_rows', 0)), 'item')}), "
        f"validation {manifest.get('validation_predictions', 0):,} (disjoint documents). Intervals: 95%, seed x item "
        f"bootstrap ({st.bootstrap} replicates; an item is a document with its rows; the replicates' sd scaled by "
        f"Student's t with seeds - 1 degrees of freedom and sqrt(seeds / (seeds - 1))); 'equivalent': TOST, 90% interval within +-{st.equivalence_margin:g} nats; "
        "'all schemes (Holm)': whether the verdict still holds with both tests of every comparison of its budget's "
        "table corrected together (Holm, family-wise 5%), else what remains of it; 'equivalent above': the margin TOST "
        "needs, the 90% interval's end farthest from 0 (equivalent at every margin above it, at none at or below), to "
        "hold against a margin of one's own.", ""]


def _budget_tables(result: dict) -> list[str]:
    """Per budget: each scheme's chosen rate, test loss and verdict against the reference."""
    lines = []
    for budget in result["budgets"]:
        lines += [f"## Budget {format_tokens(budget['tokens'])} tokens ({budget['steps']} steps)", "",
                  f"| scheme | rate (tuning seeds' validation) | test loss [95%] | vs {result['reference']} [95%] | verdict | "
                  "all schemes (Holm) | equivalent above | diverged (any rate) |", "|---|---|---|---|---|---|---|---|"]
        for scheme in result["schemes"]:
            row = budget["rows"][scheme]
            vs = row.get("vs_reference")
            vs_text = f"{vs['diff']:+.3f} [{vs['lo']:+.3f}, {vs['hi']:+.3f}]" if vs else "—"
            verdict = vs["verdict"] if vs else "—"
            bound = f"+-{study_stats.equivalence_bound(vs['lo90'], vs['hi90']):.3f}" if vs else "—"
            family = (vs["family"] or "—") if vs else "—"
            edge = " (edge of grid)" if row["rate_at_edge"] else ""
            diverged = ", ".join(f"seed {d['seed']} at {d['rate']:g} (step {d['step']})" for d in row["diverged"]) or "none"
            lines.append(f"| {scheme} | {row['rate']:g}{edge} | {row['test_loss']:.3f} [{row['lo']:.3f}, {row['hi']:.3f}] "
                         f"| {vs_text} | {verdict} | {family} | {bound} | {diverged} |")
        lines.append("")
    return lines


def _rate_lines(result: dict) -> list[str]:
    """Validation loss by rate at the last budget, and the rates trained beyond a grid's edge."""
    info = result["schemes_info"]
    last_rows = result["budgets"][-1]["rows"]
    columns = sorted({float(r) for s in result["schemes"] for r in last_rows[s]["validation_by_rate"]})
    lines = ["## Validation loss by rate at the last budget (mean over seeds)", "",
             "| scheme | " + " | ".join(f"{r:g}" for r in columns) + " |", "|---|" + "---|" * len(columns)]
    for scheme in result["schemes"]:
        by_rate = {float(r): v for r, v in last_rows[scheme]["validation_by_rate"].items()}
        lines.append(f"| {scheme} | " + " | ".join(f"{by_rate[r]:.3f}" if r in by_rate else "—" for r in columns) + " |")
    extended = [f"{s} ({', '.join(f'{r:g}' for r in info[s]['edge_rates'])})" for s in result["schemes"]
                if info[s]["edge_rates"]]
    if extended:
        lines += ["", "Rates beyond the grid (`study.extend_edges`: a budget chose a rate at the grid's edge, so the "
                  f"same seeds trained one step further): {'; '.join(extended)}."]
    return lines


def _order_lines(st, result: dict) -> list[str]:
    """Word order: each scheme's onsets, its order-horizon spectrum at the end and when each
    window's gap reached the threshold."""
    info = result["schemes_info"]
    widest = f"shuffle{max(int(w) for w in plan.split_list(st.windows))}"
    lines = ["", f"## Word order: onsets (gap under `{widest}` >= {st.order_threshold} nats, chosen rate)", "",
             "| scheme | started | at the first evaluation (left-censored) | onsets (tokens) |", "|---|---|---|---|"]
    for scheme in result["schemes"]:
        onsets = info[scheme]["onsets"]
        started = [o for o in onsets if o["started"]]
        times = ", ".join(("<=" if o["left_censored"] else "") + format_tokens(o["tokens"]) for o in started) or "—"
        lines.append(f"| {scheme} | {len(started)}/{len(onsets)} | {sum(o['left_censored'] for o in onsets)} | {times} |")
    names = list(next(iter(info.values()))["spectrum"])
    lines += ["", "## Order-horizon spectrum at the end (median loss increase, nats; trunk, chosen rate)", "",
              "| scheme | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for scheme in result["schemes"]:
        spectrum = info[scheme]["spectrum"]
        lines.append(f"| {scheme} | " + " | ".join(f"{spectrum[n]['median'][-1]:.3f}" for n in names) + " |")
    lines += ["", "First evaluation at which the median gap reaches the threshold, per window:", "",
              "| scheme | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for scheme in result["schemes"]:
        first = info[scheme]["spectrum_onset"]
        lines.append(f"| {scheme} | " + " | ".join(format_tokens(first[n]) if first[n] is not None else "never"
                                                    for n in names) + " |")
    return lines


def _signal_lines(result: dict) -> list[str]:
    """Each scheme's position signal, first -> last evaluation."""
    info = result["schemes_info"]
    lines = ["", "## Position signal over training (median over seeds: first -> last evaluation)", ""]
    for scheme in result["schemes"]:
        signal = info[scheme]["signal"]
        text = "; ".join(f"{k} {v['median'][0]:.4g} -> {v['median'][-1]:.4g}" for k, v in signal.items())
        lines.append(f"- {scheme}: {text or 'no parameters or constants (nothing to follow)'}")
    return lines


def _time_lines(result: dict) -> list[str]:
    """Each group's time: programs, first chunk, training, evaluation, throughput."""
    info = result["schemes_info"]
    lines = ["", "## Time", "", "Programs: compiling the group's programs and initialising its members, on a "
             "worker thread while the group before trained (`study.compile_ahead`; waited: what training then "
             "waited for them) or here. First "
             "chunk: the first `eval_every` steps, with their compilation where the programs were not compiled "
             "before. Tokens/s: training's (forward and backward) and evaluation's (forward only), all members.", "",
             "| scheme | parameters | memory estimate | programs | first chunk | training | evaluation | all | "
             "tokens/s training | tokens/s evaluation |", "|---|---|---|---|---|---|---|---|---|---|"]
    groups = []
    for scheme in result["schemes"]:
        groups.append((f"{scheme} | {info[scheme]['parameters']:,} | {info[scheme]['memory_estimate_gib']:.2f} GiB",
                       info[scheme]["timing"]))
        if info[scheme]["edge_timing"]:
            groups.append((f"{scheme}, beyond the grid ({info[scheme]['edge_members']} members) | — | —",
                           info[scheme]["edge_timing"]))
    for name, t in groups:
        evaluation = f"{t['eval_tokens_per_s']:,.0f}" if "eval_tokens_per_s" in t else "—"   # older records
        lines.append(f"| {name} | {_programs_time(t)} | {t['compile_s']:.1f} s | {t['train_s']:.1f} s | "
                     f"{t['eval_s']:.1f} s | {t['wall_s']:.1f} s | {t['tokens_per_s']:,.0f} | {evaluation} |")
    waited = sum(t.get("programs_wait_s", 0.0) for _, t in groups)
    lines += ["", f"In all: {len(groups)} groups, {sum(t['wall_s'] for _, t in groups):.0f} s from each group's turn "
              f"to its record, {waited:.0f} s of it waiting for programs (compiled here or not ready yet).",
              "", f"Figures: {', '.join(study_figures.figure_names(info))}."]
    return lines


def _programs_time(timing: dict) -> str:
    if "programs_s" not in timing:   # a record from before the programs were compiled apart
        return "in the first chunk"
    if timing["compiled_ahead"]:
        return f"{timing['programs_s']:.1f} s ahead (waited {timing['programs_wait_s']:.1f} s)"
    return f"{timing['programs_s']:.1f} s"


def verdicts_by_margin(result: dict, margins) -> list[dict]:
    """Each non-reference scheme's verdict at each budget and each margin in `margins`, read
    from the intervals the report already holds: [{"tokens", "scheme", margin: verdict, ...}]."""
    rows = []
    for budget in result["budgets"]:
        for scheme in result["schemes"]:
            vs = budget["rows"][scheme].get("vs_reference")
            if vs is None:
                continue
            ends = (vs["lo"], vs["hi"], vs["lo90"], vs["hi90"])
            rows.append({"tokens": budget["tokens"], "scheme": scheme,
                         "bound": study_stats.equivalence_bound(vs["lo90"], vs["hi90"]),
                         **{m: study_stats.verdict(*ends, margin=float(m)) for m in margins}})
    return rows


def write(config, workdir: str | Path, runs: dict[str, tuple[dict, dict]] | None = None) -> dict:
    """Summarize DIR's finished schemes (or `runs`, read from it before) into study.json, study.md
    and the figures; returns the summary."""
    workdir = Path(workdir)
    manifest_path = workdir / "data_manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    result = summarize(config, workdir, runs)
    write_json_atomic(workdir / REPORT_JSON, result)
    write_text_atomic(workdir / REPORT_MD, markdown(config, result, manifest))
    study_figures.figures(result, workdir)
    return result
