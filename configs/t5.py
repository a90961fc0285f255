"""T5 bucketed relative attention bias."""
from roformer.configs import base


def get_config(arg=None):
    config = base.get_config(arg)
    config.model.position = "t5"
    return config
