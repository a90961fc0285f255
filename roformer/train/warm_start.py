"""Warm start: begin a pretraining run from another model's parameters (fresh optimizer, step 0).

`train.init_from` names a pretraining workdir (`train.init_step`: its checkpoint step, newest
when < 0), a `python -m roformer.convert from-hf` output, or an HF RoFormer directory.

The architecture is the checkpoint's, as with transformers' `from_pretrained`: a model key left
unset (None, `size` "") takes the checkpoint's value, and one that is set must agree with it.
`python -m roformer.pretrain` unsets the architecture keys its command line does not give
(`unset_architecture`), so a config file's preset and defaults never conflict with a
checkpoint. Settings that change no parameter (MAY_DIFFER: RoPE base or scaling, the learned
table length, dropout, dtype, kernels) are this run's, which is what continued pretraining
at another length or a context-extension stage needs.

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
import json
import logging
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from roformer.model import PRESETS, ModelConfig

log = logging.getLogger("roformer.train")

GROW_POSITIONS = ("", "copy")
# ModelConfig fields a warm-started run may set differently from its checkpoint: no parameter
# depends on them (a longer learned table is handled by init_grow_positions).
MAY_DIFFER = ("hidden_dropout", "attention_dropout", "attention_impl", "dtype", "rope_base", "rope_scaling",
              "rope_scaling_factor", "rope_original_max_len", "max_position_embeddings")
# ModelConfig fields the run's tokenizer decides.
FROM_DATA = ("vocab_size", "pad_token_id")
# Model keys that describe the checkpoint's architecture: a warm start takes them from it.
ARCHITECTURE = ("size", *(f.name for f in dataclasses.fields(ModelConfig)
                          if f.name not in MAY_DIFFER and f.name not in FROM_DATA))
LEARNED_TABLE = ("roformer", "position", "position_embeddings", "embedding")


@dataclasses.dataclass(frozen=True)
class InitCheckpoint:
    """Where a warm start comes from: its kind, directory, step and tokenizer."""

    kind: str                    # "pretrain" | "converted" | "hf"
    path: Path
    step: int                    # checkpoint step of a pretraining workdir, else -1
    tokenizer_file: Path | None  # None: saved without one (the run names it with data.vocab)
    lowercase: bool

    def tokenizer(self):
        """The checkpoint's own tokenizer, or None when it was saved without one."""
        from roformer.data.tokenizer import load_tokenizer

        if self.tokenizer_file is None:
            return None
        return load_tokenizer(str(self.tokenizer_file), lowercase=self.lowercase)

    def with_tokenizer(self, data):
        """The run's DataConfig: with data.vocab empty, this checkpoint's tokenizer."""
        if data.vocab:
            return data
        if self.tokenizer_file is None:
            raise ValueError(f"train.init_from={self.path}: no tokenizer.json or vocab.txt beside the weights; "
                             "name the vocabulary it was trained with: --config.data.vocab=VOCAB")
        return dataclasses.replace(data, vocab=str(self.tokenizer_file), lowercase=self.lowercase)

    def model_config(self) -> ModelConfig:
        """The checkpoint's architecture, read without its parameters."""
        from roformer import convert
        from roformer.train.checkpoint import PretrainWorkdir

        if self.kind == "pretrain":
            return PretrainWorkdir(self.path).model_config(self.step)
        return convert.read_model_config(self.path)

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
    tokenizer_config = path / "tokenizer_config.json"
    lowercase = (json.loads(tokenizer_config.read_text()).get("do_lower_case", True)
                 if tokenizer_config.is_file() else True)
    return InitCheckpoint(kind, path, -1, tokenizer_file, lowercase=bool(lowercase))


def unset_architecture(model_section, given: Iterable[str] = ()) -> None:
    """Unset, in place, every architecture key of the `model` config section that is not in
    `given` (None; `size` ""), so that a warm start takes it from its checkpoint. The command
    line does this with the keys it does not set; in a notebook call it before
    `train_and_evaluate` to load a checkpoint as `from_pretrained` would."""
    for key in ARCHITECTURE:
        if key in model_section and key not in given:
            model_section[key] = "" if key == "size" else None


def resolve_model_config(model_section, source: InitCheckpoint, *, vocab_size: int, pad_token_id: int,
                         tokenizer_hash: str) -> ModelConfig:
    """The warm-started run's ModelConfig: the checkpoint's architecture with this run's
    settings (MAY_DIFFER) and tokenizer. A set architecture key that disagrees with the
    checkpoint, or a tokenizer other than its own or of another size than its embedding
    table, is refused."""
    where = f"train.init_from={source.path}"
    _check_tokenizer(source, tokenizer_hash)
    saved = source.model_config()
    if vocab_size != saved.vocab_size:
        raise ValueError(f"{where}: its embedding table has {saved.vocab_size} rows but this run's vocabulary has "
                         f"{vocab_size} tokens; name the vocabulary the checkpoint was trained with (data.vocab)")
    section = {k: v for k, v in model_section.to_dict().items() if v is not None}
    size = section.pop("size", "") or ""
    if size and size not in PRESETS:
        raise ValueError(f"unknown model size {size!r}; choose one of {list(PRESETS)}")
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
        raise ValueError(f"{where} is another architecture than this run's model settings: " + "; ".join(differ)
                         + " (a warm start takes the architecture from its checkpoint: leave these keys unset)")
    return ModelConfig(**fields)


def _check_tokenizer(source: InitCheckpoint, tokenizer_hash: str) -> None:
    own = source.tokenizer()   # None: saved without one; resolve_model_config checks the named one's size
    if own is not None and own.hash != tokenizer_hash:
        raise ValueError(f"train.init_from={source.path} was trained with another tokenizer than this run's "
                         f"data.vocab; leave data.vocab empty to use the checkpoint's ({source.tokenizer_file})")


def abstract_params(model_cfg: ModelConfig) -> dict:
    """The MLM model's parameter shapes, as a pure nested dict (nothing allocated)."""
    import jax
    from flax import nnx

    from roformer.model import RoFormerForMaskedLM

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


def load_init_params(source: InitCheckpoint, model_cfg: ModelConfig, abstract_params: dict,
                     tokenizer_hash: str, *, grow_positions: str = "") -> dict:
    """The parameters of `source` for a model of `model_cfg`, checked against it."""
    if grow_positions not in GROW_POSITIONS:
        raise ValueError(f"train.init_grow_positions={grow_positions!r}: choose '' (refuse) or 'copy'")
    where = f"train.init_from={source.path}"
    _check_tokenizer(source, tokenizer_hash)
    saved_cfg, params = source.load()
    saved, mine = dataclasses.asdict(saved_cfg), dataclasses.asdict(model_cfg)
    differ = [f"{k}: checkpoint {saved[k]!r}, this run {mine[k]!r}" for k in saved
              if k not in MAY_DIFFER and saved[k] != mine[k]]
    if differ:   # resolve_model_config gives a run the checkpoint's architecture
        raise ValueError(f"{where} is another architecture than this run's model config: " + "; ".join(differ))
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
