"""`convert to-hf --push_to_hub=REPO` (roformer/hub.py), up to the upload: what the Hub client
is asked to do, with what folder, and a one-line error where it cannot (no network, offline,
no huggingface_hub). The client is a recording stand-in, except in the offline test."""
import json
import sys

import jax.numpy as jnp
import pytest
from flax import nnx

from roformer import convert, hub
from roformer.data.tokenizer import WordPieceTokenizer
from roformer.model import ModelConfig, RoFormerForMaskedLM
from roformer.train.checkpoint import Checkpointer

huggingface_hub = pytest.importorskip("huggingface_hub")
TOKEN = "hf_secretTokenForTheTest0123456789"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A pretraining workdir at step 3: a checkpoint of a tiny model and its tokenizer."""
    root = tmp_path_factory.mktemp("hub") / "run"
    tokenizer = WordPieceTokenizer.train(["the fox jumps over the dog", "a dog sleeps"] * 5, vocab_size=60,
                                         min_frequency=1, show_progress=False)
    config = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=16, num_layers=1, num_heads=2,
                         intermediate_size=32, max_position_embeddings=32)
    model = RoFormerForMaskedLM(config, rngs=nnx.Rngs(0))
    checkpointer = Checkpointer(root / "checkpoints", max_to_keep=1, async_save=False)
    checkpointer.save(3, {"params": nnx.to_pure_dict(nnx.state(model, nnx.Param)), "opt_state": {},
                          "step": jnp.zeros((), jnp.int32)}, {}, config.to_dict())
    checkpointer.close()
    tokenizer.save(root)
    return root


class RecordingApi:
    """Stands in for huggingface_hub.HfApi: records its calls and what the folder held at upload."""
    calls = []

    def __init__(self, token=None, **_):
        self.calls.append(("init", {"token": token}))

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        files = {path.name: path.read_bytes() for path in sorted(folder_path.iterdir())}
        self.calls.append(("upload_folder", {"repo_id": repo_id, "files": files, **kwargs}))
        return type("Commit", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/abc"})()


@pytest.fixture
def recording(monkeypatch):
    RecordingApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    monkeypatch.setenv(hub.TOKEN_ENV, TOKEN)
    return RecordingApi.calls


def test_to_hf_pushes_the_export_with_its_card_to_the_repository(run_dir, tmp_path, recording, capsys):
    convert.main(["to-hf", str(run_dir), str(tmp_path / "hf"), "--push_to_hub=someone/tiny-roformer",
                  "--hub_private"])
    (_, init), (_, created), (_, uploaded) = recording
    assert init == {"token": TOKEN}
    assert created["repo_id"] == "someone/tiny-roformer" and created["private"] is True and created["exist_ok"]
    assert uploaded["repo_id"] == "someone/tiny-roformer"
    files = uploaded["files"]
    assert {"config.json", "model.safetensors", "README.md", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    assert not any(name.startswith(".") or name == convert.EXPORT_INCOMPLETE for name in files)
    config = json.loads(files["config.json"])
    assert config["transformers_version"] and config["architectures"] == ["RoFormerForMaskedLM"]
    card = files["README.md"].decode()
    assert card.startswith("---\nlicense: apache-2.0") and "pipeline_tag: fill-mask" in card and "step 3" in card
    out, err = capsys.readouterr()
    assert "pushed to https://huggingface.co/someone/tiny-roformer/commit/abc" in out
    assert TOKEN not in out + err


def test_without_the_flag_nothing_is_pushed_and_public_is_the_default(run_dir, tmp_path, recording):
    convert.main(["to-hf", str(run_dir), str(tmp_path / "hf")])
    assert recording == []
    hub.push(tmp_path / "hf", "someone/public-one")
    assert recording[1][1]["private"] is False


def test_a_converted_model_gets_a_card_too(run_dir, tmp_path, recording):
    """to-hf from our converted format (not a pretraining workdir) writes a model card, so it
    can be pushed as well."""
    convert.main(["to-hf", str(run_dir), str(tmp_path / "hf")])
    convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "ours")])
    convert.main(["to-hf", str(tmp_path / "ours"), str(tmp_path / "again"), "--push_to_hub=someone/again"])
    assert "the converted model in" in recording[-1][1]["files"]["README.md"].decode()


def one_error_line(capsys, argv) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        convert.main(argv)
    assert exited.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_an_unreachable_hub_is_one_line_and_keeps_the_export(run_dir, tmp_path, monkeypatch, capsys):
    """The real client, pointed at a port nothing listens on: what a machine without the network meets."""
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv(hub.TOKEN_ENV, TOKEN)
    line = one_error_line(capsys, ["to-hf", str(run_dir), str(tmp_path / "hf"), "--push_to_hub=someone/x"])
    assert "could not push" in line and "someone/x" in line and "hf upload someone/x" in line
    assert TOKEN not in line
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "README.md").is_file()


def test_without_huggingface_hub_the_push_is_one_line_naming_the_extra(run_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    line = one_error_line(capsys, ["to-hf", str(run_dir), str(tmp_path / "hf"), "--push_to_hub=someone/x"])
    assert "roformer-jax[hub]" in line


def test_only_a_finished_export_with_its_card_is_pushed(run_dir, tmp_path, recording):
    convert.main(["to-hf", str(run_dir), str(tmp_path / "hf")])
    (tmp_path / "hf" / "README.md").unlink()
    with pytest.raises(hub.ConfigError, match="README.md"):
        hub.push(tmp_path / "hf", "someone/x")
    assert recording == []
