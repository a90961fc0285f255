"""RoPE with linear attention (RoFormer paper eq. 19)."""
from roformer.configs import base


def get_config(arg=None):
    config = base.get_config(arg)
    config.model.position = "rope"
    config.model.attention = "linear"
    return config
