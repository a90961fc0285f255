"""MLM pretraining entry point.

    python -m roformer.pretrain --config=configs/tiny.py --workdir=runs/tiny
    python -m roformer.pretrain --config=configs/rotary.py:size=base --workdir=runs/base \\
        --config.train.steps=1000

Before renting the hardware, check a config for it (compiles the train and eval steps for
the target on this host; reads no data, writes nothing; roformer.launch_check):

    python -m roformer.pretrain --config=configs/rotary.py:size=base,accel=tpu --compile_only=v5e:4x4

Re-running with the same --workdir resumes from its latest checkpoint. A warm start
(--config.train.init_from) takes the architecture from its checkpoint: only the
--config.model.* keys given on this command line (and size= in --config=FILE:size=...)
must agree with it; the config file's preset and defaults do not count.
"""
import shlex

import jax
from absl import flags
from ml_collections import config_flags

from roformer import cli, launch_check
from roformer.accelerator import requested_accelerator, require_accelerator
from roformer.distributed import initialize_distributed
from roformer.train import train_and_evaluate, warm_start
from roformer.train.progress import stop_signal

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Pretraining config file (configs/*.py[:arg]).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory: config, metrics, TensorBoard, checkpoints.")
flags.DEFINE_string("compile_only", None, "Compile the steps for a target (a TPU slice such as v5e:4x4, or GPUs "
                    "as h100:8x2), print memory, sharding and collectives, and exit; no --workdir.")
flags.mark_flags_as_required(["config"])


def next_steps(summary: dict, workdir: str) -> str:
    """One line: where the run's outputs are and what to run next (a command a shell takes
    as it is, whatever the workdir's name holds)."""
    if summary.get("preempted"):
        return (f"stopped at step {summary['final_step']} ({stop_signal(summary)}); run the same command again to "
                f"resume from {workdir}/checkpoints")
    glue_workdir = workdir.rstrip("/") + "_glue"
    # The smoke variant: minutes on a CPU, where the full protocol takes hours.
    return (f"done: metrics in {workdir}/metrics.jsonl, TensorBoard in {workdir}/tensorboard, checkpoints in "
            f"{workdir}/checkpoints. Next, GLUE: python -m roformer.glue --config=configs/glue.py:smoke "
            f"{shlex.quote(f'--config.init={workdir}')} {shlex.quote(f'--workdir={glue_workdir}')}"
            "  # 4 tasks, 1 seed, minutes on a CPU; --config=configs/glue.py '--config.task=<task|all>' "
            "runs the full protocol")


def given_model_keys() -> set[str]:
    """The model keys this command line sets: --config.model.KEY=... and size=... in the
    --config argument. The others hold the config file's values."""
    overrides = config_flags.get_override_values(FLAGS["config"])
    given = {key.split(".", 1)[1] for key in overrides if key.startswith("model.")}
    _, _, arg = config_flags.get_config_filename(FLAGS["config"]).partition(":")
    if any(item.split("=", 1)[0].strip() == "size" for item in arg.split(",")):
        given.add("size")
    return given


def main(argv):
    if len(argv) > 1:
        raise cli.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.compile_only:
        print(launch_check.check_target(FLAGS.config, FLAGS.compile_only), flush=True)
        return
    if not FLAGS.workdir:
        raise cli.UsageError("--workdir is required (or --compile_only=TARGET to check a config for a target)")
    initialize_distributed(FLAGS.config.distributed)   # before jax looks for devices
    require_accelerator(requested_accelerator(config_flags.get_config_filename(FLAGS["config"])))
    if FLAGS.config.train.init_from:
        warm_start.unset_architecture(FLAGS.config.model, given_model_keys())
    summary = train_and_evaluate(FLAGS.config, FLAGS.workdir)
    if jax.process_index() == 0:
        print(next_steps(summary, FLAGS.workdir), flush=True)


if __name__ == "__main__":
    cli.run(main, doc=__doc__, help_config=cli.CONFIG_DIR / "base.py")
