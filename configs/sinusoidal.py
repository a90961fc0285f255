"""Fixed sinusoidal absolute positions (Vaswani et al. 2017), by default in Cramming's
"scaled sinusoidal" form (the table times a learnable scalar initialised to 1/sqrt(d));
`--config.model.sinusoidal_scaling=vaswani` multiplies the word embeddings by sqrt(d)
instead, `unscaled` adds the bare table (docs/model.md#position-schemes)."""
from roformer.configs import base


def get_config(arg=None):
    config = base.get_config(arg)
    config.model.position = "sinusoidal"
    return config
