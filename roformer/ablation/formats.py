"""How the ablation report writes its numbers: a mean ± std, a paired difference with its
95% interval, token counts, parameter counts and markdown tables. The findings
(roformer.ablation.findings) and the markdown (roformer.ablation.report_md) share them.
"""
from __future__ import annotations

from typing import Any, Mapping

from roformer.ablation.stats import finite


def pm(stats: Mapping | None, digits: int = 3, scale: float = 1.0) -> str:
    if not stats:
        return "n/a"
    text = f"{scale * stats['mean']:.{digits}f}"
    return text + (f" ± {scale * stats['std']:.{digits}f}" if stats.get("std") is not None else "")


def diff(d: Mapping | None, digits: int = 3, scale: float = 1.0) -> str:
    if not d:
        return "n/a"
    text = f"{scale * d['diff']:+.{digits}f}"
    if d.get("lo") is None:
        return text + " (one seed)"
    return text + f" [{scale * d['lo']:+.{digits}f}, {scale * d['hi']:+.{digits}f}]" + ("" if d["exceeds"] else " ~")


def tokens(n: float | None) -> str:
    return "never" if n is None else f"{n / 1e6:.2f}M"


def mtokens(n: float | None) -> str:
    if n is None:
        return "—"
    # thousands below 0.05M, so a short run's columns do not all read 0.0M
    return f"{n / 1e6:.1f}M" if n >= 5e4 else f"{n / 1e3:.0f}k" if n >= 1e3 else f"{n:.0f}"


def fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, str):
        return x
    if isinstance(x, int) and not isinstance(x, bool):
        return f"{x:,}"
    if finite(x):
        return f"{x:.{digits}f}"
    return "n/a"


def fmt_params(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 1e6:.2f}M"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
