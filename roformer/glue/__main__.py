"""python -m roformer.glue --config=configs/glue.py --config.task=<task|all>
    --config.init=<pretraining workdir | HF RoFormer dir | none> --workdir=DIR

Evaluation only, of the fine-tuned models an earlier run kept (no training):
python -m roformer.glue --config=<its config> --eval_only=<its workdir> --workdir=NEW_DIR

Before renting the hardware, check the config for it (compiles the train and predict programs
for one of the target's devices; reads no data, writes nothing; roformer.glue_launch_check):
python -m roformer.glue --config=configs/glue.py:accel=tpu --config.model.size=base \
    --config.model.vocab_size=30522 --compile_only=v5e:4x4"""
import sys
from pathlib import Path

from absl import flags

from roformer import cli
from roformer.accelerator import requested_accelerator, require_accelerator
from roformer.glue.evaluate import evaluate_glue
from roformer.glue.run import run_glue


def main(argv):
    if len(argv) > 1:
        raise cli.UsageError(f"unexpected arguments: {argv[1:]}")
    config, workdir, eval_only = flags.FLAGS.config, flags.FLAGS.workdir, flags.FLAGS.eval_only
    if flags.FLAGS.compile_only:
        from roformer import glue_launch_check as compile_only

        print(compile_only.check_target(config, flags.FLAGS.compile_only), flush=True)
        return
    if not workdir:
        raise cli.UsageError("--workdir is required (or --compile_only=TARGET to check a config for a target)")
    require_accelerator(requested_accelerator(cli.config_spec(sys.argv) or ""))
    results = evaluate_glue(config, eval_only, workdir) if eval_only else run_glue(config, workdir)
    print(open(f"{workdir}/glue_results.md").read(), end="")
    print(done_line(workdir, results), flush=True)


def done_line(workdir: str, results: dict) -> str:
    """The command's last line: where its outputs are."""
    line = (f"done: results in {workdir}/glue_results.md and {workdir}/glue_results.json, metrics in "
            f"{workdir}/metrics.jsonl, TensorBoard in {workdir}/tensorboard")
    saved = [r["saved_models"] for r in results.get("tasks", {}).values() if "saved_models" in r]
    if len(saved) > 2:   # a line per task would bury the rest
        root = str(Path(saved[0]["dir"]).parent)
        line += (f", fine-tuned models (each task's median seed) in {root}/<task>/seed<k>"
                 + (f", exported for HF transformers in {root}/<task>/hf" if any(s.get("hf") for s in saved) else ""))
    elif saved:
        line += ", fine-tuned model (median seed) in " + ", ".join(f"{s['dir']}/seed{s['median_seed']}" for s in saved)
        exports = [s["hf"] for s in saved if s.get("hf")]
        line += f", exported for HF transformers in {', '.join(exports)}" if exports else ""
    if "submission" in results:
        line += f", leaderboard submission in {results['submission']['zip']}"
    return line


if __name__ == "__main__":
    # Flags are defined only when run as a program: this module must stay importable next
    # to roformer.pretrain, which defines its own --config.
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "GLUE config file (default: configs/glue.py).")
    flags.DEFINE_string("workdir", None, "Output directory.")
    flags.DEFINE_string("eval_only", None, "Score the fine-tuned models this GLUE workdir saved "
                        "(models/<task>/seed<k>) on the dev splits, without training.")
    flags.DEFINE_string("compile_only", None, "Compile the train and predict programs for a target (a TPU slice "
                        "such as v5e:4x4, or GPUs as h100:8), print memory and exit; no --workdir.")
    cli.run(main, doc=__doc__, default_config=cli.CONFIG_DIR / "glue.py")
