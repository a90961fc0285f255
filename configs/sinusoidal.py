"""Sinusoidal absolute positions (Vaswani et al. 2017): the sin/cos table added to the word
embeddings, in the form `--config.model.sinusoidal_scaling` names (positions.SinusoidalAbsolute,
docs/model.md#position-schemes): `scaled` (default) the table times 1/sqrt(d), fixed; `cramming`
the table times a learnable scalar initialised at 1/sqrt(d) (Cramming's scaled sinusoidal);
`vaswani` the word embeddings times sqrt(d), the table as it is; `unscaled` the bare table.
configs/sinusoidal_cramming.py and configs/sinusoidal_vaswani.py name the two published forms,
so a study or ablation can run them as arms of their own (`study.schemes=rope,sinusoidal_vaswani`)."""
from roformer.configs import base


def get_config(arg=None):
    config = base.get_config(arg)
    config.model.position = "sinusoidal"
    return config
