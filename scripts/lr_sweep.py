"""Learning rate per position scheme: the reference comparison at a few rates, one seed.

    python scripts/lr_sweep.py --workdir ~/runs/lr_sweep                    # 1e-3, 2e-3, 4e-3
    python scripts/lr_sweep.py --workdir ~/runs/lr_sweep --rates 5e-4,1e-3 --report

Each rate is an ordinary `python -m roformer.ablate --config=configs/ablation.py:reference`
in <workdir>/lr_<rate> with one seed and neither GLUE nor the context extension (resumable
like any ablation: finished runs are skipped). Extra `--config.*` flags go to every one.
The table gives, per scheme and rate, the final held-out MLM loss and order gap, marks
each scheme's best rate (lowest held-out loss among the rates it ran, once it ran two),
says when that best is the lowest or highest rate it ran (extend the grid that way: e.g.
`--rates 5e-4 --config.schemes=...` adds a column for some schemes), and prints the
`scheme_learning_rates` value that runs every scheme at its best; lr_sweep.json and
lr_sweep.md hold the same.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))   # the project's package, also when it is not installed
from roformer import cli  # noqa: E402
from roformer.files import write_json_atomic, write_text_atomic  # noqa: E402

DEFAULT_RATES = [1e-3, 2e-3, 4e-3]


def rate_workdir(root: Path, rate: str) -> Path:
    return root / f"lr_{float(rate):g}"


def run_rate(root: Path, rate: str, extra: list[str]) -> int:
    command = [sys.executable, "-m", "roformer.ablate", "--config=configs/ablation.py:reference",
               f"--workdir={rate_workdir(root, rate)}", f"--config.pretrain.train.learning_rate={float(rate)}",
               "--config.seeds=1", "--config.scheme_seeds=", "--config.glue.task=",
               "--config.extension.enabled=False", *extra]
    print("+", " ".join(command), flush=True)
    return subprocess.call(command, cwd=REPO)


def collect(root: Path, rates: list[str]) -> dict:
    """{"rates": [...], "schemes": {scheme: {rate: {"eval_loss", "eval_order_gap", "status"}}}, "best": {...}}."""
    table: dict[str, dict[str, dict]] = {}
    for rate in rates:
        path = rate_workdir(root, rate) / "ablation.json"
        if not path.is_file():
            continue
        for row in json.loads(path.read_text())["runs"]:
            table.setdefault(row["scheme"], {})[rate] = {
                "eval_loss": row.get("eval_loss"), "eval_order_gap": row.get("eval_order_gap"),
                "status": row.get("status")}
    best, edge = {}, {}
    for scheme, by_rate in table.items():
        done = {r: v["eval_loss"] for r, v in by_rate.items() if v["status"] == "done" and v["eval_loss"] is not None}
        if len(done) < 2:   # one rate is not a choice
            continue
        best[scheme] = min(done, key=done.get)
        # Best at the lowest or highest rate the scheme ran: the optimum may lie beyond it.
        tried = sorted(done, key=float)
        if best[scheme] in (tried[0], tried[-1]):
            edge[scheme] = "lower" if best[scheme] == tried[0] else "higher"
    return {"rates": rates, "schemes": table, "best": best, "edge": edge,
            "scheme_learning_rates": ",".join(f"{s}={float(r):g}" for s, r in best.items())}


def to_markdown(result: dict) -> str:
    rates = result["rates"]
    lines = ["| scheme | " + " | ".join(f"lr {float(r):g}: loss / order gap" for r in rates) + " | best |",
             "|---" * (len(rates) + 2) + "|"]
    for scheme, by_rate in result["schemes"].items():
        cells = []
        for rate in rates:
            v = by_rate.get(rate)
            if v is None or v["status"] != "done" or v["eval_loss"] is None:
                cells.append(v["status"] if v else "not run")
                continue
            mark = "**" if result["best"].get(scheme) == rate else ""
            gap = "n/a" if v["eval_order_gap"] is None else f"{v['eval_order_gap']:+.3f}"
            cells.append(f"{mark}{v['eval_loss']:.3f}{mark} / {gap}")
        best = result["best"].get(scheme)
        text = "-" if best is None else f"{float(best):g}"
        if scheme in result.get("edge", {}):
            text += f" (edge of the rates run: try {result['edge'][scheme]})"
        lines.append(f"| {scheme} | " + " | ".join(cells) + f" | {text} |")
    lines += ["", f"--config.scheme_learning_rates={result['scheme_learning_rates']}"]
    return "\n".join(lines) + "\n"


@cli.entry_point
def main() -> int:
    command = cli.CommandFlags(__doc__.split("\n\n")[0] + "\n\n--config.* flags pass through to roformer.ablate.")
    command.define("--workdir", required=True, type=Path)
    command.define("--rates", many=True, type=float, default=DEFAULT_RATES)
    command.define("--report", type=bool, help="only collect and print the table")
    extra = [a for a in sys.argv[1:] if a.startswith("--config.")]   # roformer.ablate's, passed on as they are
    args, positional = command.parse([a for a in sys.argv[1:] if not a.startswith("--config.")])
    if positional:
        raise cli.UsageError(f"unexpected arguments {positional}; only --config.* flags pass through to "
                             "roformer.ablate")
    rates = [f"{r:g}" for r in args.rates]
    failed = 0
    if not args.report:
        for rate in rates:
            failed |= run_rate(args.workdir.expanduser().resolve(), rate, extra) != 0
    result = collect(args.workdir.expanduser().resolve(), rates)
    text = to_markdown(result)
    write_json_atomic(args.workdir / "lr_sweep.json", result)
    write_text_atomic(args.workdir / "lr_sweep.md", text)
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
