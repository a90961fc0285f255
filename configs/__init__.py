"""Config files (`--config=configs/<name>.py[:arg]`), a package so that they import each
other plainly (`from configs import base`) when run from the repository root."""

# The config file of each comparison arm (roformer.train.config.arm_model_keys names the arms):
# `--config=configs/<file>.py` pretrains that arm alone.
SCHEME_FILES = {"learned": "absolute", "sinusoidal": "sinusoidal", "shaw": "relative", "t5": "t5", "alibi": "alibi",
                "rope": "rotary", "rope_linear": "rotary_linear", "none": "none",
                "sinusoidal_vaswani": "sinusoidal_vaswani", "sinusoidal_cramming": "sinusoidal_cramming"}
