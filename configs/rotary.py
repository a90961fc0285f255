"""RoFormer: rotary position embedding on q and k (the default scheme)."""
from roformer.configs import base


def get_config(arg=None):
    config = base.get_config(arg)
    config.model.position = "rope"
    return config
