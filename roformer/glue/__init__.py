"""GLUE fine-tuning and evaluation: readers, features, metrics, submission, `run_glue`.

`python -m roformer.glue --config=configs/glue.py --config.task=sst2 --workdir=DIR`
"""
from roformer.glue.metrics import glue_scores, task_metrics
from roformer.glue.readers import Example, GlueDataError, read_split
from roformer.glue.tasks import GLUE_TASKS, TASKS, get_task

__all__ = ["Example", "GLUE_TASKS", "GlueDataError", "TASKS", "evaluate_glue", "get_task", "glue_scores",
           "read_split", "run_glue", "task_metrics"]


def run_glue(config, workdir):
    """See roformer.glue.run.run_glue (imported lazily: it pulls in jax and the model)."""
    from roformer.glue.run import run_glue as _run_glue

    return _run_glue(config, workdir)


def evaluate_glue(config, saved, workdir):
    """See roformer.glue.evaluate.evaluate_glue (imported lazily, as run_glue)."""
    from roformer.glue.evaluate import evaluate_glue as _evaluate_glue

    return _evaluate_glue(config, saved, workdir)
