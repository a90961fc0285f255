"""Fixed sinusoidal absolute positions (Vaswani et al.)."""
from configs import base


def get_config(arg=None):
    config = base.get_config(arg)
    config.model.position = "sinusoidal"
    return config
