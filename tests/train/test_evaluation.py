"""Held-out evaluation shared by the training drivers (roformer.train.evaluation)."""
import numpy as np

from roformer.train.evaluation import row_sums


def test_row_sums_in_padded_chunks_equal_the_sums_of_all_rows_at_once():
    """Every row once, in order, whatever the chunk size and the chunks in flight; the padding
    of the last chunk (copies of its last row at weight 0) is dropped."""
    rng = np.random.default_rng(0)
    rows = {"input_ids": rng.integers(0, 9, (11, 4)), "masked_weights": rng.uniform(0.5, 1, (11, 3)).astype(np.float32)}

    def evaluate_rows(params, rest, chunk):   # two members: params scales each row's sums
        base = chunk["input_ids"].sum(-1) * chunk["masked_weights"].sum(-1)
        return {"loss": np.stack([base * p for p in params]), "correct": np.stack([base + p for p in params])}

    whole = evaluate_rows((1.0, 2.0), None, rows)
    for size, in_flight in ((4, 1), (4, 2), (3, 4), (11, 1), (16, 2)):
        sums, evaluated = row_sums(evaluate_rows, (1.0, 2.0), None, rows, size, in_flight=in_flight)
        assert evaluated == -(-11 // size) * size
        for key in ("loss", "correct"):
            assert sums[key].shape == (2, 11)
            np.testing.assert_allclose(sums[key], whole[key], rtol=1e-6)
