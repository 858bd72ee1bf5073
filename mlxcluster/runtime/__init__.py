"""Rank processes: the supervisor that starts and watches them, the rank entry point, the local launcher, the MLX backends' files, BLAS tuning."""
