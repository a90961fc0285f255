"""roformer-jax: RoFormer encoders with rotary position embedding in JAX/Flax NNX."""

__version__ = "0.1.0"
