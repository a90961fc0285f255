"""The GPU comparison's figures, each a matplotlib Figure drawn from the report's summary
(roformer.study.report.summarize): the four the report writes beside study.md
(`FIGURES`, `figures`) and two more a notebook shows (notebooks/study_report.ipynb): the
validation loss at every rate behind each choice, and every seed's curve.

Figures are made without pyplot: no global state, so the report's worker thread can draw
while a notebook shows figures of its own.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from roformer.files import write_figure_atomic


def _figure(width: float = 7, height: float = 4.5, columns: int = 1):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.subplots(1, columns, squeeze=False)[0]


def loss_figure(result: dict):
    """Validation loss of each scheme's members at its chosen rate over training."""
    fig, (ax,) = _figure()
    for scheme, i in result["schemes_info"].items():
        x = np.asarray(i["tokens"]) / 1e6
        band = i["validation"]
        ax.plot(x, band["median"], label=f"{scheme} ({i['rate']:g})")
        ax.fill_between(x, band["lo"], band["hi"], alpha=0.2)
    ax.set(xlabel="tokens per member (M)", ylabel="validation MLM loss (trunk)", title="median, 10-90th percentile")
    ax.legend(fontsize=7)
    return fig


def onset_figure(result: dict):
    """Kaplan-Meier fraction of seeds using word order, with its band and left-censored onsets."""
    fig, (ax,) = _figure()
    for scheme, i in result["schemes_info"].items():
        c = i["onset_curve"]
        x = np.asarray(c["grid"]) / 1e6
        ax.step(x, c["fraction"], where="post", label=scheme)
        ax.fill_between(x, c["lo"], c["hi"], step="post", alpha=0.15)
        left = [o["tokens"] / 1e6 for o in i["onsets"] if o["left_censored"]]
        if left:
            ax.scatter(left, [0.02] * len(left), marker="<", s=20)
    ax.set(xlabel="tokens per member (M)", ylabel="fraction of seeds using word order", ylim=(-0.02, 1.02),
           title="Kaplan-Meier, exact 95% binomial band; < = left-censored")
    ax.legend(fontsize=7)
    return fig


def spectrum_figure(result: dict):
    """The order-horizon spectrum at the last evaluation: median and 10-90th percentile."""
    info = result["schemes_info"]
    names = list(next(iter(info.values()))["spectrum"])
    fig, (ax,) = _figure()
    for scheme, i in info.items():
        med = [i["spectrum"][n]["median"][-1] for n in names]
        lo = [i["spectrum"][n]["lo"][-1] for n in names]
        hi = [i["spectrum"][n]["hi"][-1] for n in names]
        ax.errorbar(range(len(names)), med, yerr=[np.subtract(med, lo), np.subtract(hi, med)], label=scheme,
                    capsize=2, marker="o", ms=3)
    ax.set_xticks(range(len(names)), names, rotation=45)
    ax.set(ylabel="loss increase (nats)", title="order-horizon spectrum at the end (median, 10-90th)")
    ax.legend(fontsize=7)
    return fig


def signal_figure(result: dict):
    """Each position signal over training, one panel per scheme and quantity; None when no
    scheme has one."""
    info = result["schemes_info"]
    keyed = [(scheme, key, band) for scheme, i in info.items() for key, band in i["signal"].items()]
    if not keyed:
        return None
    fig, axes = _figure(3.2 * len(keyed), 3, columns=len(keyed))
    for ax, (scheme, key, band) in zip(axes, keyed):
        x = np.asarray(info[scheme]["tokens"]) / 1e6
        ax.plot(x, band["median"])
        ax.fill_between(x, band["lo"], band["hi"], alpha=0.2)
        ax.set_title(f"{scheme}: {key}", fontsize=8)
        ax.set_xlabel("tokens (M)", fontsize=7)
    return fig


FIGURES = (("study_loss.png", loss_figure), ("study_onset.png", onset_figure),
           ("study_spectrum.png", spectrum_figure), ("study_signal.png", signal_figure))


def figures(result: dict, workdir: Path) -> None:
    """The report's figures, written into `workdir` (`figure_names`), each replaced atomically:
    a run stopped at its time limit while the report is written leaves no half image."""
    if not result["schemes_info"]:
        return
    for name, draw in FIGURES:
        fig = draw(result)
        if fig is not None:
            write_figure_atomic(workdir / name, fig, dpi=110, bbox_inches="tight")


def figure_names(info: dict) -> list[str]:
    """The figures `figures` writes for these schemes: the signal's only when one of them has a
    parameter or constant to follow (a first run that finished only rope has none)."""
    return [name for name, _ in FIGURES if name != "study_signal.png" or any(i["signal"] for i in info.values())]


def rate_figure(result: dict):
    """The tuning behind each choice: validation loss (mean over seeds) against the learning
    rate, one panel per budget, the chosen rate marked. A curve whose lowest point is at an end
    did not bracket its optimum."""
    budgets = result["budgets"]
    fig, axes = _figure(3.6 * len(budgets), 3.4, columns=len(budgets))
    for ax, budget in zip(axes, budgets):
        for scheme in result["schemes"]:
            row = budget["rows"][scheme]
            by_rate = sorted((float(r), v) for r, v in row["validation_by_rate"].items())
            (line,) = ax.plot([r for r, _ in by_rate], [v for _, v in by_rate], marker="o", ms=3, label=scheme)
            ax.scatter([row["rate"]], [row["validation_by_rate"][str(row["rate"])]], s=60, facecolors="none",
                       edgecolors=line.get_color())
        ax.set_xscale("log")
        ax.set_title(f"{budget['tokens'] / 1e6:.3g}M tokens ({budget['steps']} steps)", fontsize=8)
        ax.set_xlabel("learning rate", fontsize=7)
    axes[0].set_ylabel("validation loss (mean over seeds)", fontsize=7)
    axes[-1].legend(fontsize=6)
    return fig


def seed_curves_figure(result: dict):
    """Every member's validation loss over training at its scheme's chosen rate, one line per
    seed: what the percentile bands summarise (two groups of seeds, say, show as two bundles)."""
    schemes = result["schemes"]
    fig, axes = _figure(3.2 * len(schemes), 3, columns=len(schemes))
    for ax, scheme in zip(axes, schemes):
        info = result["schemes_info"][scheme]
        x = np.asarray(info["tokens"]) / 1e6
        for curve in info["validation_per_seed"]:
            ax.plot(x, curve, lw=0.8, alpha=0.7)
        ax.set_title(f"{scheme} at {info['rate']:g}", fontsize=8)
        ax.set_xlabel("tokens (M)", fontsize=7)
    axes[0].set_ylabel("validation loss (trunk)", fontsize=7)
    return fig
