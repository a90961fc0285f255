"""MLM pretraining entry point.

    python -m roformer.pretrain --config=configs/tiny.py --workdir=runs/tiny
    python -m roformer.pretrain --config=configs/rotary.py:size=base --workdir=runs/base \\
        --config.train.steps=1000

Re-running with the same --workdir resumes from its latest checkpoint.
"""
import jax
from absl import flags
from ml_collections import config_flags

from roformer import cli
from roformer.train import train_and_evaluate

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Pretraining config file (configs/*.py[:arg]).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory: config, metrics, TensorBoard, checkpoints.")
flags.mark_flags_as_required(["config", "workdir"])


def next_steps(summary: dict, workdir: str) -> str:
    """One line: where the run's outputs are and what to run next."""
    if summary.get("preempted"):
        return (f"stopped at step {summary['final_step']} (SIGTERM); run the same command again to resume "
                f"from {workdir}/checkpoints")
    return (f"done: metrics in {workdir}/metrics.jsonl, TensorBoard in {workdir}/tensorboard, checkpoints in "
            f"{workdir}/checkpoints. Next, GLUE: python -m roformer.glue --config=configs/glue.py "
            f"--config.task=<task|all> --config.init={workdir} --workdir={workdir.rstrip('/')}_glue")


def main(argv):
    if len(argv) > 1:
        raise cli.UsageError(f"unexpected arguments: {argv[1:]}")
    summary = train_and_evaluate(FLAGS.config, FLAGS.workdir)
    if jax.process_index() == 0:
        print(next_steps(summary, FLAGS.workdir), flush=True)


if __name__ == "__main__":
    cli.run(main, doc=__doc__, help_config=cli.CONFIG_DIR / "base.py")
