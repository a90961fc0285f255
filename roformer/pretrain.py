"""MLM pretraining entry point.

    python -m roformer.pretrain --config=configs/tiny.py --workdir=runs/tiny
    python -m roformer.pretrain --config=configs/rotary.py:size=base --workdir=runs/base \\
        --config.train.steps=1000

Re-running with the same --workdir resumes from its latest checkpoint.
"""
import logging
import sys

from absl import app, flags
from ml_collections import config_flags

from roformer.train import train_and_evaluate
from roformer.workdir_lock import WorkdirBusy

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Pretraining config file (configs/*.py[:arg]).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory: config, metrics, TensorBoard, checkpoints.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    logging.getLogger("absl").setLevel(logging.WARNING)   # orbax logs every file rename at INFO
    try:
        train_and_evaluate(FLAGS.config, FLAGS.workdir)
    except WorkdirBusy as error:   # one line, not a traceback: nothing went wrong in this run
        raise SystemExit(f"error: {error}") from None


if __name__ == "__main__":
    app.run(main)
