"""Training while the token cache builds (roformer.data.streaming): the batch order does not
depend on the build's speed, a run stopped mid-build resumes exactly (with the build started
over, or finished), the held-out batches are those of a built cache, and a failing build is a
one-line error in the reader, not a hang."""
import threading
import time

import numpy as np
import pytest

from helpers import wiki_cfg
from roformer.data import make_pretrain_data, prepare_corpus, streaming
from roformer.data.config import DataConfig
from roformer.data.sources import TextSource, make_source
from roformer.errors import ConfigError, DataBuildError, UserError

SEQ_LEN, BATCH = 64, 32


class SlowSource(TextSource):
    """A source that reads like `inner`, `delay` seconds per document (a slow tokenizer or
    disk); it stops before document `gate_at` until `gate` is set, and raises OSError at
    document `fail_after`, when given."""

    def __init__(self, inner: TextSource, delay: float = 0.0, gate_at: int | None = None,
                 gate: threading.Event | None = None, fail_after: int | None = None):
        self.inner, self.delay, self.gate_at, self.gate, self.fail_after = inner, delay, gate_at, gate, fail_after
        self.name = inner.name

    def documents(self):
        for i, doc in enumerate(self.inner.documents()):
            if i == self.fail_after:
                raise OSError(5, "Input/output error", "wiki_06")
            if i == self.gate_at:
                self.gate.wait()
            time.sleep(self.delay)
            yield doc

    def describe(self):
        return self.inner.describe()


GATE_AT = 2000   # of the two files' ~2,800 documents: several shards are finished before it


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks and shards small enough that two Wikipedia files span many of each."""
    monkeypatch.setattr(streaming, "BLOCK_TOKENS", 1 << 12)
    monkeypatch.setattr(streaming, "STREAM_SHARD_TOKENS", 1 << 12)


def config(shared_data, cache, **overrides):
    return wiki_cfg(shared_data, cache, **{"train_while_building": "on", "num_workers": 1, **overrides})


def streamed(monkeypatch, cfg, **slow):
    """The pipeline of `cfg`, its shards built in the background from a SlowSource(**slow)."""
    monkeypatch.setattr(streaming, "make_source", lambda data: SlowSource(make_source(data), **slow))
    data = make_pretrain_data(cfg, seq_len=SEQ_LEN, batch_size=BATCH, seed=3, show_progress=False)
    monkeypatch.setattr(streaming, "make_source", make_source)
    return data


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


def built_first(shared_data, cache):
    """The streamed pipeline over an entry built completely beforehand (large shards)."""
    prepare_corpus(config(shared_data, cache, train_while_building="off"), show_progress=False)
    data = make_pretrain_data(config(shared_data, cache), seq_len=SEQ_LEN, batch_size=BATCH, seed=3,
                              show_progress=False)
    data.ledger.wait(lambda: False, "the whole corpus")
    return data


def test_order_does_not_depend_on_build_speed(shared_data, tmp_path, monkeypatch, small_blocks):
    done = built_first(shared_data, tmp_path / "built")
    epoch_rows = done.epoch_plan(1).num_rows
    n = epoch_rows // BATCH + 6    # past epoch 0 into epoch 1, which reads the whole corpus
    reference = take(done.train_iterator(), n)

    gate = threading.Event()
    slow = streamed(monkeypatch, config(shared_data, tmp_path / "slow"), delay=0.0005, gate_at=GATE_AT, gate=gate)
    iterator = slow.train_iterator()
    first = take(iterator, 10)
    assert not slow.ledger.complete   # the build waits at the gate: these came from its first shards
    gate.set()
    batches = [*first, *take(iterator, n - 10)]
    assert slow.ledger.complete and len(slow.ledger.snapshot().tokens) > 3   # many small shards
    same(batches, reference)
    assert iterator.epoch == 1 and iterator.get_state()["order"] == "streamed"
    # the blocks cover every training document once in epoch 0
    assert slow.block_plan(0) is not None and slow.block_plan(10_000) is None
    slow.close()


def test_heldout_batches_are_a_built_caches(shared_data, tmp_path, monkeypatch, small_blocks):
    plain = make_pretrain_data(config(shared_data, tmp_path / "plain", train_while_building="off"),
                               seq_len=SEQ_LEN, batch_size=BATCH, seed=3, show_progress=False)
    gate = threading.Event()
    slow = streamed(monkeypatch, config(shared_data, tmp_path / "slow"), gate_at=GATE_AT, gate=gate)
    batches = slow.eval_batches(1)
    assert not slow.ledger.complete   # fixed before the corpus is, from its first shards
    same(batches, plain.eval_batches(1))
    threading.Timer(0.5, gate.set).start()
    slow.close()


def test_resume_mid_build(shared_data, tmp_path, monkeypatch, small_blocks):
    reference = take(built_first(shared_data, tmp_path / "built").train_iterator(), 12)

    cache = tmp_path / "cache"
    gate = threading.Event()
    first = streamed(monkeypatch, config(shared_data, cache), gate_at=GATE_AT, gate=gate)
    iterator = first.train_iterator()
    before = take(iterator, 5)
    state = iterator.get_state()
    assert not first.ledger.complete and state["epoch"] == 0 and state["block"] > 0
    threading.Timer(0.5, gate.set).start()   # after close() asked the build to stop
    first.close()   # the run stops mid-build: what was built is discarded
    assert not first.ledger.builder.alive and not first.ledger.complete and not first.ledger.directory.exists()

    again = streamed(monkeypatch, config(shared_data, cache), delay=0.0002)   # the build starts over
    resumed = again.train_iterator()
    resumed.set_state(state)
    after = take(resumed, 7)
    same(before + after, reference)

    again.ledger.wait(lambda: False, "the whole corpus")   # resumed once the build had finished
    finished = make_pretrain_data(config(shared_data, cache), seq_len=SEQ_LEN, batch_size=BATCH, seed=3,
                                  show_progress=False).train_iterator()
    finished.set_state(state)
    same(take(finished, 7), reference[5:])


def test_new_phase_mid_build_continues_at_the_next_block(shared_data, tmp_path, monkeypatch, small_blocks):
    gate = threading.Event()
    slow = streamed(monkeypatch, config(shared_data, tmp_path / "cache"), gate_at=GATE_AT, gate=gate)
    iterator = slow.train_iterator()
    take(iterator, 3)
    state = iterator.get_state()
    other = make_pretrain_data(config(shared_data, tmp_path / "cache"), seq_len=2 * SEQ_LEN, batch_size=BATCH,
                               seed=3, show_progress=False).train_iterator()
    assert other.resume(state)   # another batch shape: a new phase
    assert (other.epoch, other.block, other.row, other.step) == (0, state["block"] + 1, 0, 3)
    assert not slow.ledger.complete   # it did not wait for the whole corpus
    threading.Timer(0.5, gate.set).start()
    slow.close()
    other._data.close()


def test_state_of_the_built_order_is_refused(shared_data, tmp_path, monkeypatch, small_blocks):
    plain = make_pretrain_data(config(shared_data, tmp_path / "cache", train_while_building="off"),
                               seq_len=SEQ_LEN, batch_size=BATCH, seed=3, show_progress=False).train_iterator()
    next(plain)
    data = make_pretrain_data(config(shared_data, tmp_path / "cache"), seq_len=SEQ_LEN, batch_size=BATCH, seed=3,
                              show_progress=False)
    with pytest.raises(ConfigError, match="corpus_id"):
        data.train_iterator().resume(plain.get_state())
    data.close()


def test_a_failing_build_is_one_line_in_the_reader(shared_data, tmp_path, monkeypatch, small_blocks):
    data = streamed(monkeypatch, config(shared_data, tmp_path / "cache"), fail_after=1000)
    raised = []

    def read():
        try:
            take(data.train_iterator(), 10_000)
        except Exception as error:  # noqa: BLE001 - the test looks at it
            raised.append(error)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(60)
    assert not reader.is_alive(), "the reader hangs on a failed build"
    [error] = raised
    assert isinstance(error, DataBuildError) and isinstance(error, UserError)
    assert "\n" not in str(error) and "Input/output error" in str(error) and "token cache" in str(error)
    with pytest.raises(DataBuildError):   # every later read says the same
        data.eval_batches(1)


def test_the_switch():
    assert DataConfig(source="hf", hf_path="x", hf_streaming=True).trains_while_building
    assert not DataConfig(source="files").trains_while_building
    assert DataConfig(source="files", train_while_building="on").trains_while_building
    assert not DataConfig(source="hf", hf_streaming=True, train_while_building="off").trains_while_building
    with pytest.raises(ConfigError, match="train_while_building"):
        DataConfig(train_while_building="yes")


@pytest.mark.slow
def test_a_run_trains_and_resumes_in_the_streamed_order(tmp_path):
    """The training loop on a cache it builds as it trains: stopped at step 3 and resumed, it
    ends with the parameters of an uninterrupted run, and says the order in its summary."""
    import jax
    import orbax.checkpoint as ocp

    from helpers import MICRO_MODEL, tiny_run_config
    from roformer.train import train_and_evaluate

    overrides = {**MICRO_MODEL, "data.train_while_building": "on", "train.batch_size": 8, "train.seq_len": 32,
                 "train.warmup_steps": 2, "train.eval_every": 3, "train.eval_batches": 1,
                 "train.checkpoint_every": 3, "train.log_every": 1, "train.progress_bar": False}
    cache = tmp_path / "cache"
    reference = train_and_evaluate(tiny_run_config(cache, overrides, **{"train.steps": 6}), tmp_path / "ref")
    assert reference["data"]["order"] == "streamed" and reference["data"]["complete"]
    train_and_evaluate(tiny_run_config(cache, overrides, **{"train.steps": 3}), tmp_path / "run")
    resumed = train_and_evaluate(tiny_run_config(cache, overrides, **{"train.steps": 6}), tmp_path / "run")
    assert resumed["start_step"] == 3 and resumed["final_step"] == 6

    def params(workdir):
        with ocp.CheckpointManager(workdir / "checkpoints", item_names=("state",)) as manager:
            assert manager.latest_step() == 6
            return manager.restore(6, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]["params"]

    for a, b in zip(jax.tree.leaves(params(tmp_path / "ref")), jax.tree.leaves(params(tmp_path / "run"))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_recorded_runs_keep_their_fingerprints():
    """A data section where the setting leaves the order as before fingerprints as before it
    existed (ablation and study records stay current); where it changes the order, it counts."""
    import dataclasses

    import ml_collections

    from roformer.ablation import plan
    from roformer.data.config import without_neutral_settings

    section = dataclasses.asdict(DataConfig(source="files", files="x"))
    before = {k: v for k, v in section.items() if k != "train_while_building"}
    assert without_neutral_settings(section) == before
    assert without_neutral_settings({**section, "train_while_building": "off"}) == before
    config = ml_collections.ConfigDict

    assert plan.fingerprint(config({"data": section})) == plan.fingerprint(config({"data": before}))
    assert plan.fingerprint(config(section)) == plan.fingerprint(config(before))   # a data section alone
    assert plan.fingerprint(config({"data": section})) != plan.fingerprint(
        config({"data": {**section, "train_while_building": "on"}}))
    streaming_hf = {**section, "source": "hf", "hf_path": "x", "hf_streaming": True}
    assert without_neutral_settings(streaming_hf) == streaming_hf
