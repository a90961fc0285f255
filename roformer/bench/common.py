"""Shared benchmark helpers: blocked timing, alternating A/B runs, tables, JSON (the machine
they ran on, and the matmul peak: roformer.machine).

The CPU this project is developed on is shared and noisy, so comparisons are
measured as alternating rounds (A B A B ...) and summarised by the median of the
per-round ratios with their min and max, never by one long run of each side.
"""
from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from roformer.files import write_text_atomic


def time_call(fn: Callable[[], Any], iters: int) -> float:
    """Median seconds of `iters` calls of fn, each waited for with block_until_ready."""
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# Calls of a train step before any is timed. On CPU the process's heap reaches the step's
# peak only after a few steps (roformer.host_memory keeps it there); until then each step
# page-faults its buffers in.
TRAIN_STEP_WARMUP = 5


def warm_up(fns: Mapping[str, Callable[[], Any]], warmup: int) -> None:
    """Compile and run every variant `warmup` times so no round pays for compilation."""
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())


def alternate(
    fns: Mapping[str, Callable[[], Any]], *, rounds: int, iters: int, warmup: int = 2
) -> dict[str, list[float]]:
    """Time the variants in alternating rounds; returns name -> per-round seconds.

    Each round runs every variant once (median of `iters` calls), so round i of A and
    round i of B saw nearly the same machine load. The order rotates by one each round and
    runs backwards every other round (ABC, ACB, CAB, CBA): with a fixed order, the `none`
    position control (strictly less work than `learned`) timed 2-8% slower than `learned`,
    which always ran first; rotating alone keeps each variant behind the same neighbour.
    """
    warm_up(fns, warmup)
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        order = names[shift:] + names[:shift]
        for name in order[::-1] if round_index % 2 else order:
            times[name].append(time_call(fns[name], iters))
    return times


def ratio_stats(numerator: Sequence[float], denominator: Sequence[float]) -> dict[str, float]:
    """Median, min and max of the per-round ratios numerator[i] / denominator[i]."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError("ratio_stats needs two equally long, non-empty lists of round times")
    ratios = [a / b for a, b in zip(numerator, denominator)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def write_json(path: Path, result: Mapping[str, Any]) -> None:
    """A benchmark's result as indented JSON (values JSON lacks, such as paths, as text)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(result, indent=2, default=str) + "\n")


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Markdown table of the rows; floats get 3 significant digits (4 for ratios near 1)."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
        return "" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def failure(error: Exception) -> str:
    """'Type: first line of the message' (at most 200 characters of it), for a benchmark's
    note on what failed."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:200] if text else ''}"
