"""Shaw et al. relative position representations (clip k = 16)."""
from roformer.configs import base


def get_config(arg=None):
    config = base.get_config(arg)
    config.model.position = "shaw"
    return config
