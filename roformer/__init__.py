"""roformer-jax: RoFormer encoders with rotary position embedding in JAX/Flax NNX."""
from pathlib import Path as _Path

__version__ = "0.1.0"

# The config files are the subpackage roformer.configs. A wheel holds them in roformer/configs;
# a checkout keeps them at its top, in configs/ (pyproject.toml maps the directory), which an
# editable install's finder maps too. A checkout imported without that install (its root on
# PYTHONPATH, or a second checkout beside an editable one) finds them through this package's
# search path, so that roformer.configs is always the configs/ beside this roformer/.
_checkout = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).resolve().parent / "configs").is_dir() and (_checkout / "configs" / "__init__.py").is_file():
    __path__.append(str(_checkout))
