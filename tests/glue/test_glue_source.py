"""Where GLUE is read from when the config names no local copy (roformer.glue.readers.glue_source):
the local dir given, else the shared data's copy, else HF `datasets`, so an installed
package runs GLUE with no files of its own; offline, one line says which keys to set."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from roformer.errors import ConfigError
from roformer.glue import readers
from roformer.glue.readers import GlueDataError, glue_source, read_split
from roformer.glue.tasks import TASKS

REPO = Path(__file__).resolve().parents[2]


def test_auto_reads_the_dir_given_else_the_shared_copy_else_hf(tmp_path, monkeypatch):
    assert glue_source("auto", "my/glue") == ("local", "my/glue")
    (tmp_path / "with" / "glue").mkdir(parents=True)
    monkeypatch.setenv("ROFORMER_SHARED_DATA", str(tmp_path / "with"))
    assert glue_source("auto", "") == ("local", str(tmp_path / "with" / "glue"))
    monkeypatch.setenv("ROFORMER_SHARED_DATA", str(tmp_path / "without"))   # a pip install's
    assert glue_source("auto", "") == ("hf", "")
    assert glue_source("hf", "my/glue") == ("hf", "my/glue")   # an explicit source is kept
    with pytest.raises(ConfigError, match="unknown GLUE data source 'hub'; choose one of auto, local, hf, tfds"):
        glue_source("hub", "")


def test_the_default_config_names_no_local_copy():
    from roformer.configs import ablation, glue

    config = glue.get_config()
    assert (config.source, config.data_dir) == ("auto", "")
    assert ablation.get_config().glue.source == "local"   # the study reads the shared copy, as before


def test_hf_out_of_reach_is_one_line_naming_the_keys_to_set(tmp_path, monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'nyu-mll/glue' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    monkeypatch.setenv("ROFORMER_SHARED_DATA", str(tmp_path))
    with pytest.raises(GlueDataError) as caught:
        read_split(TASKS["mrpc"], "validation", source="auto", data_dir="")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("cannot read GLUE MRPC from the Hub (nyu-mll/glue) through HF datasets: Couldn't reach")
    assert "--config.data_dir" in message and "--config.source=local" in message


@pytest.mark.slow
def test_glue_offline_from_an_install_is_refused_in_one_line(tmp_path, shared_data):
    """The command as pretraining's "Next, GLUE" hint gives it, with no hub and no local copy."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "ROFORMER_SHARED_DATA": str(tmp_path / "none"), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "roformer.glue", "--config=configs/glue.py:smoke",
                           "--config.task=mrpc", f"--config.vocab={shared_data / 'vocab' / 'bert-base-uncased-vocab.txt'}",
                           f"--workdir={tmp_path / 'glue'}"], cwd=tmp_path, capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert lines and lines[-1].startswith("error: cannot read GLUE MRPC from the Hub"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "--config.data_dir" in lines[-1]
    assert readers.SOURCES[0] == "auto"
