"""End to end: fine-tune a tiny model for a few steps on a few dozen real rows, from a
pretraining checkpoint written the way roformer.train writes it, and init checks."""
import json
import shutil
import subprocess
import sys
import zipfile

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from helpers import needs_torch, needs_transformers, patient

from roformer.configs import glue as glue_config
from roformer.data.tokenizer import WordPieceTokenizer
from roformer.glue.init import load_init, resolve_model_config
from roformer.model import ModelConfig, RoFormerForMaskedLM
from roformer.train.checkpoint import Checkpointer

TINY = ModelConfig(vocab_size=30522, hidden_size=32, num_layers=1, num_heads=2,
                   intermediate_size=64, max_position_embeddings=64)


@pytest.fixture(scope="module")
def vocab(shared_data):
    return str(shared_data / "vocab" / "bert-base-uncased-vocab.txt")


@pytest.fixture(scope="module")
def pretrain_workdir(tmp_path_factory, vocab):
    """A pretraining workdir as roformer.train leaves it: config.json, the run's tokenizer
    (tokenizer.json + vocab.txt, written at start-up) and orbax checkpoints of
    {"params", "opt_state", "step"} with the MLM model's params."""
    workdir = tmp_path_factory.mktemp("pretrain")
    WordPieceTokenizer.from_vocab_file(vocab).save(workdir)   # what roformer.train.loop does
    model = RoFormerForMaskedLM(TINY, rngs=nnx.Rngs(7))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    state = {"params": params, "opt_state": optax.adamw(1e-3).init(params),
             "step": np.int32(3)}
    checkpointer = Checkpointer(workdir / "checkpoints", max_to_keep=2, async_save=False)
    checkpointer.save(3, state, {"epoch": 0}, TINY.to_dict())
    checkpointer.close()
    (workdir / "config.json").write_text(json.dumps(
        {"data": {"vocab": vocab, "lowercase": True}, "resolved_model": TINY.to_dict()}))
    return workdir, params


def test_load_pretrain_encoder_only(pretrain_workdir, vocab):
    workdir, params = pretrain_workdir
    init = load_init(str(workdir))
    # The tokenizer comes from the workdir (the run's own copy), not from the vocab file it named.
    tokenizer_json = str((workdir / "tokenizer.json").resolve())
    assert (init.kind, init.step, init.vocab, init.model_config) == ("pretrain", 3, tokenizer_json, TINY)
    tokenizer = init.tokenizer()
    assert tokenizer.vocab_size == TINY.vocab_size
    assert tokenizer.hash == WordPieceTokenizer.from_vocab_file(vocab).hash
    assert set(init.encoder_params) == set(params["roformer"])  # no MLM head
    jax.tree.map(np.testing.assert_array_equal, init.encoder_params, params["roformer"])


def test_init_mismatch_is_refused(pretrain_workdir, tmp_path):
    workdir, _ = pretrain_workdir
    init = load_init(str(workdir))
    model_cfg = glue_config.get_config().model
    model_cfg.size = "mini"
    with pytest.raises(ValueError, match=r"does not match the config: hidden_size: "
                                         r"config.model.size='mini' has 256, checkpoint has 32"):
        resolve_model_config(model_cfg, init, 30522)
    model_cfg = glue_config.get_config().model
    with pytest.raises(ValueError, match=r"vocab mismatch: the tokenizer has 8000 tokens but "
                                         r"init checkpoint .* has vocab_size 30522"):
        resolve_model_config(model_cfg, init, 8000)
    model_cfg.vocab_size = 100
    with pytest.raises(ValueError, match="vocab_size: config.model.vocab_size=100, checkpoint "
                                         "has 30522"):
        resolve_model_config(model_cfg, init, 30522)
    with pytest.raises(ValueError, match="neither a pretraining workdir"):
        load_init(str(tmp_path))
    # A workdir without the run's tokenizer cannot say what its embedding rows mean.
    shutil.copytree(workdir / "checkpoints", tmp_path / "no_tokenizer" / "checkpoints")
    with pytest.raises(ValueError, match="no tokenizer.json in the workdir"):
        load_init(str(tmp_path / "no_tokenizer"))


def test_run_glue_from_pretrain_checkpoint(pretrain_workdir, shared_data, tmp_path):
    from roformer.glue import run_glue

    workdir, _ = pretrain_workdir
    config = glue_config.get_config()
    config.task = "mrpc,stsb"
    config.init = str(workdir)
    config.data_dir = str(shared_data / "glue")
    config.model.hidden_dropout = 0.0
    config.seeds = 2
    config.max_train_examples = 32
    config.max_eval_examples = 24
    config.batch_size = 8
    config.eval_batch_size = 32
    config.max_seq_len = 16               # one length bucket: one compile per shape
    config.num_epochs = 1.0
    config.learning_rate = 1e-3
    config.per_task.stsb.max_steps = 3     # per-task override
    config.log_every = 1
    config.predict_test = True
    out = tmp_path / "glue"
    results = run_glue(config, out)

    mrpc, stsb = results["tasks"]["mrpc"], results["tasks"]["stsb"]
    assert mrpc["seeds"]["0"]["steps"] == 4 and stsb["seeds"]["1"]["steps"] == 3
    assert stsb["protocol"]["max_steps"] == 3 and mrpc["protocol"]["max_steps"] == 0
    assert mrpc["num_eval_examples"] == {"validation": 24}
    for task, metric_names in (("mrpc", {"f1", "accuracy"}), ("stsb", {"pearson", "spearman"})):
        r = results["tasks"][task]
        assert set(r["median"]["validation"]) == metric_names
        for name in metric_names:
            per_seed = [r["seeds"][s]["validation"][name] for s in ("0", "1")]
            assert r["median"]["validation"][name] == pytest.approx(np.median(per_seed))
    assert results["init"]["kind"] == "pretrain"
    assert not results["glue"]["glue_bert_9"]["complete"]
    assert set(results["glue"]["glue_bert_9"]["parts"]) == {"MRPC", "STS-B"}
    # scored on 24 of each dev split's examples: said per task and in every score
    assert mrpc["eval_cut_from"] == {"validation": 408} and stsb["eval_cut_from"] == {"validation": 1500}
    assert set(results["glue"]["glue_bert_9"]["cut"]) == {"MRPC", "STS-B"}

    on_disk = json.loads((out / "glue_results.json").read_text())
    assert on_disk["tasks"]["mrpc"]["median"] == mrpc["median"]
    table = (out / "glue_results.md").read_text()
    assert "| MRPC | validation | f1 |" in table and "glue_bert_9" in table
    assert "dev splits cut by max_eval_examples: MRPC, STS-B" in table
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {(r["task"], r["seed"]) for r in rows} == {("mrpc", 0), ("mrpc", 1), ("stsb", 0),
                                                      ("stsb", 1)}
    assert all(np.isfinite(r["loss"]) for r in rows if "loss" in r)
    assert any("validation_f1" in r for r in rows)
    assert (out / "config.json").is_file() and any((out / "tensorboard").iterdir())

    with zipfile.ZipFile(out / "submission.zip") as zf:
        assert sorted(zf.namelist()) == ["MRPC.tsv", "STS-B.tsv"]
        mrpc_tsv = zf.read("MRPC.tsv").decode().splitlines()
    assert mrpc_tsv[0] == "index\tprediction" and len(mrpc_tsv) == 1 + 1725
    assert {line.split("\t")[1] for line in mrpc_tsv[1:]} <= {"0", "1"}
    assert "MNLI-m.tsv" in results["submission"]["missing_files"]


def glue_cli(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "roformer.glue", *flags], capture_output=True, text=True,
                          cwd=glue_config.__file__.rsplit("/configs/", 1)[0], timeout=patient(600))


def test_cli_rejects_unknown_task(tmp_path):
    """The entry point parses per-task overrides and fails with one clear line."""
    proc = glue_cli("--config=configs/glue.py", "--config.task=sst3", "--config.per_task.rte.learning_rate=2e-5",
                    f"--workdir={tmp_path / 'out'}")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["error: unknown GLUE task 'sst3'; did you mean 'sst2'? choose from cola, sst2, mrpc, stsb, qqp, "
                                        "mnli, qnli, rte, wnli, ax or 'all'"]
    assert not (tmp_path / "out").exists()   # the directory made for the lock is gone again


def test_missing_task_files_are_named_at_once_before_anything_runs(shared_data, tmp_path):
    """All nine tasks on the shared data (no QQP, MNLI, RTE, QNLI train): one error naming
    every missing file, raised before the init checkpoint (here none) is even read."""
    from roformer.glue import GlueDataError, run_glue

    config = glue_config.get_config()
    config.task, config.init, config.data_dir = "all", str(tmp_path / "no_such_init"), str(shared_data / "glue")
    with pytest.raises(GlueDataError) as error:
        run_glue(config, tmp_path / "out")
    message = str(error.value)
    for name in ("QQP/train.tsv", "QQP/dev.tsv", "MNLI/train.tsv", "MNLI/dev_matched.tsv",
                 "MNLI/dev_mismatched.tsv", "QNLI/train.tsv", "RTE/train.tsv", "RTE/dev.tsv"):
        assert name in message
    assert "QNLI/dev.tsv" not in message and "CoLA" not in message
    assert message.endswith("--config.task=cola,sst2,mrpc,stsb,wnli")
    assert not (tmp_path / "out").exists()

    data = tmp_path / "glue"   # WNLI without its test file: needed only when predicting
    (data / "WNLI").mkdir(parents=True)
    for name in ("train.tsv", "dev.tsv"):
        shutil.copy(shared_data / "glue" / "WNLI" / name, data / "WNLI" / name)
    config.task, config.data_dir, config.predict_test = "wnli", str(data), True
    with pytest.raises(GlueDataError, match=r"GLUE files missing in .*: WNLI/test.tsv. Point config.data_dir"):
        run_glue(config, tmp_path / "out")
    config.data_dir = str(tmp_path / "nowhere")
    with pytest.raises(GlueDataError, match="no such directory"):
        run_glue(config, tmp_path / "out")


def test_library_logs_only_with_verbosity(pretrain_workdir, shared_data, tmp_path):
    """Loading a pretraining checkpoint makes orbax log at INFO: hidden by default, shown
    with --verbosity=0. (The run then stops at a refused model size: exit 2, one line.)"""
    workdir, _ = pretrain_workdir
    flags = ["--config.task=wnli", f"--config.init={workdir}", f"--config.data_dir={shared_data / 'glue'}",
             "--config.model.size=mini", f"--workdir={tmp_path / 'out'}"]
    quiet = glue_cli(*flags)
    assert quiet.returncode == 2, quiet.stderr[-3000:]
    assert len(quiet.stderr.splitlines()) == 1 and "does not match the config" in quiet.stderr
    verbose = glue_cli(*flags, "--verbosity=0")
    assert verbose.returncode == 2 and "checkpoint_manager.py" in verbose.stderr   # orbax INFO
    assert verbose.stderr.splitlines()[-1] == quiet.stderr.strip()


@needs_torch
@needs_transformers
def test_init_from_hf_roformer_dir(tmp_path, vocab):
    """An HF RoFormer directory (what transformers' save_pretrained writes) and its
    `roformer.convert from-hf` output both give the same encoder weights."""

    import torch
    import transformers

    from roformer import convert

    hf_config = transformers.RoFormerConfig(
        vocab_size=30522, embedding_size=32, hidden_size=32, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    hf_dir = tmp_path / "hf"
    transformers.RoFormerForMaskedLM(hf_config).save_pretrained(hf_dir)
    shutil.copy(vocab, hf_dir / "vocab.txt")
    init = load_init(str(hf_dir))
    assert init.kind == "hf" and init.vocab == str(hf_dir / "vocab.txt")
    assert init.model_config.hidden_size == 32 and init.model_config.vocab_size == 30522
    model_cfg = glue_config.get_config().model
    assert resolve_model_config(model_cfg, init, 30522).num_layers == 1

    _, mlm = convert.load_hf(hf_dir)
    convert.save_converted(mlm, tmp_path / "ours")
    converted = load_init(str(tmp_path / "ours"))
    assert converted.kind == "converted"
    jax.tree.map(np.testing.assert_allclose, converted.encoder_params, init.encoder_params)


def test_refused_settings_leave_no_workdir(shared_data, tmp_path, vocab):
    """Protocol settings no fine-tuning can run with are refused before anything is read or
    written; a refusal found in the data (no training rows) comes before the first metrics
    row, so it leaves no config.json or empty metrics.jsonl either."""
    from roformer.glue import run_glue

    def config(**overrides):
        c = glue_config.get_config()
        c.task, c.vocab, c.data_dir, c.seeds, c.model.size = "wnli", vocab, str(shared_data / "glue"), 1, "tiny"
        c.update(overrides)
        return c

    for overrides, message in [
            ({"max_seq_len": 4}, r"config.max_seq_len=4 is not allowed: an integer in \[8, 65536\]"),
            ({"batch_size": 0}, "config.batch_size=0 is not allowed: an integer >= 1"),
            ({"num_epochs": 0.0}, "GLUE protocol of wnli: no training steps: num_epochs=0.0, max_steps=0"),
            ({"decay": "step"}, "config.decay='step' is not allowed: one of 'linear', 'cosine'")]:
        with pytest.raises(ValueError, match=f"^{message}$"):
            run_glue(config(**overrides), tmp_path / "out")
        assert not (tmp_path / "out").exists()
    data = tmp_path / "glue" / "WNLI"
    data.mkdir(parents=True)
    shutil.copy(shared_data / "glue" / "WNLI" / "dev.tsv", data / "dev.tsv")
    header = (shared_data / "glue" / "WNLI" / "train.tsv").read_text().splitlines()[0]
    (data / "train.tsv").write_text(header + "\n")   # no training rows
    with pytest.raises(ValueError, match="no training steps: 0 training examples"):
        run_glue(config(data_dir=str(tmp_path / "glue")), tmp_path / "out")
    assert not (tmp_path / "out").exists()


@needs_torch
@needs_transformers
def test_hf_dir_without_tokenizer_uses_the_named_vocabulary_of_its_size(tmp_path, vocab):
    """As in pretraining: config.vocab names the vocabulary of a checkpoint saved without
    one, the architecture is the checkpoint's, and a vocabulary of another size is refused
    with both sizes."""
    import torch
    import transformers

    from roformer.data.tokenizer import load_tokenizer

    torch.manual_seed(0)
    for name, vocab_size in (("hf", 30522), ("hf_small", 500)):
        transformers.RoFormerForMaskedLM(transformers.RoFormerConfig(
            vocab_size=vocab_size, embedding_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=48, max_position_embeddings=64)).save_pretrained(tmp_path / name)
    tokens = load_tokenizer(vocab).vocab_size
    init = load_init(str(tmp_path / "hf"))
    assert init.vocab is None and init.tokenizer() is None
    model_cfg = glue_config.get_config().model
    assert resolve_model_config(model_cfg, init, tokens).intermediate_size == 48
    with pytest.raises(ValueError, match=f"the tokenizer has {tokens} tokens but init checkpoint .*hf_small has "
                                         "vocab_size 500"):
        resolve_model_config(model_cfg, load_init(str(tmp_path / "hf_small")), tokens)
    model_cfg.size = "tiny"   # set, and not the checkpoint's: refused
    with pytest.raises(ValueError, match="intermediate_size: config.model.size='tiny' has 512, checkpoint has 48"):
        resolve_model_config(model_cfg, init, tokens)
