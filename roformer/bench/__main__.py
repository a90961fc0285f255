"""python -m roformer.bench <rope|step|profile|hf|scaling|input|gpu|runs|flags|levers|glue_loop|cost> [flags] [--json=OUT]

`python -m roformer.bench <benchmark> --help` lists that benchmark's flags (lists
comma-separated: `--seq-lens=128,512`).

Each benchmark is a module roformer/bench/<name>.py exposing define_flags(command) (its
absl flags, roformer.cli.CommandFlags) and run(args) -> dict with a "rows" list, plus
anything else worth keeping: the alternating-run ratio summaries under "comparisons", "columns" (the row keys to
print when rows carry more than fits a table), further tables under "tables"
({title: {"rows", "columns"}}) and one-line "notes" (what could not be measured, and
why). This entry point prints the rows as a markdown table, the other tables, the
comparisons and the notes as lines, and writes the whole dict, with the machine it
ran on and its load average, as JSON. Benchmarks report measured figures and ratios
only; targets are judged in the dated result pages.
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import SimpleNamespace

from roformer import cli
from roformer.bench.common import format_table, write_json
from roformer.host_memory import retain_host_memory
from roformer.machine import machine_info

BENCHMARKS = ("rope", "step", "profile", "hf", "scaling", "input", "gpu", "runs", "flags", "levers", "glue_loop", "cost")


def parse_args(argv: list[str]) -> SimpleNamespace:
    """The benchmark (the first argument), then its flags; only that module is imported (hf
    pulls in torch)."""
    name = argv[0] if argv else ""
    if name not in BENCHMARKS:
        if argv and cli.asks_for_help(["", name]):
            print(__doc__)
            raise SystemExit(0)
        if not argv:
            raise cli.UsageError(f"give a benchmark: python -m roformer.bench <{'|'.join(BENCHMARKS)}> (see --help)")
        raise cli.UsageError(f"no benchmark {name!r}; choose one of {', '.join(BENCHMARKS)}")
    module = importlib.import_module(f"roformer.bench.{name}")
    command = cli.CommandFlags(f"python -m roformer.bench {name} [flags]\n\n{module.__doc__.strip()}")
    command.define("--json", type=Path, default=None, help="write the result as JSON to this file")
    module.define_flags(command)
    args, positional = command.parse(argv[1:])
    if positional:
        raise cli.UsageError(f"unexpected arguments: {positional} (a list flag takes commas: --seq-lens=128,512)")
    args.benchmark = name
    return args


@cli.entry_point
def main(argv: list[str] | None = None) -> int:
    host_memory_retained = retain_host_memory()   # as the training commands do; before jax runs
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    module = importlib.import_module(f"roformer.bench.{args.benchmark}")
    load_before = os.getloadavg()[0]
    result = module.run(args)
    # The load average says how contended the (shared) cores were during the run.
    machine = {**machine_info(), "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
               "host_memory_retained": host_memory_retained}
    result = {"benchmark": args.benchmark, "machine": machine, **result}
    print(format_table(result.get("rows", []), result.get("columns")))
    for title, table in result.get("tables", {}).items():
        print(f"\n{title}\n" + format_table(table["rows"], table.get("columns")))
    for comparison in result.get("comparisons", []):
        print(_comparison_line(comparison))
    for note in result.get("notes", []):
        print(f"note: {note}")
    if args.json is not None:
        write_json(args.json, result)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _comparison_line(comparison: dict) -> str:
    """One line per A/B comparison: 'A / B: median x (min m, max M, n rounds)'."""
    return (f"{comparison['name']}: median {comparison['median']:.3f}x "
            f"(min {comparison['min']:.3f}, max {comparison['max']:.3f}, {comparison['rounds']} rounds)")


if __name__ == "__main__":
    sys.exit(main())
