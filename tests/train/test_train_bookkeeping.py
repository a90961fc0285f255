"""roformer.train.bookkeeping: the model-config check on resume, and a resumed run's divergence
guard."""

import pytest

from roformer.model import ModelConfig
from roformer.train.bookkeeping import check_same_model_config
from roformer.train.config import TrainConfig

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)



def test_model_config_mismatch_lists_differing_keys(tmp_path):
    saved = ModelConfig(hidden_size=64, num_heads=4).to_dict()
    check_same_model_config(saved, dict(saved), tmp_path)
    with pytest.raises(ValueError, match=r"hidden_size: checkpoint=64 config=128(.|\n)*position"):
        check_same_model_config(saved, {**saved, "hidden_size": 128, "position": "t5"}, tmp_path)
    # A checkpoint written before a ModelConfig field existed resumes (the field is its
    # default), and the attention kernel may change between runs.
    older = {k: v for k, v in saved.items() if k != "attention_impl"}
    check_same_model_config(older, {**saved, "attention_impl": "xla"}, tmp_path)


def test_a_resumed_guard_replays_the_logged_losses(tmp_path):
    """A resumed run's divergence guard: its reference median holds the logged losses it judged
    in range (not a spike's), and a streak of out-of-range rows the run stopped in counts on."""
    import json

    from roformer.train import bookkeeping

    rows = [{"step": s, "loss": 590.0 if s in (18, 22) else 6.0} for s in range(2, 23, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tc = TrainConfig(warmup_steps=0, divergence_window=20)
    guard = bookkeeping.resumed_guard(tc, bookkeeping.logged_history(tmp_path, 22, 20), 22)
    assert list(guard.history) == [6.0] * 9 and guard.strikes == 1 and guard.suspicious
    assert guard.resumed_step == guard.last_good_step == 22
