"""The ablation report's figures: loss curves, extrapolation, context extension, attention
over training and the onset of word-order use, from the dict roformer.ablation.summary builds.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

# Figures are built without pyplot, so writing them needs no GUI backend and
# leaves a notebook's backend alone.
from matplotlib.figure import Figure

from roformer.ablation.summary import extrapolation_rows
from roformer.files import write_figure_atomic

LOSS_CURVES_PNG = "loss_curves.png"
EXTRAPOLATION_PNG = "extrapolation.png"
EXTENSION_PNG = "extension.png"
ATTENTION_PNG = "attention.png"
ONSET_PNG = "onset.png"


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
        write_figure_atomic(out_path, fig, dpi=120)
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
        write_figure_atomic(out_path, fig, dpi=120)
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
