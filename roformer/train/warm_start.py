"""Warm start: begin a pretraining run from another model's parameters (fresh optimizer, step 0).

`train.init_from` names a pretraining workdir (`train.init_step`: its checkpoint step, newest
when < 0), a `python -m roformer.convert from-hf` output, or an HF RoFormer directory. The
architecture must give every parameter the same shape; settings that change no parameter
(RoPE base or scaling, dropout, dtype, kernels) may differ, which is what continued
pretraining at another length or a context-extension stage needs. The run uses the
checkpoint's tokenizer (its embedding rows mean those tokens): with `data.vocab` empty it is
taken from the checkpoint, and a different `data.vocab` is refused.

A learned absolute table shorter than the new model's is refused unless
`train.init_grow_positions="copy"`: the trained rows are repeated to fill the longer table,
as Longformer did; every other scheme encodes any length without new parameters.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np

from roformer.model import ModelConfig

log = logging.getLogger("roformer.train")

GROW_POSITIONS = ("", "copy")
# ModelConfig fields a warm-started run may set differently from its checkpoint: no parameter
# depends on them (a longer learned table is handled by init_grow_positions).
MAY_DIFFER = ("hidden_dropout", "attention_dropout", "attention_impl", "dtype", "rope_base", "rope_scaling",
              "rope_scaling_factor", "rope_original_max_len", "max_position_embeddings")
LEARNED_TABLE = ("roformer", "position", "position_embeddings", "embedding")


@dataclasses.dataclass(frozen=True)
class InitCheckpoint:
    """Where a warm start comes from: its kind, directory, step and tokenizer."""

    kind: str                    # "pretrain" | "converted" | "hf"
    path: Path
    step: int                    # checkpoint step of a pretraining workdir, else -1
    tokenizer_file: Path
    lowercase: bool

    def tokenizer(self):
        from roformer.data.tokenizer import load_tokenizer

        return load_tokenizer(str(self.tokenizer_file), lowercase=self.lowercase)

    def with_tokenizer(self, data):
        """The run's DataConfig: with data.vocab empty, this checkpoint's tokenizer."""
        if data.vocab:
            return data
        return dataclasses.replace(data, vocab=str(self.tokenizer_file), lowercase=self.lowercase)

    def load(self) -> tuple[ModelConfig, dict]:
        """(ModelConfig, MLM parameters as a pure nested dict)."""
        from flax import nnx

        from roformer import convert
        from roformer.train.checkpoint import PretrainWorkdir

        if self.kind == "pretrain":
            return PretrainWorkdir(self.path).params(self.step)
        if self.kind == "hf":     # an encoder-only checkpoint gets a fresh MLM head (load_hf warns)
            config, model = convert.load_hf(self.path, head="mlm")
        else:
            config, model = convert.load_converted(self.path)
            if not hasattr(model, "cls"):
                raise ValueError(f"train.init_from={self.path} holds a {type(model).__name__}, not an MLM "
                                 "model; convert the checkpoint with its MLM head")
        return config, nnx.to_pure_dict(nnx.state(model, nnx.Param))


def find_init_checkpoint(init_from: str, init_step: int = -1) -> InitCheckpoint:
    """Identify `init_from` and its tokenizer, without loading parameters."""
    from roformer import convert
    from roformer.train.checkpoint import PretrainWorkdir

    path = Path(init_from).expanduser().resolve()
    kind = convert.checkpoint_kind(path, what="train.init_from")
    if kind == "pretrain":
        run = PretrainWorkdir(path)
        if not run.tokenizer_file.is_file():
            raise ValueError(f"train.init_from={init_from}: no tokenizer.json in the workdir")
        return InitCheckpoint(kind, path, run.resolve_step(init_step), run.tokenizer_file, lowercase=True)
    tokenizer_file = next((path / n for n in ("tokenizer.json", "vocab.txt") if (path / n).is_file()), None)
    if tokenizer_file is None:
        raise ValueError(f"train.init_from={init_from}: no tokenizer.json or vocab.txt beside the weights")
    tokenizer_config = path / "tokenizer_config.json"
    lowercase = (json.loads(tokenizer_config.read_text()).get("do_lower_case", True)
                 if tokenizer_config.is_file() else True)
    return InitCheckpoint(kind, path, -1, tokenizer_file, lowercase=bool(lowercase))


def _shapes(tree: dict, prefix: tuple = ()) -> dict[tuple, tuple]:
    out = {}
    for key, value in tree.items():
        path = (*prefix, str(key))
        out.update(_shapes(value, path) if isinstance(value, dict) else {path: tuple(value.shape)})
    return out


def _grow_table(params: dict, rows: int) -> dict:
    """`params` with the learned position table repeated to `rows` rows."""
    node = params
    for key in LEARNED_TABLE[:-1]:
        node = node[key]
    table = np.asarray(node[LEARNED_TABLE[-1]])
    node[LEARNED_TABLE[-1]] = np.concatenate([table] * -(-rows // len(table)))[:rows]
    return params


def load_init_params(source: InitCheckpoint, model_cfg: ModelConfig, abstract_params: dict,
                     tokenizer_hash: str, *, grow_positions: str = "") -> dict:
    """The parameters of `source` for a model of `model_cfg`, checked against it."""
    if grow_positions not in GROW_POSITIONS:
        raise ValueError(f"train.init_grow_positions={grow_positions!r}: choose '' (refuse) or 'copy'")
    where = f"train.init_from={source.path}"
    if source.tokenizer().hash != tokenizer_hash:
        raise ValueError(f"{where} was trained with another tokenizer than this run's data.vocab; "
                         f"leave data.vocab empty to use the checkpoint's ({source.tokenizer_file})")
    saved_cfg, params = source.load()
    saved, mine = dataclasses.asdict(saved_cfg), dataclasses.asdict(model_cfg)
    differ = [f"{k}: checkpoint {saved[k]!r}, this run {mine[k]!r}" for k in saved
              if k not in MAY_DIFFER and saved[k] != mine[k]]
    if differ:
        raise ValueError(f"{where} is another architecture than this run's model config: " + "; ".join(differ)
                         + " (set --config.model.* to the checkpoint's)")
    want, got = _shapes(abstract_params), _shapes(params)
    table = want.get(LEARNED_TABLE)
    if table and got.get(LEARNED_TABLE) and got[LEARNED_TABLE][0] < table[0]:
        if grow_positions != "copy":
            raise ValueError(f"{where}: its learned position table has {got[LEARNED_TABLE][0]} rows, this model "
                             f"needs {table[0]}; set --config.train.init_grow_positions=copy to repeat the "
                             "trained rows, or keep model.max_position_embeddings at the checkpoint's")
        params = _grow_table(params, table[0])
        got = _shapes(params)
    diffs = [f"{'/'.join(k)}: checkpoint {got.get(k)} vs model {want.get(k)}"
             for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)]
    if diffs:
        raise ValueError(f"{where} does not fit this model: " + "; ".join(diffs[:5])
                         + (" ..." if len(diffs) > 5 else ""))
    log.info("warm start from %s %s%s (parameters only; fresh optimizer)", source.kind, source.path,
             f" at step {source.step}" if source.kind == "pretrain" else "")
    return params
