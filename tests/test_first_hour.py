"""What a newcomer meets in the first hour: a `size=` preset that trains at a batch and length
its model suits, `accel=gpu|tpu` refused in one line where jax sees no such device, and the
other first-run surprises of issue 67 (each test names its own)."""
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from roformer.accelerator import requested_accelerator, require_accelerator
from roformer.configs import base, rotary
from roformer.errors import ConfigError
from roformer.model import PRESETS

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("size", ["tiny", "mini"])
def test_a_small_size_preset_trains_at_a_batch_and_length_a_laptop_holds(size):
    train = rotary.get_config(f"size={size}").train
    assert (train.batch_size, train.seq_len) == (32, 128)


def test_every_size_preset_sets_a_batch_and_base_keeps_berts():
    assert set(base.SIZE_BATCHES) == set(PRESETS)
    default, sized = rotary.get_config().train, rotary.get_config("size=base").train
    assert (default.batch_size, default.seq_len) == (sized.batch_size, sized.seq_len) == (256, 512)


def test_the_accelerator_a_config_argument_asks_for():
    assert requested_accelerator("configs/glue.py:smoke,accel=gpu") == "gpu"
    assert requested_accelerator("configs/rotary.py:size=base") == ""
    assert requested_accelerator("configs/rotary.py") == ""


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks a CPU-only jax")
@pytest.mark.parametrize("accel", ["gpu", "tpu"])
def test_an_accelerator_jax_does_not_see_is_refused(accel):
    with pytest.raises(ConfigError, match=rf"^accel={accel}, but jax sees no {accel.upper()}: it runs on .*\(cpu\)"):
        require_accelerator(accel)
    require_accelerator("cpu")
    require_accelerator("")


@pytest.mark.slow
@pytest.mark.parametrize("command, config", [("roformer.pretrain", "configs/tiny.py:accel=gpu"),
                                             ("roformer.glue", "configs/glue.py:smoke,accel=gpu")])
def test_accel_gpu_on_a_cpu_only_jax_is_one_line_before_the_run_starts(tmp_path, command, config):
    workdir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", command, f"--config={config}", f"--workdir={workdir}"],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: accel=gpu, but jax sees no GPU"), proc.stderr[-3000:]
    assert not workdir.exists()


def test_what_pip_install_and_the_readme_commands_write_in_a_checkout_is_ignored():
    """`pip install .` leaves setuptools' build/ (and `pip wheel` a dist/); the README's
    benchmark writes bench/step.json."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    paths = ["build/lib/roformer/cli.py", "dist/roformer_jax-0.1.0-py3-none-any.whl", "bench/step.json"]
    proc = subprocess.run(["git", "check-ignore", *paths], cwd=REPO, capture_output=True, text=True)
    assert proc.stdout.split() == paths


def test_training_a_tokenizer_into_a_log_writes_no_blank_lines(capfd):
    from roformer.data.tokenizer import WordPieceTokenizer

    WordPieceTokenizer.train(["the quick brown fox jumps over the lazy dog"] * 50, vocab_size=60, show_progress=True)
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")


def test_a_log_line_names_a_source_in_words_not_its_json_record(tmp_path):
    from roformer.data.sources import EmbeddedSource, FilesSource

    assert str(EmbeddedSource()) == "the embedded corpus (Python's pydoc topics)"
    files = [tmp_path / f"part{i}.txt" for i in range(3)]
    for path in files:
        path.write_text("a document\n")
    assert str(FilesSource([str(p) for p in files])) == f"{files[0]} and 2 more"


def test_glues_last_line_names_the_saved_models_and_their_hf_export():
    from roformer.glue.__main__ import done_line

    one = {"tasks": {"mrpc": {"saved_models": {"median_seed": 2, "dir": "w/models/mrpc", "hf": "w/models/mrpc/hf"}}}}
    assert done_line("w", one).endswith(
        ", fine-tuned model (median seed) in w/models/mrpc/seed2, exported for HF transformers in w/models/mrpc/hf")
    many = {"tasks": {t: {"saved_models": {"median_seed": 0, "dir": f"w/models/{t}", "hf": f"w/models/{t}/hf"}}
                      for t in ("cola", "sst2", "mrpc")}}
    assert done_line("w", many).endswith(", fine-tuned models (each task's median seed) in w/models/<task>/seed<k>, "
                                         "exported for HF transformers in w/models/<task>/hf")
    assert "model" not in done_line("w", {"tasks": {"mrpc": {}}}).split("TensorBoard")[1]


def test_glue_scores_print_as_a_person_reads_them():
    from roformer.glue.metrics import scores_line

    assert scores_line({"validation": {"f1": 0.8712345678901234, "accuracy": 0.8123456789012345}}) == (
        "validation f1 87.12, accuracy 81.23")


def test_the_install_page_lists_every_console_script():
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    page = (REPO / "docs" / "install.md").read_text()
    assert [name for name in scripts if f"`{name}`" not in page] == []
