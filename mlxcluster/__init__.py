"""mlxcluster: tensor-parallel LLM inference over MLX ranks."""

__version__ = "0.1.0"
