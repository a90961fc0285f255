"""Nothing written before a refusal: every check that can refuse a pretraining run (a
setting, resume compatibility of the model, the corpus and its masking, the workdir lock)
runs before any file of the workdir is created or replaced; each test compares the workdir
byte for byte before and after the refused command."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.refusals import make_config, refused_leaves_it_alone
from roformer.errors import ConfigError
from roformer.train import train_and_evaluate
from roformer.workdir_lock import WorkdirBusy

REPO = Path(__file__).resolve().parents[1]
@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="module")
def finished(tmp_path_factory, cache):
    workdir = tmp_path_factory.mktemp("finished") / "run"
    train_and_evaluate(make_config(cache), workdir)
    return workdir


@pytest.fixture
def run(finished, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir)
    return workdir


def test_a_refused_setting_writes_nothing(run, cache, tmp_path):
    refused_leaves_it_alone(run, make_config(cache, **{"train.steps": 0}), ConfigError, "train.steps=0 is not allowed")
    refused_leaves_it_alone(run, make_config(cache, **{"train.keep_checkpoints": -1, "train.steps": 8}), ConfigError,
                            "train.keep_checkpoints=-1 is not allowed")
    fresh = tmp_path / "fresh" / "run"
    with pytest.raises(ConfigError, match="train.checkpoint_every=0"):
        train_and_evaluate(make_config(cache, **{"train.checkpoint_every": 0}), fresh)
    assert not (tmp_path / "fresh").exists()


def test_a_refused_resume_of_another_model_writes_nothing(run, cache):
    refused_leaves_it_alone(run, make_config(cache, **{"model.hidden_size": 64, "train.steps": 8}), ConfigError,
                            "hidden_size: checkpoint=32 config=64")


def test_a_refused_resume_of_another_corpus_or_masking_writes_nothing(run, cache, tmp_path):
    """The probes' case: resuming with another corpus (its own trained tokenizer) or another
    mask rate is refused, and the run's tokenizer and config.json still describe its checkpoints."""
    refused_leaves_it_alone(run, make_config(cache, **{"data.mask_rate": 0.3, "train.steps": 8}), ConfigError,
                            "data iterator state has")
    text = tmp_path / "other.txt"
    text.write_text("\n\n".join(f"another corpus, document {i}, with words of its own: " + " ".join(
        f"word{(i * 7 + j) % 300}" for j in range(40)) for i in range(200)) + "\n")
    other = make_config(cache, **{"train.steps": 8})
    other.data.source, other.data.files = "files", str(text)
    # a tokenizer of another size is refused as another model, one of the same size by the corpus check
    refused_leaves_it_alone(run, other, ConfigError, "data iterator state has|vocab_size: checkpoint=")


def test_a_workdir_in_use_is_refused_before_anything_is_written(run, cache):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom roformer.workdir_lock import workdir_lock\n"
                               "with workdir_lock(sys.argv[1]):\n    print('locked', flush=True)\n    time.sleep(60)\n",
                               str(run)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        refused_leaves_it_alone(run, make_config(cache, **{"train.steps": 8}), WorkdirBusy, "in use by another run")
    finally:
        holder.kill()
        holder.wait()


def test_a_kernel_the_model_cannot_run_is_refused_before_the_data_is_prepared(tmp_path):
    """attention_impl=cudnn with float32 compute (and, on a CPU, no GPU at all): refused in
    one line before the corpus is tokenized into the data cache or a workdir is made, by one
    run and by vmapped seeds alike."""
    from roformer.train.seeds import train_seeds_and_evaluate

    cache, cudnn = tmp_path / "cache", {"model.attention_impl": "cudnn"}
    with pytest.raises(ConfigError, match=r"^model.attention_impl='cudnn' cannot be used: [^\n]*$"):
        train_and_evaluate(make_config(cache, **cudnn), tmp_path / "run")
    seeds = [make_config(cache, **cudnn, **{"train.seed": seed}) for seed in (0, 1)]
    with pytest.raises(ConfigError, match=r"^model.attention_impl='cudnn' cannot be used: [^\n]*$"):
        train_seeds_and_evaluate(seeds, [tmp_path / "seed0", tmp_path / "seed1"])
    assert list(tmp_path.iterdir()) == []


def test_a_step_the_device_cannot_hold_is_refused_before_the_state_is_made(cache, tmp_path, monkeypatch):
    """On a device that reports its memory, the compiled train step that exceeds it is refused in
    one line, before the state is initialised and before the run's files are written."""
    from roformer.train import compiled

    monkeypatch.setattr(compiled, "device_memory_limit", lambda: 2**20)
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^does not fit: the train step needs [^\n]* per device on this cpu, "
                                          r"which has 1.0 MiB [^\n]*train.batch_size[^\n]*$"):
        train_and_evaluate(make_config(cache), workdir)
    assert [p.name for p in workdir.rglob("*") if p.is_file() and not p.name.startswith(".")] == []
