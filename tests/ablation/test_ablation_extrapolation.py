"""Length extrapolation (roformer.ablation.extrapolation): the same leading text at every
length, learned tables n/a beyond their rows, rotary scalings at evaluation time."""
import jax
import numpy as np
import pytest
from flax import nnx

from roformer.ablation import extrapolation
from roformer.model import ModelConfig, RoFormerForMaskedLM


def _batches(rng, batch_size, length, vocab, num_batches=1, predictions=6):
    batches = []
    for _ in range(num_batches):
        batches.append({
            "input_ids": rng.integers(5, vocab, (batch_size, length)).astype(np.int32),
            "token_type_ids": np.zeros((batch_size, length), np.int32),
            "positions": np.tile(np.arange(length, dtype=np.int32), (batch_size, 1)),
            "segment_ids": np.ones((batch_size, length), np.int32),
            "masked_positions": rng.integers(0, length, (batch_size, predictions)).astype(np.int32),
            "masked_labels": rng.integers(5, vocab, (batch_size, predictions)).astype(np.int32),
            "masked_weights": np.ones((batch_size, predictions), np.float32),
        })
    return batches


def test_windows_cover_the_same_leading_text_at_every_length():
    from roformer.data.packing import plan_rows

    doc_len = np.array([600, 40, 700])    # document 1 is too short for a 256-token window
    for window, expected in ((64, 4), (128, 2), (256, 1)):
        plan = plan_rows(np.array([0, 2]), doc_len, window, "document")
        picked = extrapolation.window_rows(plan.doc, plan.offset, plan.length, window, max_len=256)
        assert list(plan.doc[picked]) == [0] * expected + [2] * expected
        assert np.all(plan.length[picked] == window - 2)
        assert np.all(plan.offset[picked] + plan.length[picked] <= 254)   # inside the first 256 tokens


def test_extrapolation_evaluate_learned_na_and_rope_scalings():
    rng = np.random.default_rng(0)
    vocab, seq_len = 64, 16
    batches = {n: _batches(rng, 2, n, vocab) for n in (seq_len, 2 * seq_len)}
    common = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, vocab_size=vocab,
                  max_position_embeddings=seq_len,
                  initializer_range=0.5)   # sharp attention, so position scalings visibly matter

    def init(position):
        config = ModelConfig.from_preset("tiny", position=position, **common)
        return config, nnx.to_pure_dict(nnx.state(RoFormerForMaskedLM(config, rngs=nnx.Rngs(0)), nnx.Param))

    # Learned absolute at 2x its table: n/a, without evaluating anything.
    learned = extrapolation.evaluate(*init("learned"), {2 * seq_len: batches[2 * seq_len]}, seq_len)
    assert learned["lengths"] == [32] and learned["loss"] == {"plain": [None]}

    config, params = init("rope")
    rope = extrapolation.evaluate(config, params, batches, seq_len, scalings=("linear", "ntk"))
    plain, linear, ntk = (rope["loss"][k] for k in ("plain", "linear", "ntk"))
    assert linear[0] == ntk[0] == plain[0]          # factor 1 is the unscaled model
    assert linear[1] != plain[1] and ntk[1] != plain[1] and linear[1] != ntk[1]
    assert extrapolation.count_params(params) == sum(np.size(x) for x in jax.tree.leaves(params))
    with pytest.raises(ValueError, match="choose from"):
        extrapolation.evaluate(config, params, batches, seq_len, scalings=("yarnish",))


def test_an_extension_no_held_out_document_reaches_is_not_applicable_not_a_loss_of_zero(monkeypatch):
    """Too few long documents for the extended length: the extension's curve is n/a at every
    step, as the extrapolation table's column is; a mean over no windows is refused."""
    class Run:   # a warm-started workdir with two checkpoints
        def __init__(self, path):
            self.path = path

        def run_config(self):
            return {"train": {"init_from": "pretrained"}}

        def model_config(self):
            return None

        def params(self, step=None):
            return None, {"step": step}

        def steps(self):
            return [10, 20]

    monkeypatch.setattr(extrapolation, "PretrainWorkdir", Run)
    monkeypatch.setattr(extrapolation, "heldout_windows", lambda run, data_cfg, lengths, **kw: {n: [] for n in lengths})
    result = extrapolation.evaluate_checkpoints("extended", None, seq_len=32, factors=(1, 4), factor=4)
    assert result == {"length": 128, "steps": [0, 10, 20], "loss": [None] * 3, "accuracy": [None] * 3}
    with pytest.raises(ValueError, match="no held-out windows"):
        extrapolation.mlm_loss(None, {}, [])
