"""Cluster formation: backend selection and the MLX distributed config files."""
