"""Staged pretraining (phases of different batch shapes) and warm starts.

Phases: a two-phase run equals one that is stopped inside phase 2 and resumed; a
finished run extends by a new shape from the command line; what may not change
between phases is refused. Warm starts: from a pretraining workdir and from an HF
RoFormer directory, the new run's step-0 held-out loss is the checkpoint's own;
tokenizer and learned-table refusals.
"""
import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from roformer.configs import bert_staged
from roformer import checkpoint_source
from roformer.train import read_metrics, train_and_evaluate
from roformer.train.config import Phase, parse_phases
from roformer.train.optim import make_schedule

from helpers import REPO_ROOT, SHARED_DATA, needs_torch, needs_transformers
from helpers.train import make_config

PHASES = "4:32:8,4:64:4"

def params_at(workdir: Path, step: int) -> dict:
    with ocp.CheckpointManager(workdir / "checkpoints", item_names=("state",)) as manager:
        state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    return state["params"]


def max_diff(a: dict, b: dict) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="module")
def two_phase_run(tmp_path_factory, cache):
    workdir = tmp_path_factory.mktemp("two_phase")
    summary = train_and_evaluate(make_config(cache, **{"train.phases": PHASES}), workdir)
    return workdir, summary


@pytest.mark.fast
def test_parse_phases():
    config = make_config(Path("/unused"))
    assert parse_phases(config.train) == [Phase(8, 32, 8)]
    config.train.phases = "900:128:256, 100:512:256"
    assert parse_phases(config.train) == [Phase(900, 128, 256), Phase(1000, 512, 256)]
    staged = bert_staged.get_config()
    assert parse_phases(staged.train) == [Phase(900_000, 128, 256), Phase(1_000_000, 512, 256)]
    config.train.phases = "900:128:256,100:512:64:lr=5e-5:warmup=10:max_predictions=80"
    assert parse_phases(config.train)[1] == Phase(1000, 512, 64, learning_rate=5e-5, warmup_steps=10,
                                                  max_predictions=80)
    for bad in ("900:128", "0:128:8", "a:b:c", "900:128:8,", "9:8:8,9:8:8:lr=fast", "9:8:8,9:8:8:lr=-1",
                "9:8:8,9:8:8:warmup=1.5", "9:8:8,9:8:8:rate=1"):
        config.train.phases = bad
        with pytest.raises(ValueError, match=r"^train.phases=.*steps:seq_len:batch_size[^\n]*$"):
            parse_phases(config.train)
    config.train.phases = "9:8:8:warmup=2,9:8:8"
    with pytest.raises(ValueError, match="the first phase warms up over train.warmup_steps"):
        parse_phases(config.train)


@pytest.mark.slow
def test_two_phases_resume_inside_phase_two_matches_uninterrupted(tmp_path, cache, two_phase_run):
    reference, summary = two_phase_run
    assert summary["final_step"] == 8
    rows = [r for r in read_metrics(reference) if "loss" in r]
    assert [(r["step"], r["phase"], r["seq_len"]) for r in rows] == \
        [(s, 0, 32) for s in range(1, 5)] + [(s, 1, 64) for s in range(5, 9)]
    # One schedule over the whole run (warmup 2, linear decay to 0 at step 8), not one per phase.
    schedule = make_schedule(learning_rate=1e-3, warmup_steps=2, total_steps=8, decay="linear")
    assert [r["learning_rate"] for r in rows] == pytest.approx([float(schedule(s - 1)) for s in range(1, 9)])

    # Stopped inside phase 2 (a run whose phase 2 ends at step 6, same schedule), then resumed.
    stopped = tmp_path / "stopped"
    train_and_evaluate(make_config(cache, **{"train.phases": "4:32:8,2:64:4", "train.decay_steps": 8}), stopped)
    resumed = train_and_evaluate(make_config(cache, **{"train.phases": PHASES}), stopped)
    assert resumed["start_step"] == 6 and resumed["final_step"] == 8
    assert max_diff(params_at(reference, 8), params_at(stopped, 8)) <= 1e-6


@pytest.mark.slow
def test_a_phase_may_set_its_learning_rate_warmup_and_masked_slots(tmp_path, cache):
    summary = train_and_evaluate(make_config(cache, **{
        "train.phases": "4:32:8,4:64:4:lr=5e-4:warmup=2:max_predictions=12"}), tmp_path)
    rows = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [(r["step"], r["phase"]) for r in rows] == [(s, 0) for s in range(1, 5)] + [(s, 1) for s in range(5, 9)]
    # The run's schedule (warmup 2, linear decay to 0 at step 8) throughout; phase 2 scales it
    # by 5e-4 / 1e-3 and ramps up again over its first 2 steps (optimizer steps 4 and 5).
    schedule = make_schedule(learning_rate=1e-3, warmup_steps=2, total_steps=8, decay="linear")
    factor = {4: 0.0, 5: 0.25, 6: 0.5, 7: 0.5}
    expected = [float(schedule(s - 1)) * factor.get(s - 1, 1.0) for s in range(1, 9)]
    assert [r["learning_rate"] for r in rows] == pytest.approx(expected)
    assert summary["data"]["max_predictions_per_seq"] == 12 and summary["final_step"] == 8


@pytest.mark.slow
def test_a_finished_run_extends_by_a_new_shape_and_refuses_other_changes(tmp_path, cache):
    workdir = tmp_path / "run"
    train_and_evaluate(make_config(cache, **{"train.steps": 4}), workdir)
    extended = train_and_evaluate(make_config(cache, **{"train.steps": 6, "train.seq_len": 64,
                                                        "train.batch_size": 4}), workdir)
    assert extended["start_step"] == 4 and extended["final_step"] == 6
    rows = [r for r in read_metrics(workdir) if "loss" in r]
    assert [(r["step"], r["phase"], r["seq_len"]) for r in rows][-2:] == [(5, 1, 64), (6, 1, 64)]
    with pytest.raises(ValueError, match="corpus_id=.*only train.seq_len, train.batch_size"):
        train_and_evaluate(make_config(cache, **{"train.steps": 8, "data.mask_rate": 0.2}), workdir)


@pytest.mark.slow
def test_warm_start_from_a_workdir_begins_at_its_held_out_loss(tmp_path, cache, two_phase_run):
    source, summary = two_phase_run
    warm = tmp_path / "warm"
    # Same length and batch as the source's last phase: the same held-out batches.
    result = train_and_evaluate(make_config(cache, **{"train.steps": 2, "train.seq_len": 64,
                                                      "train.batch_size": 4, "train.init_from": str(source)}), warm)
    assert result["final_step"] == 2 and result["start_step"] == 0
    start = next(r for r in read_metrics(warm) if r["step"] == 0 and "eval_loss" in r)
    assert start["eval_loss"] == pytest.approx(summary["eval_loss"], rel=1e-5)
    assert (warm / "tokenizer.json").read_text() == (source / "tokenizer.json").read_text()

    with pytest.raises(ValueError, match="another tokenizer"):
        train_and_evaluate(make_config(cache, **{"train.init_from": str(source), "data.vocab": str(
            SHARED_DATA / "vocab" / "bert-base-uncased-vocab.txt")}), tmp_path / "other")
    with pytest.raises(ValueError, match="another architecture.*hidden_size"):
        train_and_evaluate(make_config(cache, **{"train.init_from": str(source), "model.hidden_size": 64}),
                           tmp_path / "wide")
    assert not (tmp_path / "other").exists() and not (tmp_path / "wide").exists()   # refused before writing


@pytest.mark.slow
def test_warm_start_from_a_converted_checkpoint_begins_at_its_held_out_loss(tmp_path, cache, two_phase_run):
    from roformer import convert

    source, summary = two_phase_run
    converted = tmp_path / "converted"
    _, model = convert.load_pretrain_workdir(source)
    convert.save_converted(model, converted)
    shutil.copy(source / "tokenizer.json", converted / "tokenizer.json")
    assert checkpoint_source.checkpoint_kind(converted) == "converted"
    warm = tmp_path / "warm"
    result = train_and_evaluate(make_config(cache, **{"train.steps": 2, "train.seq_len": 64, "train.batch_size": 4,
                                                      "train.init_from": str(converted)}), warm)
    assert result["final_step"] == 2 and result["start_step"] == 0
    start = next(r for r in read_metrics(warm) if r["step"] == 0 and "eval_loss" in r)
    assert start["eval_loss"] == pytest.approx(summary["eval_loss"], rel=1e-5)


@needs_torch
@needs_transformers
@pytest.mark.slow
def test_warm_start_from_an_hf_directory_begins_at_its_held_out_loss(tmp_path, cache, two_phase_run):
    import torch
    import transformers

    from roformer import convert
    from roformer.ablation import extrapolation
    from flax import nnx

    from roformer.data import DataConfig, make_pretrain_data

    source, _ = two_phase_run
    vocab_size = len((source / "vocab.txt").read_text().splitlines())
    hf_dir = tmp_path / "hf"
    torch.manual_seed(0)
    transformers.RoFormerForMaskedLM(transformers.RoFormerConfig(
        vocab_size=vocab_size, embedding_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=128, hidden_act="gelu")).save_pretrained(hf_dir)
    shutil.copy(source / "vocab.txt", hf_dir / "vocab.txt")

    config = make_config(cache, **{"train.steps": 1, "train.init_from": str(hf_dir)})
    warm = tmp_path / "warm_hf"
    train_and_evaluate(config, warm)
    start = next(r for r in read_metrics(warm) if r["step"] == 0 and "eval_loss" in r)

    model_config, model = convert.load_hf(hf_dir)
    data_cfg = DataConfig.from_mapping(config.data)
    data = make_pretrain_data(dataclasses.replace(data_cfg, vocab=str(hf_dir / "vocab.txt")), seq_len=32, batch_size=8, seed=0, show_progress=False)
    own = extrapolation.mlm_loss(model_config, nnx.to_pure_dict(nnx.state(model, nnx.Param)), data.eval_batches(1))
    assert start["eval_loss"] == pytest.approx(own["eval_loss"], rel=1e-5)
    assert json.loads((warm / "config.json").read_text())["train"]["init_from"] == str(hf_dir)


def save_hf_roformer(hf_dir: Path, **sizes) -> Path:
    """A small HF RoFormer MLM saved as people often save one: weights and config, no tokenizer."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = {"vocab_size": 500, "embedding_size": 32, "hidden_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 2, "intermediate_size": 48, "max_position_embeddings": 128,
              "hidden_act": "gelu", **sizes}
    transformers.RoFormerForMaskedLM(transformers.RoFormerConfig(**config)).save_pretrained(hf_dir)
    return hf_dir


@needs_torch
@needs_transformers
def test_warm_start_takes_the_architecture_from_the_checkpoint_and_a_named_vocabulary(tmp_path, cache,
                                                                                      shared_data):
    """An HF directory without tokenizer files is warm-started with the vocabulary the run names,
    and with the checkpoint's architecture (intermediate_size 48, not the config's 64) once the
    architecture keys are unset, as the command line does with the keys it does not give."""
    from roformer.train import warm_start

    vocab = shared_data / "vocab" / "bert-base-uncased-vocab.txt"
    hf_dir = save_hf_roformer(tmp_path / "hf", vocab_size=30522)
    config = make_config(cache, **{"train.steps": 1, "train.init_from": str(hf_dir), "data.vocab": str(vocab)})
    warm_start.unset_architecture(config.model)
    warm = tmp_path / "warm"
    assert train_and_evaluate(config, warm)["final_step"] == 1
    resolved = json.loads((warm / "config.json").read_text())["resolved_model"]
    assert (resolved["intermediate_size"], resolved["vocab_size"], resolved["max_position_embeddings"]) == (
        48, 30522, 128)
    assert (warm / "vocab.txt").read_text() == vocab.read_text()


@needs_torch
@needs_transformers
def test_warm_start_refusals_name_the_conflict_and_leave_nothing(tmp_path, cache, shared_data):
    from roformer.train import warm_start

    vocab = shared_data / "vocab" / "bert-base-uncased-vocab.txt"
    hf_dir = save_hf_roformer(tmp_path / "hf", vocab_size=30522)
    other = save_hf_roformer(tmp_path / "hf_other_vocab")   # 500 rows
    refusals = [
        ({"train.init_from": str(hf_dir)}, (),
         f"^train.init_from={hf_dir}: no tokenizer.json or vocab.txt beside the weights; name the vocabulary "
         "it was trained with: --config.data.vocab=VOCAB$"),
        ({"train.init_from": str(other), "data.vocab": str(vocab)}, (),
         f"^train.init_from={other}: its embedding table has 500 rows but this run's vocabulary has 30522 "
         "tokens"),
        # a key the user set (here the config's intermediate_size 64) must agree with the checkpoint
        ({"train.init_from": str(hf_dir), "data.vocab": str(vocab)}, ("intermediate_size",),
         f"^train.init_from={hf_dir} is another architecture than this run's model settings: "
         r"intermediate_size: checkpoint 48, model.intermediate_size 64 \(a warm start takes"),
        ({"train.init_from": str(hf_dir), "data.vocab": str(vocab), "model.size": "mini"}, ("size", "hidden_size"),
         "num_layers: checkpoint 2, model.size='mini' 4; num_heads: checkpoint 2, model.size='mini' 4; "
         "intermediate_size: checkpoint 48, model.size='mini' 1024"),
    ]
    for overrides, given, message in refusals:
        config = make_config(cache, **overrides)
        warm_start.unset_architecture(config.model, given)
        with pytest.raises(ValueError, match=message):
            train_and_evaluate(config, tmp_path / "run")
        assert not (tmp_path / "run").exists()   # refused before anything was written


@needs_torch
@needs_transformers
def test_command_line_warm_start_checks_only_the_model_keys_it_gives(tmp_path, cache, shared_data):
    """configs/tiny.py's preset (intermediate_size 512) yields to the checkpoint's 48; the same
    key given on the command line is refused in one line, before anything is written."""
    import subprocess
    import sys

    hf_dir = save_hf_roformer(tmp_path / "hf", vocab_size=30522)
    command = [sys.executable, "-m", "roformer.pretrain", "--config=configs/tiny.py",
               f"--config.train.init_from={hf_dir}",
               f"--config.data.vocab={shared_data / 'vocab' / 'bert-base-uncased-vocab.txt'}",
               f"--config.data.cache_dir={cache}", "--config.train.steps=1", "--config.train.batch_size=4",
               "--config.train.seq_len=32", "--config.train.eval_batches=1", "--config.train.progress_bar=false",
               "--config.mesh.num_devices=1"]
    refused = subprocess.run([*command, f"--workdir={tmp_path / 'refused'}", "--config.model.intermediate_size=512"],
                             cwd=REPO_ROOT, capture_output=True, text=True)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr   # after the tokenizer's progress:
    assert refused.stderr.splitlines()[-1:] == [
        f"error: train.init_from={hf_dir} is another architecture than this run's model settings: intermediate_size: "
        "checkpoint 48, model.intermediate_size 512 (a warm start takes the architecture from its checkpoint: "
        "leave these keys unset)"], refused.stderr[-3000:]
    assert not (tmp_path / "refused").exists()
    done = subprocess.run([*command, f"--workdir={tmp_path / 'warm'}"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    resolved = json.loads((tmp_path / "warm" / "config.json").read_text())["resolved_model"]
    assert (resolved["hidden_size"], resolved["intermediate_size"], resolved["num_layers"]) == (32, 48, 2)


@pytest.mark.fast
def test_learned_table_grows_only_when_asked(tmp_path):
    from flax import nnx

    from roformer.model import ModelConfig, RoFormerForMaskedLM
    from roformer.train import warm_start

    def pure(config):
        return nnx.to_pure_dict(nnx.state(RoFormerForMaskedLM(config, rngs=nnx.Rngs(0)), nnx.Param))

    small = dict(hidden_size=32, num_heads=2, intermediate_size=64, vocab_size=50, position="learned")
    short, long = (ModelConfig.from_preset("tiny", max_position_embeddings=n, **small) for n in (16, 40))
    saved = pure(short)

    class Source(warm_start.InitCheckpoint):
        def load(self):
            return short, jax.tree.map(np.asarray, saved)

        def tokenizer(self):
            class Same:
                hash = "h"
            return Same()

    source = Source("pretrain", tmp_path, 1, tmp_path / "tokenizer.json", True)
    abstract = pure(long)
    with pytest.raises(ValueError, match="16 rows, this model needs 40.*init_grow_positions=copy"):
        warm_start.load_init_params(source, long, abstract, "h")
    grown = warm_start.load_init_params(source, long, abstract, "h", grow_positions="copy")
    table = grown["roformer"]["position"]["position_embeddings"]["embedding"]
    old = np.asarray(saved["roformer"]["position"]["position_embeddings"]["embedding"])
    np.testing.assert_array_equal(table, np.concatenate([old, old, old[:8]]))
    with pytest.raises(ValueError, match="another tokenizer"):
        warm_start.load_init_params(source, long, abstract, "other", grow_positions="copy")
