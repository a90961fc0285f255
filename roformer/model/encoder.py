"""RoFormer encoder and heads in Flax NNX, laid out like HF `modeling_roformer.py`.

Module and parameter names follow HF so conversion is a rename + transpose:
  roformer.embeddings.{word_embeddings, token_type_embeddings, LayerNorm}
  roformer.embeddings_project                       (only when embedding_size != hidden_size)
  roformer.encoder.layer[i].attention.self.{query, key, value}
  roformer.encoder.layer[i].attention.output.{dense, LayerNorm}
  roformer.encoder.layer[i].intermediate.dense
  roformer.encoder.layer[i].output.{dense, LayerNorm}
  roformer.encoder.LayerNorm                        (only with pre_layer_norm)
  roformer.position.*                               (parameters of the position scheme, if any)
  cls.predictions.{transform.dense, transform.LayerNorm, bias}   (decoder tied to word_embeddings)
  classifier.{dense, out_proj}
Params are float32; computation runs in `config.dtype`.  Every parameter declares its logical
axes where it is created (roformer.model.axes), which is all that sharding reads.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from roformer.errors import ConfigError
from roformer.model import backend
from roformer.model.attention import (ATTENTION_IMPLEMENTATIONS, ATTENTION_KINDS, RoFormerSelfAttention,
                                      lengths_mask)
from roformer.model.axes import EMBED, EMBEDDING, HEADS, MLP, NORM, VOCAB, declare
from roformer.model.backend import tied_decoder
from roformer.model.dense import Dense, dense
from roformer.model.embedding import Embed
from roformer.model.positions import POSITION_SCHEMES, make_position_scheme
from roformer.model.rope import ROPE_LAYOUTS, ROPE_SCALINGS
from roformer.settings import check_all

ACTIVATIONS = {
    # Exact gelu written as HF/torch do, x/2 (1 + erf(x/sqrt2)): on XLA:CPU erf is one
    # rational polynomial, jax.nn.gelu's erfc form two branches
    # (docs/results/archive/2026-11-25-train-step-profile-cpu.md).
    "gelu": lambda x: 0.5 * x * (1.0 + jax.lax.erf(x * (2.0 ** -0.5))),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Gradient checkpointing of each encoder layer (`model.remat`): what the backward pass keeps
# of a layer's forward pass instead of recomputing it. "full" keeps only the layer's input;
# "dots" keeps the outputs of the matmuls with the weights (no batch dimension: the q/k/v,
# output and MLP projections) and recomputes attention and the elementwise work; "none"
# keeps everything (no recomputation). Same parameters, same math: only memory and time differ.
REMAT_POLICIES = {"none": None, "full": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}
# What each numeric or yes/no field allows (roformer.settings); the position schemes check
# their own fields further (positions.py), the choices are checked by name below.
RULES = {
    "vocab_size": "int >= 1", "hidden_size": "int >= 1", "num_layers": "int >= 1", "num_heads": "int >= 1",
    "intermediate_size": "int >= 1", "embedding_size": "int >= 1 or None", "max_position_embeddings": "int >= 1",
    "type_vocab_size": "int >= 1", "hidden_dropout": "float in [0, 1)", "attention_dropout": "float in [0, 1)",
    "layer_norm_eps": "float > 0", "pre_layer_norm": "bool", "initializer_range": "float > 0",
    "rope_base": "float > 0", "rotary_dim": "int >= 1 or None", "rotary_value": "bool",
    "rope_scaling_factor": "float > 0", "rope_original_max_len": "int >= 1", "shaw_max_distance": "int >= 1",
    "t5_num_buckets": "int >= 1", "t5_max_distance": "int >= 1", "pad_token_id": "int >= 0",
}

PRESETS: dict[str, dict] = {
    "tiny": dict(num_layers=2, hidden_size=128, num_heads=2, intermediate_size=512),
    "mini": dict(num_layers=4, hidden_size=256, num_heads=4, intermediate_size=1024),
    "small": dict(num_layers=4, hidden_size=512, num_heads=8, intermediate_size=2048),
    "medium": dict(num_layers=8, hidden_size=512, num_heads=8, intermediate_size=2048),
    "base": dict(num_layers=12, hidden_size=768, num_heads=12, intermediate_size=3072),
    "large": dict(num_layers=24, hidden_size=1024, num_heads=16, intermediate_size=4096),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 30522
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    embedding_size: int | None = None     # None -> hidden_size; else embeddings_project
    max_position_embeddings: int = 512    # learned absolute table length
    type_vocab_size: int = 2
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"              # exact (erf) gelu as HF
    pre_layer_norm: bool = False
    initializer_range: float = 0.02
    position: str = "rope"                # learned|sinusoidal|none|shaw|t5|alibi|rope
    attention: str = "softmax"            # softmax|linear
    attention_impl: str = "auto"          # dot_product_attention kernel: auto|xla|cudnn
    rope_base: float = 10000.0
    rope_layout: str = "interleaved"      # interleaved|half
    rotary_dim: int | None = None         # None -> head_dim
    rotary_value: bool = False
    rope_scaling: str = "none"            # none|linear|ntk|yarn
    rope_scaling_factor: float = 1.0
    rope_original_max_len: int = 512      # for yarn
    shaw_max_distance: int = 16           # Shaw clip k
    t5_num_buckets: int = 32
    t5_max_distance: int = 128
    sinusoidal_scaling: str = "scaled"    # scaled|cramming|vaswani|unscaled (positions.SinusoidalAbsolute)
    dtype: str = "float32"                # compute dtype: float32|bfloat16
    pad_token_id: int = 0
    remat: str = "none"                   # per-layer gradient checkpointing: none|full|dots (REMAT_POLICIES)

    def __post_init__(self):
        check_all("model.", self, RULES)

        def choose(field, choices):
            value = getattr(self, field)
            if value not in choices:
                raise ConfigError(f"unknown {field} {value!r}; choose one of {sorted(choices)}")

        choose("position", POSITION_SCHEMES)
        choose("attention", ATTENTION_KINDS)
        choose("attention_impl", ATTENTION_IMPLEMENTATIONS)
        choose("rope_layout", ROPE_LAYOUTS)
        choose("rope_scaling", ROPE_SCALINGS)
        choose("dtype", DTYPES)
        choose("hidden_act", ACTIVATIONS)
        choose("remat", REMAT_POLICIES)
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        POSITION_SCHEMES[self.position].validate(self)
        if self.attention == "linear":
            needs_scores = {name for name, scheme in POSITION_SCHEMES.items()
                            if scheme.has_bias or scheme.relative_kv}
            if self.position in needs_scores:
                raise ConfigError(
                    f"attention='linear' cannot use position {self.position!r} (a logit bias or relative "
                    f"keys need the L x L scores); use one of {sorted(set(POSITION_SCHEMES) - needs_scores)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    @classmethod
    def from_preset(cls, size: str, **overrides) -> "ModelConfig":
        if size not in PRESETS:
            raise ConfigError(f"unknown model size {size!r}; choose one of {list(PRESETS)}")
        return cls(**{**PRESETS[size], **overrides})

    @classmethod
    def from_dict(cls, d: Mapping) -> "ModelConfig":
        """Build from a mapping of fields.  An optional "size" key names a preset that fills the
        fields the mapping leaves out; explicit size fields must agree with it."""
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known - {"size"})
        if unknown:
            raise ConfigError(f"unknown ModelConfig keys {unknown}; valid keys are {sorted(known)}")
        size = d.pop("size", None)
        if size is None:
            return cls(**d)
        if size not in PRESETS:
            raise ConfigError(f"unknown model size {size!r}; choose one of {list(PRESETS)}")
        clashes = {k: (d[k], v) for k, v in PRESETS[size].items() if k in d and d[k] != v}
        if clashes:
            raise ConfigError(f"size {size!r} does not match the given fields (given, preset): {clashes}")
        return cls.from_preset(size, **d)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def saved_fields(d: Mapping) -> dict:
        """A model config as a checkpoint or converted model saved it, with the fields it
        predates filled in as they were then: sinusoidal positions were unscaled before
        `sinusoidal_scaling` existed."""
        d = dict(d)
        if d.get("position") == "sinusoidal":
            d.setdefault("sinusoidal_scaling", "unscaled")
        return d


def _dense(config: ModelConfig, in_features: int, out_features: int,
           axes: tuple[str | None, str | None], rngs: nnx.Rngs) -> Dense:
    return dense(in_features, out_features, axes, dtype=config.jnp_dtype,
                 initializer_range=config.initializer_range, rngs=rngs)


def _layer_norm(config: ModelConfig, features: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(features, epsilon=config.layer_norm_eps, dtype=config.jnp_dtype,
                         param_dtype=jnp.float32, scale_metadata=declare(NORM),
                         bias_metadata=declare(NORM), rngs=rngs)


class RoFormerEmbeddings(nnx.Module):
    """Word + token-type (+ absolute position) embeddings, LayerNorm, dropout."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        size = config.embedding_size or config.hidden_size
        init = nnx.initializers.normal(config.initializer_range)
        self.word_embeddings = Embed(config.vocab_size, size, dtype=config.jnp_dtype,
                                     embedding_init=init, rngs=rngs,
                                     embedding_metadata=declare(VOCAB, EMBEDDING))
        self.token_type_embeddings = Embed(config.type_vocab_size, size, dtype=config.jnp_dtype,
                                           embedding_init=init, rngs=rngs,
                                           embedding_metadata=declare(None, EMBEDDING))
        self.LayerNorm = _layer_norm(config, size, rngs)
        self.dropout = nnx.Dropout(config.hidden_dropout, rngs=rngs)

    def __call__(self, input_ids, token_type_ids, position_embeddings=None, token_scale: float = 1.0):
        x = self.word_embeddings(input_ids)
        if token_scale != 1.0:
            x = x * token_scale
        x = x + self.token_type_embeddings(token_type_ids)
        if position_embeddings is not None:
            x = x + position_embeddings
        return self.dropout(self.LayerNorm(x))


class RoFormerOutput(nnx.Module):
    """Projection back to hidden size + dropout + LayerNorm: HF's `attention.output`
    (from hidden_size, row-parallel over heads) and `output` (from intermediate_size) blocks."""

    def __init__(self, config: ModelConfig, in_features: int, in_axis: str, *, rngs: nnx.Rngs):
        self.dense = _dense(config, in_features, config.hidden_size, (in_axis, EMBED), rngs)
        self.LayerNorm = _layer_norm(config, config.hidden_size, rngs)
        self.dropout = nnx.Dropout(config.hidden_dropout, rngs=rngs)

    def add_and_norm(self, x, h):
        """LayerNorm(x + dropout(dense(h))), the post-LN block's tail. Under the
        pallas_residual_norm form, dense's product without its bias, then one Pallas kernel
        each way for the rest, given the mask self.dropout would draw (the same key)."""
        if not backend.pallas_residual_norm():
            return self.LayerNorm(x + self.dropout(self.dense(h)))
        norm, drop = self.LayerNorm, self.dropout
        y = self.dense.product(h, self.dense.kernel[...])
        keep = None
        if not drop.deterministic and drop.rate > 0.0:
            keep = jax.random.bernoulli(drop.rngs(), 1.0 - drop.rate, y.shape, out_sharding=jax.typeof(y).sharding)
        dtype = norm.dtype
        return backend.residual_layer_norm(x.astype(dtype), y.astype(dtype), self.dense.bias[...], keep,
                                           norm.scale[...].astype(dtype), norm.bias[...].astype(dtype),
                                           keep_prob=1.0 - drop.rate, epsilon=norm.epsilon)


class RoFormerAttention(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.self = RoFormerSelfAttention(config, rngs=rngs)  # HF's name, kept for conversion
        self.output = RoFormerOutput(config, config.hidden_size, HEADS, rngs=rngs)


class RoFormerIntermediate(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.dense = _dense(config, config.hidden_size, config.intermediate_size, (EMBED, MLP), rngs)


class RoFormerLayer(nnx.Module):
    """Attention + MLP block; post-LN like HF (LayerNorm after each residual add) or pre-LN."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.pre_layer_norm = config.pre_layer_norm
        self.act = ACTIVATIONS[config.hidden_act]
        self.attention = RoFormerAttention(config, rngs=rngs)
        self.intermediate = RoFormerIntermediate(config, rngs=rngs)
        self.output = RoFormerOutput(config, config.intermediate_size, MLP, rngs=rngs)

    def attention_probabilities(self, x, **attention_inputs):
        """The attention probabilities [B, H, L, L] this layer forms from its input x."""
        if self.pre_layer_norm:
            x = self.attention.output.LayerNorm(x)
        return self.attention.self.probabilities(x, **attention_inputs)

    def __call__(self, x, **attention_inputs):
        attn_out, mlp_out = self.attention.output, self.output
        if self.pre_layer_norm:
            h = self.attention.self(attn_out.LayerNorm(x), **attention_inputs)
            x = x + attn_out.dropout(attn_out.dense(h))
            h = self.act(self.intermediate.dense(mlp_out.LayerNorm(x)))
            return x + mlp_out.dropout(mlp_out.dense(h))
        h = self.attention.self(x, **attention_inputs)
        x = attn_out.add_and_norm(x, h)
        h = self.act(self.intermediate.dense(x))
        return mlp_out.add_and_norm(x, h)


class RoFormerEncoder(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.layer = nnx.List([RoFormerLayer(config, rngs=rngs) for _ in range(config.num_layers)])
        self.remat = config.remat
        # Pre-LN leaves the residual stream unnormalised; one final LayerNorm closes it.
        self.LayerNorm = _layer_norm(config, config.hidden_size, rngs) if config.pre_layer_norm else None

    def __call__(self, x, **attention_inputs):
        for index, layer in enumerate(self.layer):
            if self.remat == "none":
                x = layer(x, layer=index, **attention_inputs)
            else:
                checkpointed = nnx.remat(_layer_call(index), policy=REMAT_POLICIES[self.remat])
                x = checkpointed(layer, x, attention_inputs)
        return x if self.LayerNorm is None else self.LayerNorm(x)


def _layer_call(index: int):
    """Layer `index`'s forward pass as a function of (layer, x, attention inputs): what is
    checkpointed, with the index static (nnx.remat takes positional arguments only)."""
    def call(layer: RoFormerLayer, x, attention_inputs: dict):
        return layer(x, layer=index, **attention_inputs)
    return call


class RoFormerModel(nnx.Module):
    """The encoder: embeddings -> (embeddings_project) -> N layers.  Returns [B, L, hidden]."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embeddings = RoFormerEmbeddings(config, rngs=rngs)
        needs_project = config.embedding_size is not None and config.embedding_size != config.hidden_size
        self.embeddings_project = (_dense(config, config.embedding_size, config.hidden_size,
                                          (EMBEDDING, EMBED), rngs) if needs_project else None)
        # The scheme draws from its own forked stream so that, for one seed, every
        # parameter the schemes share starts identical whichever scheme is chosen
        # (the ablation compares schemes from the same initialisation).
        self.position = make_position_scheme(config, rngs=nnx.Rngs(params=rngs.params()))
        self.encoder = RoFormerEncoder(config, rngs=rngs)

    def __call__(self, input_ids, *, token_type_ids=None, positions=None, attention_mask=None,
                 segment_ids=None, lengths=None) -> jax.Array:
        x, attention_inputs = self.embed_inputs(input_ids, token_type_ids=token_type_ids, positions=positions,
                                                attention_mask=attention_mask, segment_ids=segment_ids,
                                                lengths=lengths)
        return self.encoder(x, **attention_inputs)

    def embed_inputs(self, input_ids, *, token_type_ids=None, positions=None, attention_mask=None,
                     segment_ids=None, lengths=None) -> tuple[jax.Array, dict]:
        """(the first layer's input [B, L, hidden], the keyword arguments every layer's
        attention takes: scheme, position context, key mask, segment ids, kv lengths).

        Padding comes as one of: `attention_mask` [B, L] (any pattern, as HF), `lengths` [B]
        (right-padded rows: the first lengths[b] tokens are real; attention kernels take this
        form without a dense mask), or `segment_ids` [B, L] (packed documents, 0 = padding).
        None of them: every token is real."""
        input_ids = jnp.asarray(input_ids)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {input_ids.shape}")
        batch, length = input_ids.shape
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        if lengths is not None and attention_mask is not None:
            raise ValueError("give the padding as attention_mask or as lengths, not both")
        key_mask = None if attention_mask is None else jnp.asarray(attention_mask).astype(bool)
        kv_lengths = None
        if lengths is not None:
            kv_lengths = jnp.asarray(lengths, jnp.int32)
            key_mask = lengths_mask(kv_lengths, length)
        if segment_ids is not None:
            real = segment_ids != 0
            key_mask = real if key_mask is None else key_mask & real
            kv_lengths = None   # packed rows: the segment mask says it all

        x = self.embeddings(input_ids, token_type_ids,
                            self.position.embed(positions, self.config.jnp_dtype),
                            token_scale=self.position.token_scale)
        if self.embeddings_project is not None:
            x = self.embeddings_project(x)
        # Position-only work (cis table, relative bias) is done once and shared by all layers.
        context = self.position.prepare(positions)
        return x, dict(scheme=self.position, context=context, key_mask=key_mask, segment_ids=segment_ids,
                       kv_lengths=kv_lengths)


class RoFormerPredictionHeadTransform(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        size = config.embedding_size or config.hidden_size
        self.act = ACTIVATIONS[config.hidden_act]
        self.dense = _dense(config, config.hidden_size, size, (EMBED, EMBEDDING), rngs)
        self.LayerNorm = _layer_norm(config, size, rngs)

    def __call__(self, x):
        return self.LayerNorm(self.act(self.dense(x)))


class RoFormerLMPredictionHead(nnx.Module):
    """transform -> decoder tied to the word embeddings, plus its own bias."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.transform = RoFormerPredictionHeadTransform(config, rngs=rngs)
        self.bias = nnx.Param(jnp.zeros((config.vocab_size,), jnp.float32), **declare(None))

    def __call__(self, x, word_embeddings: nnx.Embed):
        x = self.transform(x)
        table = word_embeddings.embedding[...].astype(x.dtype)
        return tied_decoder(x, table, self.bias[...])


class RoFormerOnlyMLMHead(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.predictions = RoFormerLMPredictionHead(config, rngs=rngs)


class RoFormerForMaskedLM(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.roformer = RoFormerModel(config, rngs=rngs)
        self.cls = RoFormerOnlyMLMHead(config, rngs=rngs)

    def __call__(self, input_ids, *, token_type_ids=None, positions=None, attention_mask=None,
                 segment_ids=None, lengths=None, masked_positions=None) -> jax.Array:
        """float32 logits [B, L, vocab], or [B, P, vocab] at `masked_positions` [B, P]."""
        hidden = self.roformer(input_ids, token_type_ids=token_type_ids, positions=positions,
                               attention_mask=attention_mask, segment_ids=segment_ids, lengths=lengths)
        if masked_positions is not None:
            # Gather first so the vocab projection only runs on the P predicted slots.
            hidden = jnp.take_along_axis(hidden, jnp.asarray(masked_positions)[..., None], axis=1)
        return self.cls.predictions(hidden, self.roformer.embeddings.word_embeddings)


class RoFormerClassificationHead(nnx.Module):
    """HF's head: token 0 -> dropout -> dense -> act -> dropout -> out_proj."""

    def __init__(self, config: ModelConfig, num_labels: int, *, rngs: nnx.Rngs):
        self.act = ACTIVATIONS[config.hidden_act]
        self.dense = _dense(config, config.hidden_size, config.hidden_size, (EMBED, EMBED), rngs)
        self.dropout = nnx.Dropout(config.hidden_dropout, rngs=rngs)
        self.out_proj = _dense(config, config.hidden_size, num_labels, (EMBED, None), rngs)

    def __call__(self, hidden):
        x = self.dropout(hidden[:, 0])
        x = self.dropout(self.act(self.dense(x)))
        return self.out_proj(x).astype(jnp.float32)


class RoFormerForSequenceClassification(nnx.Module):
    def __init__(self, config: ModelConfig, num_labels: int, *, rngs: nnx.Rngs):
        if num_labels < 1:
            raise ValueError(f"num_labels must be >= 1 (1 = regression), got {num_labels}")
        self.config = config
        self.num_labels = num_labels
        self.roformer = RoFormerModel(config, rngs=rngs)
        self.classifier = RoFormerClassificationHead(config, num_labels, rngs=rngs)

    def __call__(self, input_ids, *, token_type_ids=None, positions=None, attention_mask=None,
                 segment_ids=None, lengths=None) -> jax.Array:
        """float32 logits [B, num_labels] (num_labels=1: a regression score)."""
        hidden = self.roformer(input_ids, token_type_ids=token_type_ids, positions=positions,
                               attention_mask=attention_mask, segment_ids=segment_ids, lengths=lengths)
        return self.classifier(hidden)
