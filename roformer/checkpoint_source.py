"""Where a model's weights, architecture and tokenizer come from: the one resolver.

A pretraining warm start (`train.init_from`, roformer.train.warm_start) and GLUE fine-tuning
(`config.init`, roformer.glue.init) both start from a directory that is one of:

- a pretraining workdir (`checkpoints/<step>`, the run's `tokenizer.json`), read through
  roformer.workdir.PretrainWorkdir, the one reader of that layout;
- a `python -m roformer.convert from-hf` output (`model_config.json` + `params/`);
- an HF RoFormer directory (`config.json` with model_type "roformer" + weights).

`CheckpointSource.find` says which, with the step and the tokenizer that came with it
(`tokenizer.json` or `vocab.txt` beside the weights; `do_lower_case` from
`tokenizer_config.json`), without reading parameters; `model_config()` reads the
architecture alone and `load()` the parameters (MLM model or bare encoder). The format
details stay in roformer.convert (HF and converted directories) and roformer.workdir
(pretraining workdirs): this module sits above both and below roformer.train, so the
training loop, GLUE and the data command import this module rather than each other.

MAY_DIFFER is the one table of ModelConfig fields a run may set differently from the
checkpoint it starts from, with why, for each way of starting from one.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from flax import nnx

from roformer import convert
from roformer.data.tokenizer import load_tokenizer
from roformer.errors import ConfigError
from roformer.model import ModelConfig
from roformer.workdir import CHECKPOINTS, PretrainWorkdir

KINDS = ("pretrain", "converted", "hf")
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt")   # first found wins


@dataclasses.dataclass(frozen=True)
class MayDiffer:
    """A ModelConfig field a run may set differently from its checkpoint, and when."""

    why: str
    resume: bool = False       # resuming the same workdir (its optimizer state, its fingerprint)
    warm_start: bool = False   # train.init_from: a new pretraining run from the parameters
    finetune: bool = False     # GLUE: config.model sets it over the checkpoint's value


_ROPE_ANGLES = "the rotary angles are computed, not learned: a context-extension stage changes them"
MAY_DIFFER: dict[str, MayDiffer] = {
    "attention_impl": MayDiffer("selects a kernel: same parameters, same math", resume=True, warm_start=True,
                                 finetune=True),
    "remat": MayDiffer("recomputes activations in the backward pass: same parameters, same math", resume=True,
                       warm_start=True, finetune=True),
    "hidden_dropout": MayDiffer("training-time regularisation, no parameter", warm_start=True, finetune=True),
    "attention_dropout": MayDiffer("training-time regularisation, no parameter", warm_start=True, finetune=True),
    "dtype": MayDiffer("the compute precision; parameters are kept in float32", warm_start=True, finetune=True),
    "rope_base": MayDiffer(_ROPE_ANGLES, warm_start=True),
    "rope_scaling": MayDiffer(_ROPE_ANGLES, warm_start=True),
    "rope_scaling_factor": MayDiffer(_ROPE_ANGLES, warm_start=True),
    "rope_original_max_len": MayDiffer(_ROPE_ANGLES, warm_start=True),
    "max_position_embeddings": MayDiffer("no parameter of a computed scheme; a longer learned table is grown "
                                         "only when train.init_grow_positions asks", warm_start=True),
}


def may_differ(when: str) -> tuple[str, ...]:
    """The fields of MAY_DIFFER allowed `when` ("resume", "warm_start" or "finetune")."""
    return tuple(name for name, rule in MAY_DIFFER.items() if getattr(rule, when))


# ------------------------------------------------------------------- identifying a directory


def checkpoint_kind(path: str | Path, *, what: str = "path") -> str:
    """What a model directory holds: "hf" (an HF RoFormer directory), "converted" (our
    format) or "pretrain" (a pretraining workdir); ConfigError naming `what` otherwise."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ConfigError(f"{what}={str(path)!r}: no such directory (give a pretraining workdir, an HF "
                          "RoFormer directory or a roformer.convert output)")
    config_json = path / "config.json"
    if config_json.is_file() and json.loads(config_json.read_text()).get("model_type") == "roformer":
        return "hf"
    if (path / convert.OUR_CONFIG_FILE).is_file():
        return "converted"
    if PretrainWorkdir.holds_run(path):
        return "pretrain"
    raise ConfigError(f"{what}={str(path)!r} is neither a pretraining workdir (no {path / CHECKPOINTS}), "
                      "an HF RoFormer directory (no config.json with model_type 'roformer') nor a "
                      f"roformer.convert output (no {convert.OUR_CONFIG_FILE})")


def read_model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of an HF RoFormer directory or a `save_converted` output, read without
    its weights (what a warm start checks a run's settings against)."""
    path = Path(path)
    kind = checkpoint_kind(path)
    if kind == "hf":
        return convert.hf_config_to_model_config(json.loads((path / "config.json").read_text()))
    if kind == "converted":
        meta = json.loads((path / convert.OUR_CONFIG_FILE).read_text())
        return ModelConfig.from_dict(ModelConfig.saved_fields(meta["model"]))
    raise ConfigError(f"{path} is a pretraining workdir, not an HF RoFormer directory or a roformer.convert "
                      "output (PretrainWorkdir reads it)")


def tokenizer_beside(directory: Path) -> tuple[Path | None, bool]:
    """The tokenizer file saved beside an HF or converted checkpoint's weights (None when it
    was saved without one) and whether it lowercases (`do_lower_case` of
    tokenizer_config.json; uncased, as BERT's, when that file does not say)."""
    tokenizer_file = next((directory / n for n in TOKENIZER_FILES if (directory / n).is_file()), None)
    tokenizer_config = directory / "tokenizer_config.json"
    lowercase = (json.loads(tokenizer_config.read_text()).get("do_lower_case", True)
                 if tokenizer_config.is_file() else True)
    return tokenizer_file, bool(lowercase)


# ------------------------------------------------------------------------------ the resolver


@dataclasses.dataclass(frozen=True)
class CheckpointSource:
    """Where a run starts from: the directory's kind, path, step and tokenizer. `what` is
    the setting that named it, as messages quote it (`train.init_from`, `config.init`)."""

    kind: str                    # "pretrain" | "converted" | "hf"
    path: Path
    step: int                    # checkpoint step of a pretraining workdir, else -1
    tokenizer_file: Path | None  # None: saved without one (the run names it)
    lowercase: bool
    what: str = "train.init_from"

    @classmethod
    def find(cls, location: str | Path, step: int = -1, *, what: str = "train.init_from",
             missing_tokenizer_hint: str = "") -> CheckpointSource:
        """Identify `location` and its tokenizer, without loading parameters. A pretraining
        workdir without its tokenizer.json is refused (its embedding rows mean nothing
        without it); `missing_tokenizer_hint` ends that message."""
        path = Path(location).expanduser().resolve()
        kind = checkpoint_kind(path, what=what)
        if kind == "pretrain":
            run = PretrainWorkdir(path)
            if not run.tokenizer_file.is_file():
                raise ConfigError(f"{what}={location}: no tokenizer.json in the workdir{missing_tokenizer_hint}")
            return cls(kind, path, run.resolve_step(step), run.tokenizer_file, True, what)
        tokenizer_file, lowercase = tokenizer_beside(path)
        return cls(kind, path, -1, tokenizer_file, lowercase, what)

    def tokenizer(self):
        """The checkpoint's own tokenizer, or None when it was saved without one."""
        if self.tokenizer_file is None:
            return None
        return load_tokenizer(str(self.tokenizer_file), lowercase=self.lowercase)

    def with_tokenizer(self, data):
        """The pretraining run's DataConfig: with data.vocab empty, this checkpoint's tokenizer."""
        if data.vocab:
            return data
        if self.tokenizer_file is None:
            raise ConfigError(f"{self.what}={self.path}: no tokenizer.json or vocab.txt beside the weights; "
                              "name the vocabulary it was trained with: --config.data.vocab=VOCAB")
        return dataclasses.replace(data, vocab=str(self.tokenizer_file), lowercase=self.lowercase)

    def model_config(self) -> ModelConfig:
        """The checkpoint's architecture, read without its parameters."""
        if self.kind == "pretrain":
            return PretrainWorkdir(self.path).model_config(self.step)
        return read_model_config(self.path)

    def load(self, head: str = "mlm") -> tuple[ModelConfig, dict]:
        """(ModelConfig, parameters as a pure nested dict) of the MLM model (`head="mlm"`)
        or of the bare encoder (`head="none"`, what fine-tuning puts a fresh head on)."""
        if head not in ("mlm", "none"):
            raise ValueError(f"head={head!r}: load the 'mlm' model or the bare encoder ('none')")
        if self.kind == "pretrain":
            return PretrainWorkdir(self.path).params(self.step, encoder_only=head == "none")
        if self.kind == "hf":     # an encoder-only checkpoint gets a fresh MLM head (load_hf warns)
            config, model = convert.load_hf(self.path, head=head)
        else:
            config, model = convert.load_converted(self.path)
            if head == "none":
                model = getattr(model, "roformer", model)   # a saved bare encoder is itself
            elif not hasattr(model, "cls"):
                raise ConfigError(f"{self.what}={self.path} holds a {type(model).__name__}, not an MLM "
                                  "model; convert the checkpoint with its MLM head")
        return config, nnx.to_pure_dict(nnx.state(model, nnx.Param))
