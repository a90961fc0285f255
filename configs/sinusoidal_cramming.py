"""Cramming's scaled sinusoidal positions (Geiping & Goldstein 2022): the sin/cos table times
a learnable scalar initialised at 1/sqrt(d) (configs/sinusoidal.py lists the forms)."""
from roformer.configs import sinusoidal


def get_config(arg=None):
    config = sinusoidal.get_config(arg)
    config.model.sinusoidal_scaling = "cramming"
    return config
