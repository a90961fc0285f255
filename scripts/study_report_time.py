"""What writing the accelerator comparison's report costs at a variant's real shapes: every
scheme of `configs/study.py:VARIANT` given a record and test sums of the sizes a study run
makes (its members and one group beyond the grid, its evaluations, budgets, order-horizon
variants, position signal and test items; the losses are random), then the report written as
a run writes it after each group: with 1, 2, ... schemes finished, then once per group beyond
a grid with every scheme finished.

    python scripts/study_report_time.py gpu_tiny --pack .device/study_data/wikipedia_en.npz --dir /tmp/reptime

Prints each write's seconds and their sum. gpu_smoke needs no pack (its corpus is embedded).
DIR is then a study workdir of fake records, which `python -m roformer.study report`
and notebooks/study_report.ipynb read as they read a real one.
"""
from __future__ import annotations

import dataclasses
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))   # the project's package, also when it is not installed

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from roformer.cli import CommandFlags, UsageError, entry_point, load_config  # noqa: E402
from roformer.config_files import CONFIG_DIR  # noqa: E402
from roformer.study import plan as study_plan, report as study_report, session as study, stats as study_stats  # noqa: E402
from roformer.study.records import save_scheme  # noqa: E402
from roformer.files import write_json_atomic  # noqa: E402
from roformer.model import RoFormerForMaskedLM  # noqa: E402


def fake_record(plan, data, scheme: str, rng: np.random.Generator) -> tuple[dict, dict]:
    """A record and test sums of a scheme whose grid and one group beyond it have trained."""
    st, train = plan.study, plan.train
    ends = plan.budgets
    grid = plan.members()
    beyond = plan.members([min(plan.rates) / 2], first_index=len(grid))
    group, n = grid + beyond, len(grid) + len(beyond)
    model_cfg = plan.model_config(scheme, data.vocab_size, data.pad_id)
    signal = RoFormerForMaskedLM(model_cfg, rngs=nnx.Rngs(0)).roformer.position.signal()
    tokens_per_step = int(train.batch_size) * int(train.seq_len)
    steps = range(0, ends[-1] + 1, int(st.eval_every))
    evals = [{"step": s, "tokens": s * tokens_per_step, "validation_loss": rng.normal(6, 0.1, n).tolist(),
              "validation_accuracy": rng.uniform(0, 0.4, n).tolist(),
              "gaps": {name: rng.normal(0.5, 0.3, n).tolist() for name in data.variants},
              "signal": {key: [np.asarray(value).tolist()] * n for key, value in signal.items()}} for s in steps]
    budgets = [{"steps": end, "tokens": end * tokens_per_step, "validation_loss": rng.normal(5, 0.1, n).tolist(),
                "test_loss": rng.normal(5, 0.1, n).tolist(), "diverged_at": [None] * n} for end in ends]
    timing = dict.fromkeys(("setup_s", "compile_s", "train_s", "eval_s", "branch_s", "programs_s", "first_eval_s",
                            "wall_s", "tokens_per_s", "programs_wait_s"), 1.0) | {"compiled_ahead": True}
    record = {"scheme": scheme, "model": model_cfg.to_dict(), "parameters": study_plan.parameter_count(model_cfg),
              "members": [dataclasses.asdict(m) for m in group], "tokens_per_step": tokens_per_step, "evals": evals,
              "budgets": budgets, "diverged_at": [None] * n, "timing": timing, "device": "none", "backend": "none",
              "edges": {"rates": [beyond[0].rate], "members": len(beyond), "timing": timing},
              "fingerprint": study.scheme_fingerprint(plan, scheme, data.manifest)}
    _, test_weight = study_stats.item_sums(np.zeros((1, len(data.test_items))),
                                           data.test["masked_weights"].sum(-1), data.test_items)
    sums = {f"budget{end}": (test_weight[None] * rng.normal(5, 0.3, (n, len(test_weight)))).astype(np.float32)
            for end in ends}
    return record, {"test_weight": test_weight, **sums}


@entry_point
def main(argv: list[str] | None = None) -> None:
    command = CommandFlags(__doc__)
    command.define("--pack", default="", help="its data pack (python -m roformer.study pack)")
    command.define("--dir", required=True, help="scratch directory (removed and made again)")
    args, positional = command.parse(sys.argv[1:] if argv is None else argv)
    if len(positional) != 1:
        raise UsageError(f"give one configs/study.py variant, e.g. gpu_tiny; got {positional}")
    args.variant = positional[0]
    config = load_config(f"{CONFIG_DIR / 'study.py'}:{args.variant}")
    config.study.data_pack = args.pack
    plan = study_plan.build_plan(config)
    data = study.study_splits(plan)
    workdir = Path(args.dir)
    shutil.rmtree(workdir, ignore_errors=True)
    (workdir / study.SCHEMES_DIR).mkdir(parents=True)
    write_json_atomic(workdir / study.DATA_MANIFEST, data.manifest)
    # The config as a study records it, so DIR reads as a study workdir (`study report`, the notebook).
    (workdir / study.CONFIG_RECORD).write_text(config.to_json_best_effort(indent=2) + "\n")
    rng = np.random.default_rng(0)
    schemes = list(plan.schemes)
    print(f"{args.variant}: {len(schemes)} schemes, {len(data.test_items):,} test rows, "
          f"bootstrap {config.study.bootstrap}")
    seconds = []
    for k in range(2 * len(schemes)):   # each scheme's grid saved, then each group beyond a grid
        if k < len(schemes):
            save_scheme(workdir, schemes[k], *fake_record(plan, data, schemes[k], rng))
        started = time.perf_counter()
        study_report.write(config, workdir)
        seconds.append(time.perf_counter() - started)
        print(f"write with {min(k + 1, len(schemes))} schemes: {seconds[-1]:.1f} s")
    print(f"{len(seconds)} writes: {sum(seconds):.1f} s")


if __name__ == "__main__":
    main()
