"""The program store: a second run with the same settings loads every GLUE program whole
(no tracing, no compiling) and trains bit for bit as the first; a program differing in
anything that decides it misses; an entry that cannot be loaded is replaced."""
import logging

import jax
import numpy as np
import pytest

from roformer.configs import glue as glue_config
from roformer.glue import finetune as finetune_lib
from roformer.glue import program_store
from roformer.glue.features import Features
from roformer.glue.program_store import ProgramStore
from roformer.model import ModelConfig

MICRO = dict(vocab_size=100, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
PREDICT = (8, 16)


def protocol(**overrides):
    config = glue_config.get_config()
    config.update(batch_size=8, max_seq_len=16, num_epochs=2.0, learning_rate=1e-3, **overrides)
    return finetune_lib.Protocol.from_config(config, "sst2")


def features(n=20, seed=0):
    rng = np.random.default_rng(seed)
    ids = [rng.integers(5, 100, k).astype(np.int32) for k in rng.choice([4, 12, 15], size=n)]
    return Features(ids, [np.zeros(len(x), np.int32) for x in ids], rng.integers(0, 2, n).astype(np.int32), np.arange(n))


def programs(store, num_labels=2, update_settings=None, **model_overrides):
    model_config = ModelConfig(**{**MICRO, **model_overrides})
    classifier = finetune_lib.Classifier.split(finetune_lib.create_model(model_config, num_labels, 0))
    return classifier, finetune_lib.Programs(classifier, update_settings or protocol().update_settings, False, store)


def train_and_predict(classifier, progs):
    logged = []
    trained, _ = finetune_lib.finetune(classifier, progs, features(), protocol(), seed=1, pad_id=0, log_every=1,
                                       log_fn=logged.append, progress=False, steps_per_call=2)
    preds = finetune_lib.predict(trained, progs, features(8, seed=1), batch_size=PREDICT[0],
                                 lengths=PREDICT[1:], pad_id=0)
    return [row["loss"] for row in logged], jax.tree.leaves(trained.params), preds


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A store filled by a first run: (store, its losses, params and predictions)."""
    store = ProgramStore(tmp_path_factory.mktemp("xla") / program_store.FOLDER)
    classifier, progs = programs(store)
    first = train_and_predict(classifier, progs)
    assert progs.loaded == 0
    return store, first


def test_a_second_run_loads_every_program_without_tracing_and_trains_bit_for_bit(filled, monkeypatch):
    store, (losses, params, preds) = filled
    assert len(list(store.directory.glob("*" + program_store.SUFFIX))) == 2    # a train and a predict program

    def no_tracing(*args, **kwargs):
        raise AssertionError("a stored program was traced again")

    monkeypatch.setattr(finetune_lib.Programs, "lower_train", no_tracing)
    monkeypatch.setattr(finetune_lib.Programs, "_lower_predict", no_tracing)
    classifier, progs = programs(store)
    again_losses, again_params, again_preds = train_and_predict(classifier, progs)
    assert progs.loaded == 2
    assert again_losses == losses and len(losses) == 6
    for ours, theirs in zip(again_params, params):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    np.testing.assert_array_equal(again_preds, preds)


@pytest.mark.parametrize("change", ["same", "num_labels", "model_config", "update_settings", "batch_size",
                                    "xla_flags", "source"])
def test_a_program_differing_in_what_decides_it_misses_the_store(filled, monkeypatch, change):
    store, _ = filled
    kwargs, shape = {}, PREDICT
    if change == "num_labels":
        kwargs = {"num_labels": 3}
    elif change == "model_config":
        kwargs = {"hidden_dropout": 0.0}      # no shape changes, the program does
    elif change == "update_settings":
        kwargs = {"update_settings": protocol(weight_decay=0.5).update_settings}
    elif change == "batch_size":
        shape = (4, PREDICT[1])
    elif change == "xla_flags":
        monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    elif change == "source":
        monkeypatch.setattr(program_store, "source_digest", lambda: "another version of the code")
    _, progs = programs(store, **kwargs)
    progs.prepare([], [shape])
    assert progs.loaded == (1 if change == "same" else 0)


def test_an_entry_that_cannot_be_loaded_is_logged_deleted_and_compiled_again(tmp_path, caplog):
    store = ProgramStore(tmp_path / program_store.FOLDER)
    _, progs = programs(store)
    progs.prepare([], [PREDICT])
    [entry] = store.directory.glob("*" + program_store.SUFFIX)
    entry.write_bytes(entry.read_bytes()[:100])      # cut short
    classifier, progs = programs(store)
    with caplog.at_level(logging.WARNING, logger="roformer.glue"):
        progs.prepare([], [PREDICT])
    assert progs.loaded == 0
    assert [r.message for r in caplog.records if "could not be loaded" in r.message and entry.name in r.message]
    preds = finetune_lib.predict(classifier, progs, features(8), batch_size=PREDICT[0], lengths=PREDICT[1:],
                                 pad_id=0)
    assert preds.shape == (8,)
    # compiled again and stored again whole: the next run loads it
    _, progs = programs(store)
    progs.prepare([], [PREDICT])
    assert progs.loaded == 1
