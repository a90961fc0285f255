"""python -m roformer.glue --config=configs/glue.py --config.task=<task|all>
    --config.init=<pretraining workdir | HF RoFormer dir | none> --workdir=DIR"""
import logging

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/glue.py", "GLUE config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.", required=True)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.getLogger("roformer").setLevel(logging.INFO)
    from roformer.glue.run import run_glue
    from roformer.workdir_lock import WorkdirBusy

    try:
        results = run_glue(_CONFIG.value, _WORKDIR.value)
    except WorkdirBusy as error:   # one line, not a traceback: nothing went wrong in this run
        raise SystemExit(f"error: {error}") from None
    print(open(f"{_WORKDIR.value}/glue_results.md").read(), end="")
    if "submission" in results:
        print(f"submission: {results['submission']['zip']}")


if __name__ == "__main__":
    app.run(main)
