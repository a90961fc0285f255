"""ALiBi linear attention-logit bias."""
from roformer.configs import base


def get_config(arg=None):
    config = base.get_config(arg)
    config.model.position = "alibi"
    return config
