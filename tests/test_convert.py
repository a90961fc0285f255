"""HF transformers RoFormer <-> roformer-jax conversion: numerical parity both ways.

Tiny random models (hidden 32, embedding 24 so `embeddings_project` is exercised,
2 layers, vocab 99), a padded batch, every parameter randomised (HF and flax both
init LayerNorm to 1/0 and biases to 0, which would hide mapping mistakes).
"""
import json
import os
import re
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import needs_torch, needs_transformers, one_line_error
from roformer import checkpoint_source, convert
from roformer.data.tokenizer import WordPieceTokenizer
from roformer.errors import ConfigError
from roformer.model import ModelConfig, RoFormerForMaskedLM, RoFormerModel, backend
from roformer.train.checkpoint import Checkpointer

try:   # the parity references (the dev extra); without them only the tests that use them skip
    import torch
    import transformers
except ImportError:
    torch = transformers = None

TOL = 1e-4  # max abs difference allowed, float32
VOCAB = 99


def hf_config(rotary_value: bool, **extra) -> "transformers.RoFormerConfig":
    return transformers.RoFormerConfig(**{
        "vocab_size": VOCAB, "embedding_size": 24, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 64,
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "rotary_value": rotary_value,
        **extra})


def random_hf(cls, config, seed=0):
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "embed_positions" not in name:  # the frozen sinusoid table stays as HF builds it
                param.normal_(0.0, 0.3)
    return model


def randomize(model, seed=0):
    """Every parameter of our model ~ N(0, 0.3), in place."""
    state = nnx.state(model, nnx.Param)
    rng = np.random.default_rng(seed)
    pure = jax.tree.map(lambda x: rng.normal(0.0, 0.3, x.shape).astype(np.float32), nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)
    return model


@pytest.fixture(scope="module")
def batch():
    """Padded batch: row 1 has 4 pad tokens, row 2 has 7; token types 0/1."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, VOCAB, (3, 12))
    mask = np.ones((3, 12), np.int64)
    mask[1, 8:] = 0
    mask[2, 5:] = 0
    ids[mask == 0] = 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": rng.integers(0, 2, (3, 12))}


def hf_outputs(model, batch):
    with torch.no_grad():
        out = model(**{k: torch.as_tensor(v) for k, v in batch.items()}, output_hidden_states=True)
    return out.hidden_states[-1].numpy(), out.logits.numpy()


def our_outputs(model, batch, set_eval=True):
    if set_eval:
        model.eval()
    kwargs = dict(token_type_ids=jnp.asarray(batch["token_type_ids"]),
                  attention_mask=jnp.asarray(batch["attention_mask"]))
    hidden = model.roformer(jnp.asarray(batch["input_ids"]), **kwargs)
    return np.asarray(hidden), np.asarray(model(jnp.asarray(batch["input_ids"]), **kwargs))


def max_diff(a, b, mask=None):
    diff = np.abs(np.asarray(a) - np.asarray(b))
    return float(diff[mask.astype(bool)].max() if mask is not None else diff.max())


def assert_close(ours, theirs, batch):
    """Hidden states and logits agree on real tokens (padded query rows carry no meaning)."""
    mask = batch["attention_mask"]
    assert max_diff(ours[0], theirs[0], mask) < TOL
    assert max_diff(ours[1], theirs[1], mask) < TOL


@needs_torch
@needs_transformers
@pytest.mark.parametrize("rotary_value", [False, True])
@pytest.mark.parametrize("rope_layout", ["interleaved", "half"])
def test_hf_to_ours_masked_lm_parity(tmp_path, batch, rotary_value, rope_layout):
    hf = random_hf(transformers.RoFormerForMaskedLM, hf_config(rotary_value))
    hf.save_pretrained(tmp_path)
    config, ours = convert.load_hf(tmp_path, rope_layout=rope_layout)
    assert isinstance(ours, RoFormerForMaskedLM)
    assert config.embedding_size == 24 and config.rotary_value == rotary_value
    assert config.rope_layout == rope_layout
    assert_close(our_outputs(ours, batch), hf_outputs(hf, batch), batch)


@needs_torch
@needs_transformers
@pytest.mark.parametrize("rotary_value", [False, True])
def test_ours_to_hf_masked_lm_parity(tmp_path, batch, rotary_value):
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, embedding_size=24, num_layers=2, num_heads=2,
                         intermediate_size=64, max_position_embeddings=64, rotary_value=rotary_value)
    ours = randomize(RoFormerForMaskedLM(config, rngs=nnx.Rngs(0)))
    convert.save_hf(ours, config, tmp_path)
    hf, info = transformers.RoFormerForMaskedLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert_close(our_outputs(ours, batch), hf_outputs(hf.eval(), batch), batch)


@needs_torch
@needs_transformers
def test_the_accelerator_forms_keep_the_export_and_its_parity(tmp_path, batch):
    """The backend's XLA forms (RoPE pairs as split halves, one QKV product, bias gradients in
    the GEMMs) change what runs, not the parameters: the export is the same files, and
    transformers' logits match ours computed under the forms."""
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, embedding_size=24, num_layers=2, num_heads=2,
                         intermediate_size=64, max_position_embeddings=64)
    ours = randomize(RoFormerForMaskedLM(config, rngs=nnx.Rngs(0)))
    plain = our_outputs(ours, batch)
    convert.save_hf(ours, config, tmp_path / "plain")
    with backend.using_forms([form for form in backend.FORMS if form not in backend.KERNEL_FORMS]):
        with_forms = our_outputs(ours, batch)
        convert.save_hf(ours, config, tmp_path / "forms")
    files = sorted(path.name for path in (tmp_path / "plain").iterdir())
    assert files == sorted(path.name for path in (tmp_path / "forms").iterdir())
    for name in files:
        assert (tmp_path / "plain" / name).read_bytes() == (tmp_path / "forms" / name).read_bytes(), name
    hf = transformers.RoFormerForMaskedLM.from_pretrained(tmp_path / "forms").eval()
    assert_close(with_forms, hf_outputs(hf, batch), batch)
    assert_close(with_forms, plain, batch)


@needs_torch
@needs_transformers
@pytest.mark.parametrize("rotary_value", [False, True])
def test_half_layout_permutes_features_and_round_trips_exactly(tmp_path, batch, rotary_value):
    hf = random_hf(transformers.RoFormerForMaskedLM, hf_config(rotary_value), seed=1)
    hf.save_pretrained(tmp_path / "hf")
    _, interleaved = convert.load_hf(tmp_path / "hf")
    _, half = convert.load_hf(tmp_path / "hf", rope_layout="half")
    query = lambda m: np.asarray(m.roformer.encoder.layer[0].attention.self.query.kernel[...])  # noqa: E731
    assert not np.array_equal(query(half), query(interleaved))
    # Without the permutation the half-layout model computes something else entirely.
    unpermuted = RoFormerForMaskedLM(half.config, rngs=nnx.Rngs(0))
    nnx.update(unpermuted, nnx.state(interleaved, nnx.Param))
    assert max_diff(our_outputs(unpermuted, batch)[1], hf_outputs(hf, batch)[1], batch["attention_mask"]) > 1e-2

    convert.save_hf(half, None, tmp_path / "back")
    back = transformers.RoFormerForMaskedLM.from_pretrained(tmp_path / "back")
    original = hf.state_dict()
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, original[name]), name


@needs_torch
@needs_transformers
def test_sequence_classification_both_directions(tmp_path, batch):
    hf = random_hf(transformers.RoFormerForSequenceClassification, hf_config(False, num_labels=3))
    hf.save_pretrained(tmp_path / "hf")
    _, ours = convert.load_hf(tmp_path / "hf")
    assert ours.num_labels == 3
    ours.eval()
    kwargs = dict(token_type_ids=jnp.asarray(batch["token_type_ids"]),
                  attention_mask=jnp.asarray(batch["attention_mask"]))
    with torch.no_grad():
        hf_logits = hf(**{k: torch.as_tensor(v) for k, v in batch.items()}).logits.numpy()
    assert max_diff(ours(jnp.asarray(batch["input_ids"]), **kwargs), hf_logits) < TOL

    # ours -> HF, as a regression head (num_labels=1, GLUE STS-B style)
    _, regressor = convert.load_hf(tmp_path / "hf", head="classification", num_labels=1, seed=3)
    randomize(regressor.classifier, seed=3)
    convert.save_hf(regressor, None, tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["problem_type"] == "regression"
    back = transformers.RoFormerForSequenceClassification.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        back_logits = back(**{k: torch.as_tensor(v) for k, v in batch.items()}).logits.numpy()
    assert back_logits.shape == (3, 1)
    regressor.eval()
    assert max_diff(regressor(jnp.asarray(batch["input_ids"]), **kwargs), back_logits) < TOL


@needs_torch
@needs_transformers
def test_cli_round_trip_from_pytorch_bin(tmp_path, batch):
    """Old-style checkpoint: pytorch_model.bin with the tied decoder and sinusoid table stored."""
    hf = random_hf(transformers.RoFormerForMaskedLM, hf_config(True), seed=2)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    hf.config.to_json_file(hf_dir / "config.json")
    torch.save(hf.state_dict(), hf_dir / "pytorch_model.bin")
    (hf_dir / "vocab.txt").write_text("[PAD]\n[UNK]\n")

    convert.main(["from-hf", str(hf_dir), str(tmp_path / "ours")])
    meta = json.loads((tmp_path / "ours" / "model_config.json").read_text())
    assert meta["head"] == "mlm" and meta["model"]["rotary_value"] is True
    assert (tmp_path / "ours" / "vocab.txt").is_file()
    _, ours = convert.load_converted(tmp_path / "ours")
    assert_close(our_outputs(ours, batch), hf_outputs(hf, batch), batch)

    convert.main(["to-hf", str(tmp_path / "ours"), str(tmp_path / "back")])
    back = transformers.RoFormerForMaskedLM.from_pretrained(tmp_path / "back")
    original = hf.state_dict()
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, original[name]), name


@needs_torch
@needs_transformers
def test_to_hf_from_pretraining_workdir(tmp_path, batch, capsys):
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, embedding_size=24, num_layers=2, num_heads=2,
                         intermediate_size=64, max_position_embeddings=64)
    ours = randomize(RoFormerForMaskedLM(config, rngs=nnx.Rngs(0)), seed=4)
    checkpointer = Checkpointer(tmp_path / "run" / "checkpoints", max_to_keep=1, async_save=False)
    state = {"params": nnx.to_pure_dict(nnx.state(ours, nnx.Param)), "opt_state": {},
             "step": jnp.zeros((), jnp.int32)}
    checkpointer.save(7, state, {}, config.to_dict())
    checkpointer.close()

    convert.main(["to-hf", str(tmp_path / "run"), str(tmp_path / "hf")])
    assert capsys.readouterr().out == (f"wrote HF RoFormerForMaskedLM (step 7 of {tmp_path / 'run'}) "
                                       f"to {tmp_path / 'hf'}\n")   # which checkpoint it took
    hf = transformers.RoFormerForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    assert_close(our_outputs(ours, batch), hf_outputs(hf, batch), batch)

    # A run whose last phase trained on 96 tokens, past max_position_embeddings (which bounds
    # nothing for rope here): the export's sinusoid table and tokenizer limit cover 96.
    (tmp_path / "run" / "config.json").write_text(json.dumps(
        {"train": {"seq_len": 32, "steps": 4, "batch_size": 4, "phases": "2:32:4,2:96:4"}}))
    convert.main(["to-hf", str(tmp_path / "run"), str(tmp_path / "hf96")])
    hf = transformers.RoFormerForMaskedLM.from_pretrained(tmp_path / "hf96").eval()
    assert hf.config.max_position_embeddings == 96
    rng = np.random.default_rng(1)
    long = {"input_ids": rng.integers(1, VOCAB, (1, 96)), "attention_mask": np.ones((1, 96), np.int64),
            "token_type_ids": np.zeros((1, 96), np.int64)}
    assert_close(our_outputs(ours, long), hf_outputs(hf, long), long)


@needs_torch
@needs_transformers
def test_to_hf_export_loads_with_the_auto_classes(tmp_path):
    """What `AutoTokenizer` and `AutoModelForMaskedLM` read from a to-hf export gives our
    ids (lowercased, accents stripped: an uncased vocabulary) and our logits."""
    corpus = ["The quick brown fox jumps over the lazy dog.", "A lazy dog sleeps; the fox runs away quickly.",
              "Foxes and dogs are animals.", "Cafe au lait, a quick drink."] * 5
    tokenizer = WordPieceTokenizer.train(corpus, vocab_size=120, min_frequency=1, show_progress=False)
    config = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, embedding_size=24, num_layers=2,
                         num_heads=2, intermediate_size=64, max_position_embeddings=64)
    ours = randomize(RoFormerForMaskedLM(config, rngs=nnx.Rngs(0)), seed=5)
    checkpointer = Checkpointer(tmp_path / "run" / "checkpoints", max_to_keep=1, async_save=False)
    checkpointer.save(3, {"params": nnx.to_pure_dict(nnx.state(ours, nnx.Param)), "opt_state": {},
                          "step": jnp.zeros((), jnp.int32)}, {}, config.to_dict())
    checkpointer.close()
    tokenizer.save(tmp_path / "run")   # where pretraining keeps it: tokenizer.json

    convert.main(["to-hf", str(tmp_path / "run"), str(tmp_path / "hf")])
    auto_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert "RoFormer" not in type(auto_tokenizer).__name__   # that one needs rjieba
    assert auto_tokenizer.model_max_length == 64
    texts = ["The QUICK brown café fox.", "Dogs and foxes, quickly away!", "zebra"]
    encoded = auto_tokenizer(texts, padding=True, return_tensors="np")
    for row, text in enumerate(texts):
        length = int(encoded["attention_mask"][row].sum())
        assert encoded["input_ids"][row, :length].tolist() == tokenizer.encode(text).ids
    assert tokenizer.encode("CAFÉ").ids == tokenizer.encode("cafe").ids   # the export is uncased as ours is

    hf = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "RoFormerForMaskedLM"
    batch = {key: np.asarray(encoded[key], np.int64) for key in ("input_ids", "attention_mask", "token_type_ids")}
    assert_close(our_outputs(ours, batch), hf_outputs(hf, batch), batch)


def refused(capsys, argv: list[str]) -> str:
    """The one stderr line `convert.main(argv)` exits with (status 2, a user error)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        convert.main(argv)
    assert exited.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_to_hf_names_a_missing_directory_and_a_missing_step(tmp_path, capsys):
    assert refused(capsys, ["to-hf", str(tmp_path / "missing"), str(tmp_path / "hf")]) == (
        f"error: to-hf: {tmp_path / 'missing'}: no such directory (expected a from-hf output or a pretraining "
        "workdir)")
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                         max_position_embeddings=64)
    state = {"params": nnx.to_pure_dict(nnx.state(RoFormerForMaskedLM(config, rngs=nnx.Rngs(0)), nnx.Param)),
             "opt_state": {}, "step": jnp.zeros((), jnp.int32)}
    checkpointer = Checkpointer(tmp_path / "run" / "checkpoints", max_to_keep=1, async_save=False)
    checkpointer.save(8, state, {}, config.to_dict())
    checkpointer.close()
    assert refused(capsys, ["to-hf", str(tmp_path / "run"), str(tmp_path / "hf"), "--step", "7"]).endswith(
        "has no checkpoint at step 7 (it has steps [8])")
    assert not (tmp_path / "hf").exists()


@needs_torch
@needs_transformers
def test_loaders_return_models_in_eval_mode(tmp_path, batch):
    """Every loader's model is ready for inference as returned: with HF's default dropout
    (0.1) in the config, a model left in training mode would give other logits."""
    hf = random_hf(transformers.RoFormerForMaskedLM,
                   hf_config(False, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1), seed=7)
    hf.save_pretrained(tmp_path / "hf")
    config, from_hf = convert.load_hf(tmp_path / "hf")
    assert config.hidden_dropout == 0.1
    convert.save_converted(from_hf, tmp_path / "ours")
    _, converted = convert.load_converted(tmp_path / "ours")
    checkpointer = Checkpointer(tmp_path / "run" / "checkpoints", max_to_keep=1, async_save=False)
    checkpointer.save(3, {"params": nnx.to_pure_dict(nnx.state(from_hf, nnx.Param)), "opt_state": {},
                          "step": jnp.zeros((), jnp.int32)}, {}, config.to_dict())
    checkpointer.close()
    _, pretrained = convert.load_pretrain_workdir(tmp_path / "run")

    want = hf_outputs(hf, batch)
    for model in (from_hf, converted, pretrained):
        assert_close(our_outputs(model, batch, set_eval=False), want, batch)


@needs_torch
@needs_transformers
def test_bare_encoder_and_new_head_from_mlm_checkpoint(tmp_path, batch):
    hf = random_hf(transformers.RoFormerForMaskedLM, hf_config(False), seed=5)
    hf.save_pretrained(tmp_path / "hf")
    _, encoder = convert.load_hf(tmp_path / "hf", head="none")  # what GLUE fine-tuning loads
    assert isinstance(encoder, RoFormerModel)
    encoder.eval()
    hidden = encoder(jnp.asarray(batch["input_ids"]), token_type_ids=jnp.asarray(batch["token_type_ids"]),
                            attention_mask=jnp.asarray(batch["attention_mask"]))
    assert max_diff(hidden, hf_outputs(hf, batch)[0], batch["attention_mask"]) < TOL

    convert.save_hf(encoder, None, tmp_path / "base")  # HF RoFormerModel layout: no "roformer." prefix
    base = transformers.RoFormerModel.from_pretrained(tmp_path / "base")
    assert torch.equal(base.embeddings.word_embeddings.weight, hf.roformer.embeddings.word_embeddings.weight)
    _, classifier = convert.load_hf(tmp_path / "base", head="classification", num_labels=2)
    assert classifier.classifier.out_proj.kernel.shape == (32, 2)


@needs_torch
@needs_transformers
def test_sharded_bfloat16_safetensors(tmp_path):
    hf = random_hf(transformers.RoFormerForMaskedLM, hf_config(False), seed=6).to(torch.bfloat16)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    _, ours = convert.load_hf(tmp_path)
    want = hf.roformer.encoder.layer[1].output.dense.weight.detach().float().numpy().T
    np.testing.assert_array_equal(ours.roformer.encoder.layer[1].output.dense.kernel[...], want)


@needs_torch
@needs_transformers
@pytest.mark.parametrize("num_positions,dim", [(64, 16), (9, 7)])
def test_sinusoid_table_is_hf_table(num_positions, dim):
    hf = transformers.models.roformer.modeling_roformer.RoFormerSinusoidalPositionalEmbedding(num_positions, dim)
    np.testing.assert_array_equal(convert.sinusoid_table(num_positions, dim), hf.create_weight().numpy())


def test_conversion_errors(tmp_path):
    with pytest.raises(ValueError, match="position"):
        convert.save_hf(RoFormerForMaskedLM(ModelConfig(
            vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, position="t5"),
            rngs=nnx.Rngs(0)), None, tmp_path / "t5")

    for setting in (dict(rope_scaling="linear", rope_scaling_factor=2.0), dict(rotary_dim=8),
                    dict(pre_layer_norm=True), dict(rope_base=500.0)):
        config = ModelConfig(vocab_size=VOCAB, hidden_size=32, num_heads=2, **setting)
        with pytest.raises(ValueError, match=next(iter(setting))):
            convert.model_config_to_hf_config(config, head="mlm")


@needs_torch
@needs_transformers
def test_hf_file_errors(tmp_path):
    hf = random_hf(transformers.RoFormerForMaskedLM, hf_config(False, tie_word_embeddings=False))
    hf_dir = tmp_path / "untied"
    hf_dir.mkdir()
    hf.config.to_json_file(hf_dir / "config.json")
    torch.save(hf.state_dict(), hf_dir / "pytorch_model.bin")
    with pytest.raises(ValueError, match="untied"):
        convert.load_hf(hf_dir)

    tied = random_hf(transformers.RoFormerForMaskedLM, hf_config(False))
    tied.save_pretrained(tmp_path / "tied")
    config = json.loads((tmp_path / "tied" / "config.json").read_text())
    (tmp_path / "tied" / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(ValueError, match="intermediate.dense"):
        convert.load_hf(tmp_path / "tied")
    (tmp_path / "tied" / "config.json").write_text(json.dumps({**config, "is_decoder": True}))
    with pytest.raises(ValueError, match="decoder"):
        convert.load_hf(tmp_path / "tied")
    with pytest.raises(ValueError, match="no model.safetensors"):
        convert.read_hf_weights(tmp_path)


def test_from_hf_names_a_missing_directory_and_a_pretraining_workdir(tmp_path, capsys):
    assert refused(capsys, ["from-hf", str(tmp_path / "missing"), str(tmp_path / "out")]).startswith(
        f"error: {tmp_path / 'missing'}: no such directory (expected an HF RoFormer")
    with pytest.raises(ValueError, match="no such directory"):
        convert.load_hf(tmp_path / "missing")

    workdir = tmp_path / "run"   # what `python -m roformer.pretrain` leaves: checkpoints/ + its config
    (workdir / "checkpoints" / "10").mkdir(parents=True)
    (workdir / "config.json").write_text(json.dumps({"model": {"size": "mini"}, "train": {"steps": 10}}))
    assert re.search(r"is a pretraining workdir .* not an HF RoFormer directory: config.json plus "
                     r"model.safetensors.* to-hf .*run OUT_DIR", refused(capsys, ["from-hf", str(workdir),
                                                                                str(tmp_path / "out")]))
    assert not (tmp_path / "out").exists()


@needs_torch
@needs_transformers
def test_read_model_config_reads_the_architecture_without_the_weights(tmp_path):
    """What a warm start checks a run's settings against: the same ModelConfig the loaders
    build, for an HF directory and for our format; a pretraining workdir is named as one."""
    transformers.RoFormerForMaskedLM(hf_config(True, intermediate_size=48)).save_pretrained(tmp_path / "hf")
    config, model = convert.load_hf(tmp_path / "hf")
    assert checkpoint_source.read_model_config(tmp_path / "hf") == config
    assert config.intermediate_size == 48 and config.rotary_value
    convert.save_converted(model, tmp_path / "ours")
    assert checkpoint_source.read_model_config(tmp_path / "ours") == config
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ValueError, match="is a pretraining workdir"):
        checkpoint_source.read_model_config(tmp_path / "run")


@pytest.mark.parametrize("cut", ["empty", "half"])
def test_a_truncated_safetensors_file_is_one_line_naming_it(tmp_path, capsys, cut):
    """An interrupted download or copy leaves a short model.safetensors: from-hf, and a GLUE or
    warm-start init from the directory, refuse it in one line naming the file."""
    from roformer.glue.init import load_init

    model = RoFormerForMaskedLM(ModelConfig(vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=2,
                                            intermediate_size=64), rngs=nnx.Rngs(0))
    hf_dir = convert.save_hf(model, None, tmp_path / "hf")
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    (hf_dir / "vocab.txt").write_text("\n".join(specials + [f"w{i}" for i in range(VOCAB - 5)]) + "\n")
    weights = hf_dir / "model.safetensors"
    weights.write_bytes(b"" if cut == "empty" else weights.read_bytes()[: weights.stat().st_size // 2])
    line = refused(capsys, ["from-hf", str(hf_dir), str(tmp_path / "out")])
    assert line.startswith(f"error: {weights} ({weights.stat().st_size} bytes) is not a readable safetensors file")
    assert "it may be truncated" in line and not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=re.escape(f"{weights} ({weights.stat().st_size} bytes) is not a readable")):
        load_init(str(hf_dir))


def test_to_hf_writes_files_others_can_read(tmp_path):
    """model.safetensors and config.json get the mode the umask gives any new file (0644 under
    the usual 022), as transformers' own save_pretrained does, not safetensors' 0600."""
    model = RoFormerForMaskedLM(ModelConfig(vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=2,
                                            intermediate_size=64), rngs=nnx.Rngs(0))
    umask = os.umask(0o022)
    try:
        out = convert.save_hf(model, None, tmp_path / "hf")
    finally:
        os.umask(umask)
    for name in ("model.safetensors", "config.json"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o644, name
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_to_hf_onto_a_file_is_one_line(tiny_run, tmp_path, capsys):
    target = tmp_path / "model"
    target.write_text("a file")
    err = one_line_error(capsys, lambda: convert.main(["to-hf", str(tiny_run), str(target)]))
    assert "is a file, not a directory" in err and target.read_text() == "a file"


def test_an_export_stopped_midway_is_refused_by_from_hf(tiny_run, tmp_path, monkeypatch, capsys):
    def stopped(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(convert, "save_hf_tokenizer", stopped)
    with pytest.raises(SystemExit):
        convert.main(["to-hf", str(tiny_run), str(tmp_path / "hf")])
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "hf" / "config.json").is_file()
    capsys.readouterr()
    err = one_line_error(capsys, lambda: convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "ours")]))
    assert "is an export that did not finish" in err


def test_a_damaged_saved_model_is_one_line(tmp_path):
    from flax import nnx

    from roformer.model import ModelConfig, RoFormerForSequenceClassification

    model = RoFormerForSequenceClassification(ModelConfig(vocab_size=50, hidden_size=16, num_layers=1, num_heads=2,
                                                          intermediate_size=32, max_position_embeddings=32),
                                              2, rngs=nnx.Rngs(0))
    saved = convert.save_converted(model, tmp_path / "seed0")
    meta = (saved / convert.OUR_CONFIG_FILE).read_text()
    convert.load_converted(saved)

    def refused(match: str) -> None:
        with pytest.raises(ConfigError, match=match):
            convert.load_converted(saved)

    (saved / convert.OUR_CONFIG_FILE).write_text("")   # a save killed mid-way, before the atomic writes
    refused("model_config.json cannot be read .*the model there is damaged")
    (saved / convert.OUR_CONFIG_FILE).write_text(json.dumps({**json.loads(meta), "head": "regression"}))
    refused("model_config.json cannot be read")
    wrong = json.loads(meta)
    wrong["model"]["hidden_size"] = 24
    (saved / convert.OUR_CONFIG_FILE).write_text(json.dumps(wrong))
    refused("parameters in .* cannot be read as the model model_config.json describes")
    (saved / convert.OUR_CONFIG_FILE).write_text(meta)
    (saved / "params" / "_METADATA").unlink()
    refused("parameters in .* cannot be read")
    rng = np.random.default_rng(0)
    for path in (saved / "params").rglob("*"):
        if path.is_file():
            path.write_bytes(rng.bytes(path.stat().st_size or 64))
    refused("parameters in .* cannot be read")
