"""ALiBi linear attention-logit bias."""
import pathlib
import runpy

# loaded by path so the file works from any working directory
_base = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config(arg=None):
    config = _base["get_config"](arg)
    config.model.position = "alibi"
    return config
