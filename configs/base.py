"""Base MLM pretraining config; the per-scheme files change a few keys.

`get_config("size=base,source=files,accel=gpu")` takes comma-separated overrides for the
model size preset (with a batch and length that suit it: `SIZE_BATCHES`), the data source and
the accelerator setting (`accel=gpu|tpu`: bf16
compute, no attention dropout, the fused attention kernel; roformer/accelerator.py); any key
can also be set on the command line, e.g. `--config.train.steps=1000 --config.model.size=mini`.
"""
import dataclasses
import typing

import ml_collections
from ml_collections import config_dict

from roformer.accelerator import apply_accelerator_setting, parse_config_arg
from roformer.data.config import DataConfig
from roformer.model import PRESETS, ModelConfig
from roformer.train.config import RETIRED_KEYS, TrainConfig

# What `size=` in the config argument sets besides the model: a batch and length (train.batch_size,
# train.seq_len) its model trains at where it is meant to run. tiny and mini are laptop-CPU
# sizes (MLM logits over a 30k vocabulary at 256 x 512 alone fill a laptop's memory); base and
# large keep BERT's 256 x 512, an accelerator's. `--config.model.size=` changes only the model.
SIZE_BATCHES = {"tiny": (32, 128), "mini": (32, 128), "small": (64, 128), "medium": (64, 256),
                "base": (256, 512), "large": (256, 512)}

# ModelConfig fields the data decides (from the tokenizer).
FROM_DATA = ("vocab_size", "pad_token_id")
# Unset unless given: the size preset's fields, and the learned table length (ModelConfig's
# default; the ablation sizes it to train.seq_len when it is unset).
FROM_PRESET = (*sorted({name for preset in PRESETS.values() for name in preset}), "max_position_embeddings")


def parse_arg(arg: str | None) -> dict[str, str]:
    """'size=base,source=files,accel=gpu' -> {'size': 'base', 'source': 'files', 'accel': 'gpu'}."""
    return parse_config_arg(arg, keys=("size", "source", "accel"), where="config")


def model_section(size: str) -> ml_collections.ConfigDict:
    """The `model` section: a size preset plus every ModelConfig field at its default.

    Fields the preset or the data decide are typed placeholders (None = the preset's value,
    or ModelConfig's default when the preset has none); vocab_size and pad_token_id come
    from the data's tokenizer."""
    hints = typing.get_type_hints(ModelConfig)
    section = ml_collections.ConfigDict({"size": size})
    for field in dataclasses.fields(ModelConfig):
        if field.name in FROM_DATA:
            continue
        if field.name in FROM_PRESET or field.default is None:
            section[field.name] = config_dict.placeholder(_value_type(hints[field.name]))
        else:
            section[field.name] = field.default
    return section


def _value_type(hint):
    """`int` for `int` and for `int | None`."""
    return next((t for t in typing.get_args(hint) if t is not type(None)), hint)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = parse_arg(arg)
    config = ml_collections.ConfigDict()
    config.model = model_section(args.get("size", "base"))
    if "accel" in args:
        apply_accelerator_setting(config.model, args["accel"])

    # Data: the DataConfig fields and defaults (roformer/data/config.py).
    config.data = ml_collections.ConfigDict(dataclasses.asdict(DataConfig()))
    config.data.source = args.get("source", "embedded")

    # Every key and its default: roformer/train/config.py. Retired keys stay as unset
    # placeholders, so setting one is refused with the name of its replacement.
    config.train = ml_collections.ConfigDict(dataclasses.asdict(TrainConfig()))
    if args.get("size") in SIZE_BATCHES:   # an unknown size is refused by the model's preset lookup
        config.train.batch_size, config.train.seq_len = SIZE_BATCHES[args["size"]]
    for key in RETIRED_KEYS:
        config.train[key] = config_dict.placeholder(str)

    # Device mesh: one -1 axis takes the remaining devices. num_devices > 0 uses
    # only the first N devices (single process).
    config.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1, "num_devices": 0})

    # Multi-host: empty/-1 -> jax.distributed.initialize() auto-detects on TPU pods
    # and SLURM; set all three for a manual cluster. `enabled` forces initialisation.
    dist = config.distributed = ml_collections.ConfigDict()
    dist.enabled = False
    dist.coordinator_address = ""
    dist.num_processes = -1
    dist.process_id = -1
    dist.local_device_ids = ""
    return config
