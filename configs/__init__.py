"""Config files (`--config=configs/<name>.py[:arg]`), installed as the package roformer.configs:
they import each other as `from roformer.configs import base`, from any directory."""

# The config file of each comparison arm (roformer.train.config.arm_model_keys names the arms):
# `--config=configs/<file>.py` pretrains that arm alone.
SCHEME_FILES = {"learned": "absolute", "sinusoidal": "sinusoidal", "shaw": "relative", "t5": "t5", "alibi": "alibi",
                "rope": "rotary", "rope_linear": "rotary_linear", "none": "none",
                "sinusoidal_vaswani": "sinusoidal_vaswani", "sinusoidal_cramming": "sinusoidal_cramming"}
