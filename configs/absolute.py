"""Learned absolute position embeddings (BERT)."""
from configs import base


def get_config(arg=None):
    config = base.get_config(arg)
    config.model.position = "learned"
    return config
