"""What an HF export carries to be published: the transformers version its config is in, and
for a GLUE head the task's class names (id2label / label2id) rather than LABEL_0, LABEL_1."""
import importlib.metadata
import json

import pytest

from roformer import convert
from roformer.glue.tasks import TASKS
from roformer.model import ModelConfig

SMALL = ModelConfig(vocab_size=100, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)


def test_a_glue_head_exports_the_tasks_class_names():
    hf = convert.model_config_to_hf_config(SMALL, head="classification", num_labels=2,
                                           label_names=TASKS["sst2"].label_names)
    assert hf["id2label"] == {"0": "negative", "1": "positive"}
    assert hf["label2id"] == {"negative": 0, "positive": 1}
    mnli = convert.model_config_to_hf_config(SMALL, head="classification", num_labels=3,
                                             label_names=TASKS["mnli"].label_names)
    assert mnli["id2label"] == {"0": "entailment", "1": "neutral", "2": "contradiction"}
    plain = convert.model_config_to_hf_config(SMALL, head="classification", num_labels=2)
    assert plain["id2label"] == {"0": "LABEL_0", "1": "LABEL_1"}   # no task: HF's default names


@pytest.mark.parametrize("name", [name for name, task in TASKS.items() if not task.is_regression])
def test_every_classification_task_names_each_class_once(name):
    names = TASKS[name].label_names
    assert len(names) == TASKS[name].num_labels == len(set(names))
    assert not set(names) & {"0", "1"}


def test_the_config_says_which_transformers_version_it_is_written_for():
    hf = convert.model_config_to_hf_config(SMALL, head="mlm")
    try:
        expected = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        expected = convert.OLDEST_TESTED_TRANSFORMERS
    assert hf["transformers_version"] == expected


def test_to_hf_from_a_pretraining_run_writes_a_model_card(tmp_path):
    """README.md beside the weights: the Hub's front matter, the architecture, what the run
    trained on, for how long, and its held-out loss at the exported step."""
    import jax.numpy as jnp
    from flax import nnx

    from roformer.model import RoFormerForMaskedLM
    from roformer.train.checkpoint import Checkpointer

    run = tmp_path / "run"
    model = RoFormerForMaskedLM(SMALL, rngs=nnx.Rngs(0))
    checkpointer = Checkpointer(run / "checkpoints", max_to_keep=1, async_save=False)
    checkpointer.save(7, {"params": nnx.to_pure_dict(nnx.state(model, nnx.Param)), "opt_state": {},
                          "step": jnp.zeros((), jnp.int32)}, {}, SMALL.to_dict())
    checkpointer.close()
    (run / "config.json").write_text(json.dumps({"data": {"source": "files", "files": "corpus/*.txt"},
                                                 "train": {"batch_size": 4, "seq_len": 32, "phases": ""}}))
    (run / "summary.json").write_text(json.dumps({"final_step": 7, "eval_loss": 5.4321}))
    convert.main(["to-hf", str(run), str(tmp_path / "hf")])
    card = (tmp_path / "hf" / "README.md").read_text()
    assert card.startswith("---\nlicense: apache-2.0\nlibrary_name: transformers\npipeline_tag: fill-mask\n")
    for text in ("# RoFormer (RoFormerForMaskedLM)", "1 layers, hidden size 32", f"step 7 of {run}",
                 "corpus/*.txt (files source)", "7 steps of 4 x 32 tokens (about 896 tokens",
                 "**held-out MLM loss**: 5.4321 at step 7", "Licence: apache-2.0"):
        assert text in card, text
