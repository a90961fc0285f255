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
    monkeypatch.setattr(finetune_lib.Programs, "lower_predict", no_tracing)
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
    # a program no other test compiles: jax's persistent cache (the suite's) does not hold it yet
    _, progs = programs(store, num_labels=5)
    progs.prepare([], [PREDICT])
    [entry] = store.directory.glob("*" + program_store.SUFFIX)
    entry.write_bytes(entry.read_bytes()[:100])      # cut short
    classifier, progs = programs(store, num_labels=5)
    with caplog.at_level(logging.WARNING, logger="roformer.glue"):
        progs.prepare([], [PREDICT])
    assert progs.loaded == 0
    assert [r.message for r in caplog.records if "could not be loaded" in r.message and entry.name in r.message]
    preds = finetune_lib.predict(classifier, progs, features(8), batch_size=PREDICT[0], lengths=PREDICT[1:],
                                 pad_id=0)
    assert preds.shape == (8,)
    # compiled again and stored again whole, and the next run loads it; unless it came from
    # jax's persistent cache (the suite's) as an executable that does not run once loaded
    # again (XLA:CPU): then it was not stored, and the next run compiles it again
    stored = len(list(store.directory.glob("*" + program_store.SUFFIX)))
    classifier, progs = programs(store, num_labels=5)
    progs.prepare([], [PREDICT])
    assert progs.loaded == stored
    preds = finetune_lib.predict(classifier, progs, features(8), batch_size=PREDICT[0], lengths=PREDICT[1:],
                                 pad_id=0)
    assert preds.shape == (8,)


RUN_STORED = """
import pickle, sys
from pathlib import Path
from jax.experimental import serialize_executable
from test_glue_program_store import PREDICT, features, finetune_lib, programs
from roformer.glue.program_store import ProgramStore

store, plant = ProgramStore(Path(sys.argv[1])), sys.argv[2] == "plant"
classifier, progs = programs(store)
if plant:   # written as the store writes an entry, without its checks
    compiled = progs.lower_predict(*PREDICT).compile()
    executable, in_tree, out_tree = serialize_executable.serialize(compiled)
    key = store.key(progs._describe("predict", PREDICT))
    store.directory.mkdir(parents=True, exist_ok=True)
    store.path(key).write_bytes(pickle.dumps({"key": key, "executable": executable, "in_tree": in_tree,
                                              "out_tree": out_tree, "device": 0}))
    sys.exit(0)
progs.prepare([], [PREDICT])
preds = finetune_lib.predict(classifier, progs, features(8), batch_size=PREDICT[0], lengths=PREDICT[1:], pad_id=0)
print("loaded", progs.loaded, "predicted", preds.shape)
"""


@pytest.mark.slow   # four processes
@pytest.mark.parametrize("how", ["saved", "plant"])
def test_a_program_from_jaxs_persistent_cache_that_loads_but_cannot_run_is_not_kept(tmp_path, how):
    """On XLA:CPU an executable jax took from its persistent cache serializes without the
    functions it calls: it loads, then fails when run (NOT_FOUND). The store runs a program
    once before keeping it, and again when it loads one: such a program is not stored, and
    one stored anyway (planted here as the store writes entries) is deleted and compiled
    again, and the run predicts."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
           "PYTHONPATH": os.pathsep.join([str(tests / "glue"), str(tests), str(tests.parent),
                                          os.environ.get("PYTHONPATH", "")])}

    def run(store: str, mode: str = "run"):
        return subprocess.run([sys.executable, "-c", RUN_STORED, str(tmp_path / store), mode], env=env,
                              capture_output=True, text=True, timeout=300)

    first = run("first")   # compiled: jax's persistent cache holds the program now
    assert first.returncode == 0 and "loaded 0 predicted (8,)" in first.stdout, first.stderr[-2000:]
    second = run("second", "plant" if how == "plant" else "run")   # from jax's cache, then kept by the store
    assert second.returncode == 0, second.stderr[-2000:]
    third = run("second")
    assert third.returncode == 0 and "predicted (8,)" in third.stdout, third.stderr[-3000:]
    if how == "plant":
        assert "could not be loaded or run" in third.stderr and "not found" in third.stderr.lower()
    else:
        assert "was not stored" in second.stderr and "once loaded again it does not run" in second.stderr


def test_a_store_other_users_may_write_to_is_not_loaded_from(tmp_path, caplog):
    """A stored program runs as it is: entries load only from a folder that is the user's own
    (not writable by other users); elsewhere the store says so once and compiles."""
    store = ProgramStore(tmp_path / program_store.FOLDER)
    _, progs = programs(store, num_labels=6)
    progs.prepare([], [PREDICT])
    store.directory.chmod(0o777)
    _, progs = programs(ProgramStore(store.directory), num_labels=6)
    with caplog.at_level(logging.WARNING, logger="roformer.glue"):
        progs.prepare([], [PREDICT, (4, 16)])
    assert progs.loaded == 0
    said = [r.getMessage() for r in caplog.records if "is not the user's own" in r.getMessage()]
    assert len(said) == 1 and str(store.directory) in said[0]
    store.directory.chmod(0o755)
    _, progs = programs(ProgramStore(store.directory), num_labels=6)
    progs.prepare([], [PREDICT])
    assert progs.loaded == 1
