"""Vaswani et al.'s sinusoidal positions (2017, section 3.4): the word embeddings times sqrt(d),
the sin/cos table added as it is (configs/sinusoidal.py lists the forms)."""
from roformer.configs import sinusoidal


def get_config(arg=None):
    config = sinusoidal.get_config(arg)
    config.model.sinusoidal_scaling = "vaswani"
    return config
