"""Position / token signal ratios at initialisation (roformer.model.position_signal)."""
import math

import pytest

from roformer.model import ModelConfig
from roformer.model.position_signal import position_signal

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)

TINY = dict(vocab_size=500, hidden_size=64, num_layers=1, num_heads=2, intermediate_size=128,
            max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)


def ratios(position: str, **fields) -> dict:
    return position_signal(ModelConfig(**TINY, position=position, **fields), length=64, batch=4)


def test_none_adds_no_position_signal():
    assert ratios("none") == {"input": None, "logits": 0.0}


def test_learned_table_starts_at_the_token_embeddings_scale():
    # Position, word and type tables share std initializer_range: position / (word + type) = 1/sqrt(2).
    assert ratios("learned")["input"] == pytest.approx(1 / math.sqrt(2), rel=0.1)


def test_default_sinusoidal_does_not_swamp_the_tokens_the_unscaled_table_does():
    # The unscaled table's rows have norm sqrt(d/2) against ~0.02 sqrt(d) for the tokens.
    unscaled = ratios("sinusoidal", sinusoidal_scaling="unscaled")["input"]
    assert unscaled == pytest.approx(math.sqrt(0.5) / (0.02 * math.sqrt(2)), rel=0.1)
    assert ratios("sinusoidal")["input"] < 5 < unscaled


@pytest.mark.parametrize("position", ["shaw", "t5", "alibi", "rope"])
def test_relative_schemes_change_the_logits_only(position):
    r = ratios(position)
    assert r["input"] is None and r["logits"] > 0
