"""python -m roformer.glue --config=configs/glue.py --config.task=<task|all>
    --config.init=<pretraining workdir | HF RoFormer dir | none> --workdir=DIR

Evaluation only, of the fine-tuned models an earlier run kept (no training):
python -m roformer.glue --config=<its config> --eval_only=<its workdir> --workdir=NEW_DIR"""
from absl import flags
from ml_collections import config_flags

from roformer import cli
from roformer.glue.evaluate import evaluate_glue
from roformer.glue.run import run_glue

_CONFIG = config_flags.DEFINE_config_file("config", None, "GLUE config file (default: configs/glue.py).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.", required=True)
_EVAL_ONLY = flags.DEFINE_string("eval_only", None, "Score the fine-tuned models this GLUE workdir saved "
                                 "(models/<task>/seed<k>) on the dev splits, without training.")


def main(argv):
    if len(argv) > 1:
        raise cli.UsageError(f"unexpected arguments: {argv[1:]}")
    if _EVAL_ONLY.value:
        results = evaluate_glue(_CONFIG.value, _EVAL_ONLY.value, _WORKDIR.value)
    else:
        results = run_glue(_CONFIG.value, _WORKDIR.value)
    print(open(f"{_WORKDIR.value}/glue_results.md").read(), end="")
    print(done_line(_WORKDIR.value, results), flush=True)


def done_line(workdir: str, results: dict) -> str:
    """The command's last line: where its outputs are."""
    line = (f"done: results in {workdir}/glue_results.md and {workdir}/glue_results.json, metrics in "
            f"{workdir}/metrics.jsonl, TensorBoard in {workdir}/tensorboard")
    if "submission" in results:
        line += f", leaderboard submission in {results['submission']['zip']}"
    return line


if __name__ == "__main__":
    cli.run(main, doc=__doc__, default_config=cli.CONFIG_DIR / "glue.py")
