"""Dynamic MLM masking, vectorised over the whole batch.

Per row, n = min(P, max(1, round(mask_rate * candidates))) positions are chosen
uniformly among the candidate tokens (every non-special token); each chosen token
becomes [MASK] with probability 0.8, a random non-special token with 0.1, or stays
unchanged with 0.1. With whole-word masking, whole words ("xyz ##ab ##c") are drawn
in random order and kept while the running token count stays within n.
The chosen positions (ascending), their original ids and weight 1.0 fill the first
slots of fixed [B, P] arrays; the rest point at position 0 with label 0, weight 0.
"""
from __future__ import annotations

import numpy as np

from roformer.errors import ConfigError

MASK_PROB, RANDOM_PROB = 0.8, 0.1   # the remaining 0.1 keeps the original token


class MlmMasker:
    def __init__(self, *, is_special: np.ndarray, is_continuation: np.ndarray, mask_id: int,
                 mask_rate: float = 0.15, max_predictions: int, whole_word: bool = False) -> None:
        if not 0.0 < mask_rate < 1.0:
            raise ConfigError(f"data.mask_rate={mask_rate}: must be in (0, 1)")
        if max_predictions < 1:
            raise ConfigError(f"data.max_predictions_per_seq={max_predictions}: must be >= 1")
        self.is_special = np.asarray(is_special, dtype=bool)
        self.is_continuation = np.asarray(is_continuation, dtype=bool)
        self.mask_id, self.mask_rate = mask_id, mask_rate
        self.max_predictions, self.whole_word = max_predictions, whole_word
        self.replacement_ids = np.flatnonzero(~self.is_special).astype(np.int32)

    def __call__(self, input_ids: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Masks a copy of input_ids [B, L]; returns input_ids + masked_positions/labels/weights."""
        B, L = input_ids.shape
        P = self.max_predictions
        candidate = ~self.is_special[input_ids]
        num_candidates = candidate.sum(axis=1)
        num_predict = np.minimum(P, np.maximum(1, np.floor(num_candidates * self.mask_rate + 0.5))).astype(np.int64)
        num_predict[num_candidates == 0] = 0
        if self.whole_word:
            chosen = self._choose_whole_words(input_ids, candidate, num_predict, rng)
        else:
            chosen = self._choose_tokens(candidate, num_predict, rng)
        # Chosen positions in ascending order fill each row's first slots (nonzero is row-major).
        rows_i, cols_i = np.nonzero(chosen)
        counts = np.bincount(rows_i, minlength=B)
        slot = np.arange(len(rows_i)) - np.repeat(np.cumsum(counts) - counts, counts)
        slots = np.full((B, P), L, dtype=np.int32)
        slots[rows_i, slot] = cols_i
        weights = slots < L
        positions = np.where(weights, slots, 0).astype(np.int32)
        labels = np.where(weights, np.take_along_axis(input_ids, positions, axis=1), 0).astype(np.int32)

        draw = rng.random((B, P), dtype=np.float32)
        random_tokens = self.replacement_ids[rng.integers(0, len(self.replacement_ids), size=(B, P))]
        replaced = np.where(draw < MASK_PROB, self.mask_id,
                            np.where(draw < MASK_PROB + RANDOM_PROB, random_tokens, labels)).astype(np.int32)
        masked = input_ids.copy()
        rows = np.broadcast_to(np.arange(B)[:, None], (B, P))
        masked[rows[weights], positions[weights]] = replaced[weights]
        return {"input_ids": masked, "masked_positions": positions, "masked_labels": labels,
                "masked_weights": weights.astype(np.float32)}

    def _choose_tokens(self, candidate: np.ndarray, num_predict: np.ndarray,
                       rng: np.random.Generator) -> np.ndarray:
        """Boolean [B, L]: num_predict[b] distinct candidate positions per row, uniformly."""
        B, L = candidate.shape
        keys = rng.random((B, L), dtype=np.float32)
        keys[~candidate] = 2.0
        k = min(self.max_predictions, L)
        picked = smallest_keys_in_order(keys, k)   # rank r < n picks the token
        take = np.arange(k) < num_predict[:, None]
        chosen = np.zeros((B, L), dtype=bool)
        rows = np.broadcast_to(np.arange(B)[:, None], (B, k))
        chosen[rows[take], picked[take]] = True
        return chosen

    def _choose_whole_words(self, input_ids: np.ndarray, candidate: np.ndarray, num_predict: np.ndarray,
                            rng: np.random.Generator) -> np.ndarray:
        """Boolean [B, L]: whole words in random order while their token total <= num_predict."""
        B, L = candidate.shape
        previous_candidate = np.zeros_like(candidate)
        previous_candidate[:, 1:] = candidate[:, :-1]
        starts = candidate & (~self.is_continuation[input_ids] | ~previous_candidate)
        word = np.cumsum(starts, axis=1)                    # word number within the row, 1-based
        word_key = np.arange(B)[:, None] * (L + 1) + word   # unique word id in the batch
        word_len = np.bincount(word_key[candidate], minlength=B * (L + 1))
        keys = rng.random((B, L), dtype=np.float32)
        keys[~starts] = 2.0
        # At most P words can be kept (each has >= 1 token): order only the P smallest keys.
        order = smallest_keys_in_order(keys, min(self.max_predictions, L))
        ordered_words = np.take_along_axis(word_key, order, axis=1)
        ordered_len = np.where(np.take_along_axis(starts, order, axis=1), word_len[ordered_words], L + 1)
        keep = np.cumsum(ordered_len, axis=1) <= num_predict[:, None]
        word_chosen = np.zeros(B * (L + 1), dtype=bool)
        word_chosen[ordered_words[keep]] = True
        return candidate & word_chosen[word_key]


def mask_rows_on_device(key, rows: dict, *, special, replacement_ids, mask_id: int, mask_rate: float,
                        max_predictions: int) -> dict:
    """Per row n = min(P, max(1, round(rate * candidates))) candidate tokens chosen uniformly
    (ascending in their slots), each [MASK] with 0.8, a random non-special token with 0.1,
    kept with 0.1: MlmMasker's rule, drawn with jax.random inside a traced step (a study's
    members mask their rows on the device, so no host work paces a step). `rows`: input_ids,
    positions and segment_ids [B, L]; `special`: bool [vocab]; `replacement_ids`: the
    non-special ids a random replacement draws from."""
    import jax   # jax: only where rows are masked on the device
    import jax.numpy as jnp

    ids = rows["input_ids"]
    B, L = ids.shape
    P = max_predictions
    candidate = ~special[ids] & (rows["segment_ids"] != 0)
    count = candidate.sum(axis=1)
    n = jnp.where(count > 0, jnp.minimum(P, jnp.maximum(1, jnp.floor(count * mask_rate + 0.5))), 0)
    k_choose, k_draw, k_token = jax.random.split(key, 3)
    scores = jnp.where(candidate, jax.random.uniform(k_choose, (B, L)), -1.0)
    _, picked = jax.lax.top_k(scores, P)
    taken = jnp.arange(P)[None, :] < n[:, None]
    slots = jnp.sort(jnp.where(taken, picked, L), axis=1)       # chosen ascending, the rest at L
    weights = slots < L
    positions = jnp.where(weights, slots, 0).astype(jnp.int32)
    labels = jnp.where(weights, jnp.take_along_axis(ids, positions, axis=1), 0)
    random_tokens = replacement_ids[jax.random.randint(k_token, (B, P), 0, replacement_ids.shape[0])]
    draw = jax.random.uniform(k_draw, (B, P))
    replaced = jnp.where(draw < MASK_PROB, mask_id, jnp.where(draw < MASK_PROB + RANDOM_PROB, random_tokens, labels))
    row = jnp.broadcast_to(jnp.arange(B)[:, None], (B, P))
    # Unused slots write the row's column L (out of bounds): dropped.
    masked = ids.at[row, jnp.where(weights, positions, L)].set(replaced.astype(ids.dtype), mode="drop")
    return {"input_ids": masked, "token_type_ids": jnp.zeros_like(ids), "positions": rows["positions"],
            "segment_ids": rows["segment_ids"], "masked_positions": positions, "masked_labels": labels.astype(jnp.int32),
            "masked_weights": weights.astype(jnp.float32)}


def smallest_keys_in_order(keys: np.ndarray, k: int) -> np.ndarray:
    """[B, k]: each row's columns of its k smallest keys, smallest first (the k smallest found
    unordered, then only they sorted)."""
    B, L = keys.shape
    smallest = np.argpartition(keys, k - 1, axis=1)[:, :k] if k < L else np.broadcast_to(np.arange(L), (B, L))
    return np.take_along_axis(smallest, np.argsort(np.take_along_axis(keys, smallest, axis=1), axis=1), axis=1)
