"""Weights in and out of HF `transformers` RoFormer format.

    python -m roformer.convert from-hf HF_DIR OUT_DIR [--rope-layout=half] [--dtype=bfloat16]
    python -m roformer.convert to-hf OUR_DIR_OR_PRETRAIN_WORKDIR OUT_DIR [--step=N] [--push_to_hub=USER/NAME]

HF_DIR is a transformers RoFormer directory (config.json + model.safetensors, a
sharded *.index.json, or pytorch_model.bin) holding a `RoFormerForMaskedLM`,
`RoFormerForSequenceClassification` or bare `RoFormerModel`.  OUR_DIR is this
package's converted format: `model_config.json` (our ModelConfig + head) and an
orbax checkpoint of the parameters in `params/`; `to-hf` also takes a pretraining
workdir (`checkpoints/<step>`, newest by default).  Tokenizer files travel along.

Our modules carry HF's names (see roformer/model/encoder.py), so a parameter's HF key is
its path joined by dots with the leaf renamed (Linear kernel <-> weight, transposed;
Embed embedding <-> weight; LayerNorm scale <-> weight).  Two things are not a rename:
  * HF's frozen sinusoid table (`encoder.embed_positions.weight`) is position-only
    data; it is regenerated from the config, never loaded.
  * HF rotates interleaved feature pairs (2j, 2j+1).  With rope_layout="half" our
    pairs are (j, j + d/2): the same rotation after permuting each head's q/k output
    features (and v's, plus the output projection's input rows, with rotary_value).

The library functions `load_hf`, `save_hf`, `load_converted`, `save_converted` are
what other code (GLUE fine-tuning, benchmarks) calls.  Every loader returns its model
in eval mode (dropout off), ready for inference; call `.train()` to fine-tune it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
import logging
import shutil
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import ml_dtypes  # noqa: F401  registers bfloat16 with numpy, so bf16 safetensors load
import numpy as np
import orbax.checkpoint as ocp
import safetensors.numpy
from flax import nnx, traverse_util
from tokenizers import Tokenizer

from roformer import cli
from roformer.data.tokenizer import CLS, MASK, PAD, SEP, UNK, normalizer_lowercases
from roformer.errors import ConfigError
from roformer.files import EXPORT_INCOMPLETE, write_bytes_atomic, write_json_atomic, write_text_atomic
from roformer.model import (
    DTYPES,
    ModelConfig,
    RoFormerForMaskedLM,
    RoFormerForSequenceClassification,
    RoFormerModel,
    rope,
)
from roformer.model.positions import POSITION_SCHEMES
from roformer.workdir import CHECKPOINTS, PretrainWorkdir

log = logging.getLogger(__name__)

HEADS = ("mlm", "classification", "none")  # "none": the bare encoder (HF RoFormerModel)
HF_ARCHITECTURES = {"mlm": "RoFormerForMaskedLM", "classification": "RoFormerForSequenceClassification",
                    "none": "RoFormerModel"}
# Activation names both sides know; HF's "swish" is silu.
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_new", "relu": "relu", "silu": "silu", "swish": "silu"}
SINUSOID_KEY = "encoder.embed_positions.weight"
OUR_CONFIG_FILE = "model_config.json"
OUR_PARAMS_DIR = "params"
FORMAT_NAME = "roformer-jax"
OLDEST_TESTED_TRANSFORMERS = "4.45.0"
TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

AnyModel = RoFormerModel | RoFormerForMaskedLM | RoFormerForSequenceClassification


# ---------------------------------------------------------------------------- configs

def hf_config_to_model_config(hf: Mapping, **overrides) -> ModelConfig:
    """Our ModelConfig for an HF RoFormer config.json dict; `overrides` set other fields
    (e.g. rope_layout="half", dtype="bfloat16", dropout rates)."""
    if hf.get("model_type", "roformer") != "roformer":
        raise ConfigError(f"config.json has model_type {hf.get('model_type')!r}, expected 'roformer'")
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        raise ConfigError("config.json describes a RoFormer decoder (is_decoder / add_cross_attention); "
                          "only the bidirectional encoder converts")
    act = hf.get("hidden_act", "gelu")
    if act not in HF_ACTIVATIONS:
        raise ConfigError(f"hidden_act {act!r} in config.json has no counterpart here; "
                          f"supported: {sorted(HF_ACTIVATIONS)}")
    hidden = hf.get("hidden_size", 768)
    embedding_size = hf.get("embedding_size") or hidden
    max_positions = hf.get("max_position_embeddings", 1536)
    fields = dict(
        vocab_size=hf.get("vocab_size", 50000),
        hidden_size=hidden,
        num_layers=hf.get("num_hidden_layers", 12),
        num_heads=hf.get("num_attention_heads", 12),
        intermediate_size=hf.get("intermediate_size", 3072),
        embedding_size=None if embedding_size == hidden else embedding_size,
        max_position_embeddings=max_positions,
        type_vocab_size=hf.get("type_vocab_size", 2),
        hidden_dropout=hf.get("hidden_dropout_prob", 0.1),
        attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
        layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
        hidden_act=HF_ACTIVATIONS[act],
        initializer_range=hf.get("initializer_range", 0.02),
        position="rope",
        rope_base=10000.0,  # hard-coded in HF's sinusoid table
        rotary_value=bool(hf.get("rotary_value", False)),
        # The trained context, so a later rope_scaling override extends from the right length.
        rope_original_max_len=max_positions,
        pad_token_id=hf.get("pad_token_id") or 0,
    )
    return ModelConfig(**{**fields, **overrides})


def check_hf_expressible(config: ModelConfig) -> None:
    """ValueError naming the settings HF RoFormer has no equivalent for."""
    wanted = {"position": "rope", "attention": "softmax", "rope_base": 10000.0, "rope_scaling": "none",
              "pre_layer_norm": False, "rotary_dim": config.head_dim if config.rotary_dim else None}
    bad = {name: getattr(config, name) for name, want in wanted.items() if getattr(config, name) != want}
    if bad:
        raise ConfigError(f"HF RoFormer cannot express these settings: {bad} (it has rope only, "
                          f"base 10000, full-head rotary, softmax attention, post-LN, no rope scaling)")


def model_config_to_hf_config(config: ModelConfig, *, head: str, num_labels: int | None = None,
                              label_names: tuple[str, ...] | None = None) -> dict:
    """HF config.json dict for our config; ValueError for settings HF RoFormer cannot express.
    `label_names`: what each class id of a classification head means (id2label; else LABEL_i)."""
    check_hf_expressible(config)
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; choose one of {HEADS}")
    hf = {
        "architectures": [HF_ARCHITECTURES[head]],
        "model_type": "roformer",
        "vocab_size": config.vocab_size,
        "embedding_size": config.embedding_size or config.hidden_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "intermediate_size": config.intermediate_size,
        "hidden_act": config.hidden_act,
        "hidden_dropout_prob": config.hidden_dropout,
        "attention_probs_dropout_prob": config.attention_dropout,
        "max_position_embeddings": config.max_position_embeddings,
        "type_vocab_size": config.type_vocab_size,
        "initializer_range": config.initializer_range,
        "layer_norm_eps": config.layer_norm_eps,
        "pad_token_id": config.pad_token_id,
        "rotary_value": config.rotary_value,
        "is_decoder": False,
        "tie_word_embeddings": True,
        "dtype": "float32",
        "transformers_version": transformers_version(),
    }
    if head == "classification":
        names = list(label_names) if label_names and len(label_names) == num_labels else [
            f"LABEL_{i}" for i in range(num_labels)]
        hf["id2label"] = {str(i): name for i, name in enumerate(names)}
        hf["label2id"] = {name: i for i, name in enumerate(names)}
        if num_labels == 1:
            hf["problem_type"] = "regression"
    return hf


MODEL_CARD = "README.md"


def model_card(model: AnyModel, facts: list[tuple[str, str]], *, licence: str = "apache-2.0") -> str:
    """The README.md a Hub repository shows for an export: HF's front matter (licence, library,
    pipeline tag), then what the model is and `facts` (what it was trained on, how long, its
    score), one line each."""
    config, head = model.config, _model_head(model)
    task = {"mlm": "fill-mask", "classification": "text-classification", "none": "feature-extraction"}[head]
    lines = ["---", f"license: {licence}", "library_name: transformers", f"pipeline_tag: {task}",
             "tags: [roformer, roformer-jax]", "---", "",
             f"# RoFormer ({HF_ARCHITECTURES[head]})", "",
             f"A RoFormer encoder (rotary position embedding) trained with roformer-jax and exported to HF "
             f"transformers' RoFormer format: {config.num_layers} layers, hidden size {config.hidden_size}, "
             f"{config.num_heads} heads, vocabulary {config.vocab_size:,}, position scheme `{config.position}`.", ""]
    lines += [f"- **{name}**: {value}" for name, value in facts]
    lines += ["", f"Licence: {licence} (the code's; the weights also carry the terms of the data they were "
              "trained on).", ""]
    return "\n".join(lines)


def pretraining_facts(run: PretrainWorkdir, step: int) -> list[tuple[str, str]]:
    """What a pretraining workdir says about its run: data, length, held-out loss at `step`."""
    config, facts = run.run_config(), []
    data, train = config.get("data") or {}, config.get("train") or {}
    if data:
        source = data.get("source", "")
        facts.append(("trained on", f"{data.get('files') or data.get('hf_path') or data.get('tfds_name') or source} "
                                    f"({source} source), masked-language-model objective"))
    if train:
        tokens = step * int(train.get("batch_size", 0)) * int(train.get("seq_len", 0))
        facts.append(("trained for", f"{step:,} steps of {train.get('batch_size')} x {train.get('seq_len')} tokens "
                                     f"(about {tokens:,} tokens; phases: {train.get('phases') or 'none'})"))
    summary = run.path / "summary.json"
    scored = run.eval_file(step)
    metrics = json.loads(scored.read_text()) if scored.is_file() else (
        json.loads(summary.read_text()) if summary.is_file() else {})
    if "eval_loss" in metrics and metrics.get("final_step", step) == step:
        facts.append(("held-out MLM loss", f"{metrics['eval_loss']:.4f} at step {step}"))
    return facts


def transformers_version() -> str:
    """The `transformers_version` of an exported config.json: the installed transformers', else
    the oldest this format is tested with (pyproject.toml's dev extra)."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return OLDEST_TESTED_TRANSFORMERS


def sinusoid_table(num_positions: int, dim: int) -> np.ndarray:
    """HF's frozen `RoFormerSinusoidalPositionalEmbedding` table (sin half, cos half), float32.

    Same float64 formula as transformers, so a written checkpoint holds the exact table
    HF would build itself.
    """
    exponents = 2 * (np.arange(dim) // 2) / dim
    angles = np.arange(num_positions, dtype=np.float64)[:, None] / np.power(10000.0, exponents)[None, :]
    sentinel = (dim + 1) // 2
    table = np.empty((num_positions, dim), np.float32)
    table[:, :sentinel] = np.sin(angles[:, 0::2])
    table[:, sentinel:] = np.cos(angles[:, 1::2])
    return table


# ---------------------------------------------------------------------------- HF files

def _read_weight_file(path: Path) -> dict[str, np.ndarray]:
    """The tensors of one weight file; a file that cannot be decoded (empty, or cut short by
    an interrupted download or copy) is a ConfigError naming it."""
    if path.suffix == ".safetensors":
        try:
            return safetensors.numpy.load_file(str(path))
        except Exception as err:  # noqa: BLE001 - the Rust side raises SafetensorError, a plain Exception
            raise ConfigError(f"{path} ({path.stat().st_size} bytes) is not a readable safetensors file ({err}): "
                              "it may be truncated; copy, download or convert it again") from err
    try:   # imported here: torch is heavy and optional, needed only for a pytorch_model.bin
        import torch
    except ImportError as err:
        raise ConfigError(f"{path} is a PyTorch pickle; reading it needs torch installed "
                          f"(or convert it to safetensors first)") from err
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, ValueError) as err:   # what torch raises for a cut or foreign file
        raise ConfigError(f"{path} ({path.stat().st_size} bytes) is not a readable PyTorch checkpoint ({err}): "
                          "it may be truncated; copy or download it again") from err
    return {k: v.detach().float().numpy() if v.is_floating_point() else v.numpy() for k, v in state.items()}


def read_hf_weights(hf_dir: str | Path) -> dict[str, np.ndarray]:
    """All tensors of an HF checkpoint directory as float32 numpy arrays, keyed by HF name."""
    hf_dir = Path(hf_dir)
    for name in ("model.safetensors", "model.safetensors.index.json",
                 "pytorch_model.bin", "pytorch_model.bin.index.json"):
        path = hf_dir / name
        if not path.exists():
            continue
        if name.endswith(".index.json"):
            shards = sorted(set(json.loads(path.read_text())["weight_map"].values()))
            weights = {}
            for shard in shards:
                weights.update(_read_weight_file(hf_dir / shard))
        else:
            weights = _read_weight_file(path)
        return {k: np.asarray(v, np.float32) for k, v in weights.items()}
    raise ConfigError(f"no model.safetensors or pytorch_model.bin (or sharded index) in {hf_dir}")


def _hf_head(weights: Mapping[str, np.ndarray]) -> str:
    if any(k.startswith("cls.predictions.") for k in weights):
        return "mlm"
    if any(k.startswith("classifier.") for k in weights):
        return "classification"
    return "none"


# ------------------------------------------------------------------- name + layout map

def _hf_name(path: tuple) -> tuple[str, bool]:
    """HF key for one of our parameter paths, and whether the array is transposed."""
    *module, leaf = (str(p) for p in path)
    if leaf == "kernel":
        return ".".join(module + ["weight"]), True
    if leaf in ("embedding", "scale"):
        return ".".join(module + ["weight"]), False
    if leaf == "bias":
        return ".".join(module + ["bias"]), False
    raise ValueError(f"parameter {'.'.join(map(str, path))} has no HF counterpart")


def _pair_permutation(config: ModelConfig) -> np.ndarray:
    """Feature order (over all heads) that turns HF's interleaved q/k features into ours."""
    rotary_dim = config.rotary_dim or config.head_dim
    per_head = np.arange(config.hidden_size).reshape(config.num_heads, config.head_dim)
    if config.rope_layout == "half":
        per_head = rope.interleaved_to_half(per_head, rotary_dim)
    return per_head.reshape(-1)


def _permuted_axis(path: tuple, config: ModelConfig) -> int | None:
    """Axis of our (kernel/bias) array indexed by rotated head features, else None."""
    names = [str(p) for p in path]
    if not POSITION_SCHEMES[config.position].rope_scaling or config.rope_layout == "interleaved":
        return None
    rotated = ("query", "key", "value") if config.rotary_value else ("query", "key")
    if len(names) >= 3 and names[-3] == "self" and names[-2] in rotated:
        return -1  # output features of q/k(/v): kernel [in, out], bias [out]
    if config.rotary_value and names[-4:-1] == ["attention", "output", "dense"] and names[-1] == "kernel":
        return 0  # the output projection reads v's (permuted) features: kernel rows
    return None


def _model_head(model: AnyModel) -> str:
    if isinstance(model, RoFormerForMaskedLM):
        return "mlm"
    if isinstance(model, RoFormerForSequenceClassification):
        return "classification"
    if isinstance(model, RoFormerModel):
        return "none"
    raise ValueError(f"expected a RoFormer model from roformer.model, got {type(model).__name__}")


def params_to_hf_weights(model: AnyModel) -> dict[str, np.ndarray]:
    """HF state dict (numpy, torch layout) for our model, sinusoid table included."""
    config = model.config
    check_hf_expressible(config)
    inverse = np.argsort(_pair_permutation(config))
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    weights = {}
    for path, value in flat.items():
        value = np.asarray(value, np.float32)
        axis = _permuted_axis(path, config)
        if axis is not None:
            value = np.take(value, inverse, axis=axis)
        name, transpose = _hf_name(path)
        weights[name] = np.ascontiguousarray(value.T if transpose else value)
    prefix = "" if isinstance(model, RoFormerModel) else "roformer."
    weights[prefix + SINUSOID_KEY] = sinusoid_table(config.max_position_embeddings, config.head_dim)
    return weights


def hf_weights_to_model(weights: Mapping[str, np.ndarray], model: AnyModel) -> list[str]:
    """Copy HF tensors into `model` in place.  Returns our parameter names that the
    checkpoint did not have (a freshly initialised head); ValueError on anything else
    that does not line up."""
    config = model.config
    weights = dict(weights)
    is_base = isinstance(model, RoFormerModel)
    if is_base and any(k.startswith("roformer.") for k in weights):
        weights = {k[len("roformer."):]: v for k, v in weights.items() if k.startswith("roformer.")}
    elif not is_base and not any(k.startswith("roformer.") for k in weights):
        weights = {"roformer." + k: v for k, v in weights.items()}  # a bare RoFormerModel checkpoint
    prefix = "" if is_base else "roformer."
    weights.pop(prefix + SINUSOID_KEY, None)  # regenerated from the config, not loaded
    _check_tied_decoder(weights)

    permutation = _pair_permutation(config)
    state = nnx.state(model, nnx.Param)
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(state))
    missing, loaded = [], {}
    for path, current in flat.items():
        name, transpose = _hf_name(path)
        if name not in weights:
            missing.append(name)
            loaded[path] = current
            continue
        value = weights.pop(name)
        value = value.T if transpose else value
        if value.shape != current.shape:
            raise ConfigError(f"{name}: checkpoint shape {value.shape} (as ours) != model shape "
                              f"{tuple(current.shape)}; config.json does not match the weights")
        axis = _permuted_axis(path, config)
        if axis is not None:
            value = np.take(value, permutation, axis=axis)
        loaded[path] = value
    head_prefixes = ("cls.", "classifier.")
    core_missing = [n for n in missing if not n.startswith(head_prefixes)]
    if core_missing:
        raise ConfigError(f"checkpoint lacks encoder weights {core_missing}")
    leftover = sorted(k for k in weights if not k.startswith(head_prefixes))
    if leftover:
        raise ConfigError(f"checkpoint has weights the model does not use: {leftover}")
    nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(loaded))
    nnx.update(model, state)
    return missing


def _check_tied_decoder(weights: dict[str, np.ndarray]) -> None:
    """Our MLM decoder is tied to the word embeddings; refuse an untied HF decoder."""
    decoder = weights.pop("cls.predictions.decoder.weight", None)
    embeddings = weights.get("roformer.embeddings.word_embeddings.weight")
    if decoder is not None and embeddings is not None and not np.array_equal(decoder, embeddings):
        raise ConfigError("cls.predictions.decoder.weight differs from the word embeddings (an untied "
                          "MLM decoder); our MLM head ties them, so it cannot be converted exactly")
    decoder_bias = weights.pop("cls.predictions.decoder.bias", None)
    if "cls.predictions.bias" not in weights and decoder_bias is not None:
        weights["cls.predictions.bias"] = decoder_bias


# ------------------------------------------------------------------------ library API

def build_model(config: ModelConfig, head: str, *, num_labels: int | None = None,
                seed: int = 0) -> AnyModel:
    """A freshly initialised model of ours with the given head."""
    rngs = nnx.Rngs(seed)
    if head == "mlm":
        return RoFormerForMaskedLM(config, rngs=rngs)
    if head == "classification":
        if not num_labels:
            raise ValueError("head='classification' needs num_labels")
        return RoFormerForSequenceClassification(config, num_labels, rngs=rngs)
    if head == "none":
        return RoFormerModel(config, rngs=rngs)
    raise ValueError(f"unknown head {head!r}; choose one of {HEADS}")


HF_DIR_EXPECTED = ("an HF RoFormer directory: config.json plus model.safetensors, a sharded "
                   "*.index.json or pytorch_model.bin, as transformers' save_pretrained writes")


def _check_hf_dir(hf_dir: Path) -> None:
    """Refuse a directory that is not an HF RoFormer directory, saying what it is instead."""
    if not hf_dir.is_dir():
        raise ConfigError(f"{hf_dir}: no such directory (expected {HF_DIR_EXPECTED})")
    config_path = hf_dir / "config.json"
    if PretrainWorkdir.holds_run(hf_dir) and "train" in PretrainWorkdir(hf_dir).run_config():
        raise ConfigError(f"{hf_dir} is a pretraining workdir (checkpoints/ and a config.json with a train "
                          f"section), not {HF_DIR_EXPECTED}. To export it use `python -m roformer.convert "
                          f"to-hf {hf_dir} OUT_DIR`; in Python, load_pretrain_workdir() reads it")
    if (hf_dir / EXPORT_INCOMPLETE).exists():
        raise ConfigError(f"{hf_dir} is an export that did not finish ({EXPORT_INCOMPLETE} is there: the command "
                          "writing it was stopped); run that export again")
    if not config_path.is_file():
        raise ConfigError(f"no config.json in {hf_dir} (expected {HF_DIR_EXPECTED})")


def load_hf(hf_dir: str | Path, *, head: str | None = None, num_labels: int | None = None,
            seed: int = 0, **overrides) -> tuple[ModelConfig, AnyModel]:
    """Read an HF RoFormer directory into (ModelConfig, our model).

    head=None keeps the checkpoint's own head ("mlm", "classification" or "none" for a bare
    encoder).  Asking for another head (e.g. head="classification", num_labels=3 on an MLM
    checkpoint, as GLUE fine-tuning does) loads the encoder and initialises the new head
    from `seed`.  `overrides` change ModelConfig fields, e.g. rope_layout="half".
    The model is returned in eval mode (dropout off); call `.train()` to fine-tune it.
    """
    hf_dir = Path(hf_dir)
    _check_hf_dir(hf_dir)
    hf = json.loads((hf_dir / "config.json").read_text())
    config = hf_config_to_model_config(hf, **overrides)
    weights = read_hf_weights(hf_dir)
    head = head or _hf_head(weights)
    if head == "classification" and num_labels is None:
        num_labels = len(hf["id2label"]) if "id2label" in hf else hf.get("num_labels")
    stored = weights.get("classifier.out_proj.bias")
    if head == "classification" and stored is not None and stored.shape[0] != num_labels:
        # a head trained for another label set: keep the encoder, start the head fresh
        weights = {k: v for k, v in weights.items() if not k.startswith("classifier.")}
    model = build_model(config, head, num_labels=num_labels, seed=seed)
    fresh = hf_weights_to_model(weights, model)
    if fresh:
        log.warning("%s holds no %s head for this model; initialised fresh: %s", hf_dir, head, fresh)
    model.eval()
    return config, model


def save_hf(model: AnyModel, config: ModelConfig | None, out_dir: str | Path,
            head: str | None = None, label_names: tuple[str, ...] | None = None) -> Path:
    """Write `model` as an HF RoFormer directory (config.json + model.safetensors) that
    transformers' RoFormerForMaskedLM / RoFormerForSequenceClassification / RoFormerModel
    `from_pretrained` loads.  `head` defaults to the model's own."""
    own_head = _model_head(model)
    if head not in (None, own_head):
        raise ValueError(f"head={head!r} but the model is a {type(model).__name__} (head {own_head!r})")
    if config is not None and config != model.config:
        raise ValueError("config differs from model.config; pass the model's own config (or None)")
    config = model.config
    num_labels = getattr(model, "num_labels", None)
    hf = model_config_to_hf_config(config, head=own_head, num_labels=num_labels, label_names=label_names)
    weights = params_to_hf_weights(model)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Through the atomic helper: a file the umask makes readable (save_file's own is 0600 on
    # Linux), and no half-written weights under the final name. config.json last: a directory
    # an export killed mid-way left has none, which HF loaders refuse.
    write_bytes_atomic(out_dir / "model.safetensors", safetensors.numpy.save(weights, metadata={"format": "pt"}))
    write_json_atomic(out_dir / "config.json", hf, indent=2, sort_keys=True)
    return out_dir


@contextlib.contextmanager
def exporting(out_dir: Path) -> Iterator[Path]:
    """Mark `out_dir` incomplete (EXPORT_INCOMPLETE) while the block writes it: an export
    killed mid-way (weights there, the tokenizer not yet) is refused by `from-hf` instead of
    read as a model without its vocabulary. A regular file in its place is refused first; an
    export refused before it wrote anything (a setting HF cannot express) leaves nothing."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{out_dir} is a file, not a directory: give a directory to write the model into")
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    marker = out_dir / EXPORT_INCOMPLETE
    write_text_atomic(marker, "an export into this directory has not finished; run it again\n")
    try:
        yield out_dir
    except BaseException:
        if [p.name for p in out_dir.iterdir()] == [EXPORT_INCOMPLETE]:   # nothing written yet
            marker.unlink()
            if created:
                out_dir.rmdir()
        raise
    marker.unlink()


def save_converted(model: AnyModel, out_dir: str | Path) -> Path:
    """Our format: model_config.json (config + head) and an orbax checkpoint in params/."""
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT_NAME, "head": _model_head(model),
            "num_labels": getattr(model, "num_labels", None), "model": model.config.to_dict()}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(out_dir / OUR_PARAMS_DIR, nnx.state(model, nnx.Param), force=True)
    # Last, and atomically: a save killed mid-way leaves no model_config.json (or the previous
    # one), never an empty one beside parameters that are not there.
    write_json_atomic(out_dir / OUR_CONFIG_FILE, meta, indent=2)
    return out_dir


def read_converted_config(our_dir: Path) -> dict:
    """model_config.json of a converted (or fine-tuned, saved) model, checked: a dict with a
    known head and a ModelConfig the project can build; anything else is refused in one line
    naming the directory (a damaged or hand-edited file)."""
    path = our_dir / OUR_CONFIG_FILE
    try:
        meta = json.loads(path.read_bytes().decode("utf-8"))
        if not isinstance(meta, dict) or meta.get("head") not in HEADS or not isinstance(meta.get("model"), dict):
            raise ValueError("not a model_config.json of this project (head, model)")
        num_labels = meta.get("num_labels")
        if meta["head"] == "classification" and not (isinstance(num_labels, int) and num_labels >= 1):
            raise ValueError(f"num_labels={num_labels!r}")
        meta["config"] = ModelConfig.from_dict(ModelConfig.saved_fields(meta["model"]))
    except FileNotFoundError:
        raise
    except (OSError, ValueError, TypeError, KeyError) as error:   # ConfigError is a ValueError
        why = (str(error).splitlines() or [""])[0][:200]
        raise ConfigError(f"{path} cannot be read ({type(error).__name__}: {why}): the model there is damaged; "
                          "save or convert it again") from None
    return meta


def load_converted(our_dir: str | Path, **overrides) -> tuple[ModelConfig, AnyModel]:
    """Inverse of `save_converted`; `overrides` change non-shape ModelConfig fields (dtype, dropout).
    The model is returned in eval mode (dropout off); call `.train()` to fine-tune it."""
    our_dir = Path(our_dir).resolve()
    meta_path = our_dir / OUR_CONFIG_FILE
    if (our_dir / EXPORT_INCOMPLETE).exists():
        raise ConfigError(f"{our_dir} is a conversion that did not finish ({EXPORT_INCOMPLETE} is there: the "
                          "command writing it was stopped); run that conversion again")
    if not meta_path.exists():
        raise ConfigError(f"no {OUR_CONFIG_FILE} in {our_dir}; expected a directory written by "
                          f"`python -m roformer.convert from-hf` or save_converted()")
    meta = read_converted_config(our_dir)
    config = ModelConfig.from_dict({**ModelConfig.saved_fields(meta["model"]), **overrides})
    model = build_model(config, meta["head"], num_labels=meta.get("num_labels"))
    abstract = nnx.state(model, nnx.Param)
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(our_dir / OUR_PARAMS_DIR, abstract)
    except Exception as error:  # noqa: BLE001 - whatever orbax meets in a damaged directory
        raise ConfigError(f"the parameters in {our_dir / OUR_PARAMS_DIR} cannot be read as the model "
                          f"{OUR_CONFIG_FILE} describes ({type(error).__name__}: "
                          f"{(str(error).splitlines() or [''])[0][:200]}): they are damaged or of another model; "
                          "save or convert it again") from None
    nnx.update(model, restored)
    model.eval()
    return config, model


def load_pretrain_workdir(workdir: str | Path, *, step: int = -1) -> tuple[ModelConfig, RoFormerForMaskedLM]:
    """The MLM model of a pretraining run (`python -m roformer.pretrain`): params of
    `workdir/checkpoints/<step>` (newest when step < 0), restored onto this host, in eval
    mode (dropout off); call `.train()` to fine-tune it."""
    config, params = PretrainWorkdir(workdir).params(step)
    model = build_model(config, "mlm")
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    model.eval()
    return config, model


def with_trained_positions(config: ModelConfig, longest: int | None) -> ModelConfig:
    """`config` with max_position_embeddings at least `longest`, the longest sequence the run
    trained on (PretrainWorkdir.longest_seq_len). For rope it bounds nothing here, but HF's
    RoFormer builds its sinusoid table, and the tokenizer its model_max_length, of that many
    positions: a run at seq_len 1024 with the default 512 would export a model that fails on
    the length it was trained at."""
    if longest is None or longest <= config.max_position_embeddings:
        return config
    return dataclasses.replace(config, max_position_embeddings=longest)


def _copy_tokenizer_files(src: Path, dst: Path) -> None:
    """Keep the vocabulary next to the weights (GLUE and HF tokenizers look for it there)."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)


def write_hf_tokenizer_config(out_dir: str | Path, *, lowercase: bool, model_max_length: int) -> None:
    """tokenizer_config.json and special_tokens_map.json beside the vocabulary: without them
    `AutoTokenizer.from_pretrained` takes the model type's RoFormerTokenizer, which needs
    rjieba, instead of the BERT WordPiece tokenizer that ours is."""
    specials = {"unk_token": UNK, "sep_token": SEP, "pad_token": PAD, "cls_token": CLS, "mask_token": MASK}
    out_dir = Path(out_dir)
    write_json_atomic(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "BertTokenizerFast", "do_lower_case": lowercase, "model_max_length": model_max_length,
        **specials})
    write_json_atomic(out_dir / "special_tokens_map.json", specials)


def save_hf_tokenizer(tokenizer, out_dir: str | Path, *, model_max_length: int) -> None:
    """Our WordPiece tokenizer beside an HF export: vocab.txt, tokenizer.json and the config
    files AutoTokenizer reads (write_hf_tokenizer_config)."""
    tokenizer.save(out_dir)
    write_hf_tokenizer_config(out_dir, lowercase=tokenizer.lowercase, model_max_length=model_max_length)


# ------------------------------------------------------------------------------- CLI

COMMANDS = ("from-hf", "to-hf")


def command_flags() -> cli.CommandFlags:
    """The flags of both commands (each reads its own)."""
    command = cli.CommandFlags("\n".join(__doc__.split("\n\n")[:2]))
    command.define("--rope-layout", default="interleaved", choices=rope.ROPE_LAYOUTS,
                   help="from-hf: our pair layout; 'half' permutes q/k features accordingly")
    command.define("--dtype", default="float32", choices=sorted(DTYPES),
                   help="from-hf: compute dtype stored in our config (params stay float32)")
    command.define("--step", type=int, default=-1, help="to-hf: the pretraining step to export (default: newest)")
    command.define("--push_to_hub", default="", metavar="USER/NAME",
                   help="to-hf: then upload the export to this Hub repository (roformer/hub.py; token: $HF_TOKEN)")
    command.define("--hub_private", type=bool, default=False, help="to-hf: create that repository private")
    return command


@cli.entry_point
def main(argv: list[str] | None = None) -> None:
    """`python -m roformer.convert from-hf|to-hf SRC OUT_DIR [flags]` (`argv` without the program name)."""
    args, positional = command_flags().parse(sys.argv[1:] if argv is None else argv)
    if not positional or positional[0] not in COMMANDS:
        raise cli.UsageError(f"give a command: {' or '.join(COMMANDS)} (see --help)")
    if len(positional) != 3:
        raise cli.UsageError(f"{positional[0]} takes two directories, the source and OUT_DIR; got {positional[1:]}")
    command, src, out_dir = positional[0], Path(positional[1]), Path(positional[2])
    if out_dir.exists() and not out_dir.is_dir():   # before the model is read
        raise ConfigError(f"{out_dir} is a file, not a directory: give a directory to write the model into")
    if command == "from-hf":
        from_hf_command(src, out_dir, rope_layout=args.rope_layout, dtype=args.dtype)
    else:
        to_hf_command(src, out_dir, step=args.step, push_to_hub=args.push_to_hub, hub_private=args.hub_private)


def from_hf_command(hf_dir: Path, out_dir: Path, **overrides) -> None:
    _check_hf_dir(hf_dir)
    config, model = load_hf(hf_dir, **overrides)
    with exporting(out_dir):
        out = save_converted(model, out_dir)
        _copy_tokenizer_files(hf_dir, out)
    print(f"wrote {_model_head(model)} model ({config.num_layers} layers, hidden {config.hidden_size}) to {out}")


def to_hf_command(src: Path, out_dir: Path, *, step: int, push_to_hub: str = "", hub_private: bool = False) -> None:
    if not src.is_dir():
        raise cli.UsageError(f"to-hf: {src}: no such directory (expected a from-hf output or a pretraining "
                             "workdir)")
    if (src / OUR_CONFIG_FILE).is_file():
        config, model = load_converted(src)
        with exporting(out_dir):
            out = save_hf(model, config, out_dir)
            source = ""
            write_text_atomic(out / MODEL_CARD, model_card(model, [("source", f"the converted model in {src}")]))
            _copy_tokenizer_files(src, out)
            if not (out / "tokenizer_config.json").is_file() and any((out / n).is_file() for n in TOKENIZER_FILES):
                # a vocabulary from an HF directory without one: BERT's default is uncased, and a
                # tokenizer.json says for itself
                fast = out / "tokenizer.json"
                lowercase = normalizer_lowercases(Tokenizer.from_file(str(fast))) if fast.is_file() else True
                write_hf_tokenizer_config(out, lowercase=lowercase, model_max_length=config.max_position_embeddings)
    elif PretrainWorkdir.holds_run(src):
        run = PretrainWorkdir(src)
        step = run.resolve_step(step)
        config, model = load_pretrain_workdir(src, step=step)
        source = f" (step {step} of {src})"
        exported = with_trained_positions(config, run.longest_seq_len())
        if exported is not config:   # the same parameters (rope has no position table of its own)
            longer = build_model(exported, "mlm")
            nnx.update(longer, nnx.state(model, nnx.Param))
            longer.eval()
            config, model = exported, longer
        with exporting(out_dir):
            out = save_hf(model, config, out_dir)
            write_text_atomic(out / MODEL_CARD, model_card(model, [("source", f"step {step} of {src}"),
                                                                  *pretraining_facts(run, step)]))
            if run.tokenizer_file.is_file():
                save_hf_tokenizer(run.tokenizer(), out, model_max_length=config.max_position_embeddings)
    else:
        raise cli.UsageError(f"to-hf: {src} has neither {OUR_CONFIG_FILE} (from-hf output) nor {CHECKPOINTS}/ "
                             "(a pretraining workdir)")
    print(f"wrote HF {HF_ARCHITECTURES[_model_head(model)]}{source} to {out}")
    if push_to_hub:
        from roformer import hub   # huggingface_hub only when asked for
        print(f"pushed to {hub.push(out, push_to_hub, private=hub_private)}")


if __name__ == "__main__":
    main()
