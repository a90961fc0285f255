"""Warm start: begin a pretraining run from another model's parameters (fresh optimizer, step 0).

`train.init_from` names a pretraining workdir (`train.init_step`: its checkpoint step, newest
when < 0), a `python -m roformer.convert from-hf` output, or an HF RoFormer directory.

The architecture is the checkpoint's, as with transformers' `from_pretrained`: a model key left
unset (None, `size` "") takes the checkpoint's value, and one that is set must agree with it.
`python -m roformer.pretrain` unsets the architecture keys its command line does not give
(`unset_architecture`), so a config file's preset and defaults never conflict with a
checkpoint. Settings that change no parameter (roformer.checkpoint_source.MAY_DIFFER: RoPE
base or scaling, the learned table length, dropout, dtype, kernels) are this run's, which is
what continued pretraining at another length or a context-extension stage needs.

Which directory, step and tokenizer `train.init_from` names is resolved by
roformer.checkpoint_source (shared with GLUE fine-tuning); this module is the pretraining
side: the run's architecture, tokenizer and parameters checked against the checkpoint.

The run uses the checkpoint's tokenizer (its embedding rows mean those tokens): with
`data.vocab` empty it is taken from the checkpoint, and a different `data.vocab` is refused.
A checkpoint saved without tokenizer files (common for HF models) needs `data.vocab`, and its
size must be the checkpoint's number of embedding rows.

A learned absolute table shorter than the new model's is refused unless
`train.init_grow_positions="copy"`: the trained rows are repeated to fill the longer table,
as Longformer did; every other scheme encodes any length without new parameters.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

import jax
import numpy as np
from flax import nnx

from roformer.checkpoint_source import CheckpointSource, may_differ
from roformer.errors import ConfigError
from roformer.model import PRESETS, ModelConfig, RoFormerForMaskedLM

log = logging.getLogger("roformer.train")

GROW_POSITIONS = ("", "copy")
# ModelConfig fields a warm-started run may set differently from its checkpoint (why: the table).
MAY_DIFFER = may_differ("warm_start")
# ModelConfig fields the run's tokenizer decides.
FROM_DATA = ("vocab_size", "pad_token_id")
# Model keys that describe the checkpoint's architecture: a warm start takes them from it.
ARCHITECTURE = ("size", *(f.name for f in dataclasses.fields(ModelConfig)
                          if f.name not in MAY_DIFFER and f.name not in FROM_DATA))
LEARNED_TABLE = ("roformer", "position", "position_embeddings", "embedding")

InitCheckpoint = CheckpointSource   # its earlier name, kept for code that builds or subclasses one


def find_init_checkpoint(init_from: str, init_step: int = -1) -> CheckpointSource:
    """Identify `init_from` and its tokenizer, without loading parameters."""
    return CheckpointSource.find(init_from, init_step, what="train.init_from")


def unset_architecture(model_section, given: Iterable[str] = ()) -> None:
    """Unset, in place, every architecture key of the `model` config section that is not in
    `given` (None; `size` ""), so that a warm start takes it from its checkpoint. The command
    line does this with the keys it does not set; in a notebook call it before
    `train_and_evaluate` to load a checkpoint as `from_pretrained` would."""
    for key in ARCHITECTURE:
        if key in model_section and key not in given:
            model_section[key] = "" if key == "size" else None


def resolve_model_config(model_section, source: CheckpointSource, *, vocab_size: int, pad_token_id: int,
                         tokenizer_hash: str) -> ModelConfig:
    """The warm-started run's ModelConfig: the checkpoint's architecture with this run's
    settings (MAY_DIFFER) and tokenizer. A set architecture key that disagrees with the
    checkpoint, or a tokenizer other than its own or of another size than its embedding
    table, is refused."""
    where = f"train.init_from={source.path}"
    _check_tokenizer(source, tokenizer_hash)
    saved = source.model_config()
    if vocab_size != saved.vocab_size:
        raise ConfigError(f"{where}: its embedding table has {saved.vocab_size} rows but this run's vocabulary has "
                          f"{vocab_size} tokens; name the vocabulary the checkpoint was trained with (data.vocab)")
    section = {k: v for k, v in model_section.to_dict().items() if v is not None}
    size = section.pop("size", "") or ""
    if size and size not in PRESETS:
        raise ConfigError(f"unknown model size {size!r}; choose one of {list(PRESETS)}")
    fields, differ = {}, []
    for name, checkpoint_value in dataclasses.asdict(saved).items():
        if name in FROM_DATA:
            value, given = {"vocab_size": vocab_size, "pad_token_id": pad_token_id}[name], "this run's tokenizer"
        elif name in section:
            value, given = section[name], f"model.{name}"
        else:
            value, given = PRESETS[size].get(name) if size else None, f"model.size={size!r}"
        if value is not None and name not in MAY_DIFFER and value != checkpoint_value:
            differ.append(f"{name}: checkpoint {checkpoint_value!r}, {given} {value!r}")
        fields[name] = value if value is not None and name in MAY_DIFFER else checkpoint_value
    if differ:
        raise ConfigError(f"{where} is another architecture than this run's model settings: " + "; ".join(differ)
                          + " (a warm start takes the architecture from its checkpoint: leave these keys unset)")
    return ModelConfig(**fields)


def _check_tokenizer(source: CheckpointSource, tokenizer_hash: str) -> None:
    own = source.tokenizer()   # None: saved without one; resolve_model_config checks the named one's size
    if own is not None and own.hash != tokenizer_hash:
        raise ConfigError(f"train.init_from={source.path} was trained with another tokenizer than this run's "
                          f"data.vocab; leave data.vocab empty to use the checkpoint's ({source.tokenizer_file})")


def abstract_params(model_cfg: ModelConfig) -> dict:
    """The MLM model's parameter shapes, as a pure nested dict (nothing allocated)."""
    return jax.eval_shape(lambda: nnx.to_pure_dict(nnx.state(RoFormerForMaskedLM(model_cfg, rngs=nnx.Rngs(0)),
                                                             nnx.Param)))


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


def load_init_params(source: CheckpointSource, model_cfg: ModelConfig, abstract_params: dict,
                     tokenizer_hash: str, *, grow_positions: str = "") -> dict:
    """The parameters of `source` for a model of `model_cfg`, checked against it."""
    if grow_positions not in GROW_POSITIONS:
        raise ConfigError(f"train.init_grow_positions={grow_positions!r}: choose '' (refuse) or 'copy'")
    where = f"train.init_from={source.path}"
    _check_tokenizer(source, tokenizer_hash)
    saved_cfg, params = source.load()
    saved, mine = dataclasses.asdict(saved_cfg), dataclasses.asdict(model_cfg)
    differ = [f"{k}: checkpoint {saved[k]!r}, this run {mine[k]!r}" for k in saved
              if k not in MAY_DIFFER and saved[k] != mine[k]]
    if differ:   # resolve_model_config gives a run the checkpoint's architecture
        raise ConfigError(f"{where} is another architecture than this run's model config: " + "; ".join(differ))
    want, got = _shapes(abstract_params), _shapes(params)
    table = want.get(LEARNED_TABLE)
    if table and got.get(LEARNED_TABLE) and got[LEARNED_TABLE][0] < table[0]:
        if grow_positions != "copy":
            raise ConfigError(f"{where}: its learned position table has {got[LEARNED_TABLE][0]} rows, this model "
                              f"needs {table[0]}; set --config.train.init_grow_positions=copy to repeat the "
                              "trained rows, or keep model.max_position_embeddings at the checkpoint's")
        params = _grow_table(params, table[0])
        got = _shapes(params)
    diffs = [f"{'/'.join(k)}: checkpoint {got.get(k)} vs model {want.get(k)}"
             for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)]
    if diffs:
        raise ConfigError(f"{where} does not fit this model: " + "; ".join(diffs[:5])
                          + (" ..." if len(diffs) > 5 else ""))
    log.info("warm start from %s %s%s (parameters only; fresh optimizer)", source.kind, source.path,
             f" at step {source.step}" if source.kind == "pretrain" else "")
    return params
