"""Where the fine-tuned encoder starts: a pretraining workdir, an HF RoFormer dir (or
its `python -m roformer.convert from-hf` output), or none (random init). Which of them
`config.init` names, and the tokenizer that came with it, is resolved by
roformer.checkpoint_source, as for a pretraining warm start.

Only the encoder (`RoFormerModel`) weights are taken; the task head is always fresh.
The resolved model config must agree with what the user asked for and with the
tokenizer, otherwise the run is refused with the mismatch named.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx

from roformer.checkpoint_source import CheckpointSource, may_differ
from roformer.data.tokenizer import load_tokenizer
from roformer.errors import ConfigError
from roformer.model import ModelConfig, RoFormerModel

DEFAULT_SIZE = "mini"  # architecture of a random-init run when config.model.size is ""


@dataclasses.dataclass
class InitSource:
    kind: str                                  # "pretrain" | "hf" | "converted" | "none"
    path: str | None
    model_config: ModelConfig | None           # architecture of the checkpoint
    encoder_params: dict | None                # pure nested dict of RoFormerModel params
    vocab: str | None                          # tokenizer file that came with the checkpoint
    step: int | None = None                    # pretraining step loaded
    lowercase: bool = True                     # how that tokenizer normalises text

    def tokenizer(self):
        """The tokenizer the checkpoint was trained with, or None if it names none."""
        return load_tokenizer(self.vocab, lowercase=self.lowercase) if self.vocab else None


def load_init(init: str, *, step: int = -1) -> InitSource:
    """The encoder `config.init` names (resolved by roformer.checkpoint_source), loaded."""
    if not init or init.lower() == "none":
        return InitSource("none", None, None, None, None)
    source = CheckpointSource.find(init, step, what="config.init",
                                   missing_tokenizer_hint="; give the run's vocabulary with --config.vocab")
    model_config, encoder_params = source.load(head="none")
    vocab = str(source.tokenizer_file) if source.tokenizer_file else None
    return InitSource(source.kind, str(source.path), model_config, encoder_params, vocab,
                      source.step if source.kind == "pretrain" else None, source.lowercase)


# ---------------------------------------------------------------- config resolution

FINETUNE_FIELDS = may_differ("finetune")   # config.model sets them over the checkpoint's (why: the table)


def resolve_model_config(model_cfg: ml_collections.ConfigDict, init: InitSource,
                         tokenizer_vocab_size: int) -> ModelConfig:
    """The architecture to fine-tune; refuses a checkpoint that disagrees with the config
    (size, vocab_size, position) or with the tokenizer (vocab size)."""
    finetune = {k: model_cfg[k] for k in FINETUNE_FIELDS if k in model_cfg}
    if init.model_config is None:
        arch = {"vocab_size": model_cfg.vocab_size or tokenizer_vocab_size}
        if model_cfg.get("position"):
            arch["position"] = model_cfg.position
        config = ModelConfig.from_preset(model_cfg.size or DEFAULT_SIZE, **arch, **finetune)
    else:
        config = init.model_config
        mismatches = []
        if model_cfg.size:
            preset = ModelConfig.from_preset(model_cfg.size)
            for key in ("hidden_size", "num_layers", "num_heads", "intermediate_size"):
                if getattr(preset, key) != getattr(config, key):
                    mismatches.append(f"{key}: config.model.size={model_cfg.size!r} has "
                                      f"{getattr(preset, key)}, checkpoint has "
                                      f"{getattr(config, key)}")
        if model_cfg.vocab_size and model_cfg.vocab_size != config.vocab_size:
            mismatches.append(f"vocab_size: config.model.vocab_size={model_cfg.vocab_size}, "
                              f"checkpoint has {config.vocab_size}")
        if model_cfg.get("position") and model_cfg.position != config.position:
            mismatches.append(f"position: config.model.position={model_cfg.position!r}, "
                              f"checkpoint has {config.position!r}")
        if mismatches:
            raise ConfigError(f"init checkpoint {init.path} does not match the config: "
                              + "; ".join(mismatches))
        config = dataclasses.replace(config, **finetune)
    if tokenizer_vocab_size != config.vocab_size:
        where = f"init checkpoint {init.path}" if init.path else "config.model.vocab_size"
        raise ConfigError(f"vocab mismatch: the tokenizer has {tokenizer_vocab_size} tokens but "
                          f"{where} has vocab_size {config.vocab_size}")
    return config


def encoder_state(model_config: ModelConfig, encoder_params: dict) -> nnx.State:
    """Pure param dict -> an `nnx.State` for `nnx.update(model.roformer, ...)`, with
    every leaf's shape checked against the architecture (names the first mismatch)."""
    abstract = nnx.eval_shape(lambda: RoFormerModel(model_config, rngs=nnx.Rngs(0)))
    state = nnx.state(abstract, nnx.Param)
    expected = nnx.to_pure_dict(state)
    flat_expected = _flatten(expected)
    flat_given = _flatten(encoder_params)
    if flat_expected.keys() != flat_given.keys():
        missing = sorted(set(flat_expected) - set(flat_given))[:5]
        extra = sorted(set(flat_given) - set(flat_expected))[:5]
        raise ConfigError(f"init encoder params do not match the model: missing {missing}, "
                          f"unexpected {extra}")
    for key, want in flat_expected.items():
        got = np.shape(flat_given[key])
        if tuple(got) != tuple(want.shape):
            raise ConfigError(f"init encoder param {'/'.join(map(str, key))} has shape {got}, "
                              f"model expects {tuple(want.shape)}")
    nnx.replace_by_pure_dict(state, jax.tree.map(np.asarray, encoder_params))
    return state


def _flatten(tree: Any, prefix: tuple = ()) -> dict[tuple, Any]:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, (*prefix, k)))
        return out
    return {prefix: tree}
