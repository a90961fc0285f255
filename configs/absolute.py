"""Learned absolute position embeddings (BERT)."""
from roformer.configs import base


def get_config(arg=None):
    config = base.get_config(arg)
    config.model.position = "learned"
    return config
