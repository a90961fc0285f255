"""Attention distance and hidden-state cosine (roformer.model.attention_stats), and the
probabilities they are read from (RoFormerSelfAttention.probabilities)."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import MICRO_MODEL, tiny_run_config

from roformer.model import ModelConfig, RoFormerModel, attention_stats
from roformer.train import read_metrics, train_and_evaluate

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)

TINY = dict(vocab_size=50, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
            max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)


def encoder(position: str, **fields) -> RoFormerModel:
    model = RoFormerModel(ModelConfig(**TINY, position=position, **fields), rngs=nnx.Rngs(0))
    model.eval()
    return model


@pytest.mark.parametrize("position", ["rope", "shaw", "t5", "alibi", "learned"])
def test_probabilities_are_what_the_layer_applies_to_v(position):
    model = encoder(position)
    ids = jnp.asarray(np.random.default_rng(0).integers(1, 50, size=(2, 12)))
    mask = jnp.arange(12)[None] < jnp.array([[12], [9]])
    x, inputs = model.embed_inputs(ids, attention_mask=mask)
    self_attention = model.encoder.layer[0].attention.self
    probs = self_attention.probabilities(x, layer=0, **inputs)
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
    assert float(jnp.abs(probs[1, :, :, 9:]).max()) < 1e-6          # padding gets no weight
    if position != "shaw":   # Shaw adds its relative value term to the probabilities' output
        q, k, v = self_attention._heads(x)
        _, _, v = inputs["scheme"].rotate(q, k, v, inputs["context"])
        expected = self_attention(x, layer=0, **inputs).reshape(2, 12, 2, 16)
        np.testing.assert_allclose(jnp.einsum("bhqk,bkhd->bqhd", probs, v), expected, atol=1e-5)


def test_uniform_attention_looks_a_third_of_the_way_and_identical_tokens_are_collapsed():
    model = encoder("none")
    for layer in model.encoder.layer:   # zero q and k: every logit 0, attention uniform
        for dense in (layer.attention.self.query, layer.attention.self.key):
            dense.kernel[...] = jnp.zeros_like(dense.kernel[...])
    n = 10
    stats = attention_stats.attention_stats(model, jnp.full((3, n), 7))
    # mean over i of mean_j |i - j| for n positions: (n^2 - 1) / (3n)
    np.testing.assert_allclose(stats["attention_distance"], (n * n - 1) / (3 * n), rtol=1e-5)
    assert stats["attention_distance"].shape == (2, 2) and stats["hidden_cosine"].shape == (3,)
    # No positions and one token everywhere: every position carries the same vector.
    np.testing.assert_allclose(stats["hidden_cosine"], 1.0, atol=1e-5)


def test_padding_and_other_documents_are_left_out():
    model = encoder("rope")
    ids = jnp.asarray(np.random.default_rng(1).integers(1, 50, size=(1, 12)))
    alone = attention_stats.attention_stats(model, ids[:, :6])
    segments = jnp.asarray([[1] * 6 + [0] * 6])   # the second half is padding
    padded = attention_stats.attention_stats(model, ids, segment_ids=segments)
    for key in alone:
        np.testing.assert_allclose(padded[key], alone[key], rtol=1e-5)


def test_metric_names_round_trip():
    stats = {"attention_distance": np.array([[1.0, 2.0], [3.0, 4.0]]), "hidden_cosine": np.array([0.1, 0.2, 0.3])}
    row = attention_stats.as_metrics(stats)
    assert row["eval_attention_distance_l1h0"] == 3.0 and row["eval_hidden_cosine_l2"] == 0.3
    back = attention_stats.from_metrics({"step": 5, "eval_loss": 1.0, **row})
    assert back == {"attention_distance": [[1.0, 2.0], [3.0, 4.0]], "hidden_cosine": [0.1, 0.2, 0.3]}
    assert attention_stats.from_metrics({"step": 5, "loss": 2.0}) is None


def test_the_training_loop_logs_them_at_every_evaluation(tmp_path):
    config = tiny_run_config(tmp_path / "cache", {
        **MICRO_MODEL, "train.steps": 4, "train.batch_size": 4, "train.seq_len": 32, "train.warmup_steps": 1,
        "train.eval_every": 2, "train.eval_batches": 1, "train.checkpoint_every": 4, "train.progress_bar": False,
        "mesh.num_devices": 1})
    train_and_evaluate(config, tmp_path / "run")
    evals = [row for row in read_metrics(tmp_path / "run" / "metrics.jsonl") if "eval_loss" in row]
    assert [row["step"] for row in evals] == [2, 4]
    for row in evals:
        stats = attention_stats.from_metrics(row)
        assert len(stats["attention_distance"]) == 2 and len(stats["attention_distance"][0]) == 2
        assert all(d > 0 for heads in stats["attention_distance"] for d in heads)
        assert all(-1.0 <= c <= 1.0 for c in stats["hidden_cosine"])
