"""No position information (bag of tokens baseline)."""
from roformer.configs import base


def get_config(arg=None):
    config = base.get_config(arg)
    config.model.position = "none"
    return config
