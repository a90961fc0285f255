"""Held-out MLM loss of a pretraining run's checkpoint, without training.

    python -m roformer.evaluate --workdir=runs/tiny [--step=N] [--eval-batches=N] [--out=FILE]

Restores the newest checkpoint (or --step's) of the workdir and scores the run's held-out
batches as the training loop does (roformer.train.checkpoint_eval): loss, MLM accuracy and
perplexity, written to WORKDIR/eval_<step>.json (or --out) beside what the run logged at
that step; a result file that cannot be written (a read-only workdir) is refused before the
checkpoint is read. GLUE scores of fine-tuned models: `python -m roformer.glue --eval_only=...`.
"""
from __future__ import annotations

import sys
from pathlib import Path

from roformer import cli
from roformer.files import check_writable, write_json_atomic, writing


def summary_line(result: dict) -> str:
    """One line: the step's held-out metrics, and the loss the run logged there if it did."""
    line = (f"step {result['step']}: held-out MLM loss {result['eval_loss']:.4f}, accuracy "
            f"{result['eval_mlm_accuracy']:.4f}, perplexity {result['eval_perplexity']:.4g} over "
            f"{result['eval_batches']} batches of {result['batch_size']} x {result['seq_len']} tokens")
    if "eval_loss" in result["logged"]:
        line += f" (the run logged {result['logged']['eval_loss']:.4f})"
    return line


def command_flags() -> cli.CommandFlags:
    command = cli.CommandFlags(__doc__)
    command.define("--workdir", required=True, help="a pretraining workdir (checkpoints/, config.json)")
    command.define("--step", type=int, default=-1, help="checkpoint step (default: newest)")
    command.define("--eval-batches", type=int, default=0,
                   help="held-out batches to score (default: the run's train.eval_batches)")
    command.define("--out", default="", help="result file (default: WORKDIR/eval_<step>.json)")
    return command


@cli.entry_point
def main(argv: list[str] | None = None) -> None:
    args, positional = command_flags().parse(sys.argv[1:] if argv is None else argv)
    if positional:
        raise cli.UsageError(f"unexpected arguments: {positional}")
    from roformer.train.checkpoint_eval import evaluate_checkpoint   # jax: after --help
    from roformer.workdir import PretrainWorkdir

    run = PretrainWorkdir(args.workdir)
    step = run.resolve_step(args.step)
    out = Path(args.out) if args.out else run.eval_file(step)
    check_writable(out.parent, f"the held-out metrics {out.name}")   # before minutes of computing them
    result = evaluate_checkpoint(run.path, step=step, eval_batches=args.eval_batches)
    with writing(f"the held-out metrics {out}"):
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out, result, indent=2)
    print(summary_line(result), flush=True)
    print(f"done: held-out metrics in {out}", flush=True)


if __name__ == "__main__":
    main()
