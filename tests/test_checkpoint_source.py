"""roformer.checkpoint_source: the one resolver of where a warm start's or a fine-tuning
run's weights, architecture and tokenizer come from, and the one table of what may differ."""
import dataclasses
import json

import jax
import numpy as np
import pytest

from roformer import checkpoint_source, convert
from roformer.checkpoint_source import MAY_DIFFER, CheckpointSource, may_differ, tokenizer_beside
from roformer.data.config import DataConfig
from roformer.errors import ConfigError
from roformer.model import ModelConfig

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)

SMALL = ModelConfig.from_preset("tiny", hidden_size=32, num_heads=2, intermediate_size=64, vocab_size=50)


def test_one_table_says_what_may_differ_and_why_for_every_use():
    from roformer.glue import init as glue_init
    from roformer.train import bookkeeping, warm_start

    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(MAY_DIFFER) <= fields and all(rule.why for rule in MAY_DIFFER.values())
    assert bookkeeping.RESUMABLE_ACROSS == may_differ("resume") == ("attention_impl", "remat")
    assert set(glue_init.FINETUNE_FIELDS) == set(may_differ("finetune")) == {
        "attention_impl", "remat", "hidden_dropout", "attention_dropout", "dtype"}
    assert warm_start.MAY_DIFFER == may_differ("warm_start")
    # a resumed or fine-tuned run may change nothing a warm start could not
    assert set(may_differ("resume")) | set(may_differ("finetune")) <= set(may_differ("warm_start"))
    assert not set(warm_start.ARCHITECTURE) & set(MAY_DIFFER)


def test_the_tokenizer_beside_the_weights_and_its_casing(tmp_path):
    assert tokenizer_beside(tmp_path) == (None, True)
    (tmp_path / "vocab.txt").write_text("[PAD]\n")
    assert tokenizer_beside(tmp_path) == (tmp_path / "vocab.txt", True)
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False}))
    assert tokenizer_beside(tmp_path) == (tmp_path / "tokenizer.json", False)


def fake_hf_dir(path, **fields):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "roformer", "vocab_size": 50, "hidden_size": 32,
                                                  "num_hidden_layers": 1, "num_attention_heads": 2, **fields}))
    return path


def test_find_identifies_each_kind_without_reading_parameters(tmp_path):
    hf = fake_hf_dir(tmp_path / "hf")
    (hf / "vocab.txt").write_text("[PAD]\n")
    (hf / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False}))
    source = CheckpointSource.find(str(hf), what="config.init")
    assert (source.kind, source.path, source.step, source.tokenizer_file, source.lowercase, source.what) == (
        "hf", hf.resolve(), -1, hf.resolve() / "vocab.txt", False, "config.init")
    assert source.model_config() == convert.hf_config_to_model_config(json.loads((hf / "config.json").read_text()))

    run = tmp_path / "run"
    for step in (3, 7):
        (run / "checkpoints" / str(step)).mkdir(parents=True)
    (run / "tokenizer.json").write_text("{}")
    assert CheckpointSource.find(run).step == 7
    found = CheckpointSource.find(run, 3)
    assert (found.kind, found.step, found.tokenizer_file, found.lowercase) == ("pretrain", 3,
                                                                               run.resolve() / "tokenizer.json", True)
    assert checkpoint_source.checkpoint_kind(run) == "pretrain"


def test_find_refuses_what_it_cannot_start_from(tmp_path):
    with pytest.raises(ConfigError, match=r"^train.init_from='.*nowhere': no such directory"):
        CheckpointSource.find(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="^config.init=.* is neither a pretraining workdir"):
        CheckpointSource.find(tmp_path, what="config.init")
    (tmp_path / "run" / "checkpoints" / "1").mkdir(parents=True)
    with pytest.raises(ConfigError, match=f"^config.init={tmp_path / 'run'}: no tokenizer.json in the workdir; "
                                          "give the run's vocabulary with --config.vocab$"):
        CheckpointSource.find(str(tmp_path / "run"), what="config.init",
                              missing_tokenizer_hint="; give the run's vocabulary with --config.vocab")


def test_a_pretraining_run_takes_the_checkpoints_tokenizer_unless_it_names_one(tmp_path):
    hf = fake_hf_dir(tmp_path / "hf")
    data = DataConfig(source="files", files="x.txt")
    with pytest.raises(ConfigError, match=r"no tokenizer.json or vocab.txt beside the weights; name the vocabulary "
                                          r"it was trained with: --config.data.vocab=VOCAB$"):
        CheckpointSource.find(hf).with_tokenizer(data)
    named = dataclasses.replace(data, vocab="mine.txt")
    assert CheckpointSource.find(hf).with_tokenizer(named) is named
    (hf / "tokenizer.json").write_text("{}")
    (hf / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False}))
    taken = CheckpointSource.find(hf).with_tokenizer(data)
    assert (taken.vocab, taken.lowercase) == (str(hf.resolve() / "tokenizer.json"), False)


def test_load_gives_the_mlm_model_or_the_bare_encoder(tmp_path):
    model = convert.build_model(SMALL, "mlm", seed=1)
    convert.save_converted(model, tmp_path / "mlm")
    source = CheckpointSource.find(tmp_path / "mlm")
    assert source.kind == "converted" and source.model_config() == SMALL
    config, params = source.load()
    assert config == SMALL and set(params) == {"roformer", "cls"}
    _, encoder = source.load(head="none")
    jax.tree.map(np.testing.assert_array_equal, encoder, params["roformer"])

    classifier = convert.build_model(SMALL, "classification", num_labels=2)
    convert.save_converted(classifier, tmp_path / "classifier")
    with pytest.raises(ConfigError, match="holds a RoFormerForSequenceClassification, not an MLM model"):
        CheckpointSource.find(tmp_path / "classifier").load()
    _, encoder = CheckpointSource.find(tmp_path / "classifier").load(head="none")
    assert "cls" not in encoder and "classifier" not in encoder
