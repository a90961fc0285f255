"""The RoFormer encoder, its position schemes and its attention.

  encoder.py          ModelConfig, the encoder and its heads (HF's module names)
  positions.py        every position scheme behind one interface, chosen by name
  rope.py             rotary position embedding as a complex product (eq. 34)
  attention.py        softmax and linear attention
  axes.py             the logical axis names parameters declare
  dense.py            the encoder's dense layers
  backend.py          forms that a backend's compiler needs, named and explained
  attention_stats.py  attention distance and hidden-state cosine of a model
  position_signal.py  how strongly a scheme's position term speaks at initialisation
"""
from __future__ import annotations

from roformer.model.encoder import (
    ACTIVATIONS,
    DTYPES,
    PRESETS,
    ModelConfig,
    RoFormerAttention,
    RoFormerClassificationHead,
    RoFormerEmbeddings,
    RoFormerEncoder,
    RoFormerForMaskedLM,
    RoFormerForSequenceClassification,
    RoFormerIntermediate,
    RoFormerLayer,
    RoFormerLMPredictionHead,
    RoFormerModel,
    RoFormerOnlyMLMHead,
    RoFormerOutput,
    RoFormerPredictionHeadTransform,
    tied_decoder,
)

__all__ = [
    "ACTIVATIONS",
    "DTYPES",
    "PRESETS",
    "ModelConfig",
    "RoFormerAttention",
    "RoFormerClassificationHead",
    "RoFormerEmbeddings",
    "RoFormerEncoder",
    "RoFormerForMaskedLM",
    "RoFormerForSequenceClassification",
    "RoFormerIntermediate",
    "RoFormerLMPredictionHead",
    "RoFormerLayer",
    "RoFormerModel",
    "RoFormerOnlyMLMHead",
    "RoFormerOutput",
    "RoFormerPredictionHeadTransform",
    "tied_decoder",
]
