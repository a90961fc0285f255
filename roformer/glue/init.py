"""Where the fine-tuned encoder starts: a pretraining workdir, an HF RoFormer dir (or
its `python -m roformer.convert from-hf` output), or none (random init).

Only the encoder (`RoFormerModel`) weights are taken; the task head is always fresh.
The resolved model config must agree with what the user asked for and with the
tokenizer, otherwise the run is refused with the mismatch named.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx

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
        from roformer.data.tokenizer import load_tokenizer

        return load_tokenizer(self.vocab, lowercase=self.lowercase) if self.vocab else None


def load_init(init: str, *, step: int = -1) -> InitSource:
    if not init or init.lower() == "none":
        return InitSource("none", None, None, None, None)
    from roformer.convert import checkpoint_kind

    path = Path(init).expanduser()
    kind = checkpoint_kind(path, what="config.init")
    if kind == "hf":
        return _load_hf(path)
    if kind == "converted":
        return _load_converted(path)
    return _load_pretrain(path, step)


# ---------------------------------------------------------------- pretraining workdir

def _load_pretrain(workdir: Path, step: int) -> InitSource:
    from roformer.train.checkpoint import PretrainWorkdir

    run = PretrainWorkdir(workdir)
    step = run.resolve_step(step)
    model_config, encoder_params = run.params(step, encoder_only=True)
    if not run.tokenizer_file.is_file():
        raise ValueError(f"config.init={workdir}: no tokenizer.json in the workdir; give the run's "
                         "vocabulary with --config.vocab")
    return InitSource("pretrain", str(workdir), model_config, encoder_params, str(run.tokenizer_file), step)


# ---------------------------------------------------------------- HF RoFormer dir

def _load_hf(hf_dir: Path) -> InitSource:
    from roformer import convert

    model_config, encoder = convert.load_hf(hf_dir, head="none")
    encoder_params = nnx.to_pure_dict(nnx.state(encoder, nnx.Param))
    vocab = next((str(hf_dir / n) for n in ("tokenizer.json", "vocab.txt")
                  if (hf_dir / n).is_file()), None)
    tokenizer_config = hf_dir / "tokenizer_config.json"
    lowercase = (json.loads(tokenizer_config.read_text()).get("do_lower_case", True)
                 if tokenizer_config.is_file() else True)
    return InitSource("hf", str(hf_dir), model_config, encoder_params, vocab,
                      lowercase=bool(lowercase))


def _load_converted(our_dir: Path) -> InitSource:
    """A directory written by `python -m roformer.convert from-hf` (our format)."""
    from roformer import convert

    model_config, model = convert.load_converted(our_dir)
    encoder = getattr(model, "roformer", model)  # head "none" is the bare encoder
    encoder_params = nnx.to_pure_dict(nnx.state(encoder, nnx.Param))
    vocab = next((str(our_dir / n) for n in ("tokenizer.json", "vocab.txt")
                  if (our_dir / n).is_file()), None)
    return InitSource("converted", str(our_dir), model_config, encoder_params, vocab)


# ---------------------------------------------------------------- config resolution

FINETUNE_FIELDS = ("hidden_dropout", "attention_dropout", "dtype")  # may differ from the checkpoint


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
            raise ValueError(f"init checkpoint {init.path} does not match the config: "
                             + "; ".join(mismatches))
        config = dataclasses.replace(config, **finetune)
    if tokenizer_vocab_size != config.vocab_size:
        where = f"init checkpoint {init.path}" if init.path else "config.model.vocab_size"
        raise ValueError(f"vocab mismatch: the tokenizer has {tokenizer_vocab_size} tokens but "
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
        raise ValueError(f"init encoder params do not match the model: missing {missing}, "
                         f"unexpected {extra}")
    for key, want in flat_expected.items():
        got = np.shape(flat_given[key])
        if tuple(got) != tuple(want.shape):
            raise ValueError(f"init encoder param {'/'.join(map(str, key))} has shape {got}, "
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
