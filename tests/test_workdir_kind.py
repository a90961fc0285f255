"""One workdir, one kind of run: a GLUE run on a pretraining workdir (or the reverse, or any
other pair of kinds) is refused in one line before it writes anything, and a workdir written
before runs recorded their kind is recognised by its files and gets the record."""
import json
import shutil

import pytest

from helpers import MICRO_MODEL, tiny_run_config
from helpers.glue import tiny_config as tiny_glue_config

PRETRAIN = {**MICRO_MODEL, "train.steps": 2, "train.batch_size": 4, "train.seq_len": 32, "train.warmup_steps": 1,
            "train.log_every": 1, "train.eval_every": 2, "train.eval_batches": 1, "train.eval_attention_stats": False,
            "train.checkpoint_every": 2, "train.progress_bar": False, "mesh.num_devices": 1}


def snapshot(workdir):
    return {p.relative_to(workdir).as_posix(): p.read_bytes() for p in sorted(workdir.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def glue_run(shared_data, tmp_path_factory):
    from roformer.glue import run as glue_run_lib

    workdir = tmp_path_factory.mktemp("glue") / "run"
    vocab = str(shared_data / "vocab" / "bert-base-uncased-vocab.txt")
    glue_run_lib.run_glue(tiny_glue_config(shared_data, vocab, "mrpc"), workdir)
    return workdir


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    from roformer.train import train_and_evaluate

    cache = tmp_path_factory.mktemp("cache")
    workdir = tmp_path_factory.mktemp("pretrain") / "run"
    train_and_evaluate(tiny_run_config(cache, PRETRAIN), workdir)
    return workdir, cache


@pytest.mark.slow   # a pretraining run and a GLUE run
def test_glue_on_a_pretraining_workdir_is_refused_and_writes_nothing(pretrained, shared_data, tmp_path):
    from roformer.errors import UserError
    from roformer.glue import run as glue_run_lib

    finished, _ = pretrained
    for legacy in (False, True):   # with the record, and as written before it existed
        workdir = tmp_path / f"run{int(legacy)}"
        shutil.copytree(finished, workdir)
        if legacy:
            (workdir / "run_kind.json").unlink()
        before = snapshot(workdir)
        vocab = str(shared_data / "vocab" / "bert-base-uncased-vocab.txt")
        with pytest.raises(UserError, match=f"{workdir} holds a pretraining run .*; a GLUE run there would replace"):
            glue_run_lib.run_glue(tiny_glue_config(shared_data, vocab, "mrpc"), workdir)
        assert snapshot(workdir) == before


@pytest.mark.slow   # a pretraining run and a GLUE run
def test_pretraining_on_a_glue_workdir_is_refused_and_writes_nothing(glue_run, pretrained, tmp_path):
    from roformer.errors import UserError
    from roformer.train import train_and_evaluate

    _, cache = pretrained
    for legacy in (False, True):
        workdir = tmp_path / f"glue{int(legacy)}"
        shutil.copytree(glue_run, workdir)
        if legacy:
            (workdir / "run_kind.json").unlink()
        before = snapshot(workdir)
        with pytest.raises(UserError, match=f"{workdir} holds a GLUE run .*; a pretraining run there would"):
            train_and_evaluate(tiny_run_config(cache, PRETRAIN), workdir)
        assert snapshot(workdir) == before


@pytest.mark.slow   # a pretraining run and a GLUE run
def test_a_workdir_written_before_the_record_gets_it_and_keeps_working(pretrained, glue_run, tmp_path):
    from roformer.train import train_and_evaluate
    from roformer.workdir_kind import recorded_kind

    finished, cache = pretrained
    assert json.loads((finished / "run_kind.json").read_text()) == {"kind": "pretraining"}
    assert json.loads((glue_run / "run_kind.json").read_text()) == {"kind": "GLUE"}
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir)
    (workdir / "run_kind.json").unlink()
    assert recorded_kind(workdir) == ("pretraining", "it has checkpoints/")
    summary = train_and_evaluate(tiny_run_config(cache, PRETRAIN, **{"train.steps": 3, "train.checkpoint_every": 3}),
                                 workdir)
    assert summary["start_step"] == 2 and summary["final_step"] == 3
    assert json.loads((workdir / "run_kind.json").read_text()) == {"kind": "pretraining"}


@pytest.mark.parametrize("marker, kind", [("ablation_config.json", "ablation"), ("study_config.json", "study"),
                                          ("capability.json", "capability"), ("glue_results.json", "GLUE"),
                                          ("checkpoints/", "pretraining")])
def test_every_kind_is_told_by_its_files_and_refuses_the_others(tmp_path, marker, kind):
    from roformer import workdir_kind
    from roformer.errors import UserError

    workdir = tmp_path / "w"
    (workdir / marker.rstrip("/")).mkdir(parents=True) if marker.endswith("/") else None
    if not marker.endswith("/"):
        workdir.mkdir()
        (workdir / marker).write_text("{}")
    assert workdir_kind.recorded_kind(workdir)[0] == kind
    for other in workdir_kind.KINDS:
        if other != kind:
            with pytest.raises(UserError, match=f"holds a {kind} run"):
                workdir_kind.claim(workdir, other)
    assert not (workdir / "run_kind.json").exists()   # refusals write nothing
    workdir_kind.claim(workdir, kind)
    assert workdir_kind.recorded_kind(workdir) == (kind, "recorded in run_kind.json")
    workdir_kind.claim(tmp_path / "new", kind)   # a new workdir is anyone's
    assert not (tmp_path / "new").exists()
